"""Captured completions → training trajectories: builders (pure functions), fidelity check."""
