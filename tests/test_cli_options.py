"""The CLI is a view of the config (issue 24): one table (``polar_env.cli.options.FLAGS``) maps each
flag to the RolloutJob / PolarEnvConfig field it sets. These tests fail when a field has no flag
and is not listed in ``NOT_EXPOSED``, when a flag names no field, when a command grows an option
in neither table, when a flag lands anywhere but its field, when ``--help`` hides a default, and
when two commands infer a different engine from the same ``--engine-url``."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest

from polar_env.cli import build_parser
from polar_env.cli.options import (
    COMMAND_OPTIONS,
    FLAGS,
    NOT_EXPOSED,
    engine_kind,
    env_config,
    fields_at,
    flags_for,
    leaf_paths,
)
from polar_env.cli.serving import resolve_engine_kind
from polar_env.preflight import JOB_OPTIONS

JOB_COMMANDS = ("rollout", "eval", "sft")
ENV_COMMANDS = ("serve", "submit")
SERVER_COMMANDS = ("engine", "gateway")


def _uncovered(paths: list[str]) -> list[str]:
    """Paths that no flag sets and ``NOT_EXPOSED`` does not list (a listed parent covers its fields)."""
    known = [f.path for f in FLAGS] + list(NOT_EXPOSED)
    return [p for p in paths if not any(p == k or p.startswith(k + ".") for k in known)]


def _subparser(name: str) -> argparse.ArgumentParser:
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")  # noqa: SLF001
    return sub.choices[name]  # type: ignore[index,no-any-return]


def _options(name: str) -> list[str]:
    return [s for a in _subparser(name)._actions for s in a.option_strings[:1] if s != "-h"]  # noqa: SLF001


def test_every_config_field_has_a_flag_or_a_reason() -> None:
    from polar_env.proxy.config import GatewayConfig

    assert _uncovered(leaf_paths()) == [], "give the field a flag in FLAGS, or list it in NOT_EXPOSED with a reason"
    assert _uncovered(leaf_paths(GatewayConfig, "gateway.")) == [], "the gateway's settings too"
    assert _uncovered(["env.limits.new_knob", "env.harness"]) == ["env.limits.new_knob"]  # the check can fail


def test_every_flag_and_exclusion_names_a_field() -> None:
    for path in [f.path for f in FLAGS] + list(NOT_EXPOSED):
        assert fields_at(path), f"{path} is no field of RolloutJob/PolarEnvConfig/GatewayConfig"
    assert all(reason.strip() for reason in NOT_EXPOSED.values())
    assert not {f.path for f in FLAGS} & set(NOT_EXPOSED), "a field is either exposed or not"
    assert len({f.name for f in FLAGS}) == len(FLAGS) and len({f.path for f in FLAGS}) == len(FLAGS)


@pytest.mark.parametrize("command", JOB_COMMANDS + ENV_COMMANDS + SERVER_COMMANDS)
def test_every_option_of_a_config_command_is_in_one_table(command: str) -> None:
    """A hand-added option that sets config behind the table's back fails here (the servers'
    included: ``gateway`` and ``engine`` once hand-wrote 22 options beside the table)."""
    table = {f.name for f in flags_for(command, env_only=command in ENV_COMMANDS)}
    stray = [o for o in _options(command) if o not in table and o not in COMMAND_OPTIONS]
    assert stray == [], f"polar-env {command}: {stray} are in neither options.FLAGS nor COMMAND_OPTIONS"
    if command in SERVER_COMMANDS:
        assert table <= set(_options(command)) and any(f.path.startswith("env.engine.") for f in flags_for(command))
        return
    env_flags = [f.name for f in FLAGS if f.env]
    assert set(env_flags) <= set(_options(command))
    if command in JOB_COMMANDS:
        assert {f.name for f in FLAGS if not f.env and (not f.commands or command in f.commands)} <= set(_options(command))


def test_preflight_names_the_same_flags() -> None:
    """preflight (below the CLI) words its one-line errors with flag names: they agree with the table."""
    by_path = {f.path: f.name for f in FLAGS}
    for field, flag in JOB_OPTIONS.items():
        if field in by_path:
            assert by_path[field] == flag, field


@pytest.mark.parametrize("command", JOB_COMMANDS + ENV_COMMANDS + SERVER_COMMANDS)
def test_help_shows_every_default(command: str) -> None:
    table = {f.name for f in flags_for(command, env_only=command in ENV_COMMANDS)}
    for action in _subparser(command)._actions:  # noqa: SLF001
        name = action.option_strings[0] if action.option_strings else action.dest
        if name in table:
            assert "(default: " in str(action.help) and "(default: None)" not in str(action.help), name
    text = " ".join(_subparser("rollout").format_help().split())
    assert "(default: 4)" in text and "(default: off: every sample runs)" in text  # stage limits, --early-stop
    assert "sessions per task (the GRPO group size) (default: 4)" in " ".join(_subparser("sft").format_help().split())


# (extra argv, the path, the value there); each flag of the table is exercised once
APPLIED: dict[str, tuple[list[str], str, Any]] = {
    "--harness": (["--harness", "loop"], "harness", "loop"),
    "--api": (["--harness", "loop", "--api", "openai_chat"], "api", "openai_chat"),
    "--engine": (["--engine", "simulated"], "engine.kind", "simulated"),
    "--engine-url": (["--engine-url", "http://h:1"], "engine.url", "http://h:1"),
    "--served-model-name": (["--served-model-name", "m"], "engine.model", "m"),
    "--template": (["--template", "append_only"], "engine.template", "append_only"),
    "--logprobs-mode": (["--logprobs-mode", "raw"], "engine.logprobs_mode", "raw"),
    "--model-dir": (["--model-dir", "/m"], "engine.model_dir", Path("/m")),
    "--seed": (["--seed", "3"], "engine.seed", 3),
    "--engine-script": (["--engine-script", "/s.json"], "engine.script", Path("/s.json")),
    "--max-tokens": (["--max-tokens", "7"], "sampling.max_tokens", 7),
    "--temperature": (["--temperature", "0.5"], "sampling.temperature", 0.5),
    "--top-p": (["--top-p", "0.9"], "sampling.top_p", 0.9),
    "--runtime": (["--runtime", "docker"], "runtime.kind", "docker"),
    "--pull": (["--pull"], "runtime.pull", True),
    "--allow-unbounded": (["--allow-unbounded"], "runtime.allow_unbounded", True),
    "--ray-wait-s": (["--ray-wait-s", "60"], "ray_wait_s", 60.0),
    "--builder": (["--builder", "per_request"], "builder", "per_request"),
    "--evaluator": (["--evaluator", '{"name": "output", "regex": "ok"}'], "evaluator.params", {"regex": "ok"}),
    "--canonical": (["--canonical"], "continuation", False),
    "--timeout-s": (["--timeout-s", "5"], "timeout_s", 5.0),
    "--init-timeout-s": (["--init-timeout-s", "6"], "init_timeout_s", 6.0),
    "--nodes": (["--nodes", "2"], "nodes", 2),
    "--ray": (["--ray"], "ray", True),
    "--ray-address": (["--ray-address", "auto"], "ray", True),  # implies --ray
    "--ray-node-resource": (["--ray-node-resource", "gpu_host"], "ray_node_resource", "gpu_host"),
    "--shared-store": (["--shared-store"], "shared_store", True),
    "--max-running": (["--max-running", "2"], "limits.ready_buffer", 6),  # the buffer is derived again
    "--max-init": (["--max-init", "3"], "limits.max_init", 3),
    "--max-postrun": (["--max-postrun", "5"], "limits.max_postrun", 5),
    "--ready-buffer": (["--ready-buffer", "9"], "limits.ready_buffer", 9),
}


def _at(obj: Any, path: str) -> Any:
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


@pytest.mark.parametrize("flag", [f.name for f in FLAGS if f.env])
@pytest.mark.parametrize("command", ["rollout", "serve"])
def test_each_flag_lands_on_its_field(flag: str, command: str) -> None:
    argv, path, value = APPLIED[flag]
    config = env_config(build_parser().parse_args([command, *argv]))
    assert _at(config, path) == value
    own = next(f for f in FLAGS if f.name == flag).path.removeprefix("env.")
    assert own.split(".")[0] in config.model_fields_set  # what submit counts as chosen


def test_a_config_file_is_the_base_the_flags_apply_to(tmp_path: Path) -> None:
    yaml = tmp_path / "env.yaml"
    yaml.write_text("harness: loop\nengine: {kind: sglang, url: 'http://a:1'}\nlimits: {max_running: 2, ready_buffer: 3}\n")
    config = env_config(build_parser().parse_args(["rollout", "--config", str(yaml), "--max-init", "5"]))
    assert config.harness == "loop" and config.limits.max_running == 2 and config.limits.ready_buffer == 7
    config = env_config(build_parser().parse_args(["rollout", "--config", str(yaml), "--engine-url", "http://b:1,http://c:1"]))
    assert config.engine.kind == "sglang" and config.engine.url == "http://b:1,http://c:1"  # the file's kind takes the URL


@pytest.mark.parametrize(("kind", "url", "base", "expected"), [
    (None, None, None, "embedded"),
    (None, "http://h:8000/v1", None, "vllm"),
    (None, "http://a:1,http://b:1", None, "vllm"),  # a pool; the gateway used to read a list as SGLang workers
    (None, "router:http://r:1", None, "sglang"),  # rollout used to read this as a vLLM URL
    (None, "router:http://r:1", "vllm", "sglang"),
    (None, "http://a:1,http://b:1", "sglang", "sglang"),  # --config's served engine takes the URLs
    (None, "http://h:1", "embedded", "vllm"),  # a URL means a served engine
    (None, None, "simulated", "simulated"),
    ("sglang", "http://h:1", None, "sglang"),
])
def test_the_engine_kind_rule(kind: str | None, url: str | None, base: str | None, expected: str) -> None:
    assert engine_kind(kind, url, base) == expected


@pytest.mark.parametrize("url", ["http://h:1", "http://a:1,http://b:1", "router:http://r:1"])
def test_gateway_and_rollout_infer_the_same_engine(url: str, tmp_path: Path) -> None:
    gateway = build_parser().parse_args(["gateway", "--engine-url", url, "--store", str(tmp_path)])
    for command in ("rollout", "eval", "sft", "serve", "submit"):
        argv = [command, *(["rows.jsonl"] if command == "submit" else []), "--engine-url", url]
        assert env_config(build_parser().parse_args(argv)).engine.kind == resolve_engine_kind(gateway), command
