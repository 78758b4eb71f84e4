"""The benchmarks: one script per measurement, each printing its table and writing its JSON
(benchmarks/README.md lists them). `common/` is what they share; `attention/` is the attention research
(kernel candidates, the rejected split kernel). Scripts, not a package the service imports."""
