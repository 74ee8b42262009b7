"""Fuzzed bodies on every provider, session and admin route (hypothesis; the strategies and the
oracle are in fuzz_bodies.py): never a 5xx, every error is JSON in the provider's shape, and every
200 left exactly one whole record. ``scripts/fuzz_gateway.py`` runs the same with 10,000+ bodies."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, given, settings

from tests.proxy.fuzz_bodies import Case, FuzzGateway, Tally, cases


@pytest.fixture(scope="module")
def fuzz_gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FuzzGateway]:
    gw = FuzzGateway(tmp_path_factory.mktemp("fuzz"))
    try:
        yield gw
    finally:
        gw.close()


TALLY = Tally()


@settings(max_examples=300, deadline=None, database=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture, HealthCheck.data_too_large])
@given(case=cases)
def test_fuzzed_requests_never_5xx_and_200s_are_recorded_whole(fuzz_gateway: FuzzGateway, case: Case) -> None:
    failures = len(TALLY.failures)
    fuzz_gateway.check(case, TALLY)
    assert len(TALLY.failures) == failures, TALLY.failures[-1]


def test_fuzz_tally(fuzz_gateway: FuzzGateway) -> None:
    """The run above reached the engine and refused bodies too (a fuzzer that only ever sends
    garbage, or only ever succeeds, would prove little)."""
    print(f"\nfuzz: {TALLY.line()}")
    assert TALLY.bodies >= 300 and TALLY.server_errors == 0 and not TALLY.failures
    ok = sum(n for (route, status), n in TALLY.by_route.items() if status == 200)
    refused = sum(n for (route, status), n in TALLY.by_route.items() if 400 <= status < 500)
    assert ok >= 20 and refused >= 50, TALLY.by_route
    assert fuzz_gateway.engine.calls >= 20

