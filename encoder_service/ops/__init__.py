"""The towers' compute ops, each a torch reference beside its fast CUDA kernel.

`fast_path.py` decides which one runs (the kernel only on CUDA in bfloat16 / float16 with Triton present);
every other module is one op family:

  - norm.py:       pre-norm (RMSNorm, LayerNorm) and the residual add of the projection that closes a
                   sub-layer (bias folded into the norm kernel, residual in the GEMM epilogue)
  - rotary.py:     the 2D rotary of q and k, split out of the fused qkv projection, in float32
  - activation.py: the MLPs' first GEMM and activation (gated SiLU on the merged gate/up weight; tanh GELU,
                   quick_gelu)
  - mlp_kernels.py: which kernel computes them (policy + startup check): a GEMM with the activation in its
                   epilogue (quack_gemm.py: optional quack-kernels; swiglu_gemm_triton.py: our Triton GEMM;
                   cuBLASLt's GELU) or the GEMM then the activation; cutlass_dsl.py: the CuTe DSL import path
                   and the one import of FA4 and of quack
  - attention.py:  non-causal attention over packed variable-length segments: the op, its layout classes and
                   the per-layout backend table + policy (--attention) over attention_torch.py (the CPU
                   reference and torch's CUDA paths), attention_triton.py (our Triton window kernel) and
                   attention_fa4.py (optional FlashAttention-4)
  - pos_embed.py:  Qwen3's learned position embedding, 4 bilinear taps weighted and added
  - backend_chain.py: what both kernel choices share (attention's, the MLP kernels'): the chain of backends
                   per key with its probes, demotions, check against float32 and describe(); the policy in
                   force on a thread (`use_policy`'s, else one default)

The towers (models/) call these from their own forward. Nothing here imports models/ or runtime/.
"""
