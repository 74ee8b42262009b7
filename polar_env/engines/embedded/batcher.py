"""Continuous batching for the embedded engine: concurrent requests decode in one forward pass.

A scheduler thread owns the model while there is work. At each step boundary it admits queued
requests (each prefilled alone, on its own KV cache, reusing a kept prefix), samples one token for
every running request from its own row of logits (``RowSampler``: the arithmetic of a lone
decode), lets finished and cancelled requests leave at once, and runs the rest in one batched
forward. The batch's KV is left-padded to the longest request, with an attention mask over the
padding and each row's own position ids: the keys already carry their rotary positions, so a row
attends to exactly what it would alone (float noise only). One request alone runs the unpadded
single-row path. The thread exits when idle; at interpreter exit the batch is cancelled and the
thread joined (a daemon thread killed inside torch aborts the process).

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
from typing import TYPE_CHECKING, Protocol, cast

import torch
import torch.nn.functional as F

from polar_env.chat import ChatFormat
from polar_env.engines.embedded.model import (
    DecodeCancelled,
    Decoded,
    DecodeParams,
    PrefixCache,
    RowSampler,
)

if TYPE_CHECKING:
    from transformers import DynamicCache

MAX_BATCH = 16
"""Rows decoded together; more requests wait in the queue. SmolLM2 holds ~46 KB of KV per token,
so 16 rows of 8k-token contexts are ~6 GB."""


DECODE_THREADS = 1
"""Torch intra-op threads while the scheduler works (set when it starts, restored when it goes
idle; None leaves torch's count). A step is hundreds of small matmuls, each ending on an OpenMP
barrier that waits for a descheduled thread on a loaded machine: on the shared 2-core VM (load ~9)
a 4-row SmolLM2 step took 5.1 s with two threads and 0.39 s with one, and a lone tiny-model decode
in a thread started per busy period ran at a third of its speed with two."""


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
                 version: Callable[[], str], max_batch: int = MAX_BATCH, threads: int | None = DECODE_THREADS) -> None:
        self.model, self.chat, self.prefix, self.version = model, chat, prefix, version
        self.threads = threads
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
        self._cache: DynamicCache | None = None  # the rows' KV, [rows, heads, longest, dim], left-padded
        # counters (read by tests and the benchmark)
        self.steps = 0  # batched forwards run
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
        if self.threads is not None:
            torch.set_num_threads(self.threads)
        try:
            self._loop()
        finally:
            if self.threads is not None:
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
            try:
                with self.model_lock, torch.inference_mode():
                    self._admit(admit)
                    self._sample()
                    if self._rows:
                        self._forward()
            except BaseException as exc:  # noqa: BLE001 - a failed forward fails its requests, never the thread
                for job in [row.job for row in self._rows] + admit:
                    _fail(job, exc)
                self._rows, self._cache = [], None

    def _admit(self, jobs: list[Job]) -> None:
        """Prefill each new request on its own cache, then pad it into the batch."""
        from transformers import DynamicCache

        joined: list[tuple[_Row, DynamicCache]] = []
        for job in jobs:
            if not job.future.set_running_or_notify_cancel():
                continue
            if self._gone(job):
                self.cancelled += 1
                _fail(job, DecodeCancelled("cancelled before the prefill"))
                continue
            try:
                sampler = RowSampler(self.chat, job.params, job.forced_ids)
                cache, reused = self.prefix.take(job.prompt_ids) if self.prefix is not None else (DynamicCache(), 0)
                out = self.model(input_ids=torch.tensor([job.prompt_ids[reused:]]), cache=cache, use_cache=True,
                                 logits_to_keep=1)
            except Exception as exc:  # noqa: BLE001 - this request's failure only
                _fail(job, exc)
                continue
            row = _Row(job, sampler, out.logits[0, -1], len(job.prompt_ids))
            if sampler.done is not None:  # nothing to sample (an empty forced turn)
                self._leave_alone(row, cache)
                continue
            joined.append((row, cache))
        if joined:
            self._join(joined)

    def _sample(self) -> None:
        """One token per row from its own logits; finished, failed and cancelled rows leave."""
        keep: list[int] = []
        for i, row in enumerate(self._rows):
            if self._gone(row.job):
                self.cancelled += 1
                _fail(row.job, DecodeCancelled(f"cancelled after {len(row.sampler.ids)} token(s)"))
                continue
            try:
                done = row.sampler.take(row.logits)
            except Exception as exc:  # noqa: BLE001 - this request's failure only
                _fail(row.job, exc)
                continue
            if done is None:
                keep.append(i)
            else:
                if self.prefix is not None:
                    self.prefix.put(row.job.prompt_ids + done.ids[:-1], self._row_cache(i))  # all but the last id ran
                row.job.future.set_result(Finished(done, self.version()))
        if len(keep) < len(self._rows):
            self._select(keep)

    def _forward(self) -> None:
        """Run every row's last sampled token in one forward pass."""
        rows, cache = self._rows, self._cache
        assert cache is not None
        tokens = torch.tensor([[row.sampler.ids[-1]] for row in rows])
        if len(rows) == 1:  # exactly a lone decode: no padding
            out = self.model(input_ids=tokens, cache=cache, use_cache=True)
        else:
            width = cache.get_seq_length()
            mask = torch.ones(len(rows), width + 1, dtype=torch.long)
            for i, row in enumerate(rows):
                mask[i, : width - row.length] = 0
            positions = torch.tensor([[row.length] for row in rows])
            out = self.model(input_ids=tokens, attention_mask=mask, position_ids=positions, cache=cache, use_cache=True)
        logits = out.logits[:, -1]
        for i, row in enumerate(rows):
            row.logits = logits[i]
            row.length += 1
        self.steps += 1
        self.peak_rows = max(self.peak_rows, len(rows))

    # -- the batch's KV -----------------------------------------------------------------------
    def _join(self, joined: list[tuple[_Row, DynamicCache]]) -> None:
        """Append rows (each with its own cache) to the batch: every cache left-padded to the longest."""
        from transformers import DynamicCache

        if not self._rows and len(joined) == 1:
            (row, cache), = joined
            self._rows, self._cache = [row], cache
            return
        sources = ([self._cache] if self._cache is not None else []) + [cache for _, cache in joined]
        width = max(source.get_seq_length() for source in sources)
        layers = []
        kvs = [_kv(source) for source in sources]
        for li in range(len(kvs[0])):
            keys = torch.cat([_left_pad(kv[li].keys, width) for kv in kvs])
            values = torch.cat([_left_pad(kv[li].values, width) for kv in kvs])
            layers.append((keys, values))
        self._rows = self._rows + [r for r, _ in joined]
        self._cache = DynamicCache(ddp_cache_data=layers)

    def _select(self, keep: list[int]) -> None:
        """Keep only these rows, dropping the padding columns no row needs any more."""
        cache = self._cache
        rows = [self._rows[i] for i in keep]
        self._rows = rows
        if not rows or cache is None:
            self._cache = None
            return
        width = cache.get_seq_length()
        drop = width - max(r.length for r in rows)  # columns that are padding in every kept row
        index = torch.tensor(keep)
        for layer in _kv(cache):
            layer.keys = layer.keys[index, :, drop:]
            layer.values = layer.values[index, :, drop:]

    def _row_cache(self, i: int) -> DynamicCache:
        """Row ``i``'s KV alone (its padding cut), for the prefix cache."""
        from transformers import DynamicCache

        cache = self._cache
        assert cache is not None
        if len(self._rows) == 1:
            return cache
        start = cache.get_seq_length() - self._rows[i].length
        return DynamicCache(ddp_cache_data=[(layer.keys[i: i + 1, :, start:].clone(),
                                             layer.values[i: i + 1, :, start:].clone()) for layer in _kv(cache)])

    def _leave_alone(self, row: _Row, cache: DynamicCache) -> None:
        done = row.sampler.done
        assert done is not None
        if self.prefix is not None:
            self.prefix.put(row.job.prompt_ids, cache)
        row.job.future.set_result(Finished(done, self.version()))


class _KV(Protocol):
    keys: torch.Tensor
    values: torch.Tensor


def _kv(cache: DynamicCache) -> list[_KV]:
    """The cache's layers as plain full-attention KV (what padding into a batch needs)."""
    from transformers.cache_utils import DynamicLayer

    layers: list[_KV] = []
    for layer in cache.layers:
        if type(layer) is not DynamicLayer or not isinstance(layer.keys, torch.Tensor):
            raise TypeError(f"cannot batch a {type(layer).__name__} cache layer")
        layers.append(cast(_KV, layer))
    return layers


def batchable(config: object) -> bool:
    """Full attention in every layer (no sliding window, no linear attention): rows can be padded."""
    kinds = getattr(config, "layer_types", None) or ["full_attention"]
    return all(kind == "full_attention" for kind in kinds) and not getattr(config, "use_sliding_window", False)


_SCHEDULERS: weakref.WeakSet[Scheduler] = weakref.WeakSet()


@atexit.register
def _shutdown_all() -> None:
    for scheduler in list(_SCHEDULERS):
        scheduler.shutdown(timeout=30)


def _left_pad(tensor: torch.Tensor, width: int) -> torch.Tensor:
    return F.pad(tensor, (0, 0, width - tensor.shape[-2], 0)) if tensor.shape[-2] < width else tensor


def _fail(job: Job, exc: BaseException) -> None:
    if not job.future.done():
        job.future.set_exception(exc)
