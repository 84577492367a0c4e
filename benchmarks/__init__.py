"""vexact benchmarks: the price of exactness (exact / native ratios). See README, "Benchmarks"."""
