"""Recipe YAML → the exact slime launch: a bash script (or argv) plus the small files it names.

slime has no global config file; everything is a command-line flag (Megatron's parser, with
``--sglang-*``/``--router-*`` going to SGLang's). A recipe maps one-to-one onto those flags:

    recipe_version: 1
    slime: {commit: 624b824a8, entrypoint: train.py, dir: /root/slime}
    model_preset: qwen3.5-4B            # => source <dir>/scripts/models/qwen3.5-4B.sh; "${MODEL_ARGS[@]}"
    args: {<section>: {<flag>: <value>}}  # section names are cosmetic
    extra_args: []                      # raw tokens, not validated (flags newer than the pinned list)
    polar: {...}                        # a PolarEnv config -> polar.yaml, named by custom_config
    custom_config: {...}                # -> slime_custom_config.yaml -> --custom-config-path
    sglang_config / eval_config: {...}  # -> files -> --sglang-config / --eval-config
    env: {NAME: value}                  # exported before the launch
    launcher: {kind: ray_job, address: http://127.0.0.1:8265}   # or {kind: python}

Rendering: scalar → ``--k v``; ``true`` → bare ``--k``; ``false``/null → omitted; list →
``--k v1 v2``. A flag repeated across sections is an error, and flags are checked against the
names slime 624b824a8 knows (``slime_flags.txt``: what slime's, Megatron's and SGLang's own argparse
parsers register, ``--sglang-*`` and ``--router-*`` included; regenerate it with
``scripts/gen_slime_flags.py`` from checkouts).
``parse_flags`` is the inverse of the flag rendering, so a rendered command round-trips.
"""

from __future__ import annotations

import difflib
import json
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from polar_env.errors import ConfigError
from polar_env.yaml_config import load_model

FLAGS_FILE = Path(__file__).with_name("slime_flags.txt")
PASSTHROUGH_PREFIXES: tuple[str, ...] = ()  # every sglang-/router- flag is in the list now
POLAR_FILE = "polar.yaml"
CUSTOM_CONFIG_FILE = "slime_custom_config.yaml"
SGLANG_CONFIG_FILE = "sglang_config.yaml"
EVAL_CONFIG_FILE = "eval_config.yaml"
GENERATE_PATH = "polar_env.integrations.slime.generate"
NORMALIZE_PATH = "polar_env.integrations.slime.grpo_normalize"
LOG_PATH = "polar_env.integrations.slime.log_rollout"  # polar/generate_errors in the rollout's metrics


class SlimeSource(BaseModel):
    model_config = ConfigDict(extra="forbid")

    commit: str = "624b824a8"
    entrypoint: str = "train.py"  # train_async.py for one-step-off-policy (no colocate)
    dir: str = "${SLIME_DIR:-/root/slime}"  # where slime is checked out (the slimerl/slime image: /root/slime)


class Launcher(BaseModel):
    model_config = ConfigDict(extra="forbid")

    kind: Literal["ray_job", "python"] = "ray_job"
    address: str = "http://127.0.0.1:8265"


class Recipe(BaseModel):
    model_config = ConfigDict(extra="forbid")

    recipe_version: Literal[1] = 1
    description: str = ""
    slime: SlimeSource = Field(default_factory=SlimeSource)
    model_preset: str | None = None
    model_args: list[str] | None = None
    args: dict[str, dict[str, Any]] = Field(default_factory=dict)
    extra_args: list[str] = Field(default_factory=list)
    polar: dict[str, Any] | None = None
    custom_config: dict[str, Any] | None = None
    sglang_config: dict[str, Any] | None = None
    eval_config: dict[str, Any] | None = None
    env: dict[str, str] = Field(default_factory=dict)
    launcher: Launcher = Field(default_factory=Launcher)

    @model_validator(mode="after")
    def _polar_config(self) -> Recipe:
        """The ``polar:`` block is a PolarEnv config: its names are checked when the recipe loads."""
        if self.polar is not None:
            from polar_env.env import PolarEnvConfig
            from polar_env.registry import validation_line

            try:
                PolarEnvConfig.model_validate(self.polar)
            except ValidationError as exc:
                raise ValueError(validation_line(exc, prefix="polar", model=PolarEnvConfig)) from None
        return self

    @classmethod
    def from_yaml(cls, path: str | Path) -> Recipe:
        return load_model(cls, path, "recipe")


@cache
def known_flags() -> frozenset[str]:
    return frozenset(line.strip() for line in FLAGS_FILE.read_text().splitlines()
                     if line.strip() and not line.startswith("#"))


def check_flag(name: str, section: str) -> None:
    if name.startswith("-"):
        raise ConfigError(f"args.{section}.{name}: write flag names without dashes ({name.lstrip('-')})")
    if name in known_flags() or name.startswith(PASSTHROUGH_PREFIXES):
        return
    close = difflib.get_close_matches(name, sorted(known_flags()), n=1)
    hint = f" (did you mean {close[0]}?)" if close else ""
    raise ConfigError(f"args.{section}.{name}: not a slime {SlimeSource().commit} flag{hint}; "
                      "put flags newer than that in extra_args")


def flag_map(recipe: Recipe) -> dict[str, Any]:
    """Every flag of the recipe's ``args`` in order, sections flattened (a repeat is an error)."""
    flags: dict[str, Any] = {}
    where: dict[str, str] = {}
    for section, values in recipe.args.items():
        for name, value in values.items():
            check_flag(name, section)
            if name in flags:
                raise ConfigError(f"flag {name} is set in both args.{where[name]} and args.{section}")
            flags[name], where[name] = value, section
    return flags


def render_value(value: object) -> str:
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, (dict, list)):
        return json.dumps(value, separators=(",", ":"))
    return str(value)


def render_flags(flags: Mapping[str, Any]) -> list[str]:
    out: list[str] = []
    for name, value in flags.items():
        if value is None or value is False:
            continue
        if value is True:
            out.append(f"--{name}")
        elif isinstance(value, list):
            out += [f"--{name}", *(render_value(v) for v in value)]
        else:
            out += [f"--{name}", render_value(value)]
    return out


def parse_flags(argv: Sequence[str]) -> dict[str, str | list[str] | bool]:
    """The inverse of ``render_flags`` (values as their rendered strings)."""
    flags: dict[str, str | list[str] | bool] = {}
    name: str | None = None
    values: list[str] = []

    def close() -> None:
        if name is not None:
            flags[name] = True if not values else values[0] if len(values) == 1 else list(values)

    for token in argv:
        if token.startswith("--"):
            close()
            name, values = token[2:], []
        elif name is None:
            raise ValueError(f"value {token!r} before any flag")
        else:
            values.append(token)
    close()
    return flags


@dataclass
class SlimeLaunch:
    """What ``render`` produces: the flag argv, the files it names, and the full bash script."""

    flags: list[str]
    files: dict[Path, str] = field(default_factory=dict)
    script: str = ""

    def write_files(self) -> None:
        for path, text in self.files.items():
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)


def _yaml(data: Mapping[str, Any]) -> str:
    return yaml.safe_dump(dict(data), sort_keys=False)


def render(recipe: Recipe, out_dir: Path) -> SlimeLaunch:
    """The launch for ``recipe``; files land in ``out_dir`` (absolute paths in the command)."""
    out_dir = out_dir.resolve()
    flags = flag_map(recipe)
    files: dict[Path, str] = {}
    custom = dict(recipe.custom_config or {})
    if recipe.polar is not None:  # checked when the recipe was built (Recipe._polar_config)
        files[out_dir / POLAR_FILE] = _yaml(recipe.polar)
        custom.setdefault("polar_config", str(out_dir / POLAR_FILE))
    for key, data, name in (("custom-config-path", custom or None, CUSTOM_CONFIG_FILE),
                            ("sglang-config", recipe.sglang_config, SGLANG_CONFIG_FILE),
                            ("eval-config", recipe.eval_config, EVAL_CONFIG_FILE)):
        if data is None:
            continue
        if key in flags:
            raise ConfigError(f"the recipe sets both {key.replace('-', '_')} data and the --{key} flag; keep one")
        files[out_dir / name] = _yaml(data)
        flags[key] = str(out_dir / name)
    uses_polar = flags.get("custom-generate-function-path") == GENERATE_PATH
    if uses_polar and recipe.polar is None and "polar_config" not in custom:
        raise ConfigError("the recipe uses polar_env's generate function but has no `polar:` block (a PolarEnv config)")
    if uses_polar and flags.get("group-rm"):
        from polar_env.integrations.slime import check_slime_args

        check_slime_args(type("Args", (), {"group_rm": True})())  # the same one line generate gives
    if uses_polar and flags.get("custom-reward-post-process-path") is None and flags.get("n-samples-per-prompt", 1) != 1:
        raise ConfigError(f"set custom-reward-post-process-path: {NORMALIZE_PATH}: one rollout can yield several "
                          "samples, and slime's default normalisation then uses one group for the batch (slime#1414)")
    if uses_polar:  # a recipe's own log function is kept (it then reports polar's errors itself)
        flags.setdefault("custom-rollout-log-function-path", LOG_PATH)
    argv = render_flags(flags) + list(recipe.extra_args)
    return SlimeLaunch(flags=argv, files=files, script=_script(recipe, argv))


def _script(recipe: Recipe, argv: list[str]) -> str:
    src = recipe.slime
    lines = ["#!/usr/bin/env bash", f"# slime launch rendered by polar-env slime-args (slime {src.commit})",
             "set -euo pipefail", f'SLIME_DIR="{src.dir}"']
    lines += [f"export {k}={shlex.quote(v)}" for k, v in recipe.env.items()]
    model: list[str] = []
    if recipe.model_preset:
        lines.append(f'source "${{SLIME_DIR}}/scripts/models/{recipe.model_preset}.sh"')
        model = ['"${MODEL_ARGS[@]}"']
    elif recipe.model_args:
        model = [shlex.quote(a) for a in recipe.model_args]
    program = ["python3", '"${SLIME_DIR}/' + src.entrypoint + '"']
    if recipe.launcher.kind == "ray_job":
        env_json = json.dumps({"env_vars": recipe.env})
        lines.append(f"RUNTIME_ENV_JSON={shlex.quote(env_json)}")
        program = ["ray", "job", "submit", f"--address={shlex.quote(recipe.launcher.address)}",
                   '--runtime-env-json="${RUNTIME_ENV_JSON}"', "--", *program]
    groups: list[list[str]] = []
    for token in argv:  # one line per flag and its values
        if token.startswith("--") or not groups:
            groups.append([])
        groups[-1].append(shlex.quote(token))
    body = [" ".join(program), *(model and [" ".join(model)]), *(" ".join(g) for g in groups)]
    return "\n".join(lines) + "\n" + " \\\n  ".join(body) + "\n"
