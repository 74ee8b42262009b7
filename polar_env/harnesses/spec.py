"""Harness presets as data: what to install, how to point the CLI at a gateway, how to run it headless.

A :class:`HarnessSpec` describes one unmodified agent harness CLI:

- ``install``: the package (npm ``name@version`` or a pip requirement) installed once into a shared
  cache (``<cache>/<cli>``), never per session (``polar_env.harnesses.install``);
- ``apis``: the provider wire formats it can speak, each with the env vars and config files that
  point it at the session's gateway (:class:`ApiConfig`), and ``default_api``;
- ``argv``: the headless command for one task instruction;
- ``quiet_env`` / ``unattended_flags``: what turns off telemetry, update checks and approval prompts;
- ``side_requests``: the extra requests the gateway should expect (``harnesses.md`` §9); a model
  call among them carries a :class:`RequestMatch`, so builders keep its chain out of what is
  trained with the task's reward (``polar_env/trajectory/lineage.py``).

Every string is a template filled by :func:`render` with ``{base_url}`` (the gateway root, no
``/v1``), ``{key}`` (the session key), ``{model}``, ``{home}`` (the private, writable ``$HOME``) and
``{prompt}``. An argv element that is exactly ``{prompt_words}`` expands to ``prompt.split()``.
Inside ``.json`` / ``.toml`` / ``.yaml`` files values are JSON-escaped. ``files`` paths are relative
to ``{home}``. :meth:`HarnessSpec.client` flattens one (harness, api) pair into a :class:`ClientSpec`,
the shape ``polar_env.testing.harness_check`` and runtimes consume.
"""

from __future__ import annotations

import itertools
import json
import shutil
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Literal

from polar_env.errors import ConfigError
from polar_env.records import ChatRequest, ProviderAPI

KEY_ENV = "POLAR_API_KEY"
"""Env var holding the session key, for harnesses whose config names a variable rather than a value
(Codex ``env_key``, opencode ``{env:...}``, pi ``apiKey``)."""

PROMPT_WORDS = "{prompt_words}"
PLACEHOLDERS = ("base_url", "key", "model", "home", "prompt")
QUOTED_SUFFIXES = (".json", ".toml", ".yaml", ".yml")


def _frozen(mapping: Mapping[str, str] | None) -> Mapping[str, str]:
    return MappingProxyType(dict(mapping or {}))


@dataclass(frozen=True, slots=True)
class Install:
    """Where a harness comes from. ``kind`` npm: ``npm install --prefix <cache>/<dir> package@version``,
    binary in ``node_modules/.bin``; pip: a venv at ``<cache>/<dir>/venv``, binary in ``venv/bin``;
    path: nothing to install, ``binary`` is an absolute path or a name on ``PATH``.
    ``dir`` is the cache sub-directory (the CLI's short name, shared with scripts/install_harnesses.sh)."""

    kind: Literal["npm", "pip", "path"]
    package: str
    version: str | None
    binary: str
    dir: str

    @property
    def requirement(self) -> str:
        if self.version is None:
            return self.package
        return f"{self.package}@{self.version}" if self.kind == "npm" else f"{self.package}=={self.version}"

    def prefix(self, cache_dir: Path) -> Path:
        return Path(cache_dir) / self.dir

    def bin_dir(self, cache_dir: Path) -> Path:
        if self.kind == "path":
            return self.binary_path(cache_dir).parent
        sub = ("node_modules", ".bin") if self.kind == "npm" else ("venv", "bin")
        return self.prefix(cache_dir).joinpath(*sub)

    def binary_path(self, cache_dir: Path) -> Path:
        if self.kind == "path":
            return Path(self.binary if "/" in self.binary else shutil.which(self.binary) or self.binary)
        return self.bin_dir(cache_dir) / self.binary


@dataclass(frozen=True, slots=True)
class ApiConfig:
    """How the harness is pointed at the gateway for one wire format."""

    env: Mapping[str, str] = field(default_factory=dict)
    files: Mapping[str, str] = field(default_factory=dict)  # path relative to {home} -> content
    paths: tuple[str, ...] = ()  # request paths its main turns hit (documentation/tests)

    def __post_init__(self) -> None:
        object.__setattr__(self, "env", _frozen(self.env))
        object.__setattr__(self, "files", _frozen(self.files))


def _text(content: object) -> str:
    """A message's text: a string, or the ``text`` of its parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(str(p.get("text", "")) for p in content if isinstance(p, Mapping))
    return ""


@dataclass(frozen=True, slots=True)
class RequestMatch:
    """What a side request's model call looks like once normalized (its ``ChatRequest``), checked
    by builders; every condition given must hold. ``system``: any of these phrases occurs in the
    leading system messages (case-insensitive; only those, so a check costs nothing per turn of
    history); ``tools``: False for a call that offers no tools;
    ``json_output``: True for a call that asks for JSON output (``response_format``)."""

    api: ProviderAPI | None = None
    system: tuple[str, ...] = ()
    tools: bool | None = None
    json_output: bool | None = None

    def matches(self, api: ProviderAPI, chat: ChatRequest) -> bool:
        if self.api is not None and api != self.api:
            return False
        if self.tools is not None and bool(chat.tools) != self.tools:
            return False
        if self.json_output is not None and (chat.response_format is not None) != self.json_output:
            return False
        if self.system:
            lead = itertools.takewhile(lambda m: m.get("role") in ("system", "developer"), chat.messages)
            text = "\n".join(_text(m.get("content")) for m in lead).lower()
            if not any(phrase.lower() in text for phrase in self.system):
                return False
        return True


@dataclass(frozen=True, slots=True)
class SideRequest:
    """An extra request the harness sends besides its main turns. ``match`` (model calls only)
    recognizes it in a capture; its chain is then kept but not trained with the task's reward,
    under the role ``side_request:<name>``."""

    what: str
    disabled_by: str | None = None  # the env/setting that stops it (set in the preset), or None
    handling: str = "record it; it forms its own prefix chain, not trained with the task's reward"
    name: str = ""  # short name for the role (title, classifier, memory); "" for non-model requests
    match: RequestMatch | None = None


@dataclass(frozen=True, slots=True)
class ClientSpec:
    """One harness CLI pointed at one gateway wire format. All strings are templates."""

    name: str  # the CLI's short name: claude, codex, gemini, qwen, opencode, pi, mini
    api: ProviderAPI
    binary: str  # executable name in the install's bin directory
    argv: tuple[str, ...]  # argv[0] is the binary; "{prompt}" / "{prompt_words}" elements
    env: Mapping[str, str] = field(default_factory=dict)
    files: Mapping[str, str] = field(default_factory=dict)  # path relative to {home} -> content
    paths: tuple[str, ...] = ()  # request paths the harness's main turns hit (documentation/tests)
    install: Install | None = None
    harness: str = ""  # the HarnessSpec name this came from
    finish_command: str | None = None  # see HarnessSpec.finish_command

    @property
    def id(self) -> str:
        return f"{self.name}-{self.api.value}"


@dataclass(frozen=True, slots=True)
class HarnessSpec:
    """One harness preset; see the module docstring."""

    name: str  # table key: claude_code, codex, ...
    cli: str  # short name: ClientSpec ids ("pi-openai_chat"), cache sub-directory
    install: Install
    apis: Mapping[ProviderAPI, ApiConfig]
    default_api: ProviderAPI
    argv: tuple[str, ...]
    quiet_env: Mapping[str, str] = field(default_factory=dict)  # telemetry/update/approval off, HOME
    unattended_flags: tuple[str, ...] = ()  # the argv elements that skip approval prompts
    side_requests: tuple[SideRequest, ...] = ()
    needs: Literal["node", "python", "none"] = "node"  # what the runtime must provide besides the install
    # A harness that ends by running a command rather than by answering in text (mini-swe-agent's
    # `echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT`); scripted engines must send it to finish.
    finish_command: str | None = None
    description: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "apis", MappingProxyType(dict(self.apis)))
        object.__setattr__(self, "quiet_env", _frozen(self.quiet_env))
        if self.default_api not in self.apis:
            raise ConfigError(f"harness {self.name!r}: default_api {self.default_api.value} is not among its apis")
        if not self.argv:
            raise ConfigError(f"harness {self.name!r}: empty argv")
        missing = [f for f in self.unattended_flags if f not in self.argv]
        if missing:
            raise ConfigError(f"harness {self.name!r}: unattended_flags {missing} are not in argv")

    @property
    def binary(self) -> str:
        return self.install.binary

    def api_of(self, api: ProviderAPI | str | None = None) -> ProviderAPI:
        chosen = self.default_api if api is None else ProviderAPI(api)
        if chosen not in self.apis:
            known = ", ".join(a.value for a in self.apis)
            raise ConfigError(f"harness {self.name!r} does not speak {chosen.value} (it speaks: {known})")
        return chosen

    def client(self, api: ProviderAPI | str | None = None) -> ClientSpec:
        chosen = self.api_of(api)
        conf = self.apis[chosen]
        return ClientSpec(
            name=self.cli,
            api=chosen,
            binary=self.install.binary,
            argv=self.argv,
            env=MappingProxyType({**self.quiet_env, **conf.env}),
            files=conf.files,
            paths=conf.paths,
            install=self.install,
            harness=self.name,
            finish_command=self.finish_command,
        )

    def clients(self) -> tuple[ClientSpec, ...]:
        return tuple(self.client(api) for api in self.apis)


def as_json(data: object) -> str:
    """A config file's text (the templates inside are filled JSON-escaped by ``render``)."""
    return json.dumps(data, indent=2) + "\n"


def _fill(template: str, values: Mapping[str, str], *, quoted: bool) -> str:
    for name in PLACEHOLDERS:
        value = values[name]
        # Inside JSON / TOML basic strings the value must be escaped; json.dumps does both.
        template = template.replace("{" + name + "}", json.dumps(value)[1:-1] if quoted else value)
    return template


def render(spec: ClientSpec, base_url: str, key: str, model: str, home: str,
           prompt: str) -> tuple[list[str], dict[str, str], dict[str, str]]:
    """Fill a spec: ``(argv, env overlay, {path relative to home: content})``."""
    values = {"base_url": base_url.rstrip("/"), "key": key, "model": model, "home": home, "prompt": prompt}
    argv: list[str] = []
    for arg in spec.argv:
        if arg == PROMPT_WORDS:
            argv.extend(prompt.split())
        else:
            argv.append(_fill(arg, values, quoted=False))
    env = {k: _fill(v, values, quoted=False) for k, v in spec.env.items()}
    files = {path: _fill(text, values, quoted=path.endswith(QUOTED_SUFFIXES)) for path, text in spec.files.items()}
    return argv, env, files
