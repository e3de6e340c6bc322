"""Benchmarks: each prints JSON; `python -m bench` runs them all and writes bench/results/."""
