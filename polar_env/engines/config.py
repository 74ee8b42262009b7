"""``EngineConfig``: an engine named in data (YAML, JSON, a Ray actor's arguments), as a pydantic
union discriminated by ``kind`` (``embedded``, ``vllm``, ``sglang``, ``simulated``), so an option of
one backend cannot be set on another (``seed`` on a vllm engine is refused, not ignored). Each
config builds its own client (``build``); nodes build their engine from it in their own process,
so the config is plain data, never a live client.

``ENGINES`` is the table (a ``Registry`` of these config classes; the union is made from it).
To add a backend: its client module plus one config class here, added to ``AnyEngineConfig``.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal, get_args

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, TypeAdapter, field_validator, model_validator

from polar_env.engines.base import EngineClient
from polar_env.engines.ready import check_embedded, check_local, check_served
from polar_env.engines.urls import engine_base_url, engine_urls_of
from polar_env.errors import ConfigError
from polar_env.records import LogprobsMode
from polar_env.registry import Preflight, Registry

if TYPE_CHECKING:
    from polar_env.chat import ChatFormat
    from polar_env.chat.detect import Detection
    from polar_env.engines.embedded.policy import ScriptedPolicy

DEFAULT_KIND = "embedded"


class _Engine(BaseModel):
    """What every backend has: the served model's name and its chat template (the gateway renders
    continuation prompts with it, whatever serves them)."""

    model_config = ConfigDict(extra="forbid")

    model: str = "polar-tiny-qwen3"  # the served model name
    template: str = "qwen3.5"  # the model family's chat format (polar_env.chat.TEMPLATES)

    @field_validator("template")
    @classmethod
    def _known_template(cls, value: str) -> str:
        from polar_env.chat import check_template

        return check_template(value)

    def chat(self) -> ChatFormat:
        """The served model's ``ChatFormat`` (the gateway, the builders and local engines use it)."""
        from polar_env.chat import chat_format

        return chat_format(self.resolved_template())

    def resolved_template(self) -> str:
        """``template``, with ``auto`` read off the served model (``polar_env.chat.detect``), once
        per process: ConfigError in one line when it cannot be told."""
        if self.template != "auto":
            return self.template
        return _detected(self.detection_key()).template

    def detection_key(self) -> tuple[str, ...]:
        """What ``template: auto`` is detected from: ("model_dir", PATH), ("urls", URL, ...), or
        ("default",) for the seeded random weights, which are built for qwen3.5."""
        return ("default",)

    def default_max_tokens(self) -> int | None:
        """The per-call token cap when the config sets none (``sampling.max_tokens``): served
        engines stop on their own; the local test engines need one."""
        return None

    def build(self, max_tokens: int | None = None) -> EngineClient:
        raise NotImplementedError

    def describe(self) -> str:
        raise NotImplementedError


class _Scripted(_Engine):
    # a scripted policy file ({steps: [...]}) forcing the tokens (README: "Scripted policies")
    script: Path | None = None
    # harnesses that end only by a command (mini-swe-agent): scripted answers also run it
    script_finish_command: str | None = None
    seed: int = Field(default=0, ge=0, lt=2**63)  # torch and numpy take a 64-bit seed

    def policy(self) -> ScriptedPolicy | None:
        if self.script is None:
            return None
        policy = load_policy(self.script)
        if self.script_finish_command is None:
            return policy
        from polar_env.engines.embedded.policy import FinishingPolicy

        return FinishingPolicy(steps=policy.steps, shell_tools=policy.shell_tools,
                               command_params=policy.command_params, finish_command=self.script_finish_command)


class EmbeddedEngineConfig(_Scripted):
    """Our CPU engine, in the node's process: a local HF folder or ``.gguf`` file (``model_dir``),
    else the model the template names (``smollm2``, ``hf:PATH``), else seeded random tiny weights."""

    kind: Literal["embedded"] = "embedded"
    model_dir: Path | None = None  # a HF model folder or a .gguf file
    logprobs_mode: LogprobsMode = "processed"

    @model_validator(mode="after")
    def _own_model(self) -> EmbeddedEngineConfig:
        """A model given by path is served with its own chat format (``auto``: read off its files)
        and under its own name, unless they are set; the defaults fit only the seeded weights.
        Written past ``model_fields_set``: derived, not chosen, so a dump re-derives them."""
        if self.model_dir is not None:
            from polar_env.chat.detect import served_name

            if "template" not in self.model_fields_set:
                self.__dict__["template"] = "auto"
            if "model" not in self.model_fields_set:
                self.__dict__["model"] = served_name(self.model_dir)
        return self

    def default_max_tokens(self) -> int:
        # A random tiny model rarely samples EOS: bound each sampled turn. Scripted turns end on
        # their own (a long patch command can exceed 256 tokens), so the cap is high for them.
        return 4096 if self.script is not None else 256

    def build(self, max_tokens: int | None = None) -> EngineClient:
        from polar_env.engines.embedded.engine import EmbeddedEngine
        from polar_env.engines.embedded.model import ModelSpec

        return EmbeddedEngine(model_dir=self.weights(), spec=ModelSpec(seed=self.seed), chat=self.chat(),
                              policy=self.policy(), logprobs_mode=self.logprobs_mode,
                              max_tokens=max_tokens or self.default_max_tokens(), model_name=self.model)

    def weights(self) -> Path | None:
        """The weights to load (checked: ConfigError in one line), None for seeded random ones."""
        from polar_env.weights import check_weights

        if self.model_dir is not None:
            return check_weights(self.model_dir, "engine model_dir")
        named = self.chat().weights
        return None if named is None else check_weights(named, f"template {self.template!r}:")

    def check_fits(self) -> None:
        """The template's tokenizer fits the weights' embedding (ConfigError in one line naming
        ``--template``): else every request fails with a prompt id out of the vocabulary."""
        weights = self.weights()
        if weights is not None:
            from polar_env.chat.detect import check_vocabulary

            check_vocabulary(weights, self.chat().tokenizer.n_vocab, self.template)

    def detection_key(self) -> tuple[str, ...]:
        return ("model_dir", str(self.model_dir)) if self.model_dir is not None else ("default",)

    def describe(self) -> str:
        path = self.model_dir or self.chat().weights
        weights = str(path) if path else f"seeded random weights (seed {self.seed})"
        return f"embedded CPU engine, {weights}{', scripted' if self.script else ''}"


class SimulatedEngineConfig(_Scripted):
    """A test double (polar_env/engines/simulated.py): answers after ``latency_s``, samples nothing real."""

    kind: Literal["simulated"] = "simulated"
    latency_s: float = Field(default=0.05, ge=0)
    jitter: float = Field(default=0.0, ge=0)

    def build(self, max_tokens: int | None = None) -> EngineClient:
        from polar_env.engines.simulated import SimulatedEngine

        return SimulatedEngine(latency_s=self.latency_s, jitter=self.jitter, policy=self.policy(),
                               chat=self.chat(), model_name=self.model, seed=self.seed)

    def describe(self) -> str:
        return f"simulated engine (test double, {self.latency_s * 1000:.0f} ms per call)"


class VLLMEngineConfig(_Engine):
    """A vLLM OpenAI server: one base URL, or several (a list, as NeMo RL passes
    ``policy_base_url``, or comma-separated): a session-sticky, failing-over pool."""

    kind: Literal["vllm"] = "vllm"
    url: str | list[str] | None = None  # None only until an adapter fills it in (NeMo Gym)
    logprobs_mode: LogprobsMode = "processed"

    def detection_key(self) -> tuple[str, ...]:
        return ("urls", *map(engine_base_url, _urls(self.kind, self.url)))

    def build(self, max_tokens: int | None = None) -> EngineClient:
        urls = _urls(self.kind, self.url)
        if len(urls) == 1:
            from polar_env.engines.vllm import VLLMClient

            return VLLMClient(engine_base_url(urls[0]), self.model, logprobs_mode=self.logprobs_mode)
        from polar_env.engines.vllm_pool import VLLMPool

        return VLLMPool([engine_base_url(u) for u in urls], self.model, logprobs_mode=self.logprobs_mode)

    def describe(self) -> str:
        urls = engine_urls_of(self.url)
        return f"vllm at {', '.join(urls)}"


class SGLangEngineConfig(_Engine):
    """SGLang: worker URLs (a list or comma-separated), or one router given as ``router:URL``."""

    kind: Literal["sglang"] = "sglang"
    url: str | list[str] | None = None  # None only until an adapter fills it in (slime's router)

    def detection_key(self) -> tuple[str, ...]:
        return ("urls", *(engine_base_url(u.removeprefix("router:")) for u in _urls(self.kind, self.url)))

    def build(self, max_tokens: int | None = None) -> EngineClient:
        from polar_env.engines.sglang import SGLangClient

        urls = _urls(self.kind, self.url)
        if len(urls) == 1 and urls[0].startswith("router:"):
            return SGLangClient(model=self.model, router_url=engine_base_url(urls[0].removeprefix("router:")),
                                chat=self.chat())
        if any(u.startswith("router:") for u in urls):
            raise ConfigError("engine url: give one router:URL or a list of SGLang worker URLs, not both")
        return SGLangClient([engine_base_url(u) for u in urls], self.model, chat=self.chat())

    def describe(self) -> str:
        return f"sglang at {', '.join(engine_urls_of(self.url))}"


@functools.cache
def _detected(key: tuple[str, ...]) -> Detection:
    """``template: auto`` for one engine (see ``_Engine.detection_key``), said once on stderr."""
    import sys

    from polar_env.chat.detect import Detection, detect, detect_model_dir

    if key[0] == "default":
        found = Detection("qwen3.5", "the seeded random weights are built for it")
    elif key[0] == "model_dir":
        found = detect_model_dir(Path(key[1]).expanduser())
    else:
        from polar_env.engines.probe import served_sources

        urls = list(key[1:])
        sources = served_sources(urls)
        if not sources:
            raise ConfigError(f"template auto: no engine answers at {', '.join(urls)} to say what it serves; start "
                              "it first, or set the engine's template (--template)")
        found = detect(sources, f"the engine at {', '.join(urls)}")
    print(f"polar-env: template auto -> {found.template} ({found.why})", file=sys.stderr, flush=True)
    return found


AnyEngineConfig = EmbeddedEngineConfig | VLLMEngineConfig | SGLangEngineConfig | SimulatedEngineConfig  # the table
# preflight: each kind's check (engines/ready.py), called with the config and the seconds a served engine gets
ENGINES: Registry[type[_Engine]] = Registry("engine", preflight=True)
_PREFLIGHT: dict[str, Preflight] = {"embedded": check_embedded, "simulated": check_local, "vllm": check_served, "sglang": check_served}
for _cls in get_args(AnyEngineConfig):
    ENGINES.register(_cls.model_fields["kind"].default, _cls, params=_cls, preflight=_PREFLIGHT.get(_cls.model_fields["kind"].default))


def _default_kind(data: Any) -> Any:
    """A mapping without ``kind`` is the embedded engine (the default); an unknown kind is the
    registry's one line, with the closest names."""
    if isinstance(data, dict):
        kind = data.get("kind", DEFAULT_KIND)
        if kind not in ENGINES:
            raise ValueError(str(ENGINES.unknown(kind)))
        return {**data, "kind": kind}
    return data


EngineConfig = Annotated[AnyEngineConfig, Field(discriminator="kind"), BeforeValidator(_default_kind)]
_ADAPTER: TypeAdapter[Any] = TypeAdapter(EngineConfig)


def engine_config(data: object) -> AnyEngineConfig:
    """The engine config for a mapping (``{"kind": "vllm", "url": ...}``; no kind: embedded)."""
    if isinstance(data, get_args(AnyEngineConfig)):
        return data  # type: ignore[no-any-return]
    return _ADAPTER.validate_python(data)  # type: ignore[no-any-return]


def build_engine(config: object, max_tokens: int | None = None) -> EngineClient:
    """The client for ``config``; the embedded engine loads its model here (in this process).
    ``max_tokens``: the per-call cap (default: the config's ``default_max_tokens``)."""
    return engine_config(config).build(max_tokens)


def _urls(kind: str, url: str | list[str] | None) -> list[str]:
    urls = engine_urls_of(url)
    if not urls:
        raise ConfigError(f"engine {kind!r} needs a URL")
    return urls


def load_policy(path: Path, where: str = "--engine-script") -> ScriptedPolicy:
    """A scripted policy file (``{"steps": [...]}``), or ConfigError in one line naming ``where``
    (the flag that gives it) and the file."""
    import json

    from polar_env.engines.embedded.policy import EXAMPLE, ScriptedPolicy

    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ConfigError(f"{where} {path}: no such file; write a scripted policy there (e.g. {EXAMPLE})") from None
    except OSError as exc:
        raise ConfigError(f"{where} {path}: cannot read it ({exc.strerror or exc}); give a JSON file") from None
    except ValueError as exc:
        raise ConfigError(f"{where} {path} is not JSON: {exc}") from None
    try:
        return ScriptedPolicy.from_dict(data)
    except ValueError as exc:
        raise ConfigError(f"{where} {path} is not a scripted policy: {exc}; see README 'Scripted policy'") from None
