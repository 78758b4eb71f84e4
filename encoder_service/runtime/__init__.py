"""Running a loaded tower on batches: eager and CUDA-graph runners, packing into buckets, outputs to the host."""
