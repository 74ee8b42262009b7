#!/usr/bin/env python3
"""Fuzz the gateway with N hypothesis-generated requests (default 10,000) on every provider route,
count_tokens, and the session and admin routes; print counts per route and status, and exit 1 if
any request got a 5xx, an error that is not JSON in the provider's shape, or a 200 that did not
leave exactly one whole record (tests/proxy/fuzz_bodies.py has the strategies and the oracle).

    python scripts/fuzz_gateway.py [--bodies 10000] [--seed 0]

The engine is a test double (RenderingFakeEngine: real template render, fixed reply); the gateway,
its validation and its journal are the real ones, served on 127.0.0.1 in a background thread.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bodies", type=int, default=10_000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    from hypothesis import HealthCheck, Phase, given, seed, settings

    from polar_env.journal.store import JournalStore
    from tests.proxy.fuzz_bodies import Case, FuzzGateway, Tally, cases

    store = Path(tempfile.mkdtemp(prefix="polar-fuzz-"))
    gw = FuzzGateway(store)
    tally = Tally()
    started = time.perf_counter()

    @seed(args.seed)
    @settings(max_examples=args.bodies, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(case=cases)
    def run(case: Case) -> None:
        gw.check(case, tally)

    try:
        run()
    finally:
        gw.close()
    elapsed = time.perf_counter() - started
    # after the run: every journal in the store reads back whole
    reread = JournalStore(store)
    records = sum(len(reread.read(sid)) for sid in reread.session_ids())
    by_route: dict[str, Counter[str]] = {}
    for (route, status), n in tally.by_route.items():
        by_route.setdefault(route, Counter())[f"{status // 100}xx"] += n
    print(f"fuzz_gateway: {tally.line()} in {elapsed:.1f}s ({tally.bodies / elapsed:.0f} requests/s)")
    print(f"engine calls {gw.engine.calls}; records in the store {records} (all journals read back whole)")
    for route in sorted(by_route):
        counts = by_route[route]
        print(f"  {route:18s} " + "  ".join(f"{k} {counts[k]:5d}" for k in ("2xx", "4xx", "5xx")))
    statuses = ", ".join(f"{s}: {n}" for s, n in sorted(tally.statuses.items()))
    print(f"  statuses: {statuses}")
    for failure in tally.failures[:20]:
        print(f"FAIL {failure}")
    return 1 if tally.failures or tally.server_errors else 0


if __name__ == "__main__":
    sys.exit(main())
