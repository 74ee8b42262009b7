"""``polar-env verify`` on a run folder scores with the model the run sampled with, read from its
``plan.json`` (SmolLM2 here): no ``--model-dir`` needed, and a flag still wins over the plan."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from polar_env.chat.hf import HFChatFormat
from polar_env.cli import main
from polar_env.cli.store import run_engine
from polar_env.errors import ConfigError
from polar_env.staging.runs import Plan
from tests.conftest import require_bwrap


@pytest.mark.slow  # a real `polar-env rollout` on SmolLM2-135M (~35 s on 2 busy cores), then two verifies
def test_a_smollm2_run_verifies_without_model_dir(tmp_path: Path, smollm2: HFChatFormat,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    require_bwrap()
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text('{"task_id": "hi", "instruction": "Say hi.", "evaluator": {"name": "output", "regex": "hi"}}\n')
    out = tmp_path / "out"
    assert main(["rollout", "--tasks", str(tasks), "--samples", "2", "--harness", "loop", "--template", "smollm2",
                 "--max-tokens", "6", "--temperature", "1.0", "--out", str(out), "--no-progress"]) == 0
    capsys.readouterr()

    assert main(["verify", "--store", str(out / "latest")]) == 0
    text = capsys.readouterr().out
    assert "model: embedded CPU engine, " in text and str(smollm2.weights) in text and "plan.json" in text
    assert re.search(r"^PASS: .* over [1-9]\d* sampled tokens in 2 sessions$", text, re.M), text
    # a node's store inside the run finds the same plan; --seed still wins (the tiny model: a true FAIL)
    assert main(["verify", "--store", str(out / "latest" / "capture" / "node-0")]) == 0
    capsys.readouterr()
    assert main(["verify", "--store", str(out / "latest"), "--seed", "0"]) == 1
    assert "seeded tiny weights (--seed 0)" in capsys.readouterr().out


def test_a_run_on_a_served_engine_asks_for_model_dir(tmp_path: Path) -> None:
    Plan(run_id="r", command="rollout", job={"env": {"engine": {"kind": "vllm", "url": "http://h:8000"}}},
         groups=[], requests=[]).write(tmp_path)
    (tmp_path / "capture").mkdir()
    with pytest.raises(ConfigError, match="vllm engine; pass --model-dir"):
        run_engine(tmp_path / "capture")
    assert run_engine(tmp_path.parent / "no-such-run") is None  # no plan: the seeded tiny model, as before
