"""Per-exec cost of the host-workspace runtimes: wall time and host CPU of one tool call.

Why: every tool call an agent makes is one ``exec``. Apptainer used to start a fresh container per
call, and bwrap a fresh sandbox with its own PID namespace (so a background process died with the
call); both now start one instance per session that every exec joins
(``runtimes/apptainer_instance.py``, ``runtimes/bwrap_instance.py``). ``apptainer-per-exec`` and
``sandbox-per-exec`` replay the old command lines (the runtime's limits prefix, uid drop and
stages, then a fresh ``apptainer exec`` / ``bwrap --unshare-all``) on the same prepared runtime, so
before and after are measured side by side on one machine.

Each variant: one prepared runtime (the debootstrap rootfs, ``network=none``, default limits), a
warm-up exec, then ``--execs`` calls of ``true``; wall is the median per call, host CPU per call is
everything the calls ran (``CpuMeter``: a cpuacct cgroup of the bench's own as root on cgroups v1,
which counts a per-exec PID namespace's processes too; else ``RUSAGE_CHILDREN``, which does not).
The 1-minute load average is printed before and after: on a shared machine, compare only figures
from the same run.

    python scripts/bench_runtimes.py [--execs 30] [--variants sandbox,sandbox-per-exec,apptainer,apptainer-per-exec] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import resource
import statistics
import subprocess
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from polar_env.runtimes import ApptainerRuntime, RuntimeSpec, SandboxRuntime
from polar_env.runtimes.apptainer import apptainer_env
from polar_env.runtimes.hostworkspace import HostWorkspaceRuntime

VARIANTS = ("sandbox", "sandbox-per-exec", "apptainer", "apptainer-per-exec")
CPUACCT = Path("/sys/fs/cgroup/cpuacct")


class CpuMeter:
    """Host CPU seconds of everything this process starts. In a cpuacct cgroup of its own (cgroups
    v1, as root) every descendant counts, a per-exec PID namespace's included; otherwise
    ``RUSAGE_CHILDREN``, which misses processes no one in the tree reaps (``meter`` says which)."""

    def __init__(self) -> None:
        self.group: Path | None = None
        with contextlib.suppress(OSError):
            group = CPUACCT / f"polar-bench-{os.getpid()}"
            group.mkdir()
            (group / "cgroup.procs").write_text(str(os.getpid()))
            self.group = group
        self.meter = "cpuacct cgroup" if self.group is not None else "RUSAGE_CHILDREN"

    def seconds(self) -> float:
        if self.group is not None:  # the whole group, less this process's own CPU
            return int((self.group / "cpuacct.usage").read_text()) / 1e9 - time.process_time()
        ru = resource.getrusage(resource.RUSAGE_CHILDREN)
        return ru.ru_utime + ru.ru_stime

    def close(self) -> None:
        if self.group is not None:
            with contextlib.suppress(OSError):
                (CPUACCT / "cgroup.procs").write_text(str(os.getpid()))
                self.group.rmdir()


METER = CpuMeter()


def rootfs() -> str:
    out = subprocess.run(["bash", "scripts/build_rootfs.sh", "--print"], capture_output=True, text=True, check=True)
    return out.stdout.strip()


def per_exec_call(rt: ApptainerRuntime) -> Callable[[], Awaitable[None]]:
    """One ``true`` the pre-instance way: a fresh ``apptainer exec`` with this runtime's prefix and binds."""
    assert rt.limits is not None
    full = [*rt.limits.prefix(), *HostWorkspaceRuntime._privileged_prefix(rt),
            *rt._apptainer_argv(["true"], rt.spec.workdir)]
    env = apptainer_env(os.environ, rt._env(None))

    async def call() -> None:
        proc = await asyncio.create_subprocess_exec(*full, stdin=asyncio.subprocess.DEVNULL,
                                                    stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
                                                    env=env, start_new_session=True)
        if await proc.wait() != 0:
            raise RuntimeError(f"apptainer exec failed: {full}")

    return call


def sandbox_per_exec_call(rt: SandboxRuntime) -> Callable[[], Awaitable[None]]:
    """One ``true`` the pre-instance way: a fresh ``bwrap --unshare-all`` (its own PID namespace)."""
    assert rt.limits is not None
    full = [*rt.limits.prefix(), *rt._privileged_prefix(), *rt._full_argv(["true"], rt.spec.workdir)]

    async def call() -> None:
        proc = await asyncio.create_subprocess_exec(*full, stdin=asyncio.subprocess.DEVNULL,
                                                    stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
                                                    env=rt._env(None), start_new_session=True)
        if await proc.wait() != 0:
            raise RuntimeError(f"bwrap failed: {full}")

    return call


async def measure(variant: str, image: str, execs: int) -> dict[str, Any]:
    sandbox = variant.startswith("sandbox")
    spec = RuntimeSpec(kind="sandbox" if sandbox else "apptainer", image=image, network="none")
    rt: SandboxRuntime | ApptainerRuntime = SandboxRuntime(spec) if sandbox else ApptainerRuntime(spec)
    await rt.prepare()
    try:
        async def runtime_call() -> None:
            res = await rt.exec(["true"])
            if res.exit_code != 0:
                raise RuntimeError(res.output)

        call: Callable[[], Awaitable[None]] = runtime_call
        if isinstance(rt, ApptainerRuntime) and variant == "apptainer-per-exec":
            call = per_exec_call(rt)
        elif isinstance(rt, SandboxRuntime) and variant == "sandbox-per-exec":
            await runtime_call()  # the instance's start-up, out of the figures
            call = sandbox_per_exec_call(rt)
        await call()  # warm-up
        walls: list[float] = []
        cpu0 = METER.seconds()
        for _ in range(execs):
            start = time.monotonic()
            await call()
            walls.append(time.monotonic() - start)
        cpu = (METER.seconds() - cpu0) / execs
    finally:
        await rt.stop()
    return {"variant": variant, "execs": execs, "wall_ms_median": round(statistics.median(walls) * 1e3, 1),
            "wall_ms_p90": round(sorted(walls)[int(0.9 * (len(walls) - 1))] * 1e3, 1), "host_cpu_ms": round(cpu * 1e3, 1),
            "prepare_s": round(rt.timings.prepare_s, 2)}


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--execs", type=int, default=30)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    image = rootfs()
    load_before = os.getloadavg()[0]
    try:
        rows = [await measure(v, image, args.execs) for v in args.variants.split(",")]
    finally:
        METER.close()
    load_after = os.getloadavg()[0]
    print(f"load average (1 min): {load_before:.2f} before, {load_after:.2f} after; {os.cpu_count()} CPUs; "
          f"euid {os.geteuid()}; host CPU from {METER.meter}")
    print(f"{'variant':<20} {'wall ms (median)':>17} {'wall ms (p90)':>14} {'host CPU ms':>12} {'prepare s':>10}")
    for r in rows:
        print(f"{r['variant']:<20} {r['wall_ms_median']:>17} {r['wall_ms_p90']:>14} {r['host_cpu_ms']:>12} {r['prepare_s']:>10}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"load_before": load_before, "load_after": load_after, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    asyncio.run(main())
