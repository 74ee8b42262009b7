"""Continuous batching in the embedded engine: a request decoded inside a batch of others (different
lengths, padded, joining mid-flight, with their own sampling parameters) samples exactly what it
samples alone, with logprobs equal within float noise; cancellation, scripted turns, the prefix
cache and weight reloads keep their single-request meaning."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from concurrent.futures import Future

import pytest

from polar_env.engines.embedded.batcher import Finished
from polar_env.engines.embedded.engine import EmbeddedEngine, SamplingExtras
from polar_env.engines.embedded.model import DecodeCancelled, ModelSpec, build_model, teacher_forced_logprobs
from polar_env.engines.embedded.policy import ScriptedPolicy
from polar_env.records import ChatRequest, Generation
from tests.conftest import SHELL_TOOL

pytestmark = pytest.mark.slow  # decodes on the embedded engine (and SmolLM2)

TOLERANCE = 1e-5
SMOLLM2_TOLERANCE = 3e-5
"""30 fp32 layers of padded attention and M-row matmuls: measured up to 1.1e-5 (STEP0_TOLERANCE,
what training checks, is 1e-4)."""


def _requests(greedy: bool) -> list[tuple[ChatRequest, SamplingExtras]]:
    """Four prompts of different lengths, each with its own sampling parameters."""
    temperature = 0.0 if greedy else None
    return [
        (ChatRequest(messages=[{"role": "user", "content": "Hi."}], max_tokens=12, seed=1,
                     temperature=temperature if greedy else 1.0), SamplingExtras(top_logprobs=3)),
        (ChatRequest(messages=[{"role": "user", "content": "Tell me about the sea. " * 9}], max_tokens=7, seed=2,
                     temperature=temperature if greedy else 0.7, top_p=0.9), SamplingExtras()),
        (ChatRequest(messages=[{"role": "user", "content": "Count: " + " ".join(map(str, range(40)))}], max_tokens=15,
                     seed=3, temperature=temperature if greedy else 1.3),
         SamplingExtras(logit_bias={11: 3.0, 13: -5.0}, ignore_eos=True)),
        (ChatRequest(messages=[{"role": "user", "content": "Why?"}, {"role": "assistant", "content": "Because."},
                               {"role": "user", "content": "Go on."}], max_tokens=9, seed=4,
                     temperature=temperature if greedy else 1.0), SamplingExtras(stop_token_ids=[999_999])),
    ]


def _together(engine: EmbeddedEngine, requests: list[tuple[ChatRequest, SamplingExtras]],
              stagger: bool = False) -> list[Generation]:
    """All requests in one batch (admitted at the same step boundary), or with the later half
    joining while the first half decodes."""
    scheduler = engine.scheduler
    prepared = [engine.prepare(r, x) for r, x in requests]
    futures: list[Future[Finished]] = []
    half = len(prepared) // 2 if stagger else len(prepared)
    with scheduler.exclusive():  # hold admissions so the first group starts together
        futures += [scheduler.submit(p.prompt_ids, p.params, p.forced_ids, lambda: False) for p in prepared[:half]]
    if stagger:
        steps = scheduler.steps
        deadline = time.monotonic() + 120
        while scheduler.steps < steps + 2 and time.monotonic() < deadline:
            time.sleep(0.005)
        futures += [scheduler.submit(p.prompt_ids, p.params, p.forced_ids, lambda: False) for p in prepared[half:]]
    return [engine._completion(r, p, f.result(timeout=300)).generation
            for (r, _), p, f in zip(requests, prepared, futures, strict=True)]


def _assert_same(alone: list[Generation], batched: list[Generation], tolerance: float = TOLERANCE) -> float:
    worst = 0.0
    for a, b in zip(alone, batched, strict=True):
        assert b.response_ids == a.response_ids
        assert b.finish_reason == a.finish_reason and b.stop_reason == a.stop_reason
        worst = max([worst, *(abs(x - y) for x, y in zip(a.response_logprobs, b.response_logprobs, strict=True))])
    assert worst <= tolerance, worst
    return worst


@pytest.fixture(scope="module")
def fresh() -> EmbeddedEngine:
    """The seeded tiny model (fp32), its own scheduler so counters are this module's."""
    return EmbeddedEngine()


@pytest.mark.parametrize("greedy", [True, False], ids=["greedy", "seeded-sampling"])
@pytest.mark.parametrize("stagger", [False, True], ids=["together", "joining-mid-flight"])
def test_a_request_alone_and_in_a_batch_of_four_agree(fresh: EmbeddedEngine, greedy: bool, stagger: bool) -> None:
    requests = _requests(greedy)
    alone = [fresh.complete(r, x).generation for r, x in requests]
    peak = fresh.scheduler.peak_rows
    batched = _together(fresh, requests, stagger)
    _assert_same(alone, batched)
    assert fresh.scheduler.peak_rows >= max(peak, 3 if stagger else 4)  # they really shared steps
    assert len({len(g.prompt_ids) for g in batched}) == 4  # different lengths: padded rows


def test_top_logprobs_per_row_survive_batching(fresh: EmbeddedEngine) -> None:
    requests = _requests(greedy=False)
    alone = fresh.complete(*requests[0])
    prepared = [fresh.prepare(r, x) for r, x in requests]
    with fresh.scheduler.exclusive():
        futures = [fresh.scheduler.submit(p.prompt_ids, p.params, p.forced_ids, lambda: False) for p in prepared]
    first = futures[0].result(timeout=300).decoded
    assert [[t for t, _ in top] for top in first.top] == [[t for t, _ in top] for top in alone.decoded.top]
    assert all(len(top) == 3 for top in first.top)
    assert all(not f.result(timeout=300).decoded.top for f in futures[1:])


def test_a_cancelled_row_leaves_and_the_others_are_untouched(fresh: EmbeddedEngine) -> None:
    requests = _requests(greedy=True)
    alone = [fresh.complete(r, x).generation for r, x in requests[1:]]
    stop = threading.Event()
    endless = fresh.prepare(ChatRequest(messages=[{"role": "user", "content": "Go."}], max_tokens=1000, temperature=1.0))
    prepared = [fresh.prepare(r, x) for r, x in requests[1:]]
    scheduler, cancelled = fresh.scheduler, fresh.scheduler.cancelled
    with scheduler.exclusive():
        doomed = scheduler.submit(endless.prompt_ids, endless.params, None, stop.is_set)
        futures = [scheduler.submit(p.prompt_ids, p.params, p.forced_ids, lambda: False) for p in prepared]
    steps = scheduler.steps
    while scheduler.steps < steps + 3:
        time.sleep(0.005)
    stop.set()
    with pytest.raises(DecodeCancelled):
        doomed.result(timeout=300)
    batched = [fresh._completion(r, p, f.result(timeout=300)).generation
               for (r, _), p, f in zip(requests[1:], prepared, futures, strict=True)]
    _assert_same(alone, batched)
    assert scheduler.cancelled == cancelled + 1


def test_scripted_turns_batch_and_keep_the_models_logprobs() -> None:
    scripted = EmbeddedEngine(policy=ScriptedPolicy())
    chats = [ChatRequest(messages=[{"role": "user", "content": "x" * n}], tools=[SHELL_TOOL]) for n in (1, 40, 90)]
    alone = [scripted.complete(c).generation for c in chats]
    batched = _together(scripted, [(c, SamplingExtras()) for c in chats])
    _assert_same(alone, batched)
    for gen in batched:
        assert gen.message.tool_calls and gen.response_ids[-1] == scripted.chat.end_of_turn_id
        recomputed = teacher_forced_logprobs(scripted.model, gen.prompt_ids, gen.response_ids)
        assert max(abs(a - b) for a, b in zip(recomputed, gen.response_logprobs, strict=True)) < 1e-4


def test_the_prefix_cache_keeps_each_rows_kv(fresh: EmbeddedEngine) -> None:
    """Rows leaving a batch leave their own KV (padding cut); a batch of follow-ups reuses it and
    decodes what an engine without the cache decodes."""
    cached = EmbeddedEngine(prefix_cache_slots=4)
    requests = _requests(greedy=False)
    firsts = _together(cached, requests)
    assert cached._prefix is not None and len(cached._prefix.entries) == 4
    for (ids, kv), gen in zip(sorted(cached._prefix.entries, key=lambda e: len(e[0])),
                              sorted(firsts, key=lambda g: len(g.prompt_ids) + len(g.response_ids)), strict=True):
        assert ids == gen.prompt_ids + gen.response_ids[:-1] and kv.get_seq_length() == len(ids)
    turn = cached.tokenizer.encode("<|im_start|>user\nAgain.<|im_end|>\n<|im_start|>assistant\n")
    follow = [(ChatRequest(messages=[{"role": "user", "content": "-"}], prompt_ids=g.prompt_ids + g.response_ids + turn,
                           max_tokens=6, seed=9, temperature=1.0), SamplingExtras()) for g in firsts]
    want = [fresh.complete(r, x).generation for r, x in follow]
    got = _together(cached, follow)
    _assert_same(want, got)


def test_siblings_admitted_together_prefill_their_shared_prompt_once(fresh: EmbeddedEngine) -> None:
    """GRPO siblings (one prompt, several seeds) and requests sharing a long head: the shared ids
    are prefilled once into the prefix cache, every row takes them from there, and each decodes
    what an engine without the cache decodes."""
    cached = EmbeddedEngine(prefix_cache_slots=8)
    ask = "Name a colour, any colour you like, and tell me why in one word."
    head = [{"role": "system", "content": "You are terse. " * 12}, {"role": "user", "content": ask}]
    requests = [(ChatRequest(messages=head, max_tokens=6, seed=seed, temperature=1.0), SamplingExtras())
                for seed in (1, 2, 3)]
    requests.append((ChatRequest(messages=[*head[:1], {"role": "user", "content": "Name a tree, please."}],
                                 max_tokens=6, seed=4, temperature=1.0), SamplingExtras()))
    want = [fresh.complete(r, x).generation for r, x in requests]
    got = _together(cached, requests)
    _assert_same(want, got)
    assert cached.scheduler.shared_prefills == 2  # the system prompt for all four, then the whole prompt for three
    assert cached.scheduler.prefills == 1  # the four rows' own few ids, in one forward


def test_a_weight_reload_waits_for_the_running_requests() -> None:
    """Requests running when a reload arrives finish under the old weights and say so; requests
    queued behind it run under the new ones."""
    engine = EmbeddedEngine()
    old = engine.weight_version
    running = engine.prepare(ChatRequest(messages=[{"role": "user", "content": "Go."}], max_tokens=200, seed=5))
    scheduler = engine.scheduler
    with scheduler.exclusive():
        first = scheduler.submit(running.prompt_ids, running.params, None, lambda: False)
    while scheduler.steps < 2:
        time.sleep(0.005)
    other = build_model(ModelSpec(seed=77)).state_dict()
    reloaded: list[int] = []
    reload = threading.Thread(target=lambda: reloaded.append(engine.reload_weights(other)))
    reload.start()
    while not (scheduler._paused or reloaded):
        time.sleep(0.001)
    later = scheduler.submit(running.prompt_ids, running.params, None, lambda: False)  # queued behind the reload
    reload.join(300)
    assert reloaded == [old + 1] and first.done()
    before, after = first.result().decoded, later.result(timeout=300)
    assert first.result().weight_version == str(old) and after.weight_version == str(old + 1)
    assert len(before.ids) == 200
    new_weights = teacher_forced_logprobs(engine.model, running.prompt_ids, after.decoded.ids)
    assert max(abs(a - b) for a, b in zip(new_weights, after.decoded.logprobs, strict=True)) < 1e-4
    old_weights = teacher_forced_logprobs(EmbeddedEngine().model, running.prompt_ids, before.ids)
    assert max(abs(a - b) for a, b in zip(old_weights, before.logprobs, strict=True)) < 1e-4


def test_exit_with_a_request_in_flight_is_clean() -> None:
    """Interpreter exit cancels the batch and waits for the scheduler thread (a daemon thread
    killed inside torch aborts the process)."""
    code = (
        "import time\n"
        "from polar_env.engines.embedded.engine import EmbeddedEngine\n"
        "from polar_env.records import ChatRequest\n"
        "e = EmbeddedEngine(max_tokens=100000)\n"
        "p = e.prepare(ChatRequest(messages=[{'role': 'user', 'content': 'go'}], max_tokens=100000))\n"
        "f = e.scheduler.submit(p.prompt_ids, p.params, None, lambda: False)\n"
        "while e.scheduler.steps < 3: time.sleep(0.01)\n"
        "print('exiting', flush=True)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "exiting" in done.stdout, done.stderr[-2000:]
    assert "terminate called" not in done.stderr


def test_smollm2_alone_and_in_a_batch_of_four_agree(smollm2: object) -> None:
    """The same on real weights (SmolLM2-135M, fp32): 30 layers of padded attention."""
    from polar_env.engines.config import EmbeddedEngineConfig

    engine = EmbeddedEngineConfig(template="smollm2", model="smollm2").build()
    assert isinstance(engine, EmbeddedEngine)
    requests = [(r.model_copy(update={"max_tokens": 6}), x) for r, x in _requests(greedy=True)]
    alone = [engine.complete(r, x).generation for r, x in requests]
    prefills = engine.scheduler.prefills
    _assert_same(alone, _together(engine, requests), SMOLLM2_TOLERANCE)
    assert engine.scheduler.prefills - prefills < len(requests)  # some prompts shared a padded prefill
