"""Recipe YAML → slime launch: the shipped recipes render to known slime flags, the flags (and the
printed bash script) round-trip back to the recipe, and the written polar.yaml reaches the generate
function through --custom-config-path."""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import yaml

from polar_env.cli import main
from polar_env.env import PolarEnvConfig
from polar_env.errors import ConfigError
from polar_env.integrations.slime import forced_sampling, polar_config
from polar_env.integrations.slime_recipe import (
    GENERATE_PATH,
    LOG_PATH,
    NORMALIZE_PATH,
    Recipe,
    flag_map,
    known_flags,
    parse_flags,
    render,
    render_value,
)
from polar_env.proxy.config import Sampling

RECIPES = Path(__file__).resolve().parents[2] / "recipes"
SHIPPED = sorted(RECIPES.glob("slime_*.yaml"))


def expected_flags(recipe: Recipe) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, value in flag_map(recipe).items():
        if value is None or value is False:
            continue
        if value is True:
            out[name] = True
        elif isinstance(value, list):
            out[name] = [render_value(v) for v in value] if len(value) != 1 else render_value(value[0])
        else:
            out[name] = render_value(value)
    return out


def script_flags(script: str) -> dict[str, Any]:
    """The flags of the launch command in a rendered script, as bash would pass them."""
    joined = script.replace(" \\\n  ", " ")
    last = [line for line in joined.splitlines() if "train.py" in line][-1]
    tokens = shlex.split(last)
    start = tokens.index("${MODEL_ARGS[@]}") + 1 if "${MODEL_ARGS[@]}" in tokens else tokens.index("${SLIME_DIR}/train.py") + 1
    return parse_flags(tokens[start:])


def test_shipped_recipes_exist() -> None:
    names = {p.name for p in SHIPPED}
    assert {"slime_grpo_qwen3.5_4b_swegym.yaml", "slime_smoke_qwen3.5_0.8b_toy.yaml"} <= names


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
def test_recipe_round_trips(path: Path, tmp_path: Path) -> None:
    recipe = Recipe.from_yaml(path)
    launch = render(recipe, tmp_path)
    flags = parse_flags(launch.flags)
    custom = flags.pop("custom-config-path")
    assert flags.pop("custom-rollout-log-function-path") == LOG_PATH  # polar/generate_errors in slime's metrics
    assert flags == expected_flags(recipe)  # every recipe flag, exactly, and nothing else
    assert script_flags(launch.script) == parse_flags(launch.flags)  # what bash would pass
    assert all(name in known_flags() or name.startswith(("sglang-", "router-")) for name in flags)
    launch.write_files()
    custom_config = yaml.safe_load(Path(str(custom)).read_text())
    polar_file = Path(custom_config["polar_config"])
    assert PolarEnvConfig.model_validate(yaml.safe_load(polar_file.read_text())) is not None
    # the generate function reads it back the way slime hands it over (custom config keys on args)
    args = SimpleNamespace(**custom_config, sglang_router_ip="127.0.0.1", sglang_router_port=30000)
    cfg = polar_config(args)
    env_cfg = PolarEnvConfig.model_validate(cfg)
    assert env_cfg.engine.kind == "sglang" and env_cfg.engine.url == "router:http://127.0.0.1:30000"
    # slime's sampling comes with each call, as the session's; the recipe's polar block agrees with it
    sampling = Sampling.model_validate(forced_sampling({"temperature": float(flags["rollout-temperature"]), "top_p": 1.0,
                                                        "max_new_tokens": int(flags["rollout-max-response-len"])}))
    env_cfg.check_sampling(sampling, "recipe")


def test_qwen35_4b_swegym_recipe_layout(tmp_path: Path) -> None:
    recipe = Recipe.from_yaml(RECIPES / "slime_grpo_qwen3.5_4b_swegym.yaml")
    flags = flag_map(recipe)
    assert recipe.model_preset == "qwen3.5-4B"
    assert flags["custom-generate-function-path"] == GENERATE_PATH
    assert flags["custom-reward-post-process-path"] == NORMALIZE_PATH
    assert flags["advantage-estimator"] == "grpo" and flags["n-samples-per-prompt"] == 16
    assert (flags["actor-num-nodes"], flags["actor-num-gpus-per-node"], flags["colocate"]) == (1, 8, True)
    assert flags["global-batch-size"] == flags["rollout-batch-size"] * flags["n-samples-per-prompt"]
    assert "SkyRL-v0-293" in flags["prompt-data"] and flags["metadata-key"] == "instance"
    assert flags["rollout-top-p"] == 1.0 and flags["rollout-stop-token-ids"] == [248046, 248044]
    assert recipe.polar is not None and recipe.polar["builder"] == "prefix_merge"
    script = render(recipe, tmp_path).script
    assert 'source "${SLIME_DIR}/scripts/models/qwen3.5-4B.sh"' in script
    assert "ray job submit --address=http://127.0.0.1:8265" in script


def _recipe(**args: dict[str, Any]) -> Recipe:
    return Recipe.model_validate({"args": args})


def test_rendering_rules() -> None:
    launch = render(_recipe(a={"colocate": True, "offload": False, "load": None, "lr": 1e-6,
                               "rollout-stop-token-ids": [1, 2], "rollout-top-k": -1}), Path("/tmp"))
    assert launch.flags == ["--colocate", "--lr", "1e-06", "--rollout-stop-token-ids", "1", "2",
                            "--rollout-top-k", "-1"]
    assert parse_flags(launch.flags) == {"colocate": True, "lr": "1e-06", "rollout-stop-token-ids": ["1", "2"],
                                         "rollout-top-k": "-1"}


@pytest.mark.parametrize("recipe, message", [
    ({"args": {"a": {"lr": 1e-6}, "b": {"lr": 2e-6}}}, "both args.a and args.b"),
    ({"args": {"a": {"rollout-temprature": 1.0}}}, "did you mean rollout-temperature"),
    ({"args": {"a": {"--lr": 1e-6}}}, "without dashes"),
    ({"args": {"r": {"custom-generate-function-path": GENERATE_PATH}}}, "no `polar:` block"),
    ({"args": {"r": {"custom-generate-function-path": GENERATE_PATH, "n-samples-per-prompt": 8}},
      "polar": {"harness": "loop"}}, "slime#1414"),
])
def test_recipe_mistakes_are_one_line_errors(recipe: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        render(Recipe.model_validate(recipe), Path("/tmp/x"))


def test_a_wrong_name_in_the_polar_block_is_refused_at_load(tmp_path: Path) -> None:
    path = tmp_path / "recipe.yaml"
    path.write_text("polar:\n  harness: loop\n  builder: prefix_merg\n")
    with pytest.raises(ConfigError) as info:
        Recipe.from_yaml(path)
    assert str(info.value) == (f"recipe {path}: polar.builder: unknown builder 'prefix_merg'; did you mean 'prefix_merge'? "
                               "(known: per_request, prefix_merge, prefix_merge_strict; or a pkg.module:attr import path)")
    path.write_text("polar:\n  harnes: loop\n")
    with pytest.raises(ConfigError, match="polar.harnes: not a known setting"):
        Recipe.from_yaml(path)
    path.write_text("polar:\n  evaluator: {name: outptu}\n")
    with pytest.raises(ConfigError, match="polar.evaluator.name: unknown evaluator 'outptu'; did you mean 'output'"):
        Recipe.from_yaml(path)


def test_recipe_file_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        Recipe.from_yaml(tmp_path / "none.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("recipe_version: 2\n")
    with pytest.raises(ConfigError, match="recipe_version"):
        Recipe.from_yaml(bad)


def test_cli_prints_and_writes(tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    path = RECIPES / "slime_smoke_qwen3.5_0.8b_toy.yaml"
    assert main(["slime-args", str(path), "--out", str(tmp_path), "--argv"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed == render(Recipe.from_yaml(path), tmp_path).flags
    assert main(["slime-args", str(path), "--out", str(tmp_path)]) == 0
    script = capsys.readouterr().out
    assert script == (tmp_path / "launch_slime.sh").read_text() and (tmp_path / "polar.yaml").is_file()
    import importlib.util

    if importlib.util.find_spec("slime") is None:
        monkeypatch.delenv("SLIME_DIR", raising=False)
        assert main(["slime-args", str(path), "--out", str(tmp_path), "--run"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "slime is not installed here" in err[0]


def test_cli_mistake_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "r.yaml"
    bad.write_text("args: {a: {rollout-temprature: 1.0}}\n")
    assert main(["slime-args", str(bad), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["polar-env slime-args: error: args.a.rollout-temprature: not a slime 624b824a8 flag "
                   "(did you mean rollout-temperature?); put flags newer than that in extra_args"]
