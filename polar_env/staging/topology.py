"""What a node says about where its sessions are and what serves them, for ``live.json`` and the
dashboard's health view: each session's stage (past QUEUED), and the engine behind the node (the
embedded one, one server, a vLLM pool's members with their health, an SGLang router or workers).

Read from the objects as they are (no call to an engine): a node's stats are asked for twice a
second, and a health view must not add load to what it shows.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

from polar_env.staging.models import Stage


class Staged(Protocol):
    """What a session in flight says of itself (``lifecycle.Run``)."""

    @property
    def stage(self) -> Stage | None: ...


def session_stages(runs: Mapping[str, Staged]) -> dict[str, str]:
    """``{session id: stage}`` of the node's sessions past QUEUED (queued ones are the planned rest,
    and a 5,000-session job queues most of its sessions at once)."""
    return {sid: run.stage.value for sid, run in list(runs.items())
            if run.stage is not None and run.stage is not Stage.QUEUED}


def engine_members(engine: object) -> dict[str, object]:
    """The engine client's kind and members: a pool's servers (up, sessions held, last error), an
    SGLang router and the workers it last listed, or the one URL a client talks to."""
    kind = type(engine).__name__
    cache = getattr(engine, "prefix_cache", None)  # routed clients: hit rates per server and session
    routed = {"prefix_cache": cache()} if callable(cache) else {}
    health = getattr(engine, "health", None)
    if callable(health):  # VLLMPool
        return {"client": kind, "members": [{"url": url, **dict(h)} for url, h in dict(health()).items()], **routed}
    router = getattr(engine, "router_url", None)
    workers = getattr(engine, "_workers", None)
    if router or isinstance(workers, list):  # SGLangClient: a router, or workers given by URL
        return {"client": kind, "router": router, "members": [{"url": str(u)} for u in workers or []], **routed}
    url = getattr(engine, "base_url", None)
    if isinstance(url, str):
        return {"client": kind, "members": [{"url": url}]}
    return {"client": kind, "members": []}  # in the node's process (embedded, simulated)
