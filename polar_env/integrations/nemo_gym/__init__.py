"""NeMo Gym integration: Polar sessions behind a Gym agent server's ``/run``.

``convert`` turns a trajectory into the Responses output items NeMo RL trains on (pure, no
nemo_gym import: it runs on Python 3.11 with the rest of polar_env). ``agent`` runs one Polar
session for a ``/run`` row through ``PolarEnv`` and builds the row's result. ``gym_root/`` is a
Gym component tree (``environments/polar_swegym``, ``responses_api_agents/polar_agent``) that Gym
finds through ``--search-dir`` or ``NEMO_GYM_EXTRA_ROOTS``; ``python -m
polar_env.integrations.nemo_gym root`` prints its path. nemo-gym itself (Python ≥3.13.14, one venv
per server) is imported only by ``gym_root/responses_api_agents/polar_agent/app.py``.
"""

from __future__ import annotations

from pathlib import Path

GYM_ROOT = Path(__file__).resolve().parent / "gym_root"
"""The directory to pass as ``--search-dir`` / ``NEMO_GYM_EXTRA_ROOTS``."""
