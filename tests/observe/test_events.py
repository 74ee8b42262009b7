"""The gateway's typed events: one record per kind, fanned out to subscribers."""

from __future__ import annotations

from typing import get_args

from polar_env.observe.events import EVENT_KINDS, GatewayEvent, GatewayEvents


def test_every_kind_has_a_typed_record() -> None:
    kinds = [get_args(get_args(alias)[0])[0] for alias in get_args(GatewayEvent)]
    assert kinds == list(EVENT_KINDS)


def test_emit_fans_out_and_a_failing_subscriber_does_not_stop_the_others() -> None:
    events = GatewayEvents()
    got: list[GatewayEvent] = []
    events.emit("paused", None, drained=True)  # nobody listens: nothing built
    events.subscribe(lambda e: 1 / 0)
    unsubscribe = events.subscribe(got.append)
    events.emit("call_failed", "s1", provider="anthropic", error="EngineTimeout", status=504)
    unsubscribe()
    events.emit("resumed", None, weight_version="3")
    assert [(e.kind, e.session_id, e.data) for e in got] == [
        ("call_failed", "s1", {"provider": "anthropic", "error": "EngineTimeout", "status": 504})]
