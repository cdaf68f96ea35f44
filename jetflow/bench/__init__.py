"""Benchmarks: each writes JSON and markdown under results/bench/ naming the machine it ran on."""
