"""Benchmarks: Spec-Bench-style comparison of decoding methods (``adaptive bench``)."""
