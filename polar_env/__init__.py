"""polar_env: unmodified agent harnesses as token-faithful RL environments.

Public surface: the rollout API (``PolarEnv``, ``TaskRequest``, results), the records that cross
process lines and the error tree. Importing the package is cheap (no torch, no Ray): the rollout API
is loaded on first use; engines, the gateway and builders live in their subpackages.
"""

from __future__ import annotations

from polar_env.errors import (
    ConfigError,
    EngineError,
    EngineHTTPError,
    EngineProtocolError,
    EngineTimeout,
    EngineUnavailable,
    PolarError,
    RequestError,
)
from polar_env.records import (
    AssistantMessage,
    ChatRequest,
    CompletionRecord,
    FailureKind,
    Generation,
    ProviderAPI,
    Status,
    ToolCall,
    Trace,
    Trajectory,
    masked,
)

__version__ = "0.1.0"

_LAZY = {
    "PolarEnv": "polar_env.env",
    "PolarEnvConfig": "polar_env.env",
    "RolloutGroup": "polar_env.env",
    "TaskRequest": "polar_env.staging.models",
    "AgentSpec": "polar_env.staging.models",
    "SessionResult": "polar_env.staging.models",
    "SessionStatus": "polar_env.staging.models",
    "TaskStatus": "polar_env.staging.models",
    "EngineConfig": "polar_env.engines.config",
    "EvaluatorSpec": "polar_env.evaluators.base",
    "RuntimeSpec": "polar_env.runtimes.base",
    "rollout": "polar_env.staging.job",
    "RolloutJob": "polar_env.staging.job",
    "build_trajectories": "polar_env.env",
    "run_evaluator": "polar_env.evaluators",
}


def __getattr__(name: str) -> object:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'polar_env' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


__all__ = [
    "AgentSpec",
    "EngineConfig",
    "EvaluatorSpec",
    "PolarEnv",
    "PolarEnvConfig",
    "RolloutGroup",
    "RolloutJob",
    "RuntimeSpec",
    "SessionResult",
    "SessionStatus",
    "TaskRequest",
    "TaskStatus",
    "build_trajectories",
    "rollout",
    "run_evaluator",
    "AssistantMessage",
    "ChatRequest",
    "CompletionRecord",
    "ConfigError",
    "EngineError",
    "EngineHTTPError",
    "EngineProtocolError",
    "EngineTimeout",
    "EngineUnavailable",
    "FailureKind",
    "Generation",
    "PolarError",
    "ProviderAPI",
    "RequestError",
    "Status",
    "ToolCall",
    "Trace",
    "Trajectory",
    "masked",
]
