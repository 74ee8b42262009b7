"""polar_env: unmodified agent harnesses as token-faithful RL environments.

Public surface: the records that cross process lines and the error tree. Importing the package is
cheap (no torch); engines, the gateway and builders live in their subpackages.
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
    Generation,
    ProviderAPI,
    Status,
    ToolCall,
    Trace,
    Trajectory,
)

__version__ = "0.1.0"

__all__ = [
    "AssistantMessage",
    "ChatRequest",
    "CompletionRecord",
    "ConfigError",
    "EngineError",
    "EngineHTTPError",
    "EngineProtocolError",
    "EngineTimeout",
    "EngineUnavailable",
    "Generation",
    "PolarError",
    "ProviderAPI",
    "RequestError",
    "Status",
    "ToolCall",
    "Trace",
    "Trajectory",
]
