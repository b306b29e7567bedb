"""Policies: pure decision code (no I/O) -- block index, features, predictor, baselines, planner."""
