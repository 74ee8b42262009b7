from __future__ import annotations

import base64
import copy
from pathlib import Path
from typing import Any

import orjson
import pytest

from polar_env.errors import RequestError
from polar_env.proxy.providers import anthropic
from polar_env.proxy.providers.base import Reply
from polar_env.records import (
    AssistantMessage,
    ChatRequest,
    Generation,
    ProviderAPI,
    ToolCall,
)

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "providers" / "anthropic"
REQUEST_ID = "0123456789abcdef0123456789abcdef"


def load(name: str) -> dict[str, Any]:
    return orjson.loads((FIXTURES / name).read_bytes())


def minimal(**extra: Any) -> dict[str, Any]:
    return {"model": "m", "max_tokens": 64, "messages": [{"role": "user", "content": "hi"}], **extra}


def reply(
    content: str | None = None,
    reasoning: str | None = None,
    tool_calls: list[ToolCall] | None = None,
    finish_reason: str = "stop",
    stop_reason: int | str | None = None,
    options: dict[str, Any] | None = None,
) -> Reply:
    generation = Generation(
        message=AssistantMessage(content=content, reasoning=reasoning, tool_calls=tool_calls or []),
        prompt_ids=[1, 2, 3, 4, 5],
        response_ids=[10, 11, 12],
        response_logprobs=[-0.1, -0.2, -0.3],
        finish_reason=finish_reason,
        stop_reason=stop_reason,
    )
    return Reply(generation, "claude-sonnet-4-5", REQUEST_ID, 1_750_000_000, options or {})


BASH_CALL = ToolCall(id="chatcmpl-tool-9f3c2a7b1e4d4c0f8a6b5d21ffff", name="Bash", arguments='{"command": "echo hi", "n": [1, 2]}')


def frames(stream: bytes) -> list[tuple[str, dict[str, Any]]]:
    """Parse SSE bytes into (event name, data) pairs, checking the framing as it goes."""
    out = []
    for frame in stream.decode().split("\n\n")[:-1]:
        event_line, data_line = frame.split("\n")
        assert event_line.startswith("event: ") and data_line.startswith("data: ")
        out.append((event_line.removeprefix("event: "), orjson.loads(data_line.removeprefix("data: "))))
    assert stream.endswith(b"\n\n")
    return out


def events(r: Reply) -> list[tuple[str, dict[str, Any]]]:
    pairs = frames(b"".join(anthropic.stream_events(r)))
    for name, data in pairs:
        assert data["type"] == name
    return pairs


# --- to_chat -------------------------------------------------------------------------------------


def test_module_contract() -> None:
    assert anthropic.API is ProviderAPI.ANTHROPIC
    assert [(r.method, r.path) for r in anthropic.ROUTES] == [("POST", "/v1/messages")]


def test_claude_code_tool_round_trip_normalizes_exactly() -> None:
    body = load("claude_code_tool_turn.json")
    inbound = anthropic.to_chat(body, {})
    system = "\n\n".join(block["text"] for block in body["system"])
    bash, read = body["tools"]
    assert inbound.chat == ChatRequest(
        messages=[
            {"role": "system", "content": system},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": body["messages"][0]["content"][0]["text"]},
                    {"type": "text", "text": "run echo hi"},
                ],
            },
            {"role": "system", "content": body["messages"][1]["content"]},
            {
                "role": "assistant",
                "content": "Running it now.",
                "reasoning_content": "The user wants the output of echo hi. I'll use Bash.",
                "tool_calls": [
                    {
                        "id": "toolu_9f3c2a7b1e4d4c0f8a6b5d21",
                        "type": "function",
                        "function": {"name": "Bash", "arguments": '{"command":"echo hi","description":"Print hi"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "toolu_9f3c2a7b1e4d4c0f8a6b5d21", "content": "hi"},
        ],
        tools=[
            {"type": "function", "function": {"name": "Bash", "description": bash["description"], "parameters": bash["input_schema"]}},
            {"type": "function", "function": {"name": "Read", "description": read["description"], "parameters": read["input_schema"]}},
        ],
        max_tokens=32000,
    )
    assert inbound.stream is True
    assert inbound.model == "claude-sonnet-4-5"
    assert inbound.notes == []
    assert inbound.options == {"stop_sequences": []}
    assert "$schema" in inbound.chat.tools[0]["function"]["parameters"]  # kept as the harness sent it


def test_system_blocks_lose_cache_control_and_join_as_paragraphs() -> None:
    chat = anthropic.to_chat(load("claude_code_tool_turn.json"), {}).chat
    assert chat.messages[0]["content"].startswith("x-anthropic-billing-header: cc_version=2.1.197.e4a;")
    assert "\n\nYou are Claude Code" in chat.messages[0]["content"]
    assert "cache_control" not in orjson.dumps(chat.model_dump()).decode()


def test_moving_cache_control_does_not_change_the_chat_request() -> None:
    # Claude Code and pi move the breakpoint to the newest user block every turn.
    body = load("claude_code_tool_turn.json")
    moved = copy.deepcopy(body)
    del moved["messages"][3]["content"][0]["cache_control"]
    moved["messages"][0]["content"][1]["cache_control"] = {"type": "ephemeral"}
    assert anthropic.to_chat(body, {}).chat == anthropic.to_chat(moved, {}).chat


def test_mid_list_system_message_is_kept_in_place() -> None:
    body = minimal(
        system="top",
        messages=[
            {"role": "user", "content": "a"},
            {"role": "assistant", "content": "b"},
            {"role": "system", "content": "skills listing"},
            {"role": "user", "content": "c"},
        ],
    )
    roles = [(m["role"], m["content"]) for m in anthropic.to_chat(body, {}).chat.messages]
    assert roles == [("system", "top"), ("user", "a"), ("assistant", "b"), ("system", "skills listing"), ("user", "c")]


def test_mid_list_system_message_accepts_text_blocks() -> None:
    body = minimal(messages=[{"role": "user", "content": "a"}, {"role": "system", "content": [{"type": "text", "text": "x"}]}])
    assert anthropic.to_chat(body, {}).chat.messages[1] == {"role": "system", "content": "x"}


def test_unknown_fields_are_tolerated() -> None:
    body = minimal(
        metadata={"user_id": '{"device_id":"d","session_id":"s"}'},
        context_management={"edits": [{"type": "clear_thinking_20251015"}]},
        output_config={"effort": "high"},
        thinking={"type": "adaptive"},
        service_tier="auto",
        container=None,
        some_future_field={"nested": [1, 2]},
    )
    inbound = anthropic.to_chat(body, {})
    assert inbound.chat == ChatRequest(messages=[{"role": "user", "content": "hi"}], max_tokens=64)
    assert inbound.stream is False


def test_pi_tool_results_come_before_the_rest_of_their_user_turn() -> None:
    inbound = anthropic.to_chat(load("pi_tool_turn.json"), {})
    messages = inbound.chat.messages
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool", "tool", "user"]
    assert messages[1]["content"] == [
        {"type": "text", "text": "What is in screenshot.png? Then run echo hi."},
        {
            "type": "image_url",
            "image_url": {
                "url": "data:image/png;base64,"
                       "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8BQDwAEhQGAhKmMIQAAAABJRU5ErkJggg=="
            },
        },
    ]
    assert messages[2] == {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "toolu_5d1e0c9b8a7f6e5d4c3b2a19", "type": "function",
             "function": {"name": "bash", "arguments": '{"command":"echo hi"}'}},
            {"id": "toolu_a0b1c2d3e4f5061728394a5b", "type": "function", "function": {"name": "read", "arguments": '{"path":"logo.png"}'}},
        ],
    }
    assert messages[3] == {"role": "tool", "tool_call_id": "toolu_5d1e0c9b8a7f6e5d4c3b2a19", "content": [{"type": "text", "text": "hi\n"}]}
    assert messages[4] == {
        "role": "tool",
        "tool_call_id": "toolu_a0b1c2d3e4f5061728394a5b",
        "content": [
            {"type": "text", "text": "Read image file [image/png]"},
            {"type": "image_url", "image_url": {"url": "https://example.invalid/logo.png"}},
        ],
    }
    assert messages[5] == {"role": "user", "content": [{"type": "text", "text": "Keep it short."}]}
    assert inbound.chat.chat_template_kwargs == {}  # thinking enabled: the template default
    assert inbound.chat.max_tokens == 16384


def test_claude_code_title_request_becomes_json_schema_response_format() -> None:
    body = load("claude_code_title.json")
    inbound = anthropic.to_chat(body, {})
    assert inbound.chat.response_format == {
        "type": "json_schema",
        "json_schema": {"name": "output", "schema": body["output_config"]["format"]["schema"]},
    }
    assert inbound.chat.tools == []
    assert inbound.notes == ["output_config.format json_schema sent as response_format"]


def test_generation_params() -> None:
    body = minimal(temperature=0.7, top_p=0.9, stop_sequences=["END", "\n\nHuman:"], thinking={"type": "disabled"}, top_k=5)
    inbound = anthropic.to_chat(body, {})
    chat = inbound.chat
    assert (chat.temperature, chat.top_p, chat.max_tokens) == (0.7, 0.9, 64)
    assert chat.stop == ["END", "\n\nHuman:"]
    assert chat.chat_template_kwargs == {"enable_thinking": False}
    assert inbound.options == {"stop_sequences": ["END", "\n\nHuman:"]}
    assert inbound.notes == ["ignored top_k"]


@pytest.mark.parametrize(
    ("choice", "expected"),
    [
        ({"type": "auto"}, "auto"),
        ({"type": "any"}, "required"),
        ({"type": "none"}, "none"),
        ({"type": "tool", "name": "Bash"}, {"type": "function", "function": {"name": "Bash"}}),
        ({"type": "auto", "disable_parallel_tool_use": True}, "auto"),
    ],
)
def test_tool_choice(choice: dict[str, Any], expected: Any) -> None:
    assert anthropic.to_chat(minimal(tool_choice=choice), {}).chat.tool_choice == expected


def test_server_tools_are_dropped_and_cache_control_stripped() -> None:
    tools = [
        {"type": "web_search_20250305", "name": "web_search", "max_uses": 5},
        {"type": "bash_20250124", "name": "bash"},
        {"name": "f", "input_schema": {"type": "object"}, "cache_control": {"type": "ephemeral"}},
        {"type": "custom", "name": "g", "description": "d", "input_schema": {"type": "object"}},
    ]
    inbound = anthropic.to_chat(minimal(tools=tools), {})
    assert inbound.chat.tools == [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}},
        {"type": "function", "function": {"name": "g", "description": "d", "parameters": {"type": "object"}}},
    ]
    assert inbound.notes == ["dropped server tool of type 'web_search_20250305'", "dropped server tool of type 'bash_20250124'"]


def test_dropped_blocks_leave_notes() -> None:
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "doc"}},
                {"type": "image", "source": {"type": "file", "file_id": "file_1"}},
                {"type": "search_result", "source": "s", "title": "t", "content": []},
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "boom", "is_error": True},
                {"type": "text", "text": "go"},
            ],
        },
        {"role": "assistant", "content": [{"type": "redacted_thinking", "data": "abc"}, {"type": "text", "text": "ok"}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_2", "is_error": True}]},
    ]
    inbound = anthropic.to_chat(minimal(messages=messages), {})
    assert inbound.chat.messages == [
        {"role": "tool", "tool_call_id": "toolu_1", "content": "boom"},
        {"role": "user", "content": [{"type": "text", "text": "go"}]},
        {"role": "assistant", "content": "ok"},
        {"role": "tool", "tool_call_id": "toolu_2", "content": ""},
    ]
    assert inbound.notes == [
        "dropped document block",
        "dropped image with source type 'file'",
        "dropped search_result block",
        "tool_result is_error flag not forwarded (content kept as sent)",
        "dropped redacted_thinking block",
    ]


def test_assistant_blocks_concatenate_text_and_thinking() -> None:
    content = [
        {"type": "thinking", "thinking": "a", "signature": "sig"},
        {"type": "text", "text": "x"},
        {"type": "thinking", "thinking": "b", "signature": "sig"},
        {"type": "text", "text": "y"},
    ]
    chat = anthropic.to_chat(minimal(messages=[{"role": "user", "content": "q"}, {"role": "assistant", "content": content}]), {}).chat
    assert chat.messages[1] == {"role": "assistant", "content": "xy", "reasoning_content": "ab"}


def test_count_tokens_chat_matches_to_chat_without_max_tokens() -> None:
    body = load("claude_code_tool_turn.json")
    counted = dict(body)
    del counted["max_tokens"], counted["stream"]
    chat = anthropic.count_tokens_chat(counted)
    assert chat == anthropic.to_chat(body, {}).chat.model_copy(update={"max_tokens": None})
    with pytest.raises(RequestError, match="'messages'"):
        anthropic.count_tokens_chat({"model": "m"})


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"model": "m", "max_tokens": 8}, "missing required field 'messages'"),
        (minimal(messages={"role": "user"}), "field 'messages' must be a list"),
        (minimal(messages=[]), "'messages' must not be empty"),
        (minimal(messages=["hi"]), r"messages\[0\] must be an object"),
        (minimal(messages=[{"role": "tool", "content": "x"}]), r"messages\[0\].role 'tool' is not one of"),
        (minimal(messages=[{"role": "user"}]), r"messages\[0\].content is required"),
        (minimal(messages=[{"role": "user", "content": 3}]), r"messages\[0\].content must be a string or a list"),
        ({"model": "m", "messages": [{"role": "user", "content": "hi"}]}, "missing required field 'max_tokens'"),
        (minimal(max_tokens=0), "'max_tokens' must be a positive integer"),
        (minimal(max_tokens="10"), "field 'max_tokens' must be a positive integer"),
        (
            minimal(messages=[{"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "input": {}}]}]),
            r"messages\[0\].content\[0\].name must be a non-empty string",
        ),
        (
            minimal(messages=[{"role": "assistant", "content": [{"type": "tool_use", "name": "f", "input": {}}]}]),
            r"messages\[0\].content\[0\].id must be a non-empty string",
        ),
        (
            minimal(messages=[{"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": "x"}]}]),
            r"messages\[0\].content\[0\].input must be an object",
        ),
        (minimal(messages=[{"role": "user", "content": ["hi"]}]), r"messages\[0\].content\[0\] must be an object with a string 'type'"),
        (minimal(messages=[{"role": "user", "content": [{"text": "hi"}]}]),
         r"messages\[0\].content\[0\] must be an object with a string 'type'"),
        (minimal(messages=[{"role": "user", "content": [{"type": "text"}]}]), r"messages\[0\].content\[0\].text must be a string"),
        (minimal(messages=[{"role": "user", "content": [{"type": "image"}]}]), r"messages\[0\].content\[0\].source must be an object"),
        (
            minimal(messages=[{"role": "user", "content": [{"type": "image", "source": {"type": "base64", "data": "x"}}]}]),
            r"messages\[0\].content\[0\].source needs string 'media_type' and 'data'",
        ),
        (minimal(messages=[{"role": "user", "content": [{"type": "document"}]}]), r"messages\[0\].content\[0\].source must be an object"),
        (
            minimal(messages=[{"role": "user", "content": [{"type": "tool_result", "content": "x"}]}]),
            r"messages\[0\].content\[0\].tool_use_id must be a non-empty string",
        ),
        (
            minimal(messages=[{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": 5}]}]),
            r"messages\[0\].content\[0\].content must be a string or a list of blocks",
        ),
        (
            minimal(messages=[{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": [{"type": "text"}]}]}]),
            r"messages\[0\].content\[0\].content\[0\].text must be a string",
        ),
        (
            minimal(messages=[{"role": "assistant", "content": [{"type": "thinking", "signature": "s"}]}]),
            r"messages\[0\].content\[0\].thinking must be a string",
        ),
        (minimal(system=[{"type": "image"}]), r"system\[0\] must be a text block"),
        (minimal(system=7), "system must be a string or a list of text blocks"),
        (minimal(tools={"name": "f"}), "'tools' must be a list"),
        (minimal(tools=[{"input_schema": {}}]), r"tools\[0\].name must be a non-empty string"),
        (minimal(tools=[{"name": "f"}]), r"tools\[0\].input_schema must be an object"),
        (minimal(tool_choice="auto"), "'tool_choice' must be an object"),
        (minimal(tool_choice={"type": "tool"}), "tool_choice.name must be a non-empty string"),
        (minimal(temperature="hot"), "'temperature' must be a number"),
        (minimal(stop_sequences=[1]), "'stop_sequences' must be a string or a list of strings"),
        (minimal(thinking="off"), "'thinking' must be an object"),
        (minimal(output_config={"format": {"type": "json_schema"}}), "output_config.format.schema must be an object"),
    ],
)
def test_malformed_input_raises_request_error(body: dict[str, Any], message: str) -> None:
    with pytest.raises(RequestError, match=message) as info:
        anthropic.to_chat(body, {})
    assert info.value.status == 400


# --- from_chat -----------------------------------------------------------------------------------


SIGNATURE = base64.b64encode(f"polar:{REQUEST_ID}".encode()).decode()  # opaque, non-empty: clients replay it


def test_from_chat_shape_with_thinking_text_and_tool_use() -> None:
    body = anthropic.from_chat(reply("Running it.", "Use Bash.", [BASH_CALL], finish_reason="tool_calls"))
    assert body == {
        "id": f"msg_{REQUEST_ID}",
        "type": "message",
        "role": "assistant",
        "model": "claude-sonnet-4-5",
        "content": [
            {"type": "thinking", "thinking": "Use Bash.", "signature": SIGNATURE},
            {"type": "text", "text": "Running it."},
            {"type": "tool_use", "id": "toolu_9f3c2a7b1e4d4c0f8a6b5d21", "name": "Bash", "input": {"command": "echo hi", "n": [1, 2]}},
        ],
        "stop_reason": "tool_use",
        "stop_sequence": None,
        "usage": {"input_tokens": 5, "output_tokens": 3, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0},
    }


def test_from_chat_text_only_and_empty() -> None:
    assert anthropic.from_chat(reply("hello"))["content"] == [{"type": "text", "text": "hello"}]
    assert anthropic.from_chat(reply(None, ""))["content"] == []


def test_from_chat_wraps_non_object_arguments() -> None:
    calls = [ToolCall(id="a", name="f", arguments="[1]"), ToolCall(id="b", name="g", arguments="not json"),
             ToolCall(id="c", name="h", arguments="")]
    inputs = [block["input"] for block in anthropic.from_chat(reply(tool_calls=calls, finish_reason="tool_calls"))["content"]]
    assert inputs == [{"value": [1]}, {"raw_arguments": "not json"}, {}]


@pytest.mark.parametrize(
    ("finish", "stop", "calls", "options", "expected"),
    [
        ("stop", None, [], {}, ("end_turn", None)),
        ("stop", 248046, [], {}, ("end_turn", None)),
        ("length", None, [], {}, ("max_tokens", None)),
        ("tool_calls", None, [BASH_CALL], {}, ("tool_use", None)),
        ("stop", None, [BASH_CALL], {}, ("tool_use", None)),
        ("length", None, [BASH_CALL], {}, ("max_tokens", None)),
        ("stop", "END", [], {"stop_sequences": ["END"]}, ("stop_sequence", "END")),
        ("stop", "END", [], {"stop_sequences": ["OTHER"]}, ("end_turn", None)),
        ("stop", "END", [], {}, ("end_turn", None)),
    ],
)
def test_stop_reason_mapping(finish: str, stop: Any, calls: list[ToolCall], options: dict[str, Any],
                             expected: tuple[str, str | None]) -> None:
    r = reply("x", tool_calls=calls, finish_reason=finish, stop_reason=stop, options=options)
    body = anthropic.from_chat(r)
    assert (body["stop_reason"], body["stop_sequence"]) == expected
    assert events(r)[-2][1]["delta"] == {"stop_reason": expected[0], "stop_sequence": expected[1]}


def test_stop_sequences_flow_from_to_chat_options() -> None:
    inbound = anthropic.to_chat(minimal(stop_sequences=["END"]), {})
    r = reply("x", stop_reason="END", options=inbound.options)
    assert anthropic.from_chat(r)["stop_reason"] == "stop_sequence"


# --- stream_events -------------------------------------------------------------------------------


def test_stream_text_only_exact_sequence() -> None:
    pairs = events(reply("hello world"))
    assert [name for name, _ in pairs] == [
        "message_start",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert pairs[0][1]["message"] == {
        "id": f"msg_{REQUEST_ID}",
        "type": "message",
        "role": "assistant",
        "model": "claude-sonnet-4-5",
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": {"input_tokens": 5, "output_tokens": 1, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0},
    }
    # Claude Code ignores text in content_block_start: it must arrive as a text_delta.
    assert pairs[1][1] == {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}
    assert pairs[2][1] == {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "hello world"}}
    assert pairs[3][1] == {"type": "content_block_stop", "index": 0}
    assert pairs[4][1] == {"type": "message_delta", "delta": {"stop_reason": "end_turn", "stop_sequence": None},
                           "usage": {"output_tokens": 3}}
    assert pairs[5][1] == {"type": "message_stop"}


def test_stream_thinking_then_text() -> None:
    pairs = events(reply("4", "2+2"))
    assert [(name, data.get("index"), (data.get("delta") or data.get("content_block") or {}).get("type")) for name, data in pairs] == [
        ("message_start", None, None),
        ("content_block_start", 0, "thinking"),
        ("content_block_delta", 0, "thinking_delta"),
        ("content_block_delta", 0, "signature_delta"),
        ("content_block_stop", 0, None),
        ("content_block_start", 1, "text"),
        ("content_block_delta", 1, "text_delta"),
        ("content_block_stop", 1, None),
        ("message_delta", None, None),
        ("message_stop", None, None),
    ]
    assert pairs[1][1]["content_block"] == {"type": "thinking", "thinking": "", "signature": ""}
    assert pairs[2][1]["delta"] == {"type": "thinking_delta", "thinking": "2+2"}
    assert pairs[3][1]["delta"] == {"type": "signature_delta", "signature": SIGNATURE}
    assert pairs[6][1]["delta"] == {"type": "text_delta", "text": "4"}


def test_stream_tool_use() -> None:
    second = ToolCall(id="call_0001", name="Read", arguments='{"file_path": "/tmp/a"}')
    pairs = events(reply(None, None, [BASH_CALL, second], finish_reason="tool_calls"))
    assert [(name, data.get("index")) for name, data in pairs] == [
        ("message_start", None),
        ("content_block_start", 0),
        ("content_block_delta", 0),
        ("content_block_stop", 0),
        ("content_block_start", 1),
        ("content_block_delta", 1),
        ("content_block_stop", 1),
        ("message_delta", None),
        ("message_stop", None),
    ]
    assert pairs[1][1]["content_block"] == {"type": "tool_use", "id": "toolu_9f3c2a7b1e4d4c0f8a6b5d21", "name": "Bash", "input": {}}
    assert pairs[2][1]["delta"] == {"type": "input_json_delta", "partial_json": '{"command":"echo hi","n":[1,2]}'}
    assert pairs[4][1]["content_block"]["id"] == "toolu_call_0001"
    assert pairs[-2][1]["delta"]["stop_reason"] == "tool_use"


def test_stream_input_json_deltas_concatenate_to_the_input() -> None:
    r = reply("ok", None, [BASH_CALL], finish_reason="tool_calls")
    partial = "".join(d["delta"]["partial_json"] for n, d in events(r)
                      if n == "content_block_delta" and d["delta"]["type"] == "input_json_delta")
    assert orjson.loads(partial) == anthropic.from_chat(r)["content"][1]["input"] == {"command": "echo hi", "n": [1, 2]}
    assert partial == '{"command":"echo hi","n":[1,2]}'  # compact, as JSON.stringify would echo it


def test_stream_rebuilds_from_chat_body() -> None:
    """Folding the events the way an SDK accumulator does gives back the non-streaming body."""
    r = reply("Running it.", "Use Bash.", [BASH_CALL], finish_reason="tool_calls")
    message: dict[str, Any] = {}
    partial: dict[int, str] = {}
    for name, data in events(r):
        if name == "message_start":
            message = data["message"]
        elif name == "content_block_start":
            message["content"].append(dict(data["content_block"]))
        elif name == "content_block_delta":
            block, delta = message["content"][data["index"]], data["delta"]
            if delta["type"] == "input_json_delta":
                partial[data["index"]] = partial.get(data["index"], "") + delta["partial_json"]
            else:
                key = {"text_delta": "text", "thinking_delta": "thinking", "signature_delta": "signature"}[delta["type"]]
                block[key] += delta[key]
        elif name == "content_block_stop" and data["index"] in partial:
            message["content"][data["index"]]["input"] = orjson.loads(partial[data["index"]])
        elif name == "message_delta":
            message.update(data["delta"])
            message["usage"]["output_tokens"] = data["usage"]["output_tokens"]
    assert message == anthropic.from_chat(r)


def test_stream_frames_are_event_then_data() -> None:
    first = next(iter(anthropic.stream_events(reply("x"))))
    assert first.startswith(b"event: message_start\ndata: {") and first.endswith(b"}\n\n")


# --- error_body ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("status", "kind"),
    [
        (400, "invalid_request_error"),
        (401, "authentication_error"),
        (403, "permission_error"),
        (404, "not_found_error"),
        (413, "request_too_large"),
        (422, "invalid_request_error"),
        (429, "rate_limit_error"),
        (500, "api_error"),
        (502, "api_error"),
        (503, "overloaded_error"),
        (504, "api_error"),
        (529, "overloaded_error"),
    ],
)
def test_error_body(status: int, kind: str) -> None:
    assert anthropic.error_body(status, "boom") == {"type": "error", "error": {"type": kind, "message": "boom"}}
