"""Canonical mode's delta decoding (``proxy/echoes.py``, ``tokenids.echoed_ids``,
``engines/vllm.decode_canonical``) gives exactly what a whole decode gives: the same ids, at every
boundary, for every chat family's real renders; and its journal references are the ones the
journal's own whole-context prefix check finds, so the lines are byte-identical."""

from __future__ import annotations

import asyncio
import copy
import pickle
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web

from polar_env.chat import chat_format
from polar_env.engines.vllm import VLLMClient, decode_canonical, decode_chat_body
from polar_env.journal.format import Decoder, Encoder, PromptRef
from polar_env.journal.store import JournalStore
from polar_env.proxy.config import GatewayConfig
from polar_env.proxy.echoes import EchoTip, context_ref, extending_ref, journal_ref
from polar_env.proxy.gateway import Gateway
from polar_env.records import AssistantMessage, ChatRequest, CompletionRecord, ProviderAPI, Timings
from polar_env.tokenids import EchoIds, JsonIds, echoed_ids

KEY = b'"prompt_token_ids":'


def anchor_of(ids: list[int], json: bytes | None = None) -> JsonIds:
    out = JsonIds(ids)
    out.json = orjson.dumps(ids) if json is None else json
    return out


def whole(raw: bytes, start: int) -> list[int] | None:
    """The reference: the array at ``start`` decoded whole, None unless a flat array of ids."""
    end = raw.find(b"]", start) + 1
    try:
        value = orjson.loads(raw[start:end]) if end else None
    except orjson.JSONDecodeError:
        return None
    if not isinstance(value, list) or not all(type(i) is int and 0 <= i < 2**63 for i in value):
        return None
    return value


# (anchor ids, the anchor's bytes if not orjson's, the echo's array bytes); each a boundary
CASES = [
    ([1, 2, 3], None, b"[1,2,3,4,5]"),  # extends
    ([1, 2, 3], None, b"[1,2,3]"),  # the same prompt again: the anchor's closing bracket
    ([1, 2, 3], None, b"[1,2,34]"),  # the anchor's last id is a prefix of the echo's digits
    ([1, 2, 3], None, b"[1,2,3 ,4]"),  # space after the shared head: whole decode
    ([1, 2, 34], None, b"[1,2,3]"),  # the echo is shorter than the anchor
    ([1, 2, 3], None, b"[1,2]"),
    ([1, 2, 3], None, b"[9,2,3,4]"),  # history rewritten at its start
    ([1, 2, 3], None, b"[1,2,5,4]"),  # rewritten in the middle
    ([], None, b"[7,8]"),  # empty anchor
    ([1], None, b"[]"),  # empty echo
    ([1, 2], b"[1, 2]", b"[1, 2, 3]"),  # another serializer's spacing, consistent
    ([1, 2], b"[1, 2]", b"[1,2,3]"),  # inconsistent spacing: whole decode, same ids
    ([1, 2, 3], None, b"[1,2,3,[4]]"),  # not a flat array
    ([1, 2, 3], None, b"[1,2,3,-4]"),  # not an id
    ([1, 2, 3], None, b"[1,2,3,4.0]"),
    ([1, 2, 3], None, b"[1,2,3,9223372036854775808]"),  # past 64 bits
    ([1, 2, 3], None, b"[1,2,3,true]"),
    ([1, 2, 3], None, b'[1,2,3,"4"]'),
    ([1, 2, 3], None, b"[1,2,3,4"),  # truncated
    ([1, 2, 3], None, b"null"),
    ([0, 248046, 10**6], None, b"[0,248046,1000000,151643,0]"),
]


@pytest.mark.parametrize(("anchor", "anchor_json", "echo"), CASES)
def test_echoed_ids_equal_a_whole_decode_at_every_boundary(anchor: list[int], anchor_json: bytes | None, echo: bytes) -> None:
    raw = b'{"a":1,' + KEY + echo + b',"z":[5]}'
    start = raw.index(KEY) + len(KEY)
    base = anchor_of(anchor, anchor_json)
    expected = whole(raw, start)
    got = echoed_ids(raw, start, base)
    if expected is None:
        assert got is None
        return
    assert got is not None
    ids, end = got
    assert list(ids) == expected and type(ids) is EchoIds
    assert ids.json == raw[start:end] == echo and raw[end:] == b',"z":[5]}'
    # the head taken from the anchor is the anchor's ids, and (one serializer's bytes) all of the
    # ids the two share, so only the ids after it were decoded
    common = next((i for i, (x, y) in enumerate(zip(anchor, expected, strict=False)) if x != y), min(len(anchor), len(expected)))
    if ids.base is not None:
        assert ids.base() is base and 0 < ids.shared <= len(anchor) and expected[:ids.shared] == anchor[:ids.shared]
    if anchor_json is None and echo == orjson.dumps(expected):
        assert (ids.shared, ids.base is not None) == (common, common > 0)
    assert echoed_ids(raw, start, None) is not None and list(echoed_ids(raw, start, None)[0]) == expected  # type: ignore[index]


def test_echoed_ids_pickle_and_copy_as_plain_lists() -> None:
    raw = b'{"p":[1,2,3,4]}'
    ids, _ = echoed_ids(raw, 5, anchor_of([1, 2, 3]))  # type: ignore[misc]
    assert ids.base is not None
    for copied in (pickle.loads(pickle.dumps(ids)), copy.deepcopy(ids), copy.copy(ids)):
        assert type(copied) is list and copied == [1, 2, 3, 4]


def vllm_reply(prompt: list[int], prompt_json: bytes | None = None, *, decoy: bool = False) -> bytes:
    """A vLLM chat reply body; ``decoy``: a message field of the same key name comes first."""
    content = {"prompt_token_ids": [9, 9]} if decoy else "ok"
    head = orjson.dumps({"id": "c", "object": "chat.completion", "model": "m",
                         "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok", "extra": content},
                                      "logprobs": {"content": [{"token": "a", "logprob": -0.5}, {"token": "b", "logprob": -1.0}]},
                                      "token_ids": [11, 12], "finish_reason": "stop"}]})
    echo = orjson.dumps(prompt) if prompt_json is None else prompt_json
    return head[:-1] + b"," + KEY + echo + b',"usage":{"prompt_tokens":1}}'


@pytest.mark.parametrize("decoy", [False, True])
def test_decode_canonical_is_the_whole_decode(decoy: bool) -> None:
    prompts = [[1, 2, 3], [1, 2, 3, 11, 12, 4], [1, 2, 3, 11, 12, 4, 11, 5], [1, 2, 7], [1, 2, 7]]
    anchor: JsonIds | None = None
    for prompt in prompts:
        raw = vllm_reply(prompt, decoy=decoy)
        got, ref = decode_canonical(raw, anchor), decode_chat_body(raw)
        assert got.prompt_token_ids == ref.prompt_token_ids == prompt  # type: ignore[attr-defined]
        assert got.choices[0].token_ids == ref.choices[0].token_ids  # type: ignore[attr-defined]
        assert type(got.prompt_token_ids) is EchoIds  # type: ignore[attr-defined]
        anchor = got.prompt_token_ids  # type: ignore[attr-defined]


def record(seq: int, prompt: list[int], response: list[int], messages: list[dict[str, Any]]) -> CompletionRecord:
    return CompletionRecord.model_construct(
        message=AssistantMessage(content="ok"), prompt_ids=prompt, response_ids=response,
        response_logprobs=[-0.5] * len(response), finish_reason="stop", stop_reason=None, model="m", engine="vllm",
        weight_version=None, logprobs_mode="processed", session_id="s", seq=seq,
        provider_api=ProviderAPI.OPENAI_CHAT, provider_request={"messages": messages},
        chat_request=ChatRequest(messages=messages), timings=Timings(received_at=0.0, engine_ms=1.0, total_ms=2.0),
        notes=[])


# Conversations with the boundaries templates treat specially: reasoning (Qwen3 drops it from
# earlier turns), tool calls and results, an empty assistant content, non-ASCII text, a system
# prompt, and a compaction that rewrites the history.
TOOLS = [{"type": "function", "function": {"name": "bash", "description": "Run a command.",
                                           "parameters": {"type": "object", "properties": {"command": {"type": "string"}},
                                                          "required": ["command"]}}}]


def turns() -> list[tuple[dict[str, Any], list[dict[str, Any]]]]:
    """(the assistant reply, the messages the harness adds after it), in order."""
    call = {"id": "c1", "type": "function", "function": {"name": "bash", "arguments": '{"command":"ls -la"}'}}
    return [
        ({"role": "assistant", "content": "", "reasoning_content": "List first.", "tool_calls": [call]},
         [{"role": "tool", "tool_call_id": "c1", "content": "a.py\nb.py — ünïcode ✓"}]),
        ({"role": "assistant", "content": "Two files.",
          "tool_calls": [{**call, "id": "c2", "function": {"name": "bash", "arguments": '{"command":"cat a.py"}'}}]},
         [{"role": "tool", "tool_call_id": "c2", "content": "print('hi')\n"}]),
        ({"role": "assistant", "content": "It prints hi."}, [{"role": "user", "content": "Now run it."}]),
        ({"role": "assistant", "content": "Done.", "reasoning_content": "Ran it."}, [{"role": "user", "content": "Thanks\n\n"}]),
    ]


def family_prompts(template: str, thinking: bool) -> list[list[int]]:
    """Each call's prompt as the engine renders it (the published template, whole history),
    for one session that grows turn by turn, then is compacted and grows again."""
    fmt = chat_format(template)
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You are terse."},
                                      {"role": "user", "content": "What is in this folder?"}]
    prompts = []

    def render() -> None:
        prompts.append(list(fmt.tokenizer.encode(fmt.render(messages, TOOLS, enable_thinking=thinking))))

    render()
    for i, (reply, added) in enumerate(turns()):
        messages += [reply, *added]
        render()
        if i == 1:  # a compaction: the history is summarised, then the session goes on
            messages = [messages[0], {"role": "user", "content": "Summary: two files, a.py prints hi."}]
            render()
    return prompts


def available(template: str) -> bool:
    try:
        chat_format(template).tokenizer  # noqa: B018 - loads it
    except Exception:  # noqa: BLE001 - an optional family (the smollm2 extra) not installed here
        return False
    return True


@pytest.mark.parametrize("thinking", [True, False])
@pytest.mark.parametrize("template", ["qwen3.5", "append_only", "qwen3", "smollm2"])
def test_every_family_decodes_and_journals_as_a_whole_decode(template: str, thinking: bool) -> None:
    if not available(template):
        pytest.skip(f"template {template} not installed here")
    prompts = family_prompts(template, thinking)
    response = [11, 12, 13]
    tip: EchoTip | None = None
    with_refs, without = Encoder(), Encoder()
    decoder = Decoder()
    extended = 0
    for seq, prompt in enumerate(prompts):
        raw = vllm_reply(prompt)
        got = decode_canonical(raw, tip.anchor() if tip is not None else None)
        ids = got.prompt_token_ids  # type: ignore[attr-defined]
        assert ids == decode_chat_body(raw).prompt_token_ids == prompt  # type: ignore[attr-defined]
        ref: PromptRef | None = None
        if tip is not None:
            ref = extending_ref(tip, ids)
            if ref is not None:
                extended += 1
                assert ref == context_ref(tip, ids)  # O(new) finds what the whole comparison finds
            else:
                ref = context_ref(tip, ids)
        rec = record(seq, ids, response, [{"role": "user", "content": str(seq)}])
        line, token = with_refs.encode(rec, ref)
        with_refs.commit(token)
        plain, token = without.encode(rec)
        without.commit(token)
        assert line == plain  # the journal's own prefix check writes the same line
        assert decoder.decode(orjson.loads(line)).prompt_ids == prompt
        tip = EchoTip(seq, ids, response)
    assert extended >= 3  # the delta path ran (every family appends a turn after a tool result)


def test_journal_ref_compares_the_whole_context_only_when_the_prompt_does_not_extend() -> None:
    first = decode_canonical(vllm_reply([1, 2, 3]), None).prompt_token_ids  # type: ignore[attr-defined]
    tip = EchoTip(0, first, [4, 5])
    extending = decode_canonical(vllm_reply([1, 2, 3, 4, 9]), first).prompt_token_ids  # type: ignore[attr-defined]
    assert asyncio.run(journal_ref(tip, extending)) == PromptRef(0, 4, extending)
    rewritten = decode_canonical(vllm_reply([1, 2, 8]), first).prompt_token_ids  # type: ignore[attr-defined]
    assert rewritten.shared == 2 and extending_ref(tip, rewritten) == PromptRef(0, 2, rewritten)
    assert asyncio.run(journal_ref(tip, rewritten)) == PromptRef(0, 2, rewritten)
    # rewritten far from the end (a compaction): compared whole, off the loop, same reference
    long = decode_canonical(vllm_reply(list(range(1, 20_000))), None).prompt_token_ids  # type: ignore[attr-defined]
    tip = EchoTip(1, long, [4, 5])
    compacted = decode_canonical(vllm_reply([*range(1, 11), 7, 7]), long).prompt_token_ids  # type: ignore[attr-defined]
    assert compacted.shared == 10 and extending_ref(tip, compacted) is None
    assert asyncio.run(journal_ref(tip, compacted)) == context_ref(tip, compacted) == PromptRef(1, 10, compacted)
    assert asyncio.run(journal_ref(tip, [7])) is None and asyncio.run(journal_ref(None, extending)) is None


class RenderingVLLM:
    """Test double of a vLLM server without token-in: renders the messages with a family's
    template and echoes the ids (what NeMo RL's pinned vLLM does), and answers with a tool call
    until ``turns`` calls, then text."""

    def __init__(self, template: str, turns: int) -> None:
        self.fmt = chat_format(template)
        self.turns = turns
        self.prompts: list[list[int]] = []
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def chat(self, request: web.Request) -> web.Response:
        body = await request.json()
        assert "kv_transfer_params" not in body
        prompt = list(self.fmt.tokenizer.encode(self.fmt.render(body["messages"], body.get("tools"))))
        self.prompts.append(prompt)
        n = len(self.prompts)
        if n < self.turns:
            arguments = orjson.dumps({"command": f"echo {n}"}).decode()
            message: dict[str, Any] = {"role": "assistant", "content": None, "tool_calls": [
                {"id": f"call-{n}", "type": "function", "function": {"name": "bash", "arguments": arguments}}]}
        else:
            message = {"role": "assistant", "content": "Done."}
        reply = {"id": "c", "object": "chat.completion", "model": "m", "prompt_token_ids": prompt,
                 "choices": [{"index": 0, "message": message, "token_ids": [100 + n, 200 + n],
                              "logprobs": {"content": [{"token": "x", "logprob": -0.5}, {"token": "y", "logprob": -0.25}]},
                              "finish_reason": "tool_calls" if n < self.turns else "stop"}]}
        return web.Response(body=orjson.dumps(reply), content_type="application/json")

    async def start(self) -> RenderingVLLM:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/v1/chat/completions", self.chat)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        port = self.runner.addresses[0][1]
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()


async def test_a_canonical_session_through_the_gateway_records_the_engines_ids(tmp_path: Path) -> None:
    """The real gateway and vLLM client, canonical: every record's prompt is the engine's render,
    later calls are journaled as references, and a rewritten history is still exact."""
    engine = await RenderingVLLM("append_only", turns=6).start()
    store = JournalStore(tmp_path / "capture")
    gateway = Gateway(VLLMClient(engine.url, "m"), store, GatewayConfig(engine_model="m"))
    await gateway.start("127.0.0.1", 0)
    try:
        session = gateway.open_session(continuation=False)
        messages: list[dict[str, Any]] = [{"role": "user", "content": "Look around."}]
        headers = {"Authorization": f"Bearer {session.key}"}
        async with aiohttp.ClientSession() as http:
            for turn in range(6):
                if turn == 3:  # compaction: a rewritten history
                    messages = [{"role": "user", "content": "Summary so far: three echoes."}]
                async with http.post(f"{gateway.url}/v1/chat/completions", headers=headers,
                                     json={"model": "m", "messages": messages, "tools": TOOLS}) as resp:
                    assert resp.status == 200, await resp.text()
                    reply = (await resp.json())["choices"][0]["message"]
                messages += [{k: v for k, v in reply.items() if k in ("role", "content", "tool_calls")}]
                for call in reply.get("tool_calls") or []:
                    messages.append({"role": "tool", "tool_call_id": call["id"], "content": f"out {turn} ✓"})
        assert gateway.sessions.get(session.id).echo is not None
        gateway.close_session(session.id)
        assert gateway.sessions.get(session.id).echo is None
    finally:
        await gateway.aclose()
        await engine.stop()
    records = JournalStore(tmp_path / "capture").read(session.id)
    assert [r.prompt_ids for r in records] == engine.prompts and len(records) == 6
    lines = [orjson.loads(line) for line in (tmp_path / "capture" / f"{session.id}.jsonl").read_bytes().splitlines()]
    stored = [line["prompt"] for line in lines if "prompt" in line]
    assert "ids" in stored[0] and all("parent" in p for p in stored[1:])
    assert len(stored[2]["suffix"]) < len(engine.prompts[2]) // 2  # by its delta, not the whole prompt
