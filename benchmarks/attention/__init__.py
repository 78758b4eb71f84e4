"""The attention research: which kernel for which layout. The benchmarks: candidates.py (issue 14's
comparison of the attention backends on the graphs' layouts, crash-isolated) and kernels.py (attention
variants, GEMMs and fused ops against the eager torch ops they replace). The rest is theirs, NOT production
code: attention candidates the service does not run (extras.py: cudnn-frontend's ragged SDPA graph, FA4's
dense entry point, torch SDPA per backend on equal-length batches; triton_split.py: our head-dim-split Triton
kernel, rejected on the H100 and taken out of the service), the Triton interpreter tests and the sm_90a
compile check of our Triton kernels. The production backends are ops/attention.py's BACKENDS, measured as
the service runs them."""
