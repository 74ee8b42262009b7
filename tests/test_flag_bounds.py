"""Every flag and config value is bounded where it is parsed (issue 44, item 8): a value out of
bounds, a ``-k`` past ``--samples``, an ``--out`` that is a file and a malformed ``--engine-script``
are each one line naming the flag, exit 2, before the run folder is made or ``latest`` moved."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from polar_env.cli import main
from polar_env.cli.options import fields_at, leaf_paths
from polar_env.engines.embedded.policy import ScriptedPolicy

SIMULATED = ["--engine", "simulated", "--harness", "loop", "--no-progress"]


def one_line(capsys: pytest.CaptureFixture[str], argv: list[str], *expected: str) -> str:
    rc = main(argv)
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert rc == 2, (out, err)
    assert len(lines) == 1, err
    assert lines[0].startswith(f"polar-env {argv[0]}: error: "), err
    for text in expected:
        assert text in lines[0], lines[0]
    assert "Traceback" not in err and "pydantic" not in err and "**" not in err, err
    return lines[0]


@pytest.mark.parametrize(("argv", "expected"), [
    (["--nodes", "0"], "nodes: Input should be greater than or equal to 1 (got 0) (given as --nodes)"),
    (["--nodes", "-1"], "(given as --nodes)"),
    (["--timeout-s", "-5"], "timeout_s: Input should be greater than 0 (got -5.0) (given as --timeout-s)"),
    (["--timeout-s", "nan"], "timeout_s: Input should be a finite number (got nan) (given as --timeout-s)"),
    (["--init-timeout-s", "0"], "init_timeout_s: Input should be greater than 0 (got 0.0) (given as --init-timeout-s)"),
    (["--seed", "-1"], "seed: Input should be greater than or equal to 0 (got -1) (given as --seed)"),
    (["--max-running", "0"], "(given as --max-running)"),
    (["--top-p", "2"], "top_p: Input should be less than or equal to 1 (got 2.0) (given as --top-p)"),
    (["--max-tokens", "0"], "(given as --max-tokens)"),
])
def test_a_flag_out_of_bounds_is_one_line_before_the_run_folder(argv: list[str], expected: str, tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str],
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    one_line(capsys, ["rollout", *SIMULATED, *argv, "--out", "runs"], expected)
    assert not (tmp_path / "runs").exists()


def test_a_yaml_value_out_of_bounds_names_the_file_and_key(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "c.yaml"
    config.write_text("engine: {kind: simulated}\nharness: loop\nnodes: -1\n")
    one_line(capsys, ["rollout", "--config", str(config), "--no-progress", "--out", str(tmp_path / "runs")],
             f"config file {config}: nodes: Input should be greater than or equal to 1 (got -1)")
    assert not (tmp_path / "runs").exists()
    config.write_text("engine: {kind: simulated}\nharness: loop\ntimeout_s: 0\n")
    one_line(capsys, ["serve", "--local", "--config", str(config), "--store", str(tmp_path / "s")], "timeout_s")
    assert not (tmp_path / "s").exists()


def test_k_past_samples_is_refused_not_dropped(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    one_line(capsys, ["eval", *SIMULATED, "-k", "5", "--samples", "2", "--out", str(tmp_path / "runs")],
             "invalid option -k 5: pass@5 needs at least 5 sessions per task and --samples is 2; "
             "pass --samples 5 or a smaller -k")
    one_line(capsys, ["eval", *SIMULATED, "-k", "2", "--out", str(tmp_path / "runs")], "--samples is 1")  # eval's default
    one_line(capsys, ["rollout", *SIMULATED, "--early-stop", "3", "--out", str(tmp_path / "runs")],
             "invalid option --early-stop 3", "give --early-stop at most 2")
    assert not (tmp_path / "runs").exists()


def test_out_naming_a_file_says_so(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "afile").write_text("")
    line = one_line(capsys, ["rollout", *SIMULATED, "--out", str(tmp_path / "afile")],
                    f"--out {tmp_path / 'afile'} is a file, not a folder")
    assert "--resume" not in line
    one_line(capsys, ["rollout", *SIMULATED, "--out", str(tmp_path / "afile" / "sub")],
             f"is under the file {tmp_path / 'afile'}")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]


@pytest.mark.parametrize(("script", "expected"), [
    ({"steps": [1]}, "step 1 is a number (1), not an object like"),
    ([{"command": "ls"}], "the file holds a list, not an object like"),
    ({"steps": {"command": "ls"}}, "'steps' is an object, not a list of steps"),
    ({"steps": [{"comand": "ls"}]}, "step 1 has unknown key 'comand' (known: command, text, reasoning)"),
    ({"step": [{"command": "ls"}]}, "unknown key 'step' (known: steps, shell_tools, command_params)"),
    ({"steps": [{"text": "ok"}, {"command": 5}]}, "step 2: 'command' is a number (5), not a string"),
    ({"steps": [], "shell_tools": "bash"}, "'shell_tools' is a string ('bash'), not a non-empty list of names"),
])
def test_a_malformed_engine_script_names_the_flag_and_the_step(script: object, expected: str, tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "s.json"
    path.write_text(json.dumps(script))
    one_line(capsys, ["rollout", *SIMULATED, "--engine-script", str(path), "--out", str(tmp_path / "runs")],
             f"--engine-script {path} is not a scripted policy: {expected}", "README 'Scripted policy'")
    one_line(capsys, ["engine", "--engine-script", str(path)], f"--engine-script {path} is not a scripted policy: {expected}")
    assert not (tmp_path / "runs").exists()


def test_a_missing_or_unreadable_script_names_the_flag(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    one_line(capsys, ["rollout", *SIMULATED, "--engine-script", str(tmp_path / "nope.json"), "--out",
                      str(tmp_path / "runs")], f"--engine-script {tmp_path / 'nope.json'}: no such file")
    (tmp_path / "bad.json").write_text("{oops")
    one_line(capsys, ["engine", "--script", str(tmp_path / "bad.json")], "--engine-script", "is not JSON")  # the old name


def test_a_well_formed_script_still_loads() -> None:
    policy = ScriptedPolicy.from_dict({"steps": [{"command": "ls", "reasoning": "look"}, {"text": "done", "reasoning": None}],
                                       "shell_tools": ["bash"]})
    assert [s.command for s in policy.steps] == ["ls", None] and policy.steps[1].text == "done"
    assert policy.shell_tools == ("bash",)
    assert ScriptedPolicy.from_dict({}).steps == ScriptedPolicy().steps


# Numeric settings that may be unbounded, each with why (a new field without a bound fails here).
UNBOUNDED = {
    "pass_k": "bounded per item (list[Annotated[int, Field(ge=1)]])",
}


def test_every_numeric_setting_has_a_bound() -> None:
    missing = []
    for path in leaf_paths():
        for field in fields_at(path):
            if any(t in str(field.annotation) for t in ("int", "float")) and "bool" not in str(field.annotation):
                if not field.metadata and path not in UNBOUNDED:
                    missing.append(path)
    assert not missing, f"numeric settings without a bound: {missing}"


@pytest.mark.parametrize(("argv", "expected"), [
    (["engine", "--port", "70000"], "invalid option --port 70000: give a number from 0 to 65535; see --help"),
    (["engine", "--seed", "-3"], "invalid option --seed -3: input should be greater than or equal to 0; see --help"),
    (["engine", "--max-tokens", "0"], "invalid option --max-tokens 0: input should be greater than or equal to 1"),
    (["gateway", "--store", "s", "--top-p", "0"], "invalid option --top-p 0: input should be greater than 0"),
    (["gateway", "--store", "s", "--engine-timeout", "-1"], "invalid option --engine-timeout -1"),
    (["gateway", "--store", "s", "--engine-wait-s", "-2"], "invalid option --engine-wait-s -2"),
])
def test_engine_and_gateway_numbers_are_bounded_before_they_start(argv: list[str], expected: str, tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str],
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    one_line(capsys, argv, expected)  # was: a traceback (OverflowError from bind) or a server that refuses every call
    assert not any(tmp_path.iterdir())


def test_a_value_argparse_cannot_read_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["rollout", "--nodes", "abc"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2
    assert err.strip() == ("polar-env rollout: error: argument --nodes: invalid int value: 'abc'; "
                           "see polar-env rollout --help"), err  # was: under 26 lines of usage
