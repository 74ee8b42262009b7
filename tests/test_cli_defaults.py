"""One default per setting (issue 47): an option from the flag table (``options.FLAGS``) leaves its
field's default to the config model (argparse's own default is None, or off for a switch), and
``--help`` states that default — the model's own, the table's ``shown`` words, or a job command's
declared own (``eval`` runs 1 sample, ``sft`` 4: ``default_samples``). Every command that sets
configuration is checked, the servers included: ``engine`` and ``gateway`` once hand-wrote their
options and capped the embedded engine at 1024 tokens where the config says 256."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from polar_env.cli import build_parser
from polar_env.cli.options import FLAGS, Flag, flags_for, model_default
from polar_env.cli.serving import embedded_engine, gateway_settings
from polar_env.engines.config import EmbeddedEngineConfig
from polar_env.proxy.config import GatewayConfig, Sampling

TABLE_COMMANDS = ("rollout", "eval", "sft", "serve", "submit", "engine", "gateway")
ENGINE_PATHS = ("env.engine.", "env.sampling.", "gateway.")


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    return next(a for a in parser._actions if a.dest == "command").choices  # type: ignore[return-value]  # noqa: SLF001


def _shown(help_text: str) -> str:
    assert "(default: " in help_text, help_text
    return help_text.rsplit("(default: ", 1)[1].removesuffix(")")


def default_problems(command: str, sub: argparse.ArgumentParser) -> list[str]:
    """Each table option of ``command`` whose default is not its field's (empty: all agree)."""
    if command in TABLE_COMMANDS:
        table = flags_for(command, env_only=command in ("serve", "submit"))
    else:  # an engine setting spelled as in the table (export-model --seed) keeps its default too
        table = tuple(f for f in FLAGS if f.path.startswith(ENGINE_PATHS))
    by_name: dict[str, Flag] = {name: f for f in table for name in (f.name, *f.aliases)}
    problems = []
    for action in sub._actions:  # noqa: SLF001
        flag = next((by_name[o] for o in action.option_strings if o in by_name), None)
        if flag is None:
            continue
        model = sub.get_default(f"default_{flag.dest}") or model_default(flag.path)  # a job command's own, declared
        if action.default not in (None, False) and action.default != model:
            problems.append(f"{command} {flag.name}: argparse default {action.default!r}, the config's {model!r}")
        if command in TABLE_COMMANDS and flag.shown is None and _shown(str(action.help)) != str(model):
            problems.append(f"{command} {flag.name}: --help says {_shown(str(action.help))!r}, the config {model!r}")
    return problems


@pytest.mark.parametrize("command", sorted(_subparsers()))
def test_every_flag_defaults_to_its_config_default(command: str) -> None:
    assert default_problems(command, _subparsers()[command]) == []


def test_the_check_can_fail() -> None:
    """Hand-written options with their own defaults beside the table are caught (the old gateway's)."""
    p = argparse.ArgumentParser()
    p.add_argument("--max-tokens", type=int, default=1024, help="cap (default: 1024)")
    p.add_argument("--engine-timeout", type=float, default=60.0, help="seconds (default: 60.0)")
    assert default_problems("gateway", p) == [
        "gateway --max-tokens: argparse default 1024, the config's None",
        "gateway --engine-timeout: argparse default 60.0, the config's 1800.0",
        "gateway --engine-timeout: --help says '60.0', the config 1800.0",
    ]


def test_the_token_cap_default_is_the_configs_in_every_command(tmp_path: Path) -> None:
    """The shown default of --max-tokens is the embedded config's, and the servers' engines use it."""
    (help_text,) = {a.help for s in _subparsers().values() for a in s._actions if "--max-tokens" in a.option_strings}  # noqa: SLF001
    plain, scripted = EmbeddedEngineConfig().default_max_tokens(), EmbeddedEngineConfig(script=tmp_path).default_max_tokens()
    assert f"embedded {plain}, scripted {scripted}" in str(help_text)
    parse = build_parser().parse_args
    assert embedded_engine(parse(["engine"]), "engine").max_tokens == plain == 256
    gateway_args = parse(["gateway", "--store", str(tmp_path), "--engine", "embedded"])
    assert embedded_engine(gateway_args, "gateway").max_tokens == plain
    assert embedded_engine(parse(["engine", "--max-tokens", "9"]), "engine").max_tokens == 9


def test_the_gateway_config_is_the_models_defaults_with_the_flags_on_top(tmp_path: Path) -> None:
    parse = build_parser().parse_args
    bare = gateway_settings(parse(["gateway", "--store", str(tmp_path)]), engine_model="m")
    assert bare == GatewayConfig(engine_model="m")  # no flag: every setting is the model's default
    config = gateway_settings(parse([
        "gateway", "--store", str(tmp_path), "--engine-timeout", "5", "--continuation", "--public-url", "http://h:1",
        "--admin-token", "t", "--temperature", "0.5", "--top-p", "0.9", "--max-tokens", "7"]), engine_model="m")
    assert (config.engine_timeout_s, config.continuation, config.public_url, config.admin_token) == (5.0, True, "http://h:1", "t")
    assert config.sampling == Sampling(temperature=0.5, top_p=0.9, max_tokens=7)
