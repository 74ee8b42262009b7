"""The real path for the integration tests: a ``PolarEnv`` with the embedded CPU engine driven by a
scripted policy (it applies a toy task's gold patch through the ``loop`` harness's bash tool),
the bubblewrap sandbox and the swebench evaluator. The script only forces which tokens are
sampled; the engine, gateway capture, runtime and grading are all real."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
from fake_engines import FakeSGLangRouter, FakeSGLangWorker  # noqa: F401 - re-exported for the tests here

from polar_env.tasks.swe import SweTask


def require_sandbox() -> None:
    """Skip locally with the fix; fail under CI, which installs all of these."""
    problems = []
    if shutil.which("bwrap") is None:
        problems.append("bubblewrap is not installed (apt-get install -y bubblewrap)")
    if not os.access("/usr/bin/python3", os.X_OK):
        problems.append("/usr/bin/python3 is missing (the sandbox's gateway relay runs on it)")
    try:
        import swebench.harness.grading  # noqa: F401
    except ImportError:
        problems.append("the swebench extra is not installed (pip install -e '.[swebench]')")
    if problems:
        reason = "; ".join(problems)
        if os.environ.get("CI"):
            pytest.fail(f"{reason} (CI must provide it)", pytrace=False)
        pytest.skip(reason)


def env_config(tmp: Path, fix: SweTask, **extra: Any) -> dict[str, Any]:
    """A PolarEnv config whose engine applies ``fix``'s gold patch, then answers."""
    command = f"cat > /tmp/fix.diff <<'POLAR_EOF'\n{fix.patch}POLAR_EOF\ngit apply /tmp/fix.diff && echo applied"
    script = tmp / "script.json"
    script.write_text(json.dumps({"steps": [{"command": command, "reasoning": "Apply the fix."},
                                            {"text": "Done: {tool_output}", "reasoning": "It applied."}]}))
    return {"engine": {"kind": "embedded", "script": str(script)}, "harness": "loop", "store": str(tmp / "store"),
            **extra}
