"""Helpers of benchmarks/attention_candidates.py that are NOT production code: attention candidates the
service does not run (cudnn-frontend's ragged SDPA graph, FA4's dense entry point, torch SDPA per backend on
equal-length batches) and the sm_90a compile check of our Triton kernels. The production backends are
ops/attention.py's BACKENDS, measured as the service runs them."""
