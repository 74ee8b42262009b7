"""scripts/bench_scale.py at a reduced size (a few seconds): the real node, gateway and journal
under N sessions × T turns, then POSTRUN. Checks that it runs clean and that the journal stays
linear in tokens; speed figures are the script's to print, not this test's to time."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT

pytestmark = pytest.mark.slow  # a reduced benchmark run


@pytest.mark.parametrize("harness", ["process", "node"])
def test_bench_scale_reduced_size(tmp_path: Path, harness: str) -> None:
    out = tmp_path / "scale.json"
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    proc = subprocess.run([sys.executable, str(REPO_ROOT / "scripts" / "bench_scale.py"), "--sessions", "6", "--turns", "6",
                           "--context", "6000", "--engine-ms", "20", "--no-baseline", "--json", str(out), "--harness", harness],
                          env=env, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "journal bytes / token" in proc.stdout and "POSTRUN s / session" in proc.stdout
    after = json.loads(out.read_text())["after"]
    assert after["errors"] == 0 and after["sessions"] == 6 and after["calls"] == 36, after
    assert after["final_context_tokens"] > 3000
    # v2 stores each token about once (ids as JSON digits, plus logprobs of sampled ids), not once per turn
    assert after["journal_bytes_per_token"] < 60, after
    # the loops ran in the harness host (its CPU is counted there) or in the node (no host figure)
    assert (after["harness_cpu_ms_per_call"] > 0) if harness == "process" else math.isnan(after["harness_cpu_ms_per_call"])
