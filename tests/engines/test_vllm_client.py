"""VLLMClient against a real local HTTP server replaying vLLM 0.33 response shapes."""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import socket
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from fake_engines import MODEL, ScriptedEngine
from fake_engines import load_fixture as load

from polar_env.engines.base import EngineClient
from polar_env.engines.vllm import VLLMClient, reads_token_in, release
from polar_env.errors import EngineHTTPError, EngineProtocolError, EngineTimeout, EngineUnavailable
from polar_env.records import ChatRequest


@pytest.fixture
async def upstream() -> AsyncIterator[ScriptedEngine]:
    up = await ScriptedEngine().start()
    yield up
    await up.close()


@pytest.fixture
async def client(upstream: ScriptedEngine) -> AsyncIterator[VLLMClient]:
    c = VLLMClient(upstream.url, MODEL)
    yield c
    await c.aclose()


CHAT = "/v1/chat/completions"
USER = [{"role": "user", "content": "What is 2+2?"}]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather for a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_text_and_reasoning(upstream: ScriptedEngine, client: VLLMClient) -> None:
    fx = load("vllm_chat_reasoning.json")
    upstream.reply(CHAT, fx)
    req = ChatRequest(
        model="gpt-4o",
        messages=USER,
        temperature=0.7,
        top_p=1.0,
        max_tokens=64,
        seed=7,
        stop=["\n\nUser:"],
        chat_template_kwargs={"enable_thinking": True},
        extra_body={"include_reasoning": False, "top_k": 20},
    )
    gen = await client.generate(req)

    (method, path, body), = upstream.requests
    assert (method, path) == ("POST", CHAT)
    assert body["model"] == MODEL  # forced, whatever the harness asked for
    assert body["messages"] == USER
    assert body["logprobs"] is True and body["top_logprobs"] == 0 and body["return_token_ids"] is True
    assert body["stream"] is False
    assert "include_reasoning" not in body  # false would null token_ids and logprobs
    assert "tools" not in body and "tool_choice" not in body and "kv_transfer_params" not in body
    assert body["temperature"] == 0.7 and body["top_p"] == 1.0 and body["max_tokens"] == 64
    assert body["seed"] == 7 and body["stop"] == ["\n\nUser:"] and body["top_k"] == 20
    assert body["chat_template_kwargs"] == {"enable_thinking": True}

    choice = fx["choices"][0]
    assert gen.prompt_ids == fx["prompt_token_ids"]
    assert gen.response_ids == choice["token_ids"]
    assert gen.response_logprobs == [e["logprob"] for e in choice["logprobs"]["content"]]
    assert gen.response_ids[-1] == 248046  # EOS is part of the sampled ids
    assert gen.message.content == "4."
    assert gen.message.reasoning == "Simple arithmetic."
    assert gen.message.tool_calls == []
    assert (gen.finish_reason, gen.stop_reason) == ("stop", None)
    assert (gen.engine, gen.model, gen.logprobs_mode) == ("vllm", MODEL, "processed")
    assert gen.weight_version is None


async def test_qwen3_coder_tool_call_and_history_passthrough(upstream: ScriptedEngine, client: VLLMClient) -> None:
    fx = load("vllm_chat_tool_call.json")
    upstream.reply(CHAT, fx)
    history = [
        {"role": "user", "content": "Weather in Rome?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city":"Rome"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "user", "content": "And Paris?"},
    ]
    gen = await client.generate(ChatRequest(messages=history, tools=TOOLS, tool_choice="auto"))

    body = upstream.bodies[0]
    assert body["tools"] == TOOLS and body["tool_choice"] == "auto"
    assert body["messages"] == history  # string arguments go as-is; vLLM parses them for the template
    assert gen.finish_reason == "tool_calls"
    assert gen.message.content is None
    assert gen.message.reasoning == "Need weather."
    (call,) = gen.message.tool_calls
    assert call.id == "chatcmpl-tool-8c3f1e2a9b7d4c60"
    assert call.name == "get_weather"
    assert call.arguments == '{"city": "Paris"}'  # the engine's JSON text, unmodified
    assert gen.response_ids[6] == 248058 and gen.response_ids[-2:] == [248059, 248046]
    assert len(gen.response_logprobs) == len(gen.response_ids) == 27


async def test_token_in_sends_kv_transfer_params(upstream: ScriptedEngine, client: VLLMClient) -> None:
    fx = load("vllm_chat_reasoning.json")
    upstream.reply(CHAT, fx)
    prompt = fx["prompt_token_ids"]
    extra = {"kv_transfer_params": {"do_remote_decode": False}}
    req = ChatRequest(messages=USER, prompt_ids=prompt, extra_body=extra)
    gen = await client.generate(req)
    body = upstream.bodies[0]
    assert body["kv_transfer_params"] == {"do_remote_decode": False, "prompt_token_ids": prompt}
    assert body["messages"] == USER  # still required: they drive the tool and reasoning parsers
    assert gen.prompt_ids == prompt


async def test_token_in_on_vllm_0_32_sends_the_ids(upstream: ScriptedEngine, client: VLLMClient) -> None:
    upstream.version = "0.32.0"
    fx = load("vllm_chat_reasoning.json")
    upstream.reply(CHAT, fx)
    prompt = fx["prompt_token_ids"]
    gens = await asyncio.gather(*(client.generate(ChatRequest(messages=USER, prompt_ids=prompt)) for _ in range(3)))
    assert upstream.version_gets == 1  # once per engine, though three first calls raced
    assert all(body["kv_transfer_params"] == {"prompt_token_ids": prompt} for body in upstream.bodies)
    assert all(g.prompt_ids == prompt for g in gens)
    assert (client.served_version, client.token_in, client.canonical_fallbacks) == ("0.32.0", True, 0)


async def test_token_in_on_vllm_0_25_falls_back_to_the_canonical_render(
        upstream: ScriptedEngine, client: VLLMClient, caplog: pytest.LogCaptureFixture) -> None:
    """NeMo RL's pinned vLLM 0.25.1 ignores kv_transfer_params.prompt_token_ids: the call goes out as
    messages, the Generation carries the ids the server rendered (which the trajectory compares
    with the context: drift), and the fallback is said once, not per call."""
    upstream.version = "0.25.1"
    fx = load("vllm_chat_reasoning.json")
    upstream.reply(CHAT, fx)
    continued = [*fx["prompt_token_ids"], 11, 12]  # what token-in would have sent: not what the server renders
    extra = {"kv_transfer_params": {"do_remote_decode": False}}
    with caplog.at_level(logging.WARNING, logger="polar_env.engines.vllm"):
        for _ in range(2):
            gen = await client.generate(ChatRequest(messages=USER, prompt_ids=continued, extra_body=extra))
            assert gen.prompt_ids == fx["prompt_token_ids"]  # the server's render, not an "ignored token-in" error
    assert upstream.version_gets == 1
    for body in upstream.bodies:
        assert body["messages"] == USER and body["kv_transfer_params"] == {"do_remote_decode": False}
    (warning,) = [r for r in caplog.records if r.name == "polar_env.engines.vllm"]
    assert "vLLM 0.25.1" in warning.getMessage() and "needs vLLM >= 0.32" in warning.getMessage()
    assert (client.served_version, client.token_in, client.canonical_fallbacks) == ("0.25.1", False, 2)
    plain = await client.generate(ChatRequest(messages=USER))  # templated calls never needed the probe
    assert plain.prompt_ids == fx["prompt_token_ids"] and client.canonical_fallbacks == 2


async def test_no_version_route_keeps_token_in_and_templated_calls_never_probe(
        upstream: ScriptedEngine, client: VLLMClient) -> None:
    fx = load("vllm_chat_reasoning.json")
    upstream.reply(CHAT, fx)
    await client.generate(ChatRequest(messages=USER))
    assert upstream.version_gets == 0
    await client.generate(ChatRequest(messages=USER, prompt_ids=fx["prompt_token_ids"]))  # 404: not vLLM's server
    assert upstream.version_gets == 1 and client.token_in is True and client.served_version is None
    assert upstream.bodies[1]["kv_transfer_params"] == {"prompt_token_ids": fx["prompt_token_ids"]}


@pytest.mark.parametrize("version, parsed, token_in", [
    ("0.25.1", (0, 25, 1), False), ("0.31.9", (0, 31, 9), False), ("0.32.0", (0, 32, 0), True),
    ("0.32.0rc1.dev5+g1a2b3c", (0, 32, 0), True), ("v0.33", (0, 33), True), ("1.0.0", (1, 0, 0), True),
    ("unknown", None, True),
])
def test_served_version_decides_token_in(version: str, parsed: tuple[int, ...] | None, token_in: bool) -> None:
    assert release(version) == parsed and reads_token_in(version) is token_in


async def test_token_in_ignored_by_engine_is_an_error(upstream: ScriptedEngine, client: VLLMClient) -> None:
    upstream.reply(CHAT, load("vllm_chat_reasoning.json"))
    with pytest.raises(EngineProtocolError, match="ignored token-in"):
        await client.generate(ChatRequest(messages=USER, prompt_ids=[248045, 846, 198, 1, 2, 3]))


async def test_client_extra_body_and_forced_flags(upstream: ScriptedEngine) -> None:
    upstream.reply(CHAT, load("vllm_chat_reasoning.json"))
    defaults = {"top_k": -1, "logprobs": False}
    c = VLLMClient(upstream.url + "/", MODEL, extra_body=defaults, logprobs_mode="raw")
    try:
        req = ChatRequest(
            messages=USER,
            extra_body={"top_k": 5, "stream": True, "return_token_ids": False, "model": "other"},
        )
        gen = await c.generate(req)
    finally:
        await c.aclose()
    body = upstream.bodies[0]
    assert body["top_k"] == 5  # request extra_body wins over the client default
    assert body["stream"] is False and body["return_token_ids"] is True and body["logprobs"] is True
    assert body["model"] == MODEL
    assert gen.logprobs_mode == "raw"


async def test_reasoning_content_fallback_and_int_stop_reason(upstream: ScriptedEngine, client: VLLMClient) -> None:
    fx = load("vllm_chat_reasoning.json")
    msg = fx["choices"][0]["message"]
    msg["reasoning_content"] = msg.pop("reasoning")
    fx["choices"][0]["stop_reason"] = 248044  # secondary EOS <|endoftext|>
    fx["choices"][0]["token_ids"][-1] = 248044
    upstream.reply(CHAT, fx)
    gen = await client.generate(ChatRequest(messages=USER))
    assert gen.message.reasoning == "Simple arithmetic."
    assert gen.stop_reason == 248044


# ---- typed errors -------------------------------------------------------------------------------


async def test_http_500_carries_engine_message_and_status(upstream: ScriptedEngine, client: VLLMClient) -> None:
    upstream.reply(CHAT, load("vllm_error.json"), status=500)
    with pytest.raises(EngineHTTPError) as info:
        await client.generate(ChatRequest(messages=USER))
    err = info.value
    assert err.status == 500
    assert err.message.startswith("This model's maximum context length is 2048 tokens")
    assert err.engine == "vllm" and err.url == upstream.url + CHAT


async def test_malformed_json_is_protocol_error(upstream: ScriptedEngine, client: VLLMClient) -> None:
    upstream.reply(CHAT, b'{"choices": [')
    with pytest.raises(EngineProtocolError, match="malformed JSON"):
        await client.generate(ChatRequest(messages=USER))


async def test_connection_refused_is_unavailable() -> None:
    c = VLLMClient(f"http://127.0.0.1:{closed_port()}", MODEL)
    try:
        with pytest.raises(EngineUnavailable):
            await c.generate(ChatRequest(messages=USER))
    finally:
        await c.aclose()


async def test_slow_engine_times_out(upstream: ScriptedEngine) -> None:
    upstream.reply(CHAT, load("vllm_chat_reasoning.json"))
    upstream.hang_paths.add(CHAT)
    c = VLLMClient(upstream.url, MODEL, timeout_s=0.2)
    try:
        with pytest.raises(EngineTimeout):
            await c.generate(ChatRequest(messages=USER))
    finally:
        await c.aclose()


async def test_null_token_ids_explain_the_fix(upstream: ScriptedEngine, client: VLLMClient) -> None:
    upstream.reply(CHAT, load("vllm_chat_token_ids_null.json"))
    with pytest.raises(EngineProtocolError) as info:
        await client.generate(ChatRequest(messages=USER))
    text = str(info.value)
    assert "return_token_ids" in text and "0.10.2" in text and "include_reasoning" in text
    assert "prompt_token_ids" in text and "choices[0].token_ids" in text


def _mutated(fn: Any) -> dict[str, Any]:
    fx = copy.deepcopy(load("vllm_chat_reasoning.json"))
    fn(fx)
    return fx


@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        (lambda fx: fx["choices"][0]["logprobs"]["content"].pop(), "misaligned: 8 logprobs for 9"),
        (lambda fx: fx["choices"][0]["token_ids"].append(198), "misaligned: 9 logprobs for 10"),
        (lambda fx: fx["choices"][0].update(logprobs=None), "no logprobs"),
        (
            lambda fx: fx["choices"][0]["logprobs"]["content"][2].pop("logprob"),
            r"content\[2\] has no numeric",
        ),
        (lambda fx: fx.update(choices=[]), "no choices"),
        (lambda fx: fx.pop("prompt_token_ids"), "prompt_token_ids null, missing"),
        (lambda fx: fx["choices"][0].update(finish_reason=None), "no finish_reason"),
        (lambda fx: fx["choices"][0]["token_ids"].__setitem__(0, "x"), "ill-typed"),
    ],
)
async def test_unusable_bodies_are_protocol_errors(
    upstream: ScriptedEngine, client: VLLMClient, mutate: Any, match: str
) -> None:
    upstream.reply(CHAT, _mutated(mutate))
    with pytest.raises(EngineProtocolError, match=match) as info:
        await client.generate(ChatRequest(messages=USER))
    assert info.value.engine == "vllm"


# ---- session ownership --------------------------------------------------------------------------


def test_constructing_outside_a_loop_is_fine() -> None:
    c: EngineClient = VLLMClient("http://127.0.0.1:1", MODEL)  # also a static protocol check
    assert c.name == "vllm"
    assert isinstance(c, VLLMClient) and c._session is None  # created on first use, inside the loop


async def test_borrowed_session_is_not_closed(upstream: ScriptedEngine) -> None:
    upstream.reply(CHAT, load("vllm_chat_reasoning.json"))
    async with aiohttp.ClientSession() as session:
        c = VLLMClient(upstream.url, MODEL, session=session)
        await c.generate(ChatRequest(messages=USER))
        await c.aclose()
        assert not session.closed


async def test_owned_session_is_closed(upstream: ScriptedEngine) -> None:
    upstream.reply(CHAT, load("vllm_chat_reasoning.json"))
    c = VLLMClient(upstream.url, MODEL)
    await c.generate(ChatRequest(messages=USER))
    session = c._session
    await c.aclose()
    assert session is not None and session.closed


# ---- the typed fast path gives exactly what the validated path gives -----------------------------


def _outcome(fn: Any) -> Any:
    try:
        return fn().model_dump()
    except EngineProtocolError as exc:
        return ("error", str(exc))


@pytest.mark.parametrize(
    "mutate",
    [
        lambda fx: None,
        lambda fx: fx["choices"][0].update(stop_reason=151645),
        lambda fx: fx["choices"][0].update(stop_reason="</tool_call>"),
        lambda fx: fx["choices"][0]["logprobs"]["content"][0].update(logprob=-1),  # an int logprob
        lambda fx: fx["choices"][0]["message"].update(reasoning=None, reasoning_content="why"),
        lambda fx: fx.update(model=None),
        lambda fx: fx["choices"][0]["token_ids"].__setitem__(0, 5.0),  # pydantic's lax int
        lambda fx: fx["choices"][0]["token_ids"].__setitem__(0, True),
        lambda fx: fx["prompt_token_ids"].__setitem__(0, "7"),
        lambda fx: fx["prompt_token_ids"].__setitem__(0, -3),
        lambda fx: fx["choices"][0]["logprobs"]["content"][1].update(logprob="x"),
        lambda fx: fx["choices"][0]["logprobs"].update(content=None),
        lambda fx: fx["choices"][0].update(finish_reason=3),
        lambda fx: fx["choices"][0].update(message=None),
        lambda fx: fx["choices"][0]["message"].update(tool_calls={"not": "a list"}),
        lambda fx: fx.update(choices="none"),
    ],
)
def test_typed_decoding_matches_the_validated_parse(mutate: Any) -> None:
    from polar_env.engines.vllm import decode_chat_body

    client = VLLMClient("http://127.0.0.1:9", MODEL)
    raw = json.dumps(_mutated(mutate)).encode()
    for request in (ChatRequest(messages=USER), ChatRequest(messages=USER, prompt_ids=[1, 2, 3])):
        slow = _outcome(lambda r=request: client.parse(json.loads(raw), r))
        fast = _outcome(lambda r=request: client.parse_decoded(decode_chat_body(raw), r))
        assert fast == slow
    assert _outcome(lambda: client.parse_decoded(decode_chat_body(b"[1, 2]"), ChatRequest(messages=USER)))[0] == "error"


def test_a_token_id_past_64_bits_takes_the_orjson_path() -> None:
    import orjson

    from polar_env.engines.vllm import decode_chat_body

    raw = json.dumps(_mutated(lambda fx: fx["prompt_token_ids"].__setitem__(0, 2**70))).encode()
    decoded = decode_chat_body(raw)
    assert isinstance(decoded, dict)  # refused by the typed schema: handled exactly as before
    client = VLLMClient("http://127.0.0.1:9", MODEL)
    request = ChatRequest(messages=USER)
    assert _outcome(lambda: client.parse_decoded(decoded, request)) == _outcome(lambda: client.parse(orjson.loads(raw), request))


# ---- token-in: the echo is compared as the bytes sent, not decoded ------------------------------


async def test_token_in_echo_sent_back_byte_for_byte_is_not_decoded(upstream: ScriptedEngine, client: VLLMClient) -> None:
    """An engine that echoes the ids as sent (vLLM's compact JSON): the Generation carries the
    gateway's own list, and the payload still holds the ids as a plain JSON list."""
    import orjson

    fx = load("vllm_chat_reasoning.json")
    upstream.reply(CHAT, orjson.dumps(fx))
    prompt = list(fx["prompt_token_ids"])
    request = ChatRequest(messages=USER, prompt_ids=prompt)
    gen = await client.generate(request)
    assert upstream.bodies[0]["kv_transfer_params"]["prompt_token_ids"] == prompt
    assert gen.prompt_ids is request.prompt_ids  # the echo matched the bytes sent: not decoded


async def test_a_continuation_prompt_is_sent_as_the_json_it_carries(upstream: ScriptedEngine, client: VLLMClient) -> None:
    """A ``JsonIds`` prompt (the continuation's, extended by the delta) is sent as the JSON text
    it carries, not serialized again (that text is exact by construction: tests/test_tokenids.py)."""
    import orjson

    from polar_env.tokenids import JsonIds, joined_json

    fx = load("vllm_chat_reasoning.json")
    upstream.reply(CHAT, orjson.dumps(fx))
    prompt = JsonIds(fx["prompt_token_ids"])
    prompt.json = joined_json(orjson.dumps(fx["prompt_token_ids"][:-3]), fx["prompt_token_ids"][-3:])
    assert prompt.json == orjson.dumps(list(prompt))
    gen = await client.generate(ChatRequest(messages=USER).model_copy(update={"prompt_ids": prompt}))
    assert upstream.bodies[0]["kv_transfer_params"]["prompt_token_ids"] == prompt and gen.prompt_ids is prompt
    assert upstream.raw[0].count(prompt.json) == 1  # the carried text, as it is
    # the carried text, not a fresh serialization: a spaced one (the same ids) reaches the engine as
    # it is; the compact echo then differs from the bytes sent, so it is decoded and compared
    spaced = JsonIds(prompt)
    spaced.json = b"[" + b", ".join(str(i).encode() for i in prompt) + b"]"
    gen = await client.generate(ChatRequest(messages=USER).model_copy(update={"prompt_ids": spaced}))
    assert spaced.json in upstream.raw[1] and orjson.dumps(list(prompt)) not in upstream.raw[1]
    assert gen.prompt_ids == prompt


@pytest.mark.parametrize("echo", ["spaced", "other", "null", "missing", "past64", "decoy", "decoy-missing", "marker"])
def test_token_in_echo_that_differs_is_decoded_and_checked_as_before(echo: str) -> None:
    """Echoes other than the sent bytes, and bodies where the first key of that name is not the
    top-level echo (a nested ``prompt_token_ids`` holding the sent ids; the top level other,
    absent, or the cut marker itself), all get the full decode's verdict."""
    import orjson

    from polar_env.engines.vllm import decode_chat_body, decode_token_in

    fx = load("vllm_chat_reasoning.json")
    prompt = list(fx["prompt_token_ids"])
    if echo == "other":
        fx["prompt_token_ids"] = prompt[:-1] + [prompt[-1] + 1]
    elif echo == "null":
        fx["prompt_token_ids"] = None
    elif echo == "missing":
        del fx["prompt_token_ids"]
    elif echo == "past64":
        fx["prompt_token_ids"] = [2**70, *prompt[1:]]
    elif echo.startswith("decoy"):
        fx = {"decoy": {"prompt_token_ids": prompt}, **fx}  # found first, holds the sent ids
        if echo == "decoy":
            fx["prompt_token_ids"] = prompt[:-1] + [prompt[-1] + 1]
        else:
            del fx["prompt_token_ids"]
    elif echo == "marker":
        fx = {"decoy": {"prompt_token_ids": prompt}, **fx, "prompt_token_ids": "polar-env:cut"}
    raw = json.dumps(fx).encode() if echo in ("spaced", "past64") else orjson.dumps(fx)  # orjson: no 2**70
    client = VLLMClient("http://127.0.0.1:9", MODEL)
    request = ChatRequest(messages=USER, prompt_ids=prompt)
    sent = orjson.dumps(prompt)
    expected = _outcome(lambda: client.parse_decoded(decode_chat_body(raw), request))
    assert _outcome(lambda: client.parse_decoded(decode_token_in(raw, sent, prompt), request)) == expected
    assert isinstance(expected, tuple) == (echo != "spaced")  # ("error", message) or a Generation
    if echo.startswith("decoy"):
        assert orjson.dumps(fx).index(b'"prompt_token_ids":' + sent) < orjson.dumps(fx).index(b'"choices"')
