"""Harbor tasks: the toy task folders shipped in polar_env/tasks/harbor_toy (offline, no image
pulls) load into task rows, and ``polar-env rollout --tasks <folder>`` grades them with the real
loop harness, bubblewrap sandboxes, the embedded engine (scripted: a test double for the policy's
choices only) and the harbor evaluator running each task's tests/test.sh in a fresh sandbox:
reward 1 for a scripted fix, 0 otherwise; a workspace that plants its own tests or reward file
gains nothing."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from polar_env.cli import main
from polar_env.errors import ConfigError
from polar_env.evaluators.harbor import parse_reward
from polar_env.tasks.harbor import TOY_ROOT, harbor_row, load_harbor_rows
from tests.conftest import require_bwrap

pytestmark = pytest.mark.slow  # Harbor tasks in real sandboxes

GREETING = TOY_ROOT / "fix-greeting"


def test_toy_tasks_load_into_rows() -> None:
    rows = {r["task_id"]: r for r in load_harbor_rows(TOY_ROOT)}
    assert set(rows) == {"polar-toy__count-lines", "polar-toy__fix-greeting"}
    greet = rows["polar-toy__fix-greeting"]
    assert greet["instruction"].startswith("`greet.sh` in the current directory")
    assert greet["runtime"]["workdir"] == "/app" and greet["timeout_s"] == 300.0
    assert (Path(greet["runtime"]["source_dir"]) / "greet.sh").read_text() == "#!/bin/sh\necho \"Helo, world\"\n"
    assert greet["evaluator"] == {"name": "harbor", "params": {"timeout_s": 60.0, "env": {}}}
    assert greet["task"]["harbor_task_dir"] == str(GREETING.resolve())
    assert rows["polar-toy__count-lines"]["evaluator"]["params"]["env"] == {"EXPECTED_FILE": "count.txt"}


def test_bad_task_folders_get_one_line(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no Harbor task folders"):
        load_harbor_rows(tmp_path)
    task = tmp_path / "t"
    shutil.copytree(GREETING, task)
    (task / "tests" / "test.sh").unlink()
    with pytest.raises(ConfigError, match="no tests/test.sh"):
        harbor_row(task)
    (task / "tests" / "test.sh").write_text("true\n")
    (task / "task.toml").write_text("[[steps]]\nname = 'a'\n")
    with pytest.raises(ConfigError, match="multi-step"):
        harbor_row(task)
    docker = tmp_path / "d"
    shutil.copytree(GREETING, docker)
    (docker / "task.toml").write_text("[environment]\ndocker_image = 'ghcr.io/x/y:1'\n")
    row = harbor_row(docker)
    assert row["runtime"] == {"workdir": "/app", "kind": "docker", "image": "ghcr.io/x/y:1"}


def test_reward_files_parse_as_harbor_reads_them() -> None:
    assert parse_reward(b"1\n", None) == (1.0, {"reward": 1.0})
    assert parse_reward(None, b'{"reward": 0.5, "exists": 1}') == (0.5, {"reward": 0.5, "exists": 1})
    assert parse_reward(None, b'{"score": 1}')[0] == 1.0
    for bad in ((None, None), (b"", b""), (b"nan", None), (None, b'{"reward": "1"}'), (None, b'{"a": 1, "b": 0}')):
        with pytest.raises(ValueError):
            parse_reward(*bad)


def _script(tmp: Path, command: str) -> Path:
    path = tmp / "script.json"
    path.write_text(json.dumps({"steps": [{"command": command, "reasoning": "Work."},
                                          {"text": "Done: {tool_output}", "reasoning": "Ok."}]}))
    return path


def _rollout(tmp: Path, command: str) -> dict[str, Any]:
    out = tmp / "out"
    code = main(["rollout", "--tasks", str(TOY_ROOT), "--task-id", "polar-toy__fix-greeting", "--harness", "loop",
                 "--samples", "1", "--out", str(out), "--no-progress", "--engine-script", str(_script(tmp, command))])
    assert code == 0
    return json.loads((out / "latest" / "report.json").read_text())


@pytest.mark.parametrize("command, reward", [
    ("printf '#!/bin/sh\\necho \"Hello, world\"\\n' > greet.sh && bash greet.sh", 1.0),  # the fix
    ("ls && bash greet.sh", 0.0),  # looks, fixes nothing
    # games the grader: its own tests/ and a reward file in the workspace and in /logs, no fix
    ("mkdir -p tests /logs/verifier && printf 'echo 1 > /logs/verifier/reward.txt\\n' > tests/test.sh "
     "&& echo 1 > /logs/verifier/reward.txt && echo 1 > reward.txt", 0.0),
])
def test_rollout_on_harbor_tasks(tmp_path: Path, command: str, reward: float) -> None:
    require_bwrap()
    report = _rollout(tmp_path, command)
    assert report["statuses"] == {"completed": 1}, report["session_rows"]
    assert report["mean_reward"] == reward, report["session_rows"]


def test_harbor_grading_drops_planted_runner_files(tmp_path: Path) -> None:
    """The shared grading-integrity policy applies to Harbor: a planted conftest.py and
    sitecustomize.py are dropped from the graded diff and reported; the real fix still scores."""
    require_bwrap()
    fix = "printf '#!/bin/sh\\necho \"Hello, world\"\\n' > greet.sh"
    report = _rollout(tmp_path, f"{fix} && echo 'import os' > conftest.py && echo 'import os' > sitecustomize.py")
    assert report["mean_reward"] == 1.0, report["session_rows"]
    rows = [json.loads(line) for line in (tmp_path / "out" / "latest" / "sessions.jsonl").read_text().splitlines()]
    evaluation = rows[0]["evaluation"]
    assert evaluation["policy"] == "allowlist-workspace"
    assert sorted(d["path"] for d in evaluation["dropped_paths"]) == ["conftest.py", "sitecustomize.py"]
