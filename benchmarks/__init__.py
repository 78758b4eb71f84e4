"""The benchmarks: one script per measurement (one package, `mlp_kernels/`), each run as a module
(`python -m benchmarks.<name>`), printing its table and writing its JSON (benchmarks/README.md lists them).
`common/` is what they share; `attention/` is the attention research (kernel candidates, the rejected split
kernel); `tests/` their own tests. Not a package the service imports."""
