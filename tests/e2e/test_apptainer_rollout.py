"""End to end through a real Apptainer: ``polar-env rollout --runtime apptainer --harness loop`` on
``toy__calc-1`` with the rootfs as a sandbox-directory image and the README's scripted fix → reward 1,
and a script that changes nothing → reward 0 (the session and its grading both run in Apptainer).
Needs the binary from ``scripts/install_apptainer.sh``, the rootfs and the swebench extra; missing
ones skip locally and fail under ``CI``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from polar_env.cli import main
from polar_env.runtimes.apptainer import find_apptainer
from tests.conftest import unavailable
from tests.staging.test_readme_script import readme_script

pytestmark = pytest.mark.slow
CONTROL = {"steps": [{"command": "cd /testbed && git status --short", "reasoning": "Look only."},
                     {"text": "Nothing changed:\n{tool_output}", "reasoning": "Done."}]}


@pytest.mark.parametrize(("name", "reward"), [("fix", 1.0), ("control", 0.0)])
def test_apptainer_rollout_scores_the_fix(name: str, reward: float, tmp_path: Path, rootfs: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    if find_apptainer() is None:
        unavailable("no apptainer binary (on PATH or built by scripts/install_apptainer.sh): run that script")
    try:
        import swebench.harness.grading  # noqa: F401
    except ImportError:
        unavailable("the swebench extra is not installed (pip install -e '.[swebench]')")
    script = readme_script()["script"] if name == "fix" else CONTROL
    (tmp_path / "script.json").write_text(json.dumps(script))
    (tmp_path / "env.yaml").write_text(f"runtime:\n  kind: apptainer\n  image: {rootfs}\n")
    code = main(["rollout", "--task-id", "toy__calc-1", "--samples", "1", "--harness", "loop", "--runtime", "apptainer",
                 "--config", str(tmp_path / "env.yaml"), "--engine-script", str(tmp_path / "script.json"),
                 "--out", str(tmp_path / "out"), "--no-progress"])
    printed = capsys.readouterr().out
    report = json.loads((tmp_path / "out" / "latest" / "report.json").read_text())
    assert code == 0, printed
    assert report["mean_reward"] == reward, report["session_rows"]
    trajectory = json.loads((tmp_path / "out" / "latest" / "trajectories.jsonl").read_text().splitlines()[0])
    assert trajectory["metadata"]["runtime"] == "apptainer", trajectory["metadata"]
