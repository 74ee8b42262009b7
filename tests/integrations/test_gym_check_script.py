"""``scripts/check_nemo_gym.sh`` on a fresh Gym venv: it installs every core dependency of
polar_env (read from pyproject.toml, so the first ``/run`` cannot die of a missing module), keeps
Gym's Ray off any other cluster on the machine, and its final check reads token ids only on the
items that carry them (reasoning and tool-output items carry none)."""

from __future__ import annotations

import json
import re
import shlex
import tomllib
from pathlib import Path

import pytest

from polar_env.integrations.nemo_gym.__main__ import main
from polar_env.integrations.nemo_gym.check import check_result, venv_requirements

REPO = Path(__file__).resolve().parents[2]
SCRIPT = (REPO / "scripts" / "check_nemo_gym.sh").read_text()
PYPROJECT = REPO / "pyproject.toml"


def pip_installs() -> list[list[str]]:
    """Each ``pip install`` of the script, as its words (continuation lines joined)."""
    text = SCRIPT.replace("\\\n", " ")
    return [shlex.split(line.split("pip\" install", 1)[1])
            for line in text.splitlines() if 'pip" install' in line and not line.lstrip().startswith("#")]


def test_the_venv_gets_every_core_dependency(capsys: pytest.CaptureFixture[str]) -> None:
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    assert main(["requirements", str(PYPROJECT)]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed == venv_requirements(PYPROJECT)
    assert set(project["dependencies"]) <= set(printed)  # msgspec included, whatever is added later
    assert any(r.startswith("swebench") for r in printed) and any(r.startswith("pytest") for r in printed)
    assert not any(r.startswith("polar-env") for r in printed)


def test_the_script_installs_what_the_helper_prints_and_nothing_by_hand() -> None:
    installs = pip_installs()
    packages = [w for words in installs for w in words if not w.startswith("-") and not w.startswith('"$')
                and "$" not in w]
    assert packages == ["nemo-gym==0.7.0", "uv"]  # no hand-kept list of polar_env's dependencies
    assert ["-q", "-r", "$WORK/requirements.txt"] in installs
    assert ('"$POLAR_PY" -m polar_env.integrations.nemo_gym requirements "$REPO/pyproject.toml" > '
            '"$WORK/requirements.txt"') in SCRIPT
    order = [i for i, words in enumerate(installs) if "-r" in words or "--no-deps" in words]
    assert [("-r" in installs[i]) for i in order] == [True, False]  # dependencies first, then polar_env
    ready = SCRIPT.index('touch "$VENV/.polar-ready"\nfi')
    assert SCRIPT.index('install -q -r "$WORK/requirements.txt"') > ready  # also on an already built venv


def test_gym_starts_its_own_ray() -> None:
    ng_run = SCRIPT.index("setsid ng_run")
    assert re.search(r"^unset RAY_ADDRESS$", SCRIPT[:ng_run], re.M)
    assert re.search(r'^RAY_TMPDIR="\$\(mktemp -d /tmp/', SCRIPT[:ng_run], re.M)
    assert re.search(r"^export .*\bRAY_TMPDIR\b", SCRIPT[:ng_run], re.M)


def test_the_final_check_skips_items_without_token_ids(tmp_path: Path) -> None:
    """The item types a real rollout yields (see test_agent_runs_a_real_polar_session)."""
    items = [
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "Apply the fix."}]},
        {"type": "function_call", "name": "bash", "arguments": "{}", "call_id": "c1",
         "prompt_token_ids": [1, 2], "generation_token_ids": [3, 4], "generation_log_probs": [-0.1, -0.2]},
        {"type": "function_call_output", "call_id": "c1", "output": "applied"},
        {"type": "reasoning", "summary": []},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Done"}],
         "prompt_token_ids": [1, 2, 3, 4, 5], "generation_token_ids": [6], "generation_log_probs": [-0.3]},
    ]
    row = {"response": {"output": items}, "reward": 1.0, "mask_sample": False,
           "polar": {"session_id": "s", "evaluation": {"reason": "resolved"}}}
    out = tmp_path / "out.jsonl"
    out.write_text(json.dumps(row) + "\n")
    line = check_result(out)
    assert "6 tokens (3 generated)" in line and "session s" in line
    out.write_text(json.dumps({**row, "reward": 0.0}) + "\n")
    with pytest.raises(AssertionError):
        check_result(out)
