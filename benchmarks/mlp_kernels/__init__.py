"""The MLP kernels benchmark (issue 23: fused MLP epilogues, Qwen3-VL's head-dim-72 attention, the service's
throughput) in one bounded GPU run, `python -m benchmarks.mlp_kernels`: `driver.py` runs each section in a
worker process of its own (`__main__.py` starts it), restarting one that crashes:

  kernels.py  per kernel, CUDA graphs, against float32: the kernels not measured yet (Qwen2's fc1 +
              quick_gelu); with --sweep every candidate of the first run: the Qwen2.5 gated MLP (cuBLAS +
              silu_mul, our Triton GEMM with the SwiGLU epilogue per tile config, quack's gemm_act per config,
              torch.compile), Qwen3's fc1 (cuBLASLt GELU vs quack), the RMSNorm (ours vs quack), and attention
              at head dims 72 and 80 (FA4 as the service calls it, FA4 with explicit tile configs, FA4 dense,
              zero-padding 72 to 80, cuDNN)
  e2e.py      whole towers at real size through GraphRunner, MLP kernels before and after, against transformers
  service.py  where the service loses Qwen3's throughput: host copies of the rows (torch's allocator, the
              host row pool), preprocessing on the GPU, the engine's pipeline (a closed loop on the engine
              itself, without HTTP)
  measure.py  numerics against float32, CUDA-graph timing
  report.py   the markdown tables
The driver runs bench_vit itself for the README rows; the workers' records are a JSON-lines stream
(benchmarks/common/report.py). Beside them, run on their own: the host row pool's CPU check (host_pool_cpu.py)
and the sm_90a compile checks of the quack and Triton SwiGLU GEMMs (compile_check_*.py).
"""
