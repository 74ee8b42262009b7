"""Every name a rollout command takes is resolved before anything starts (issue 16, finding 1):
a typo is exit 2 and one line, ``polar-env <cmd>: error: <field>: <problem>``, in well under 5 s,
with no runtime, engine or output folder created."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest

from polar_env.cli import build_parser, main

REPO_ROOT = Path(__file__).resolve().parents[1]


def test_a_misspelled_harness_is_one_line_before_any_runtime_starts(tmp_path: Path) -> None:
    out, scratch = tmp_path / "out", tmp_path / "tmp"
    scratch.mkdir()
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "TMPDIR": str(scratch)}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.run([sys.executable, "-m", "polar_env.cli", "rollout", "--harness", "clade_code", "--out", str(out)],
                          capture_output=True, text=True, env=env, timeout=60, cwd=tmp_path)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    # CPU seconds, not wall time: the bound must hold on a loaded CI machine (wall: ~1.5 s idle)
    cpu_s = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert lines[0].startswith("polar-env rollout: error: harness: unknown harness 'clade_code'; "
                               "did you mean 'claude_code'? (known: claude_code, codex,"), lines[0]
    assert proc.stdout == ""  # not even the start line: nothing began
    assert not out.exists() and list(scratch.iterdir()) == []  # no output folder, no runtime folders
    assert cpu_s < 5, f"took {cpu_s:.1f} CPU seconds"


@pytest.mark.parametrize(("argv", "expected"), [
    (["rollout", "--builder", "prefix_merg"], "builder: unknown builder 'prefix_merg'; did you mean 'prefix_merge'?"),
    (["eval", "--evaluator", "outptu"], "evaluator.name: unknown evaluator 'outptu'; did you mean 'output'?"),
    (["rollout", "--runtime", "dockr"], "runtime.kind: unknown runtime 'dockr'; did you mean 'docker'?"),
    (["rollout", "--engine", "vlm"], "engine: unknown engine 'vlm'; did you mean 'vllm'?"),
    (["rollout", "--engine", "vllm", "--engine-url", "http://127.0.0.1:9", "--seed", "3"],
     "engine.vllm.seed: not a known setting"),
    (["rollout", "--evaluator", '{"name": "output", "command": "true", "exit_code": "zero"}'],
     "evaluator: params of evaluator 'output': exit_code: Input should be a valid integer"),
    (["rollout", "--temperature", "-1"], "sampling.temperature: Input should be greater than or equal to 0 (got -1.0)"),
    (["serve", "--harness", "clade_code", "--port", "1"], "harness: unknown harness 'clade_code'"),
])
def test_every_name_is_checked_up_front(argv: list[str], expected: str, tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    rc = main([*argv, *(["--out", str(tmp_path / "out")] if argv[0] in ("rollout", "eval") else [])])
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1, err
    assert lines[0].startswith(f"polar-env {argv[0]}: error: {expected}"), lines[0]
    assert list(tmp_path.iterdir()) == []


def test_a_yaml_config_with_a_typo_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "env.yaml"
    config.write_text("harness: loop\nbuilder: prefix_merg\n")
    rc = main(["rollout", "--config", str(config), "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.startswith(f"polar-env rollout: error: config file {config}: builder: unknown builder"), err


def test_flag_choices_come_from_the_registries(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["rollout", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--builder {per_request,prefix_merge,prefix_merge_strict}" in text
    assert "--runtime {apptainer,docker,sandbox}" in text
    assert "--engine {embedded,sglang,simulated,vllm}" in text
    assert "--max-tokens MAX_TOKENS" in text and "--max-tokens-per-turn" not in text


def test_submit_checks_every_row_before_sending_any(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rows = tmp_path / "tasks.jsonl"
    rows.write_text('{"task_id": "ok", "instruction": "x", "evaluator": {"name": "output", "regex": "y"}}\n'
                    '{"task_id": "typo", "instruction": "x", "evaluator": "outptu"}\n')
    rc = main(["submit", str(rows), "--token", "t", "--server", "http://127.0.0.1:9", "--harness", "loop"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err  # the dead server was never contacted: the typo came first
    assert err[0].startswith("polar-env submit: error: task 'typo': evaluator.name: unknown evaluator 'outptu'; "
                             "did you mean 'output'?"), err


def test_a_task_row_naming_an_unknown_evaluator_is_refused_before_any_session(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"task_id": "a", "instruction": "x", "evaluator": {"name": "outptu"}}\n')
    rc = main(["rollout", "--tasks", str(rows), "--harness", "loop", "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    assert err[0].startswith("polar-env rollout: error: task 'a': evaluator.name: unknown evaluator 'outptu'; "
                             "did you mean 'output'?"), err
    assert not (tmp_path / "out" / "capture").exists()  # no node, no journal: nothing started
