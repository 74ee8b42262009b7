"""Fuzzed bodies on every provider, session and admin route (hypothesis; the strategies and the
oracle are in fuzz_bodies.py): never a 5xx, every error is JSON in the provider's shape, and every
200 left exactly one whole record. ``scripts/fuzz_gateway.py`` runs the same with 10,000+ bodies.

One test owns its gateway and its tally: the per-body checks and the check on the whole run (that it
reached the engine and was refused too) share no module state, so the test passes alone, in any
order and under ``-k``/``--lf`` selection.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings

from tests.proxy.fuzz_bodies import Case, FuzzGateway, Tally, cases

pytestmark = pytest.mark.slow  # hypothesis over the live gateway

EXAMPLES = 300


def test_fuzzed_requests_never_5xx_and_200s_are_recorded_whole(tmp_path: Path) -> None:
    gateway, tally = FuzzGateway(tmp_path / "fuzz"), Tally()

    @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(case=cases)
    def one_body(case: Case) -> None:
        failures = len(tally.failures)
        gateway.check(case, tally)
        assert len(tally.failures) == failures, tally.failures[-1]

    try:
        one_body()
    finally:
        gateway.close()
    # the run reached the engine and refused bodies too (a fuzzer that only ever sends garbage, or
    # only ever succeeds, would prove little)
    print(f"\nfuzz: {tally.line()}")
    assert tally.bodies >= EXAMPLES and tally.server_errors == 0 and not tally.failures
    ok = sum(n for (_, status), n in tally.by_route.items() if status == 200)
    refused = sum(n for (_, status), n in tally.by_route.items() if 400 <= status < 500)
    assert ok >= 20 and refused >= 50, tally.by_route
    assert gateway.engine.calls >= 20
