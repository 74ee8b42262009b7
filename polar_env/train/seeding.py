"""Per-session sampling seeds, so the same recipe, seed and base weights sample the same rollouts.

Without a seed in the request the embedded engine draws one from the global ``random`` when a call
reaches its lock: the draws follow the arrival order of concurrent sessions (sandbox start-up, tool
run times, thread scheduling), so two runs of one recipe gave one session another's seed and
started at different step-0 rewards (0.167 and 0.250 on the SmolLM2 tool recipe). Here each call's
seed is a hash of (run seed, task id, the task's rollout round, sample index, the call's number in
its session): nothing that depends on which session came first.

What is left: float reduction order, which changes logits in the last bits and so flips a sampled
token only when its draw falls on a boundary. Each decode runs alone (the engine's lock), but torch's
CPU kernels split reductions across ``torch.get_num_threads()`` threads: pin the count
(``torch.set_num_threads(n)`` or ``OMP_NUM_THREADS=n``) for the same bits on one machine. With real
weights the prefix cache (4 slots) also lets a prompt that extends a cached decode prefill only its
new tokens, and which decodes are still cached follows arrival order: ``prefix_cache_slots=0`` on
the engine removes that too, at the cost of full prefills.
"""

from __future__ import annotations

import hashlib
import re
import secrets
from collections import Counter
from typing import Any

from polar_env.engines.embedded.engine import EmbeddedEngine
from polar_env.records import ChatRequest, Generation

_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]")


class SessionSeeds:
    """The group ids a run's sources use, and the seed of each call in their sessions.

    A group id is ``<task id>-<run nonce>-<round>``: the nonce keeps two runs' journals apart in one
    capture folder and is never hashed; session ids are ``<group id>-<sample index>``."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.nonce = secrets.token_hex(3)
        self._groups: dict[str, tuple[str, int]] = {}  # group id -> (task id, round)
        self._rounds: Counter[str] = Counter()  # task id -> groups started
        self._calls: Counter[str] = Counter()  # session id -> calls seeded

    def group_id(self, task_id: str) -> str:
        """A new group of ``task_id``; its sessions' seeds depend on the task's round, not on time."""
        round_ = self._rounds[task_id]
        self._rounds[task_id] += 1
        group = f"{_UNSAFE.sub('_', task_id).lstrip('_.-')[:100] or 'task'}-{self.nonce}-{round_}"
        self._groups[group] = (task_id, round_)
        return group

    def call_seed(self, session_id: str) -> int | None:
        """The next call's seed in ``session_id``; None for a session no group of ours holds."""
        group, _, index = session_id.rpartition("-")
        if group not in self._groups or not index.isdigit():
            return None
        task_id, round_ = self._groups[group]
        call = self._calls[session_id]
        self._calls[session_id] += 1
        key = f"{self.seed}\0{task_id}\0{round_}\0{index}\0{call}".encode()
        return int.from_bytes(hashlib.sha256(key).digest()[:8], "big") >> 1  # 63 bits, as the engine draws


class SeededEngine(EmbeddedEngine):
    """The embedded engine, with each call that names no seed given its session's (the gateway
    names the session in ``extra_body``); the seed is set on the event loop, before the decode
    thread, so calls of one session are numbered in the order the harness made them."""

    def __init__(self, seeds: SessionSeeds, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.seeds = seeds

    async def generate(self, request: ChatRequest) -> Generation:
        if request.seed is None:
            seed = self.seeds.call_seed(str(request.extra_body.get("session_id", "")))
            if seed is not None:
                request = request.model_copy(update={"seed": seed})
        return await super().generate(request)
