"""Harness presets: the unmodified agent CLIs polar_env drives, as data.

``HARNESSES`` (a ``Registry``) maps a name to its :class:`HarnessSpec` (one small module per harness,
registered below: a new one is its module plus one line here). ``get_harness(ref)`` takes a table
name, a CLI short name (``claude``, ``qwen``, ...), a user-defined harness file (``.json``, or
``.yaml``/``.yml`` with PyYAML) or an import path (``pkg.module:attr``, the attribute a
``HarnessSpec``, a mapping or a callable returning one). ``check_harness`` also accepts ``loop``
(the built-in agent loop, which is not a preset).

A harness file is a mapping::

    name: my-agent                      # required
    command: ["my-agent", "--task", "{prompt}"]   # or one string, split like a shell would
    install: {kind: npm, package: my-agent, version: 1.2.3}   # or kind: pip; omit: binary on PATH
    binary: my-agent                    # default: command[0]
    api: openai_chat                    # the default wire format (default openai_chat)
    apis: [openai_chat]                 # all it speaks (default: [api])
    env: {OPENAI_BASE_URL: "{base_url}/v1", OPENAI_API_KEY: "{key}", OPENAI_MODEL: "{model}"}
    files: {".my-agent/config.json": "{\\"model\\": \\"{model}\\"}"}   # relative to {home}
    needs: node                         # node | python | none: what the runtime must provide
    finish_command: null                # a command that ends the run, if it never answers in text

Templates use ``{base_url}``, ``{key}``, ``{model}``, ``{home}``, ``{prompt}`` and the argv element
``{prompt_words}`` (see ``spec.py``). ``HOME`` is set to ``{home}`` unless ``env`` sets it.
"""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

from polar_env.errors import ConfigError
from polar_env.harnesses import claude_code, codex, gemini_cli, mini_swe_agent, opencode, pi, qwen_code
from polar_env.harnesses.install import (
    binary_path,
    check_installable,
    default_cache_dir,
    ensure_installed,
    install_hint,
    is_installed,
)
from polar_env.harnesses.spec import (
    KEY_ENV,
    PROMPT_WORDS,
    ApiConfig,
    ClientSpec,
    HarnessSpec,
    Install,
    RequestMatch,
    SideRequest,
    render,
)
from polar_env.records import ProviderAPI
from polar_env.registry import Registry

__all__ = [
    "HARNESSES",
    "KEY_ENV",
    "PROMPT_WORDS",
    "ApiConfig",
    "ClientSpec",
    "HarnessSpec",
    "Install",
    "RequestMatch",
    "SideRequest",
    "binary_path",
    "check_harness",
    "default_cache_dir",
    "ensure_installed",
    "get_harness",
    "harness_from_dict",
    "install_hint",
    "is_installed",
    "load_harness_file",
    "render",
]

HARNESS_FILE_SUFFIXES = (".json", ".yaml", ".yml")
LOOP = "loop"  # the built-in agent loop (polar_env.harnesses.loop), accepted wherever a harness is named


def _from_import(obj: Any, ref: str) -> HarnessSpec:
    if callable(obj) and not isinstance(obj, HarnessSpec):
        obj = obj()
    if isinstance(obj, Mapping):
        return harness_from_dict(obj)
    if not isinstance(obj, HarnessSpec):
        raise ConfigError(f"{ref!r} is a {type(obj).__name__}, not a HarnessSpec (or a mapping / callable giving one)")
    return obj


HARNESSES: Registry[HarnessSpec] = Registry(  # preflight: a spec's install and needs are data, one check for all
    "harness", load=_from_import, preflight=check_installable,
    extra=f"'{LOOP}' (the built-in agent loop), a harness file ({'/'.join(HARNESS_FILE_SUFFIXES)}) or a pkg.module:attr import path")
for _spec in (codex.SPEC, claude_code.SPEC, gemini_cli.SPEC, qwen_code.SPEC, opencode.SPEC, pi.SPEC, mini_swe_agent.SPEC):
    HARNESSES.register(_spec.name, _spec)

_BY_CLI: Mapping[str, HarnessSpec] = MappingProxyType({s.cli: s for s in HARNESSES.values()})


def get_harness(ref: str | HarnessSpec) -> HarnessSpec:
    """A harness by table name, CLI short name, harness file path or ``module:attr`` import path."""
    if isinstance(ref, HarnessSpec):
        return ref
    if ref in HARNESSES:
        return HARNESSES.get(ref)
    if ref in _BY_CLI:
        return _BY_CLI[ref]
    if ref.endswith(HARNESS_FILE_SUFFIXES) or Path(ref).is_file():
        return load_harness_file(Path(ref))
    return HARNESSES.get(ref)


def check_harness(ref: str) -> str:
    """``ref`` when it names a harness (``loop`` included; a harness file is read and checked), else
    ConfigError with the one line. For validators: the name is resolved before any session starts."""
    if ref != LOOP:
        get_harness(ref)
    return ref


def load_harness_file(path: Path) -> HarnessSpec:
    """A user-defined harness from a JSON or YAML file (format in the module docstring)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read harness file {path}: {exc}") from exc
    if str(path).endswith((".yaml", ".yml")):
        try:
            import yaml  # type: ignore[import-untyped, unused-ignore]
        except ImportError as exc:
            raise ConfigError(f"{path}: YAML harness files need PyYAML (pip install pyyaml); or use JSON") from exc
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ConfigError(f"{path}: invalid YAML: {exc}") from exc
    else:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path}: invalid JSON: {exc}") from exc
    if not isinstance(data, Mapping):
        raise ConfigError(f"{path}: a harness file holds a mapping, got {type(data).__name__}")
    return harness_from_dict(data, source=str(path))


_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_KNOWN_KEYS = frozenset({"name", "command", "install", "binary", "api", "apis", "env", "files", "quiet_env",
                         "needs", "finish_command", "description", "unattended_flags", "paths"})


def _str_map(data: Mapping[str, Any], key: str, where: str) -> dict[str, str]:
    value = data.get(key) or {}
    if not isinstance(value, Mapping) or not all(isinstance(v, str | int | float | bool) for v in value.values()):
        raise ConfigError(f"{where}: {key!r} must map names to strings")
    return {str(k): (json.dumps(v) if isinstance(v, bool) else str(v)) for k, v in value.items()}


def harness_from_dict(data: Mapping[str, Any], *, source: str = "harness") -> HarnessSpec:
    """Build a ``HarnessSpec`` from the plain mapping a harness file holds."""
    unknown = sorted(set(data) - _KNOWN_KEYS)
    if unknown:
        raise ConfigError(f"{source}: unknown keys {unknown}; known: {sorted(_KNOWN_KEYS)}")
    name = data.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ConfigError(f"{source}: 'name' is required: letters, digits, '.', '_' or '-' (got {name!r})")
    where = f"{source} ({name})"
    command = data.get("command")
    if isinstance(command, str):
        argv = tuple(shlex.split(command))
    elif isinstance(command, list | tuple) and all(isinstance(a, str) for a in command):
        argv = tuple(command)
    else:
        raise ConfigError(f"{where}: 'command' must be a string or a list of strings")
    if not argv:
        raise ConfigError(f"{where}: 'command' is empty")
    if "{prompt}" not in " ".join(argv) and PROMPT_WORDS not in argv:
        raise ConfigError(f"{where}: 'command' never uses {{prompt}} or {{prompt_words}}: the task would not reach it")
    binary = str(data.get("binary") or argv[0])
    install = _install_from(data.get("install"), binary, name, where)
    try:
        default_api = ProviderAPI(data.get("api") or ProviderAPI.OPENAI_CHAT.value)
        apis = [ProviderAPI(a) for a in (data.get("apis") or [default_api.value])]
    except ValueError as exc:  # a registered name is checked where the harness is chosen (staging.models)
        raise ConfigError(f"{where}: {exc}") from exc
    env = _str_map(data, "env", where)
    env.setdefault("HOME", "{home}")
    files = _str_map(data, "files", where)
    paths = tuple(str(p) for p in data.get("paths") or ())
    needs = data.get("needs", "none")
    if needs not in ("node", "python", "none"):
        raise ConfigError(f"{where}: 'needs' is node, python or none, got {needs!r}")
    try:
        return HarnessSpec(
            name=name,
            cli=name,
            install=install,
            apis={api: ApiConfig(env=env, files=files, paths=paths) for api in apis},
            default_api=default_api,
            argv=argv,
            quiet_env=_str_map(data, "quiet_env", where),
            unattended_flags=tuple(data.get("unattended_flags") or ()),
            needs=needs,
            finish_command=data.get("finish_command"),
            description=str(data.get("description") or f"user-defined harness from {source}"),
        )
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{where}: {exc}") from exc


def _install_from(value: Any, binary: str, name: str, where: str) -> Install:
    if value is None:
        return Install("path", name, None, binary=binary, dir=name)
    if not isinstance(value, Mapping):
        raise ConfigError(f"{where}: 'install' must be a mapping {{kind, package, version}}")
    kind = value.get("kind")
    if kind not in ("npm", "pip"):
        raise ConfigError(f"{where}: install.kind must be npm or pip, got {kind!r}")
    package = value.get("package")
    if not isinstance(package, str) or not package:
        raise ConfigError(f"{where}: install.package is required")
    version = value.get("version")
    if "/" in binary:
        raise ConfigError(f"{where}: an installed harness's binary is a name in its bin directory, not {binary!r}")
    return Install(kind, package, None if version is None else str(version), binary=binary,
                   dir=str(value.get("dir") or name))

