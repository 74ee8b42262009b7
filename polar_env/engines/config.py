"""``EngineConfig``: an engine named in data (YAML, JSON, a Ray actor's arguments), and the one
function that builds the client for it. Nodes build their own engine from this in their own
process, so the config must be plain data, never a live client."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from polar_env.engines.base import EngineClient
from polar_env.errors import ConfigError
from polar_env.records import LogprobsMode


class EngineConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    kind: Literal["embedded", "vllm", "sglang", "simulated"] = "embedded"
    # vllm: base URL, or several (a list, as NeMo RL passes policy_base_url, or comma-separated);
    # sglang: worker URLs (a list or comma-separated) or router:URL
    url: str | list[str] | None = None
    model: str = "polar-tiny-qwen3"  # the served model name
    logprobs_mode: LogprobsMode = "processed"
    # embedded only
    model_dir: Path | None = None
    seed: int = 0
    template: str = "qwen3.5"
    # A random tiny model rarely samples EOS: bound each sampled turn. Scripted turns end on their
    # own (a long patch command can exceed 256 tokens), so the default cap is high for them.
    max_tokens_cap: int | None = None  # default: 256 sampled, 4096 scripted
    script: Path | None = None  # a scripted policy file ({steps: [...]}) forcing the tokens
    # harnesses that end only by a command (mini-swe-agent): scripted answers also run it
    script_finish_command: str | None = None
    # simulated (a test double: see polar_env/testing/simulated_engine.py)
    latency_s: float = 0.05
    jitter: float = 0.0

    def describe(self) -> str:
        if self.kind in ("vllm", "sglang"):
            from polar_env.engines import engine_urls_of

            urls = engine_urls_of(self.url)
            return f"{self.kind} at {', '.join(urls)}" if len(urls) > 1 or self.kind == "sglang" else f"{self.kind} at {self.url}"
        if self.kind == "simulated":
            return f"simulated engine (test double, {self.latency_s * 1000:.0f} ms per call)"
        weights = str(self.model_dir) if self.model_dir else f"seeded random weights (seed {self.seed})"
        return f"embedded CPU engine, {weights}{', scripted' if self.script else ''}"


def build_engine(config: EngineConfig) -> EngineClient:
    """The client for ``config``; the embedded engine loads its model here (in this process)."""
    policy = None
    if config.script is not None:
        policy = _policy(config.script)
        if config.script_finish_command is not None:
            from polar_env.harnesses.scripted import FinishingPolicy

            policy = FinishingPolicy(steps=policy.steps, shell_tools=policy.shell_tools,
                                     command_params=policy.command_params,
                                     finish_command=config.script_finish_command)
    if config.kind == "embedded":
        from polar_env.engines.embedded.engine import EmbeddedEngine
        from polar_env.engines.embedded.model import ModelSpec
        from polar_env.qwen.template import QUIRKS

        if config.template not in QUIRKS:
            raise ConfigError(f"unknown template {config.template!r}; known: {sorted(QUIRKS)}")
        if config.model_dir is not None and not Path(config.model_dir).is_dir():
            raise ConfigError(f"engine model_dir {config.model_dir} is not a directory")
        return EmbeddedEngine(model_dir=config.model_dir, spec=ModelSpec(seed=config.seed),
                              quirks=QUIRKS[config.template], policy=policy, logprobs_mode=config.logprobs_mode,
                              max_tokens_cap=config.max_tokens_cap or (4096 if policy else 256),
                              model_name=config.model)
    if config.kind == "simulated":
        from polar_env.testing.simulated_engine import SimulatedEngine

        return SimulatedEngine(latency_s=config.latency_s, jitter=config.jitter, policy=policy,
                               model_name=config.model, seed=config.seed)
    from polar_env.engines import make_engine

    return make_engine(config.kind, config.url, config.model, logprobs_mode=config.logprobs_mode)


def _policy(path: Path) -> Any:
    import json

    from polar_env.engines.embedded.policy import ScriptedPolicy

    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ConfigError(f"script file {path} does not exist") from None
    except ValueError as exc:
        raise ConfigError(f"script file {path} is not valid JSON: {exc}") from None
    return ScriptedPolicy.from_dict(data)
