"""The whole polar_env exception tree, in one place.

    PolarError
    ├── RequestError          bad client input; the gateway answers with a provider-shaped 4xx
    ├── ConfigError           bad configuration, caught at the CLI/actor edge
    └── EngineError           anything that went wrong talking to an inference engine
        ├── EngineUnavailable     connection refused / reset, DNS failure
        ├── EngineTimeout         no complete answer within the client's deadline
        ├── EngineHTTPError       the engine answered non-2xx; carries its status and message
        └── EngineProtocolError   the engine answered 2xx but the body is unusable
                                  (malformed JSON, token ids or logprobs missing/misaligned)

Foreign exceptions (aiohttp, OSError, asyncio.TimeoutError) are translated once, where the engine is
called, with the cause chained. An engine error is never turned into an empty completion.
"""

from __future__ import annotations


class PolarError(Exception):
    """Root of every error polar_env raises on purpose."""


class RequestError(PolarError):
    """The client sent something we cannot serve; ``status`` is the HTTP status to answer with."""

    def __init__(self, message: str, *, status: int = 400, kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.kind = kind


class ConfigError(PolarError):
    """Configuration that cannot work (missing binary, bad path, contradictory options)."""


class EngineError(PolarError):
    """An inference engine call failed. ``engine`` names the backend, ``url`` the endpoint."""

    def __init__(self, message: str, *, engine: str = "", url: str = "", status: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.engine = engine
        self.url = url
        self.status = status

    def __str__(self) -> str:
        where = f" [{self.engine} {self.url}]".rstrip() if (self.engine or self.url) else ""
        code = f" (HTTP {self.status})" if self.status is not None else ""
        return f"{self.message}{code}{where if where.strip(' []') else ''}"


class EngineUnavailable(EngineError):
    """The engine could not be reached at all."""


class EngineTimeout(EngineError):
    """The engine did not answer in time."""


class EngineHTTPError(EngineError):
    """The engine answered with a non-2xx status; ``message`` is the engine's own error text."""


class EngineProtocolError(EngineError):
    """The engine's 2xx answer cannot be used (bad JSON, missing or misaligned token data)."""
