"""A reference GRPO loop on CPU: proves that captured, merged trajectories train.

``grpo`` (advantages, loss), ``step0`` (the logprob-equality check), ``trainer`` (one optimiser
step per batch), ``rollout`` (where batches come from, and weight sync through the gateway),
``recipe`` (the YAML), ``loop`` (steps, timings, the run report), ``report`` (PNGs and JSON).
"""
