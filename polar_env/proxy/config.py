"""The gateway's settings: what every request is checked and overridden against (the served
model, trainer-owned sampling, body limits, timeouts, the engine's template)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator


class Sampling(BaseModel):
    """Trainer-owned sampling: each value that is set overrides what every harness request says,
    whatever the engine (``PolarEnvConfig.sampling``, the node's and the gateway's are this one
    model; the CLI's ``--temperature``/``--top-p``/``--max-tokens`` are views of it)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    temperature: float | None = Field(default=None, ge=0)
    top_p: float | None = Field(default=None, gt=0, le=1)
    max_tokens: int | None = Field(default=None, ge=1)  # cap on the tokens sampled per call

    def conflicts(self, other: Sampling) -> list[str]:
        """Each value both set, differently (``temperature 0.7 != 1.0``): a trainer that asks for
        one value while the environment forces another would train off-policy."""
        mine, theirs = self.model_dump(), other.model_dump()
        return [f"{k} {theirs[k]!r} != {v!r}" for k, v in mine.items() if v is not None and theirs[k] not in (None, v)]

    def over(self, base: Sampling) -> Sampling:
        """These values, with ``base``'s where these are unset (a session's own over the gateway's)."""
        return base.model_copy(update=self.model_dump(exclude_none=True))

    def line(self) -> str:
        """The set values as one short note (``temperature=0.7 max_tokens=512``)."""
        return " ".join(f"{k}={v}" for k, v in self.model_dump(exclude_none=True).items())


class GatewayConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    engine_model: str
    public_url: str | None = None  # what harnesses should use; defaults to the request's Host
    max_body_bytes: int = 32 * 1024 * 1024  # a 100k-token Claude Code history is ~1-2 MB
    sampling: Sampling = Sampling()
    admin_token: str | None = None  # None: the Gateway generates one (gateway.config.admin_token)
    metrics_token: str | None = None  # read-only: GET /metrics only (the admin token reads it too)
    template: str = "qwen3.5"  # the engine's chat format (polar_env.chat): rules, continuation, count_tokens
    continuation: bool = False  # default for new sessions (POST /sessions may override)
    engine_timeout_s: float = Field(default=1800.0, gt=0)  # per engine call; past it the harness gets a 504
    session_idle_s: float | None = 24 * 3600.0  # open sessions unused this long are closed; None: never
    drain_s: float = 30.0  # aclose waits this long for in-flight captures before closing the journal

    @field_validator("template")
    @classmethod
    def _known_template(cls, value: str) -> str:
        from polar_env.chat import check_template

        return check_template(value)
