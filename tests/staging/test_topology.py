"""What a node's stats say about its engine and its sessions (``staging/topology.py``), over the
real engine clients (built, not called: the stats read them as they are)."""

from __future__ import annotations

from dataclasses import dataclass

from polar_env.engines.sglang import SGLangClient
from polar_env.engines.vllm import VLLMClient
from polar_env.engines.vllm_pool import VLLMPool
from polar_env.staging.models import Stage
from polar_env.staging.topology import engine_members, session_stages


@dataclass
class InFlight:
    stage: Stage | None


def test_engine_members_of_each_client() -> None:
    pool = engine_members(VLLMPool(["http://a:8000", "http://b:8000/"], "m"))
    fresh = {"up": True, "sessions": 0, "in_flight": 0, "hit_rate": None, "error": ""}
    assert pool["members"] == [{"url": "http://a:8000", **fresh}, {"url": "http://b:8000", **fresh}]
    cache = pool["prefix_cache"]  # routed clients add their prefix-cache figures (engines/routing.py)
    assert isinstance(cache, dict) and list(cache["servers"]) == ["http://a:8000", "http://b:8000"]
    router = engine_members(SGLangClient(router_url="http://r:30000/", model="m"))
    assert {k: v for k, v in router.items() if k != "prefix_cache"} == {
        "client": "SGLangClient", "router": "http://r:30000", "members": []}  # none listed yet
    workers = engine_members(SGLangClient(["http://w1:30000", "http://w2:30000"], "m"))
    assert [m["url"] for m in workers["members"]] == ["http://w1:30000", "http://w2:30000"]  # type: ignore[attr-defined]
    one = engine_members(VLLMClient("http://a:8000", "m"))
    assert one["client"] == "VLLMClient" and len(one["members"]) == 1  # type: ignore[arg-type]
    assert engine_members(object()) == {"client": "object", "members": []}  # in the node's process


def test_session_stages_leave_queued_sessions_out() -> None:
    runs = {"a": InFlight(Stage.QUEUED), "b": InFlight(Stage.INIT), "c": InFlight(Stage.POSTRUN), "d": InFlight(None)}
    assert session_stages(runs) == {"b": "init", "c": "postrun"}
