"""Benchmarks: each prints ratios measured in one run (``python -m bench.<name>``)."""
