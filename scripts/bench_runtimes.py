"""Per-exec cost of the host-workspace runtimes: wall time and host CPU of one tool call.

Why: every tool call an agent makes is one ``exec``; Apptainer used to start a fresh container per
call (~410 ms wall, ~88 ms host CPU against bubblewrap's 35 ms / 2.8 ms). It now starts one instance
per session and joins it (``runtimes/apptainer_instance.py``); ``apptainer-per-exec`` replays the old
command line (the runtime's limits prefix, uid drop and stages, then ``apptainer exec`` with the same
binds) on the same prepared runtime, so before and after are measured side by side on one machine.

Each variant: one prepared runtime (the debootstrap rootfs, ``network=none``, default limits), a
warm-up exec, then ``--execs`` calls of ``true``; wall is the median per call, host CPU the user+sys
time of the reaped children (``RUSAGE_CHILDREN``) per call. The 1-minute load average is printed
before and after: on a shared machine, compare only figures from the same run.

    python scripts/bench_runtimes.py [--execs 30] [--variants sandbox,apptainer,apptainer-per-exec] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import statistics
import subprocess
import time
from collections.abc import Awaitable, Callable
from typing import Any

from polar_env.runtimes import ApptainerRuntime, RuntimeSpec, SandboxRuntime
from polar_env.runtimes.apptainer import apptainer_env
from polar_env.runtimes.hostworkspace import HostWorkspaceRuntime

VARIANTS = ("sandbox", "apptainer", "apptainer-per-exec")


def children_cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


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


async def measure(variant: str, image: str, execs: int) -> dict[str, Any]:
    spec = RuntimeSpec(kind="sandbox" if variant == "sandbox" else "apptainer", image=image, network="none")
    rt: SandboxRuntime | ApptainerRuntime = SandboxRuntime(spec) if variant == "sandbox" else ApptainerRuntime(spec)
    await rt.prepare()
    try:
        async def runtime_call() -> None:
            res = await rt.exec(["true"])
            if res.exit_code != 0:
                raise RuntimeError(res.output)

        call = per_exec_call(rt) if isinstance(rt, ApptainerRuntime) and variant == "apptainer-per-exec" else runtime_call
        await call()  # warm-up
        walls: list[float] = []
        cpu0 = children_cpu()
        for _ in range(execs):
            start = time.monotonic()
            await call()
            walls.append(time.monotonic() - start)
        cpu = (children_cpu() - cpu0) / execs
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
    rows = [await measure(v, image, args.execs) for v in args.variants.split(",")]
    load_after = os.getloadavg()[0]
    print(f"load average (1 min): {load_before:.2f} before, {load_after:.2f} after; {os.cpu_count()} CPUs; "
          f"euid {os.geteuid()}")
    print(f"{'variant':<20} {'wall ms (median)':>17} {'wall ms (p90)':>14} {'host CPU ms':>12} {'prepare s':>10}")
    for r in rows:
        print(f"{r['variant']:<20} {r['wall_ms_median']:>17} {r['wall_ms_p90']:>14} {r['host_cpu_ms']:>12} {r['prepare_s']:>10}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"load_before": load_before, "load_after": load_after, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    asyncio.run(main())
