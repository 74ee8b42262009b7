"""The README's scripted-policy example, run as the README says: it must earn reward 1 on
toy__calc-1 with the real pi CLI, the embedded engine and the swebench evaluator (issue 16,
finding 8: the --engine-script format was documented only by the tests)."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from polar_env.cli import main
from polar_env.harnesses import get_harness, install_hint, is_installed
from tests.conftest import require_bwrap, unavailable

pytestmark = pytest.mark.slow
README = Path(__file__).resolve().parents[2] / "README.md"


def readme_script() -> dict[str, object]:
    text = README.read_text()
    section = text[text.index("**Scripted policy** (`--engine-script FILE`"):]
    block = re.search(r"```json\n(.*?)```", section, re.S)
    assert block is not None, "README's scripted policy section has no json block"
    command = re.search(r"Saved as `fix_calc.json`: `(polar-env rollout [^`]+)`", section)
    assert command is not None and "--engine-script fix_calc.json" in command.group(1)
    return {"script": json.loads(block.group(1)), "argv": command.group(1).split()[1:]}


def test_readme_scripted_policy_earns_reward_one(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    example = readme_script()
    require_bwrap()
    if shutil.which("node") is None or not is_installed(get_harness("pi")):
        unavailable(f"node and pi are needed; run {install_hint(get_harness('pi'))}")
    try:
        import swebench.harness.grading  # noqa: F401
    except ImportError:
        unavailable("the swebench extra is not installed (pip install -e '.[swebench]')")
    (tmp_path / "fix_calc.json").write_text(json.dumps(example["script"]))
    argv = [str(tmp_path / a) if a == "fix_calc.json" else a for a in example["argv"]]  # type: ignore[union-attr]
    code = main([*argv, "--out", str(tmp_path / "out"), "--no-progress"])
    printed = capsys.readouterr().out
    report = json.loads((tmp_path / "out" / "latest" / "report.json").read_text())
    assert code == 0, printed
    assert report["mean_reward"] == 1.0 and report["session_rows"][0]["resolved"] is True, report["session_rows"]
    assert "reward 1.00 — resolved" in printed and "called bash: cd /testbed && sed -i" in printed
