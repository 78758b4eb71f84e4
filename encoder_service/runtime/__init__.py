"""GPU fast path: attention kernels, runners, CUDA graphs, packing, fused ops."""
