"""SGLangClient against real local HTTP servers (workers and a router) replaying SGLang 0.5.23 shapes.

Generate-mode tests come in two sets: ``test_generate_*`` swap in tiny fakes for the Qwen tokenizer,
template and parser (so they pin the wire contract alone), and ``test_generate_real_qwen_*`` use
``polar_env.chat`` for real.
"""

from __future__ import annotations

import asyncio
import copy
import json
import socket
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from fake_engines import MODEL, ScriptedEngine
from fake_engines import load_fixture as load

from polar_env.chat import chat_format
from polar_env.chat.qwen35.format import Qwen35Format
from polar_env.chat.qwen35.template import QWEN35
from polar_env.engines.base import EngineClient
from polar_env.engines.sglang import SGLangClient
from polar_env.errors import (
    ConfigError,
    EngineHTTPError,
    EngineProtocolError,
    EngineTimeout,
    EngineUnavailable,
)
from polar_env.records import AssistantMessage, ChatRequest, ToolCall

CHAT = "/v1/chat/completions"
GENERATE = "/generate"
USER = [{"role": "user", "content": "What is 2+2?"}]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]


@pytest.fixture
async def servers() -> AsyncIterator[Callable[[], Any]]:
    """Factory of started ScriptedEngines, all torn down at the end."""
    started: list[ScriptedEngine] = []

    async def make() -> ScriptedEngine:
        up = await ScriptedEngine().start()
        started.append(up)
        return up

    yield make
    for up in started:
        await up.close()


@pytest.fixture
async def worker(servers: Callable[[], Any]) -> ScriptedEngine:
    up: ScriptedEngine = await servers()
    return up


@pytest.fixture
async def closing() -> AsyncIterator[list[SGLangClient]]:
    clients: list[SGLangClient] = []
    yield clients
    for c in clients:
        await c.aclose()


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ---- construction and worker selection ----------------------------------------------------------


def test_needs_workers_or_router() -> None:
    with pytest.raises(ConfigError):
        SGLangClient()
    with pytest.raises(ConfigError):
        SGLangClient(["http://w"], mode="stream")  # type: ignore[arg-type]
    c: EngineClient = SGLangClient(["http://w1/", "http://w1"], MODEL)
    assert c.name == "sglang"


async def test_round_robin_without_session(servers: Any, closing: list[SGLangClient]) -> None:
    w1, w2 = await servers(), await servers()
    for w in (w1, w2):
        w.reply(CHAT, load("sglang_chat.json"))
    c = SGLangClient([w1.url, w2.url], MODEL)
    closing.append(c)
    for _ in range(4):
        await c.generate(ChatRequest(messages=USER))
    assert len(w1.requests) == 2 and len(w2.requests) == 2


async def test_session_affinity_is_stable_and_session_id_is_not_sent(
    servers: Any, closing: list[SGLangClient]
) -> None:
    workers = [await servers() for _ in range(3)]
    for w in workers:
        w.reply(CHAT, load("sglang_chat.json"))
    c = SGLangClient([w.url for w in workers], MODEL)
    closing.append(c)
    for _ in range(5):
        await c.generate(ChatRequest(messages=USER, extra_body={"session_id": "episode-42"}))
    hit = [w for w in workers if w.requests]
    assert len(hit) == 1 and len(hit[0].requests) == 5
    assert all("session_id" not in body for body in hit[0].bodies)
    assert c.router.home("episode-42") == hit[0].url
    for i in range(6):  # new sessions spread over the workers
        await c.generate(ChatRequest(messages=USER, extra_body={"session_id": f"s{i}"}))
    assert all(len(w.requests) >= 2 for w in workers)


@pytest.mark.parametrize(
    "shape",
    [
        lambda urls: urls,
        lambda urls: {"urls": urls},
        lambda urls: {"workers": [{"url": u, "model_id": MODEL, "is_healthy": True} for u in urls]},
    ],
    ids=["list", "urls", "workers"],
)
async def test_router_discovery_once_then_workers_directly(
    servers: Any, closing: list[SGLangClient], shape: Any
) -> None:
    router, w1, w2 = await servers(), await servers(), await servers()
    router.reply("/workers", shape([w2.url, w1.url + "/"]))
    for w in (w1, w2):
        w.reply(CHAT, load("sglang_chat.json"))
    c = SGLangClient(model=MODEL, router_url=router.url + "/")
    closing.append(c)
    await asyncio.gather(*(c.generate(ChatRequest(messages=USER)) for _ in range(4)))
    assert router.requests == [("GET", "/workers", None)]  # discovered once, never used for traffic
    assert len(w1.requests) == 2 and len(w2.requests) == 2
    assert await c.workers() == sorted([w1.url, w2.url])


async def test_router_without_workers_is_config_error(servers: Any, closing: list[SGLangClient]) -> None:
    router = await servers()
    router.reply("/workers", {"workers": []})
    c = SGLangClient(router_url=router.url)
    closing.append(c)
    with pytest.raises(ConfigError, match="lists no healthy workers"):
        await c.generate(ChatRequest(messages=USER))


async def test_unreachable_router_is_unavailable(closing: list[SGLangClient]) -> None:
    c = SGLangClient(router_url=f"http://127.0.0.1:{closed_port()}")
    closing.append(c)
    with pytest.raises(EngineUnavailable):
        await c.generate(ChatRequest(messages=USER))


# ---- chat mode -----------------------------------------------------------------------------------


async def test_chat_flags_and_parse(worker: ScriptedEngine, closing: list[SGLangClient]) -> None:
    fx = load("sglang_chat.json")
    worker.reply(CHAT, fx)
    c = SGLangClient([worker.url], MODEL)
    closing.append(c)
    req = ChatRequest(
        model="gpt-4o",
        messages=USER,
        temperature=1.0,
        max_tokens=32,
        chat_template_kwargs={"enable_thinking": True},
        extra_body={"top_k": 20, "stream": True},
    )
    gen = await c.generate(req)
    (method, path, body), = worker.requests
    assert (method, path) == ("POST", CHAT)
    assert body["logprobs"] is True and body["top_logprobs"] == 0 and body["return_token_ids"] is True
    assert body["stream"] is False and body["model"] == MODEL and body["top_k"] == 20
    assert body["max_tokens"] == 32 and body["chat_template_kwargs"] == {"enable_thinking": True}
    assert "input_ids" not in body and "tools" not in body

    choice = fx["choices"][0]
    assert gen.prompt_ids == choice["prompt_token_ids"]
    assert gen.response_ids == choice["response_token_ids"]
    assert gen.response_logprobs == [e["logprob"] for e in choice["logprobs"]["content"]]
    assert gen.message == AssistantMessage(content="4.", reasoning="Simple arithmetic.")
    assert (gen.finish_reason, gen.stop_reason) == ("stop", 248046)
    assert (gen.engine, gen.model, gen.weight_version) == ("sglang", MODEL, None)


async def test_chat_tool_call_and_token_in(worker: ScriptedEngine, closing: list[SGLangClient]) -> None:
    fx = load("sglang_chat_tool_call.json")
    worker.reply(CHAT, fx)
    c = SGLangClient([worker.url], MODEL)
    closing.append(c)
    prompt = fx["choices"][0]["prompt_token_ids"]
    gen = await c.generate(ChatRequest(messages=USER, tools=TOOLS, tool_choice="auto", prompt_ids=prompt))
    body = worker.bodies[0]
    assert body["input_ids"] == prompt and body["tools"] == TOOLS and body["tool_choice"] == "auto"
    assert gen.finish_reason == "tool_calls" and gen.stop_reason is None
    assert gen.message.tool_calls == [
        ToolCall(id="call_f2b6c1d8e9a04b7f", name="get_weather", arguments='{"city": "Paris"}')
    ]
    assert gen.message.reasoning == "Need weather." and gen.message.content is None


async def test_chat_token_in_ignored_is_error(worker: ScriptedEngine, closing: list[SGLangClient]) -> None:
    worker.reply(CHAT, load("sglang_chat.json"))
    c = SGLangClient([worker.url], MODEL)
    closing.append(c)
    with pytest.raises(EngineProtocolError, match="ignored token-in"):
        await c.generate(ChatRequest(messages=USER, prompt_ids=[1, 2, 3]))


def _chat_mutated(fn: Any) -> dict[str, Any]:
    fx = copy.deepcopy(load("sglang_chat.json"))
    fn(fx)
    return fx


@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        (lambda fx: fx["choices"][0].pop("response_token_ids"), "response_token_ids null, missing"),
        (lambda fx: fx["choices"][0].update(prompt_token_ids=None), "return_token_ids"),
        (lambda fx: fx["choices"][0]["logprobs"]["content"].pop(), "misaligned: 8 logprobs for 9"),
        (lambda fx: fx["choices"][0].update(logprobs=None), "no logprobs"),
        (lambda fx: fx.update(choices=[]), "no choices"),
    ],
)
async def test_chat_unusable_bodies(
    worker: ScriptedEngine, closing: list[SGLangClient], mutate: Any, match: str
) -> None:
    worker.reply(CHAT, _chat_mutated(mutate))
    c = SGLangClient([worker.url], MODEL)
    closing.append(c)
    with pytest.raises(EngineProtocolError, match=match) as info:
        await c.generate(ChatRequest(messages=USER))
    assert info.value.engine == "sglang" and info.value.url == worker.url + CHAT


async def test_http_error_carries_engine_message(worker: ScriptedEngine, closing: list[SGLangClient]) -> None:
    worker.reply(CHAT, load("sglang_error.json"), status=400)
    c = SGLangClient([worker.url], MODEL)
    closing.append(c)
    with pytest.raises(EngineHTTPError) as info:
        await c.generate(ChatRequest(messages=USER))
    assert info.value.status == 400
    assert "maximum context length of 2048" in info.value.message


async def test_transport_errors(worker: ScriptedEngine, closing: list[SGLangClient]) -> None:
    worker.reply(CHAT, b"<html>502 Bad Gateway")
    c = SGLangClient([worker.url], MODEL)
    closing.append(c)
    with pytest.raises(EngineProtocolError, match="malformed JSON"):
        await c.generate(ChatRequest(messages=USER))

    dead = SGLangClient([f"http://127.0.0.1:{closed_port()}"], MODEL)
    closing.append(dead)
    with pytest.raises(EngineUnavailable):
        await dead.generate(ChatRequest(messages=USER))

    worker.reply(CHAT, load("sglang_chat.json"))
    worker.hang_paths.add(CHAT)
    slow = SGLangClient([worker.url], MODEL, timeout_s=0.2)
    closing.append(slow)
    with pytest.raises(EngineTimeout):
        await slow.generate(ChatRequest(messages=USER))


# ---- generate mode with fake Qwen modules --------------------------------------------------------

# Prompt of sglang_generate_*.json: ...<|im_start|>assistant\n<think>\n (thinking on).
PROMPT_THINKING = [
    248045, 846, 198, 3838, 374, 220, 17, 10, 17, 30, 248046, 198, 248045, 74455, 198, 248068, 198,
]
PROMPT_NO_THINKING = [*PROMPT_THINKING[:-2], 248068, 271, 248069, 271]
VOCAB = {50438: "Simple", 34784: " arithmetic", 13: ".", 198: "\n", 248069: "</think>", 271: "\n\n", 19: "4",
         248046: "<|im_end|>", 248044: "<|endoftext|>", 248058: "<tool_call>", 248059: "</tool_call>"}


class FakeQwen(Qwen35Format):
    """A test double of the Qwen3.5 ChatFormat: its tokenizer, render and parse are fakes that record
    how they were called; its ids and ``opens_thinking`` are the real family's."""

    def __init__(self, prompt: list[int]) -> None:
        super().__init__("qwen3.5", QWEN35)
        self.prompt = prompt
        self.rendered: list[tuple[Any, Any, dict[str, Any]]] = []
        self.parsed: list[tuple[str, bool]] = []

    def encode(self, text: str) -> list[int]:
        return list(self.prompt)

    def decode(self, ids: list[int]) -> str:
        return "".join(VOCAB[i] for i in ids)

    @property
    def tokenizer(self) -> Any:
        return self

    def render(self, messages: Any, tools: Any = None, **kw: Any) -> str:  # type: ignore[override]
        self.rendered.append((messages, tools, kw))
        return "<rendered>"

    def parse(self, text: str, *, tools: Any, thinking: bool) -> AssistantMessage:
        self.parsed.append((text, thinking))
        reasoning, _, content = text.partition("</think>") if thinking else ("", "", text)
        calls = []
        if "<tool_call>" in text:
            calls = [ToolCall(id="call_0", name="get_weather", arguments='{"city":"Paris"}')]
        return AssistantMessage(
            content=content.strip() or None, reasoning=reasoning.strip() or None, tool_calls=calls
        )


@pytest.fixture
def fake_qwen(monkeypatch: pytest.MonkeyPatch) -> FakeQwen:
    fake = FakeQwen(PROMPT_THINKING)
    monkeypatch.setattr("polar_env.engines.sglang.chat_format", lambda template: fake)
    return fake


def gen_client(worker: ScriptedEngine, closing: list[SGLangClient]) -> SGLangClient:
    c = SGLangClient([worker.url], MODEL, mode="generate")
    closing.append(c)
    return c


async def test_generate_request_body(
    worker: ScriptedEngine, closing: list[SGLangClient], fake_qwen: FakeQwen
) -> None:
    worker.reply(GENERATE, load("sglang_generate_stop.json"))
    req = ChatRequest(
        messages=USER,
        tools=TOOLS,
        temperature=0.6,
        top_p=0.95,
        max_tokens=128,
        stop=["</answer>"],
        seed=3,
        chat_template_kwargs={"enable_thinking": True},
        extra_body={"session_id": "ep-1", "rid": "r-1", "sampling_params": {"top_k": 20}},
    )
    await gen_client(worker, closing).generate(req)
    (method, path, body), = worker.requests
    assert (method, path) == ("POST", GENERATE)
    assert body["input_ids"] == PROMPT_THINKING
    assert body["sampling_params"] == {
        "max_new_tokens": 128, "temperature": 0.6, "top_p": 0.95, "stop": ["</answer>"], "sampling_seed": 3,
        "top_k": 20, "skip_special_tokens": False, "no_stop_trim": True,
    }
    assert body["return_logprob"] is True and body["logprob_start_len"] == -1 and body["rid"] == "r-1"
    assert "messages" not in body and "session_id" not in body
    assert fake_qwen.rendered == [(USER, TOOLS, {"enable_thinking": True})]


async def test_generate_stop_parse(
    worker: ScriptedEngine, closing: list[SGLangClient], fake_qwen: FakeQwen
) -> None:
    fx = load("sglang_generate_stop.json")
    worker.reply(GENERATE, fx)
    gen = await gen_client(worker, closing).generate(ChatRequest(messages=USER))
    assert gen.prompt_ids == PROMPT_THINKING
    assert gen.response_ids == fx["output_ids"]
    assert gen.response_logprobs == [t[0] for t in fx["meta_info"]["output_token_logprobs"]]
    assert (gen.finish_reason, gen.stop_reason, gen.weight_version) == ("stop", 248046, "17")
    assert (gen.engine, gen.model) == ("sglang", MODEL)
    # The trailing EOS is not decoded; the prompt opened <think>, so the parser starts in reasoning.
    assert fake_qwen.parsed == [("Simple arithmetic.\n</think>\n\n4.", True)]
    assert gen.message == AssistantMessage(content="4.", reasoning="Simple arithmetic.")


async def test_generate_token_in_skips_render(
    worker: ScriptedEngine, closing: list[SGLangClient], fake_qwen: FakeQwen
) -> None:
    worker.reply(GENERATE, load("sglang_generate_stop.json"))
    req = ChatRequest(messages=USER, prompt_ids=PROMPT_NO_THINKING)
    gen = await gen_client(worker, closing).generate(req)
    assert worker.bodies[0]["input_ids"] == PROMPT_NO_THINKING
    assert fake_qwen.rendered == []
    assert fake_qwen.parsed[0][1] is False  # the prompt closed the think block itself
    assert gen.prompt_ids == PROMPT_NO_THINKING


async def test_generate_length_and_stop_string(
    worker: ScriptedEngine, closing: list[SGLangClient], fake_qwen: FakeQwen
) -> None:
    c = gen_client(worker, closing)
    worker.reply(GENERATE, load("sglang_generate_length.json"))
    gen = await c.generate(ChatRequest(messages=USER, max_tokens=6))
    assert (gen.finish_reason, gen.stop_reason, len(gen.response_ids)) == ("length", None, 6)

    worker.reply(GENERATE, load("sglang_generate_stop_str.json"))
    gen = await c.generate(ChatRequest(messages=USER, stop=["."]))
    assert (gen.finish_reason, gen.stop_reason) == ("stop", ".")
    assert gen.response_ids[-1] == 13  # the stop string's ids stay sampled...
    assert fake_qwen.parsed[-1][0] == "Simple arithmetic.\n</think>\n\n4"  # ...but not in the content


async def test_generate_tool_calls_finish(
    worker: ScriptedEngine, closing: list[SGLangClient], fake_qwen: FakeQwen
) -> None:
    ids = [248069, 271, 248058, 248059, 248046]
    fx = load("sglang_generate_stop.json")
    fx["output_ids"] = ids
    fx["meta_info"]["output_token_logprobs"] = [[-0.1, i, None] for i in ids]
    worker.reply(GENERATE, fx)
    gen = await gen_client(worker, closing).generate(ChatRequest(messages=USER, tools=TOOLS))
    assert gen.finish_reason == "tool_calls" and gen.stop_reason == 248046
    assert gen.message.tool_calls[0].name == "get_weather"


async def test_generate_abort_is_protocol_error(
    worker: ScriptedEngine, closing: list[SGLangClient], fake_qwen: FakeQwen
) -> None:
    worker.reply(GENERATE, load("sglang_generate_abort.json"))
    with pytest.raises(EngineProtocolError, match="aborted the request: Abort in waiting queue"):
        await gen_client(worker, closing).generate(ChatRequest(messages=USER))


def _gen_mutated(fn: Any) -> dict[str, Any]:
    fx = copy.deepcopy(load("sglang_generate_stop.json"))
    fn(fx)
    return fx


@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        (
            lambda fx: fx["meta_info"]["output_token_logprobs"][3].__setitem__(1, 199),
            "misaligned at position 3",
        ),
        (lambda fx: fx["meta_info"]["output_token_logprobs"].pop(), "misaligned: 8 logprobs for 9"),
        (lambda fx: fx["meta_info"].pop("output_token_logprobs"), "return_logprob"),
        (lambda fx: fx.update(output_ids=None), "no output_ids"),
        (lambda fx: fx["meta_info"].update(finish_reason=None), "finish_reason missing"),
        (lambda fx: fx.pop("meta_info"), "no meta_info"),
        (lambda fx: fx["meta_info"]["output_token_logprobs"][0].__setitem__(0, None), "no numeric logprob"),
    ],
)
async def test_generate_unusable_bodies(
    worker: ScriptedEngine, closing: list[SGLangClient], fake_qwen: FakeQwen, mutate: Any, match: str
) -> None:
    worker.reply(GENERATE, _gen_mutated(mutate))
    with pytest.raises(EngineProtocolError, match=match):
        await gen_client(worker, closing).generate(ChatRequest(messages=USER))


def test_opens_think() -> None:
    opens_think = chat_format("qwen3.5").opens_thinking
    assert opens_think(PROMPT_THINKING) is True
    assert opens_think(PROMPT_NO_THINKING) is False
    assert opens_think([248045, 74455, 198]) is False
    # A closed think block in an *earlier* turn does not count; only the last turn matters.
    assert opens_think([248045, 248068, 248069, 248046, 248045, 74455, 198, 248068, 198]) is True


# ---- generate mode with the real polar_env.chat.qwen35 modules ------------------------------------------


def _generate_reply(output_ids: list[int]) -> dict[str, Any]:
    return {
        "text": "",
        "output_ids": output_ids,
        "meta_info": {
            "id": "real",
            "finish_reason": {"type": "stop", "matched": 248046},
            "weight_version": "3",
            "output_token_logprobs": [[-0.25, i, None] for i in output_ids],
        },
    }


async def test_generate_real_qwen_tool_call(worker: ScriptedEngine, closing: list[SGLangClient]) -> None:
    from polar_env.chat.qwen35.template import render
    from polar_env.chat.qwen35.tokenizer import load_tokenizer

    tok = load_tokenizer()
    sampled = (
        "The user wants the weather.\n</think>\n\n<tool_call>\n<function=get_weather>\n"
        "<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>"
    )
    output_ids = [*tok.encode(sampled), 248046]
    worker.reply(GENERATE, _generate_reply(output_ids))
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    req = ChatRequest(messages=messages, tools=TOOLS, max_tokens=256)
    gen = await gen_client(worker, closing).generate(req)

    sent = worker.bodies[0]["input_ids"]
    assert sent == tok.encode(render(messages, TOOLS, add_generation_prompt=True, enable_thinking=True))
    assert sent[-2:] == [248068, 198]  # generation prompt ends "<think>\n"
    assert gen.prompt_ids == sent and gen.response_ids == output_ids
    assert gen.finish_reason == "tool_calls" and gen.weight_version == "3"
    (call,) = gen.message.tool_calls
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
    assert gen.message.reasoning is not None and "weather" in gen.message.reasoning


async def test_generate_real_qwen_no_thinking(worker: ScriptedEngine, closing: list[SGLangClient]) -> None:
    from polar_env.chat.qwen35.tokenizer import load_tokenizer

    tok = load_tokenizer()
    output_ids = [*tok.encode("Four."), 248046]
    worker.reply(GENERATE, _generate_reply(output_ids))
    req = ChatRequest(messages=USER, chat_template_kwargs={"enable_thinking": False}, max_tokens=16)
    gen = await gen_client(worker, closing).generate(req)
    assert 248069 in worker.bodies[0]["input_ids"][-4:]  # "<think>\n\n</think>\n\n" generation prompt
    assert gen.message.content == "Four." and not gen.message.reasoning
    assert gen.finish_reason == "stop"
