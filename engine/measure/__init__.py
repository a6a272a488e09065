"""Measuring: the A/B bench, memory cgroups, soak, held-out eval, micro-benchmarks."""
