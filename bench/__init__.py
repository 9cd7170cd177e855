"""The benchmarks (docs/benchmarks.md). They run as modules from the repository root: `python -m bench.run_all`."""
