"""Per-session limits, through real sandboxed sessions (the ``loop`` harness running real shell
commands in bubblewrap, the gateway and node real; the policy is the named ``AttackPolicy`` test
double): an output flood keeps this process's memory bounded and the model sees a truncation
marker; a fork storm, a memory hog and a disk filler each end their own session ERROR with the
limit named, while a normal session next to them completes; the agent is never the host's root."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from polar_env.runtimes import RuntimeSpec, make_runtime
from polar_env.runtimes.limits import (
    CappedBuffer,
    Cgroup,
    LimitExceeded,
    cgroup_version,
)
from tests.conftest import require_bwrap

FLOOD_BYTES = 2_000_000_000


def test_capped_buffer_keeps_head_and_tail_with_a_marker() -> None:
    buf = CappedBuffer(100)
    for i in range(1000):
        buf.add(f"{i:04d}\n".encode())
    text = buf.text()
    assert text.startswith("0000\n") and text.endswith("0999\n")
    assert buf.total == 5000 and buf.truncated == 4900 and "4900 bytes of output truncated" in text
    assert len(buf.head) + len(buf.tail) <= 300  # bounded whatever is added
    small = CappedBuffer(100)
    small.add(b"abc")
    assert small.text() == "abc" and small.truncated == 0


def test_cgroup_version_detection(tmp_path: Path) -> None:
    (tmp_path / "cgroup.controllers").write_text("memory pids\n")
    assert cgroup_version(tmp_path) == "v2"
    v1 = tmp_path / "v1"
    (v1 / "memory").mkdir(parents=True)
    (v1 / "pids").mkdir()
    assert cgroup_version(v1) == ("v1" if os.geteuid() == 0 else None)
    assert cgroup_version(tmp_path / "none") is None


def test_cgroup_v1_counters_name_the_limit(tmp_path: Path) -> None:
    group = Cgroup("v1", [], [], memory_events=tmp_path / "oom_control", pids_events=tmp_path / "pids.events")
    (tmp_path / "oom_control").write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 0\n")
    (tmp_path / "pids.events").write_text("max 0\n")
    group.baseline = group.counters()
    assert group.hit() is None
    (tmp_path / "pids.events").write_text("max 3\n")
    assert group.hit() == "pids_limit"
    (tmp_path / "oom_control").write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 1\n")
    assert group.hit() == "memory_mb"


@pytest.mark.slow
async def test_agent_is_not_host_root_and_etc_is_minimal() -> None:
    require_bwrap()
    rt = make_runtime(RuntimeSpec(network="none"))
    await rt.prepare()
    try:
        shadow = await rt.exec("cat /etc/shadow")
        assert shadow.exit_code != 0 and "root:" not in shadow.output
        uid = await rt.exec("id -u; cat /proc/self/uid_map")
        assert uid.output.split()[0] == "0"  # root inside its own user namespace ...
        inside, outside = uid.output.split()[1:3]
        if os.geteuid() == 0:
            assert (inside, outside) != ("0", "0") and int(outside) >= 100_000  # ... never the host's root
        etc = (await rt.exec("ls /etc")).output.split()
        assert "passwd" in etc and "shadow" not in etc and "sudoers" not in etc and "ssh" not in etc
        cmdline = (await rt.exec("tr '\\0' ' ' < /proc/1/cmdline")).output
        assert "/tmp/" not in cmdline and "polar-sandbox" not in cmdline  # bwrap's options travel by fd
        report = rt.limits_report()  # type: ignore[attr-defined]
        assert set(report["mechanisms"]) == {"pids_limit", "memory_mb", "disk_mb", "output_mb", "patch_mb"}
        if cgroup_version() == "v1":
            assert report["mechanisms"]["memory_mb"] == "cgroup v1 memory.limit_in_bytes"
    finally:
        await rt.stop()


@pytest.mark.slow
async def test_patch_over_the_cap_is_refused() -> None:
    require_bwrap()
    rt = make_runtime(RuntimeSpec(network="none", patch_mb=1))
    await rt.prepare()
    try:
        await rt.exec("head -c 3000000 /dev/urandom | base64 > big.txt")
        with pytest.raises(LimitExceeded, match="patch_mb"):
            await rt.diff()
    finally:
        await rt.stop()


_CHILD = """
import json, sys
from pathlib import Path
from tests.evaluators.attacks import run_sessions

def peak_mb():  # this process image's own peak RSS (ru_maxrss would carry the forking parent's over exec)
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024

tmp, cases = Path(sys.argv[1]), json.loads(sys.argv[2])
before = peak_mb()
results = run_sessions(tmp, {name: (cmd, rt) for name, (cmd, rt) in cases.items()})
print(json.dumps({"before_mb": before, "peak_mb": peak_mb(),
                  "results": {k: v.model_dump(mode="json", exclude={"trajectory"}) for k, v in results.items()}}))
"""


@pytest.mark.slow
def test_limits_end_their_own_session_and_spare_the_others(tmp_path: Path) -> None:
    """The rollout runs in a fresh process so its peak RSS is its own, not the test run's."""
    require_bwrap()
    small = {"pids_limit": 64, "memory_mb": 256, "disk_mb": 64}
    cases: dict[str, tuple[str, dict[str, Any]]] = {
        "flood": (f"head -c {FLOOD_BYTES} /dev/zero | tr '\\0' a; echo flood-done", {}),
        "forks": ("for i in $(seq 2000); do sleep 30 & done; wait", small),
        "memory": ("python3 -c \"x = b'a' * (1 << 30); print(len(x))\"", small),
        "disk": ("for i in 1 2 3 4 5; do head -c 30000000 /dev/zero > /testbed/f$i; done; sleep 12; echo filled", small),
        "normal": ("echo 6*7=$((6*7))", small),
    }
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, "-c", _CHILD, str(tmp_path), json.dumps(cases)], cwd=root,
                          env={**os.environ, "PYTHONPATH": str(root)}, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    results = out["results"]
    assert out["peak_mb"] < 1024, f"peak RSS {out['peak_mb']:.0f} MiB (before the sessions {out['before_mb']:.0f} MiB)"
    flood = results["flood"]
    assert flood["status"] == "completed", flood["failure_detail"]
    seen = _tool_outputs(tmp_path, flood["session_id"])  # what the model was sent
    assert "characters truncated; " in seen and "bytes of output were dropped by the runtime's output cap" in seen
    assert "flood-done" in seen
    # without a writable cgroup (rootless, no delegation) pids and memory fall back to rlimits, which
    # cannot name the limit: only the disk watchdog is checked there
    enforced = [("forks", "pids_limit"), ("memory", "memory_mb")] if cgroup_version() else []
    for name, limit in (*enforced, ("disk", "disk_mb")):
        r = results[name]
        assert r["status"] == "error" and r["failure_kind"] == "limit_exceeded", (name, r["failure_detail"])
        assert f"limit exceeded: {limit}=" in r["failure_detail"] and r["mask"] is False  # the policy's doing: trained
        assert r["limits"]["hit"] and r["limits"]["hit"].startswith(limit)
    assert results["normal"]["status"] == "completed" and results["normal"]["reward"] == 1.0
    assert results["normal"]["limits"]["limits"]["pids_limit"] == 64


def _tool_outputs(tmp: Path, session_id: str) -> str:
    """The tool results the model was sent (from the session's journal)."""
    text = ""
    for path in (tmp / "store").rglob(f"{session_id}*.jsonl"):
        text += path.read_text(errors="replace")
    return text
