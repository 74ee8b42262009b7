"""The integrations import without torch, slime or nemo-gym (polar_env's core promise: users
install it next to the trainer's own torch, and Gym's venv has no torch at all)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
CODE = f"""
import sys

class NotInstalled:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "transformers", "safetensors", "slime", "nemo_gym", "ray"):
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None

sys.meta_path.insert(0, NotInstalled())
sys.path.insert(0, {str(REPO_ROOT)!r})
import polar_env.integrations.credit, polar_env.integrations.slime, polar_env.integrations.slime_recipe
import polar_env.integrations.sft, polar_env.integrations.nemo_gym.agent, polar_env.integrations.nemo_gym.convert
from polar_env.integrations.slime_recipe import Recipe, render
from pathlib import Path
render(Recipe.from_yaml({str(REPO_ROOT / "recipes" / "slime_grpo_qwen3.5_4b_swegym.yaml")!r}), Path({{out!r}}))
print("ok")
"""


def test_integrations_import_without_torch_slime_or_nemo_gym(tmp_path: Path) -> None:
    code = CODE.replace("{out!r}", repr(str(tmp_path)))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]
