"""``EmbeddedEngine``: the CPU engine as an in-process EngineClient.

One model, decoded by a scheduler thread that batches concurrent requests (``batcher.py``: one
forward pass per step for all of them), so the event loop stays free; a weight reload waits for
the running requests and bumps ``weight_version``. The HTTP server (``server.py``) wraps the same
object, so in-process and over-the-wire answers are identical.
"""

from __future__ import annotations

import asyncio
import math
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from polar_env.chat import ChatFormat, chat_format
from polar_env.engines.embedded.batcher import DECODE_THREADS, MAX_BATCH, Finished, Scheduler
from polar_env.engines.embedded.model import (
    Decoded,
    DecodeParams,
    ModelSpec,
    PrefixCache,
    build_model,
    load_model,
)
from polar_env.engines.embedded.policy import ScriptedPolicy
from polar_env.errors import RequestError
from polar_env.records import ChatRequest, Generation, LogprobsMode

DEFAULT_MODEL_NAME = "polar-tiny-qwen3"


@dataclass(slots=True)
class SamplingExtras:
    """vLLM request fields beyond the normalized ChatRequest."""

    top_logprobs: int = 0
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logit_bias: dict[int, float] = field(default_factory=dict)


@dataclass(slots=True)
class Prepared:
    """A request checked and tokenized, ready for the scheduler."""

    prompt_ids: list[int]
    prompt_text: str | None
    params: DecodeParams
    forced_ids: list[int] | None


@dataclass(slots=True)
class Completion:
    generation: Generation
    decoded: Decoded
    prompt_text: str | None


def _never() -> bool:
    return False


class EmbeddedEngine:
    """Tiny Qwen3 on CPU with real token ids and logprobs; optionally forced to a scripted policy."""

    name = "embedded"

    def __init__(
        self,
        *,
        model_dir: Path | None = None,
        spec: ModelSpec = ModelSpec(),
        chat: ChatFormat | None = None,  # the model family's format (default: Qwen3.5)
        policy: ScriptedPolicy | None = None,
        logprobs_mode: LogprobsMode = "processed",
        max_tokens: int = 1024,  # the cap on tokens sampled per call (sampling.max_tokens)
        model_name: str = DEFAULT_MODEL_NAME,
        prefix_cache_slots: int | None = None,  # KV caches kept for prompts that extend them; None: one per batch row for loaded weights
        max_batch: int = MAX_BATCH,  # requests decoded together; more wait their turn
        decode_threads: int | None = DECODE_THREADS,  # torch threads while decoding; None: the cores others leave idle
    ) -> None:
        self.chat = chat or chat_format("qwen3.5")
        self.tokenizer = self.chat.tokenizer
        self.model = load_model(model_dir) if model_dir else build_model(spec, self.chat)
        # A real model's prefill is most of a call's CPU; seeded tiny weights keep one-pass prefills
        # (their tests compare logprobs across engines at 1e-6).
        slots = (max(4, max_batch) if model_dir else 0) if prefix_cache_slots is None else prefix_cache_slots
        self._prefix = PrefixCache(slots) if slots > 0 else None
        self.max_model_len = int(self.model.config.max_position_embeddings)
        self.policy = policy
        self.logprobs_mode: LogprobsMode = logprobs_mode
        # A random tiny model practically never samples EOS; without a cap a harness asking for
        # max_tokens=32000 would wait minutes. Scripted turns end on their own well below it.
        self.max_tokens = max_tokens
        self.model_name = model_name
        self.weight_version = 0
        self.version_label: str | None = None  # the trainer's name for the weights (gateway resume)
        self.scheduler = Scheduler(self.model, self.chat, self._prefix, self._version, max_batch, decode_threads)
        self._in_flight: set[threading.Event] = set()  # one stop flag per generate() running (loop thread only)

    # -- EngineClient -------------------------------------------------------------------------
    async def generate(self, request: ChatRequest) -> Generation:
        """The completion, decoded by the scheduler with the other requests in flight."""
        return (await self.complete_async(request)).generation

    async def complete_async(self, request: ChatRequest, extras: SamplingExtras | None = None) -> Completion:
        """``complete`` without holding a thread while it decodes (a thread pool's few workers
        would cap the batch). Cancelling the caller (an aborted call, a client gone with nothing
        to record) takes the request out of the batch at its next token."""
        stop = threading.Event()
        self._in_flight.add(stop)
        try:
            prepared = await asyncio.to_thread(self.prepare, request, extras)
            future = self.scheduler.submit(prepared.prompt_ids, prepared.params, prepared.forced_ids, stop.is_set)
            return self._completion(request, prepared, await asyncio.wrap_future(future))
        except asyncio.CancelledError:
            stop.set()
            raise
        finally:
            self._in_flight.discard(stop)

    async def aclose(self) -> None:
        """Stop the generations in flight (each at its next token); the engine stays usable."""
        for stop in list(self._in_flight):
            stop.set()

    # -- the work -----------------------------------------------------------------------------
    def prompt_ids(self, request: ChatRequest) -> tuple[list[int], str | None]:
        if request.prompt_ids is not None:
            return list(request.prompt_ids), None
        text = self.chat.render(request.messages, request.tools, enable_thinking=self._thinking(request))
        return self.tokenizer.encode(text), text

    def complete(self, request: ChatRequest, extras: SamplingExtras | None = None,
                 stop: threading.Event | None = None) -> Completion:
        """Blocking: decodes with whatever else is in flight. ``stop``: set by another thread to
        abandon the decode (DecodeCancelled)."""
        prepared = self.prepare(request, extras)
        cancelled = stop.is_set if stop is not None else _never
        future = self.scheduler.submit(prepared.prompt_ids, prepared.params, prepared.forced_ids, cancelled)
        return self._completion(request, prepared, future.result())

    def prepare(self, request: ChatRequest, extras: SamplingExtras | None = None) -> Prepared:
        """The prompt ids and sampling parameters, or RequestError for a request that cannot run."""
        extras = extras or SamplingExtras()
        prompt_ids, prompt_text = self.prompt_ids(request)
        if not prompt_ids:
            raise RequestError("prompt is empty")
        if max(prompt_ids) >= self.model.config.vocab_size or min(prompt_ids) < 0:
            raise RequestError("prompt token id out of vocabulary range")
        room = self.max_model_len - len(prompt_ids)
        if room <= 0:
            raise RequestError(
                f"This model's maximum context length is {self.max_model_len} tokens. "
                f"However, your request has {len(prompt_ids)} input tokens."
            )
        max_tokens = min(request.max_tokens or room, room, self.max_tokens)
        if max_tokens < 1:
            raise RequestError("max_tokens must be at least 1")
        params = DecodeParams(
            max_tokens=max_tokens,
            temperature=1.0 if request.temperature is None else request.temperature,
            top_p=1.0 if request.top_p is None else request.top_p,
            seed=request.seed,
            stop=request.stop,
            stop_token_ids=extras.stop_token_ids,
            ignore_eos=extras.ignore_eos,
            logit_bias=extras.logit_bias,
            top_logprobs=extras.top_logprobs,
            logprobs_mode=self.logprobs_mode,
        )
        forced = self._scripted_ids(request) if self.policy is not None else None
        return Prepared(prompt_ids, prompt_text, params, forced)

    def _completion(self, request: ChatRequest, prepared: Prepared, finished: Finished) -> Completion:
        decoded, prompt_ids = finished.decoded, prepared.prompt_ids
        if not all(map(math.isfinite, decoded.logprobs)):
            raise RequestError("sampling produced non-finite logprobs (check logit_bias and temperature)")
        message = self.chat.parse(decoded.text, tools=request.tools, thinking=self.chat.opens_thinking(prompt_ids))
        finish = decoded.finish_reason
        if finish == "stop" and message.tool_calls:
            finish = "tool_calls"
        generation = Generation(
            message=message,
            prompt_ids=prompt_ids,
            response_ids=decoded.ids,
            response_logprobs=decoded.logprobs,
            finish_reason=finish,
            stop_reason=decoded.stop_reason,
            model=self.model_name,
            engine=self.name,
            weight_version=finished.weight_version,
            logprobs_mode=self.logprobs_mode,
        )
        return Completion(generation, decoded, prepared.prompt_text)

    def _version(self) -> str:
        return self.version_label or str(self.weight_version)

    def _thinking(self, request: ChatRequest) -> bool:
        return request.chat_template_kwargs.get("enable_thinking", True) is not False

    def _scripted_ids(self, request: ChatRequest) -> list[int]:
        """Token ids of the scripted turn as the model would write it after the generation prompt."""
        assert self.policy is not None
        text = self.policy.response_text(request.messages, request.tools, thinking=self._thinking(request),
                                         chat=self.chat)
        return self.tokenizer.encode(text) + [self.chat.end_of_turn_id]

    # -- weights ------------------------------------------------------------------------------
    def set_weight_version(self, label: str) -> None:
        """Name the current weights (what a trainer passes to the gateway's resume); records carry it
        until the next ``reload_weights``."""
        self.version_label = label

    def reload_weights(self, source: Path | dict[str, torch.Tensor]) -> int:
        """Load new weights (a HF folder or a state dict) between generations; returns the new version."""
        if isinstance(source, Path):
            from safetensors.torch import load_file

            files = sorted(source.glob("*.safetensors"))
            if not files:
                raise RequestError(f"no *.safetensors files in {source}")
            state: dict[str, Any] = {}
            for f in files:
                state.update(load_file(str(f)))
        else:
            state = source
        with self.scheduler.exclusive():  # after the running requests, before the queued ones
            missing, unexpected = self.model.load_state_dict(state, strict=False)
            # Tied embeddings: lm_head.weight is legitimately absent from saved checkpoints.
            missing = [k for k in missing if k != "lm_head.weight"]
            if missing or unexpected:
                raise RequestError(f"state dict does not fit the model: missing={missing[:5]} unexpected={unexpected[:5]}")
            if self._prefix is not None:
                self._prefix.clear()  # the kept KV was computed with the old weights
            self.weight_version += 1
            self.version_label = None
            return self.weight_version

    def describe(self) -> dict[str, Any]:
        cfg = self.model.config
        return {
            "model": self.model_name,
            "parameters": sum(p.numel() for p in self.model.parameters()),
            "hidden_size": cfg.hidden_size,
            "layers": cfg.num_hidden_layers,
            "max_model_len": self.max_model_len,
            "template": self.chat.name,
            "scripted": self.policy is not None,
            "logprobs_mode": self.logprobs_mode,
            "weight_version": self.weight_version,
            "created": int(time.time()),
        }
