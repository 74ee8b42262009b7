"""What ``scripts/check_nemo_gym.sh`` installs into the Gym venv and how it checks the result.

The requirements come from ``pyproject.toml`` (core dependencies, the swebench extra, the rollout
extra's pytest), never from a hand list: a core dependency added to polar_env (msgspec once) is in
the Gym venv the next time the script runs, instead of a 500 at the first ``/run``.
"""

from __future__ import annotations

import json
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path

EXTRAS = ("swebench", "rollout")  # grading in the sandbox runs the Gym venv's python3 (swebench, pytest)
TOKEN_ITEM_TYPES = ("message", "function_call")  # Gym's training item types; reasoning and tool outputs carry no ids


def venv_requirements(pyproject: Path) -> list[str]:
    """polar_env's core dependencies plus ``EXTRAS``'s own packages (their ``polar-env[...]``
    references are left out: the editable install brings polar_env itself)."""
    project = tomllib.loads(pyproject.read_text())["project"]
    name = str(project["name"])
    out = [str(d) for d in project["dependencies"]]
    extras: Mapping[str, Sequence[str]] = project.get("optional-dependencies", {})
    for extra in EXTRAS:
        out += [str(d) for d in extras[extra] if not str(d).startswith(f"{name}[") and str(d) not in out]
    return out


def trained_tokens(items: Sequence[Mapping[str, object]]) -> int:
    """The generated token count of a ``/run`` result's output items, read only where Gym's item
    types carry token ids (a call's last model-generated item)."""
    total = 0
    for item in items:
        ids = item.get("generation_token_ids")
        if item.get("type") in TOKEN_ITEM_TYPES and isinstance(ids, list):
            total += len(ids)
    return total


def check_result(out_jsonl: Path) -> str:
    """The one rollout of ``gym eval run``: contiguous (NeMo RL's rule), reward 1.0, not masked;
    returns the summary line, raises AssertionError/ValueError otherwise."""
    from polar_env.integrations.nemo_gym.convert import check_contiguous

    rows = [json.loads(line) for line in out_jsonl.read_text().splitlines() if line.strip()]
    assert len(rows) == 1, f"{len(rows)} rollouts"
    row = rows[0]
    items = row["response"]["output"]
    full = check_contiguous(items)
    trained = trained_tokens(items)
    assert trained > 0, "no item carries generated tokens"
    assert row["reward"] == 1.0 and not row["mask_sample"], row.get("failure_reason")
    polar = row.get("polar") or {}
    return (f"reward {row['reward']}, mask_sample {row['mask_sample']}, {len(items)} output items, {len(full)} tokens "
            f"({trained} generated), evaluator: {(polar.get('evaluation') or {}).get('reason')}, "
            f"session {polar.get('session_id')}")
