"""Replay: what-if harness running the same policy objects over recorded traces and emulated tiers."""
