"""How long the first session page's trace takes after ``polar-env dashboard`` starts: the
tokenizer loaded on first use (the baseline) vs loaded in the background at start (what
``run_dashboard`` does), side by side.

Each variant is a fresh Python process (a cold tokenizer cache) that builds the dashboard over
RUN, optionally starts the warm-up, waits ``--open-after`` seconds (a user opening the page and
clicking a session), then times the first ``/trace/0`` request: wall seconds and this process's
CPU seconds during the request. The load average is printed with the figures (the machine is shared).

    python scripts/bench_dashboard_first_trace.py RUN_FOLDER [--open-after 15]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

CHILD = r"""
import asyncio, json, sys, time
from pathlib import Path
from aiohttp.test_utils import TestClient, TestServer
from polar_env.dashboard.server import Dashboard, build_dashboard
from polar_env.dashboard.session import warm_tokenizer

run, warm, wait = Path(sys.argv[1]), sys.argv[2] == "1", float(sys.argv[3])

async def main():
    dash = Dashboard([run])
    if warm:
        warm_tokenizer()
    name = next(iter(dash.runs))
    async with TestClient(TestServer(build_dashboard(dash))) as client:
        rows = (await (await client.get(f"/api/runs/{name}/sessions")).json())["rows"]
        sid = next(r["session_id"] for r in rows if r["calls"])
        await asyncio.sleep(wait)
        wall, cpu = time.perf_counter(), time.process_time()
        resp = await client.get(f"/api/runs/{name}/sessions/{sid}/trace/0")
        assert resp.status == 200, await resp.text()
        await resp.json()
        print(json.dumps({"wall_s": time.perf_counter() - wall, "cpu_s": time.process_time() - cpu}))

asyncio.run(main())
"""


def measure(run: str, warm: bool, wait: float) -> dict[str, float]:
    out = subprocess.run([sys.executable, "-c", CHILD, run, "1" if warm else "0", str(wait)], capture_output=True,
                         text=True, check=True)
    figures: dict[str, float] = json.loads(out.stdout.strip().splitlines()[-1])
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run", help="a run folder with at least one session that made a call")
    parser.add_argument("--open-after", type=float, default=15.0, help="seconds between start and the first trace")
    args = parser.parse_args()
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    cold = measure(args.run, False, args.open_after)
    warm = measure(args.run, True, args.open_after)
    print(f"{'first trace page':<28}{'wall s':>10}{'CPU s':>10}")
    print(f"{'loaded on first use':<28}{cold['wall_s']:>10.2f}{cold['cpu_s']:>10.2f}")
    print(f"{'loaded at start (now)':<28}{warm['wall_s']:>10.2f}{warm['cpu_s']:>10.2f}")
    print(f"ratio (first use / at start): wall {cold['wall_s'] / max(warm['wall_s'], 1e-9):.1f}x, "
          f"CPU {cold['cpu_s'] / max(warm['cpu_s'], 1e-9):.1f}x")
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
