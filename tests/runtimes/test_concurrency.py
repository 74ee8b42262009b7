"""More sessions than the default thread pool has threads all execute at the same time: an exec
holds no thread (Docker: ``docker exec`` as an asyncio subprocess; the sandbox: bwrap as one), so
N concurrent ``sleep`` commands overlap instead of running in waves of ``min(32, cpus + 4)``.
Real runtimes: the Docker variant needs the private dockerd (scripts/start_dockerd.sh) and the
imported test image, like the other Docker tests; the sandbox variant needs bubblewrap.

Also: output and limits behave the same under Docker (the flood is capped, the fork storm and the
memory hog end their exec with the limit named)."""

from __future__ import annotations

import asyncio
import os
from typing import Any

import pytest

SLEEP_S = 3.0


def default_executor_size() -> int:
    return min(32, (os.cpu_count() or 1) + 4)


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["sandbox-host", "docker"])
async def test_sessions_beyond_the_default_executor_run_concurrently(runtimes: Any, variant: str) -> None:
    n = default_executor_size() + 6
    made = await asyncio.gather(*(runtimes() for _ in range(n)))
    results = await asyncio.gather(*(rt.exec(f"date +%s.%N; sleep {SLEEP_S}; date +%s.%N", timeout_s=60) for rt in made))
    spans = [tuple(float(x) for x in r.output.split()) for r in results]
    assert all(r.exit_code == 0 for r in results), [r.output for r in results]
    latest_start, earliest_end = max(s for s, _ in spans), min(e for _, e in spans)
    # waves of the default executor would start some execs only after others ended: all overlapping is the proof
    assert latest_start < earliest_end, f"{n} execs did not all overlap (waves?): spans {spans}"


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["docker"])
async def test_docker_caps_output_and_names_the_limit(runtimes: Any, variant: str) -> None:
    rt = await runtimes(output_mb=1, pids_limit=64, memory_mb=256)
    flood = await rt.exec("head -c 50000000 /dev/zero | tr '\\0' a; echo end")
    assert flood.exit_code == 0 and flood.truncated_bytes > 40_000_000 and flood.output.rstrip().endswith("end")
    assert "bytes of output truncated" in flood.output and len(flood.output) < 1_100_000
    assert rt.limits_report()["mechanisms"]["pids_limit"] == "docker --pids-limit (cgroup)"
    forks = await rt.exec("for i in $(seq 500); do sleep 20 & done; wait", timeout_s=60)
    assert forks.limit is not None and forks.limit.startswith("pids_limit=64"), forks
    rt2 = await runtimes(memory_mb=256)
    hog = await rt2.exec("python3 -c \"x = b'a' * (1 << 30)\"", timeout_s=60)
    assert hog.limit is not None and hog.limit.startswith("memory_mb=256"), hog
