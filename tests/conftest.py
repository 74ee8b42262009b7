from __future__ import annotations

import pytest

from polar_env.engines.embedded.engine import EmbeddedEngine
from polar_env.engines.embedded.policy import ScriptedPolicy
from polar_env.qwen.template import APPEND_ONLY

SHELL_TOOL = {
    "type": "function",
    "function": {
        "name": "bash",
        "description": "Run a shell command",
        "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]},
    },
}


@pytest.fixture(scope="session")
def engine() -> EmbeddedEngine:
    """Sampling mode, Qwen3.5 template quirks on."""
    return EmbeddedEngine()


@pytest.fixture(scope="session")
def scripted_engine(engine: EmbeddedEngine) -> EmbeddedEngine:
    """Scripted policy on the same weights (built from the same seed)."""
    return EmbeddedEngine(policy=ScriptedPolicy())


@pytest.fixture(scope="session")
def append_only_engine() -> EmbeddedEngine:
    return EmbeddedEngine(policy=ScriptedPolicy(), quirks=APPEND_ONLY)
