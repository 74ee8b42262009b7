"""Continuous batching for the embedded engine: concurrent requests decode in one forward pass.

A scheduler thread owns the model while there is work. At each step boundary it admits queued
requests (prefilled together where their new-token counts are alike: ``prefill_groups``; each
row left-padded after its own kept prefix, at its own positions), samples one token for every
running request from its own row of logits (``RowSampler``: the arithmetic of a lone decode),
lets finished and cancelled requests leave at once, and runs the rest in one batched forward.
The batch's KV (``kv.BatchKV``) is one preallocated slab per layer, rows left-padded to the
longest, with a per-row attention mask and each row's own position ids: the keys already carry
their rotary positions, so a row attends to exactly what it would alone (float noise only). One
request alone runs the unpadded single-row path. The thread exits when idle; at interpreter exit
the batch is cancelled and the thread joined (a daemon thread killed inside torch aborts the
process).

Weights change only between requests: ``exclusive()`` stops admitting, lets the running requests
finish, and holds the model until the new weights are in; a request reports the weight version it
ran under, read when it finishes.
"""

from __future__ import annotations

import atexit
import threading
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass, field
from itertools import pairwise
from typing import TYPE_CHECKING

import torch

from polar_env.chat import ChatFormat
from polar_env.engines.embedded.kv import BatchKV, pad_together
from polar_env.engines.embedded.model import (
    DecodeCancelled,
    Decoded,
    DecodeParams,
    PrefixCache,
    RowSampler,
)
from polar_env.engines.embedded.packed import decoding_view
from polar_env.engines.embedded.threads import ThreadBudget, allowed_cores
from polar_env.journal.format import common_prefix

if TYPE_CHECKING:
    from transformers import DynamicCache

MAX_BATCH = 16
"""Rows decoded together; more requests wait in the queue. SmolLM2 holds ~46 KB of KV per token,
so 16 rows of 8k-token contexts are ~6 GB."""

PREFILL_TOKENS = 4096
"""Padded prompt tokens prefilled in one forward (a longer prompt runs alone): bounds the
activations of a group prefill (SmolLM2's MLP: 6 KB a token a layer)."""

SHARED_PREFILL_MIN = 16
"""Ids that requests admitted together share beyond their kept KV before the shared part is
prefilled once for all of them (GRPO siblings: the same prompt n times)."""

DECODE_THREADS: int | None = None
"""Torch intra-op threads while the scheduler works (set when it starts, restored when it goes
idle). None: the cores other processes leave idle, looked at every second (``threads.py``); a
number: that many, always."""


@dataclass(frozen=True, slots=True)
class Finished:
    decoded: Decoded
    weight_version: str  # the weights it ran under, read as it finished (no reload can intervene)


@dataclass(slots=True)
class Job:
    prompt_ids: list[int]
    params: DecodeParams
    forced_ids: list[int] | None
    cancelled: Callable[[], bool]
    future: Future[Finished] = field(default_factory=Future)


@dataclass(slots=True)
class _Row:
    job: Job
    sampler: RowSampler
    logits: torch.Tensor  # the next position's logits, [vocab]
    length: int  # tokens in this row's KV (its padding excluded)


class Scheduler:
    """The model's only user while requests run; see the module docstring."""

    def __init__(self, model: torch.nn.Module, chat: ChatFormat, prefix: PrefixCache | None,
                 version: Callable[[], str], max_batch: int = MAX_BATCH, threads: int | None = DECODE_THREADS,
                 prefill_tokens: int = PREFILL_TOKENS) -> None:
        self.model, self.chat, self.prefix, self.version = model, chat, prefix, version
        self.decoder = decoding_view(model)  # the same parameters; multi-row linears packed for oneDNN
        self.threads, self.prefill_tokens = threads, prefill_tokens
        self.budget = ThreadBudget(min(torch.get_num_threads(), allowed_cores()) if threads is None else threads)
        self.max_batch = max_batch if batchable(getattr(model, "config", None)) else 1
        self.model_lock = threading.Lock()  # held for every forward and for a weight load
        self._cond = threading.Condition()
        self._queue: deque[Job] = deque()
        self._alive = False  # a scheduler thread is running
        self._thread: threading.Thread | None = None
        self._closing = False  # interpreter exit: cancel everything, let the thread end
        self._paused = 0  # exclusive() callers waiting or holding the model
        # scheduler thread only:
        self._rows: list[_Row] = []
        self._kv: BatchKV | None = None  # the rows' KV and mask
        # counters (read by tests and the benchmark)
        self.steps = 0  # batched forwards run
        self.prefills = 0  # prefill forwards run (one per group of requests admitted together)
        self.shared_prefills = 0  # prefixes prefilled once for several requests admitted together
        self.peak_rows = 0
        self.cancelled = 0
        _SCHEDULERS.add(self)

    # -- callers' side ------------------------------------------------------------------------
    def submit(self, prompt_ids: list[int], params: DecodeParams, forced_ids: list[int] | None,
               cancelled: Callable[[], bool]) -> Future[Finished]:
        """Queue a request; the future resolves to its ``Finished`` or raises (DecodeCancelled, or
        what its forward raised)."""
        job = Job(prompt_ids, params, forced_ids, cancelled)
        with self._cond:
            self._queue.append(job)
            self._start()
        return job.future

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        """Hold the model with no request running (a weight load): admissions stop, the running
        requests finish, and queued ones start after, under the new weights."""
        with self._cond:
            self._paused += 1
            while self._alive:
                self._cond.wait()
        try:
            with self.model_lock:
                yield
        finally:
            with self._cond:
                self._paused -= 1
                self._start()

    @property
    def running(self) -> int:
        """Requests queued or decoding."""
        with self._cond:
            return len(self._queue) + len(self._rows)

    def _start(self) -> None:  # under self._cond
        if self._queue and not self._alive and not self._paused:
            self._alive = True
            self._thread = threading.Thread(target=self._run, name="embedded-engine-batcher", daemon=True)
            self._thread.start()

    def shutdown(self, timeout: float) -> None:
        """Cancel every request and wait for the thread: a daemon thread killed inside torch at
        interpreter exit aborts the process."""
        with self._cond:
            self._closing = True
            thread = self._thread
        if thread is not None:
            thread.join(timeout)

    def _gone(self, job: Job) -> bool:
        return self._closing or job.cancelled()

    # -- the scheduler thread -----------------------------------------------------------------
    def _run(self) -> None:
        before = torch.get_num_threads()
        try:
            self._loop()
        finally:
            torch.set_num_threads(before)

    def _loop(self) -> None:
        while True:
            with self._cond:
                admit: list[Job] = []
                while not self._paused and self._queue and len(self._rows) + len(admit) < self.max_batch:
                    admit.append(self._queue.popleft())
                if not admit and not self._rows:
                    self._alive = False
                    self._cond.notify_all()
                    return
            threads = self.budget.pick() if self.threads is None else self.threads
            if self.threads is None and not admit and len(self._rows) == 1:
                threads = 1  # a lone row's decode streams the weights no faster with two (60.4 vs 57.7 ms)
            if threads != torch.get_num_threads():
                torch.set_num_threads(threads)
            try:
                with self.model_lock, torch.inference_mode():
                    self._admit(admit)
                    self._sample()
                    if self._rows:
                        self._forward()
            except BaseException as exc:  # noqa: BLE001 - a failed forward fails its requests, never the thread
                for job in [row.job for row in self._rows] + admit:
                    _fail(job, exc)
                self._rows, self._kv = [], None

    def _admit(self, jobs: list[Job]) -> None:
        """Prefill the new requests (together where their lengths allow), then pad them into the batch."""
        live: list[tuple[Job, RowSampler]] = []
        for job in jobs:
            if not job.future.set_running_or_notify_cancel():
                continue
            if self._gone(job):
                self.cancelled += 1
                _fail(job, DecodeCancelled("cancelled before the prefill"))
                continue
            try:
                live.append((job, RowSampler(self.chat, job.params, job.forced_ids)))
            except Exception as exc:  # noqa: BLE001 - this request's failure only
                _fail(job, exc)
        if self.prefix is not None and len(live) > 1:
            for ids in shared_prefixes([job.prompt_ids for job, _ in live], SHARED_PREFILL_MIN):
                self._prefill_shared(self.prefix, ids)
        waiting: list[_Waiting] = []
        for job, sampler in live:
            try:
                cache, reused = self.prefix.take(job.prompt_ids) if self.prefix is not None else (None, 0)
            except Exception as exc:  # noqa: BLE001 - this request's failure only
                _fail(job, exc)
                continue
            waiting.append(_Waiting(job, sampler, cache, reused))
        for group in prefill_groups(waiting, self.prefill_tokens):
            try:
                self._prefill(group)
            except Exception as exc:  # noqa: BLE001 - these requests' failure only
                for w in group:
                    _fail(w.job, exc)

    def _prefill_shared(self, prefix: PrefixCache, ids: list[int]) -> None:
        """Prefill ``ids`` (a prefix several admitted requests share) once, into the prefix cache
        they then take it from. A failure leaves each request to prefill its own."""
        cache, reused = prefix.take(ids)
        if len(ids) - reused < SHARED_PREFILL_MIN:
            return
        try:
            self.decoder(input_ids=torch.tensor([ids[reused:]]), cache=cache, use_cache=True, logits_to_keep=1)
        except Exception:  # noqa: BLE001 - an optimisation only
            return
        prefix.put(list(ids), cache)
        self.shared_prefills += 1

    def _prefill(self, group: list[_Waiting]) -> None:
        """One forward for the group's new tokens (left-padded, masked, each at its own positions,
        after its kept prefix), then the group joins the batch. One request alone runs unpadded."""
        from transformers import DynamicCache

        new = [w.job.prompt_ids[w.reused:] for w in group]
        if len(group) == 1:
            cache = group[0].cache if group[0].cache is not None else DynamicCache()
            out = self.decoder(input_ids=torch.tensor(new), cache=cache, use_cache=True, logits_to_keep=1)
            mask = torch.ones(1, len(group[0].job.prompt_ids), dtype=torch.long)
        else:
            cache, kept = pad_together([w.cache for w in group], [w.reused for w in group])
            width = max(map(len, new))
            ids = torch.tensor([[0] * (width - len(n)) + n for n in new])
            fresh = torch.tensor([[0] * (width - len(n)) + [1] * len(n) for n in new])
            mask = torch.cat([kept, fresh], dim=1)
            starts = torch.tensor([[w.reused - width + len(n)] for w, n in zip(group, new, strict=True)])
            positions = (torch.arange(width) + starts).clamp(min=0)  # padding's positions are never attended
            out = self.decoder(input_ids=ids, attention_mask=mask, position_ids=positions, cache=cache, use_cache=True,
                             logits_to_keep=1)
        self.prefills += 1
        self._kv = BatchKV.of(cache, mask) if self._kv is None else self._kv.joined(cache, mask)
        self._rows = self._rows + [_Row(w.job, w.sampler, out.logits[i, -1], len(w.job.prompt_ids))
                                   for i, w in enumerate(group)]

    def _sample(self) -> None:
        """One token per row from its own logits; finished, failed and cancelled rows leave."""
        keep: list[int] = []
        for i, row in enumerate(self._rows):
            if self._gone(row.job):
                self.cancelled += 1
                _fail(row.job, DecodeCancelled(f"cancelled after {len(row.sampler.ids)} token(s)"))
                continue
            try:  # an empty forced turn is done before it samples
                done = row.sampler.done if row.sampler.done is not None else row.sampler.take(row.logits)
            except Exception as exc:  # noqa: BLE001 - this request's failure only
                _fail(row.job, exc)
                continue
            if done is None:
                keep.append(i)
            else:
                if self.prefix is not None and self._kv is not None:
                    self.prefix.put(row.job.prompt_ids + done.ids[:-1], self._kv.row(i))  # all but the last id ran
                row.job.future.set_result(Finished(done, self.version()))
        if len(keep) < len(self._rows):
            self._rows = [self._rows[i] for i in keep]
            self._kv = self._kv.select(keep) if keep and self._kv is not None else None

    def _forward(self) -> None:
        """Run every row's last sampled token in one forward pass."""
        rows, kv = self._rows, self._kv
        assert kv is not None
        tokens = torch.tensor([[row.sampler.ids[-1]] for row in rows])
        mask = kv.step_mask()
        if len(rows) == 1 and kv.dense:  # exactly a lone decode: no padding
            out = self.decoder(input_ids=tokens, cache=kv.cache, use_cache=True)
        else:
            positions = torch.tensor([[row.length] for row in rows])
            out = self.decoder(input_ids=tokens, attention_mask=mask, position_ids=positions, cache=kv.cache,
                             use_cache=True)
        logits = out.logits[:, -1]
        for i, row in enumerate(rows):
            row.logits = logits[i]
            row.length += 1
        self.steps += 1
        self.peak_rows = max(self.peak_rows, len(rows))


@dataclass(slots=True)
class _Waiting:
    """A request admitted, its kept prefix taken, not yet prefilled."""

    job: Job
    sampler: RowSampler
    cache: DynamicCache | None  # the kept prefix's KV (None: nothing kept)
    reused: int  # prompt ids that KV holds

    @property
    def new(self) -> int:
        return len(self.job.prompt_ids) - self.reused


def prefill_groups(waiting: list[_Waiting], budget: int) -> list[list[_Waiting]]:
    """Requests to prefill in one forward each: similar new-token counts together (padding at most
    a quarter of a group's tokens, plus a few), at most ``budget`` padded tokens a group (a longer
    prompt runs alone)."""
    groups: list[list[_Waiting]] = []
    for w in sorted(waiting, key=lambda w: w.new, reverse=True):
        group = groups[-1] if groups else None
        if group is not None:
            padded = group[0].new * (len(group) + 1)
            real = sum(g.new for g in group) + w.new
            if padded <= budget and padded <= real * 1.25 + 16 * (len(group) + 1):
                group.append(w)
                continue
        groups.append([w])
    return groups


def shared_prefixes(prompts: list[list[int]], minimum: int) -> list[list[int]]:
    """The prefixes worth prefilling once for ``prompts`` (requests admitted together), shorter
    first: each is shared by two or more prompts and at least ``minimum`` ids longer than the
    shared prefix it extends (nested: some siblings of a group can share more than all do)."""
    found: list[list[int]] = []

    def visit(group: list[list[int]], base: int) -> None:
        if len(group) < 2:
            return
        joints = [common_prefix(a, b) for a, b in pairwise(group)]  # sorted: the group shares the least
        shared = min(joints)
        if shared - base >= minimum:
            found.append(group[0][:shared])
            base = shared
        start = 0
        for i, joint in enumerate(joints):
            if joint == shared:
                visit(group[start: i + 1], base)
                start = i + 1
        visit(group[start:], base)

    visit(sorted(prompts), 0)
    return found


def batchable(config: object) -> bool:
    """Full attention in every layer (no sliding window, no linear attention): rows can be padded."""
    kinds = getattr(config, "layer_types", None) or ["full_attention"]
    return all(kind == "full_attention" for kind in kinds) and not getattr(config, "use_sliding_window", False)


_SCHEDULERS: weakref.WeakSet[Scheduler] = weakref.WeakSet()


@atexit.register
def _shutdown_all() -> None:
    for scheduler in list(_SCHEDULERS):
        scheduler.shutdown(timeout=30)


def _fail(job: Job, exc: BaseException) -> None:
    if not job.future.done():
        job.future.set_exception(exc)
