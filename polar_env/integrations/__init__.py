"""Trainer integrations: trajectories in the exact shapes Slime, NeMo Gym and SFT pipelines take.

Each module converts ``polar_env.records.Trajectory`` objects (from ``PolarEnv``) into one
trainer's contract and imports that trainer lazily, so ``import polar_env.integrations`` costs
nothing and works without slime, nemo-gym or torch:

- ``credit``: session-normalised loss weights and per-trace session ids (any trainer).
- ``slime``: slime ``Sample`` lists, the custom generate function, per-group GRPO normalisation.
- ``slime_recipe``: recipe YAML → the exact slime command line.
- ``nemo_gym``: ``/run`` response items that pass NeMo RL's contiguity check, the Gym tree.
- ``sft``: evaluator-accepted trajectories → JSONL / Parquet rows for supervised fine-tuning.
"""
