"""OpenAI Responses provider: Codex and pi bodies to Chat, replies and the full SSE sequence back."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import orjson
import pytest

from polar_env.chat.qwen35.template import render
from polar_env.engines.embedded.engine import EmbeddedEngine
from polar_env.errors import RequestError
from polar_env.proxy.providers import PROVIDERS
from polar_env.proxy.providers import openai_responses as responses
from polar_env.proxy.providers.base import Reply
from polar_env.records import AssistantMessage, Generation, ToolCall
from tests.proxy.conftest import admin_headers, start_gateway

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "providers" / "openai_responses"
ENGINE_CALL_ID = "chatcmpl-tool-8f3c2a1b9d7e4f60a1b2c3d4"  # what vLLM names a tool call
REQUEST_ID = "0f1e2d3c4b5a69788796a5b4c3d2e1f0"


def fixture(name: str) -> dict[str, Any]:
    return json.loads((FIXTURES / name).read_text())


def reply(
    content: str | None = None,
    reasoning: str | None = None,
    calls: tuple[tuple[str, str], ...] = (),
    finish: str = "stop",
    options: dict[str, Any] | None = None,
) -> Reply:
    tool_calls = [ToolCall(id=f"chatcmpl-tool-{i}a1b2c3d4e5f60718293a4b5c{i}", name=n, arguments=a) for i, (n, a) in enumerate(calls)]
    if len(calls) == 1:
        tool_calls = [ToolCall(id=ENGINE_CALL_ID, name=calls[0][0], arguments=calls[0][1])]
    gen = Generation(
        message=AssistantMessage(content=content, reasoning=reasoning, tool_calls=tool_calls),
        prompt_ids=[1, 2, 3, 4], response_ids=[5, 6, 7], response_logprobs=[-0.1, -0.2, -0.3],
        finish_reason=finish,
    )
    return Reply(gen, model="qwen3.5", request_id=REQUEST_ID, created=1_760_000_000, options=options or {})


def parse_stream(raw: bytes) -> list[dict[str, Any]]:
    """Parse a framed stream, checking each frame's ``event:`` line matches its data's type."""
    out = []
    for frame in raw.split(b"\n\n")[:-1]:
        event_line, data_line = frame.split(b"\n")
        data = orjson.loads(data_line.removeprefix(b"data: "))
        assert event_line == b"event: " + data["type"].encode()
        out.append(data)
    return out


def events(r: Reply) -> list[dict[str, Any]]:
    return parse_stream(b"".join(responses.stream_events(r)))


# --- request translation -------------------------------------------------------------------------


def test_codex_tool_round_trip_normalizes_to_chat() -> None:
    body = fixture("codex_tool_turn.json")
    inbound = responses.to_chat(copy.deepcopy(body), {})
    assert inbound.stream is True and inbound.model == "qwen3.5"
    dev, env, ask = (item["content"][0]["text"] for item in body["input"][:3])
    assert inbound.chat.messages == [
        {"role": "system", "content": dev},
        {"role": "user", "content": env},
        {"role": "user", "content": ask},
        {
            "role": "assistant",
            "content": None,
            "reasoning_content": "The user wants me to run echo hi. I'll use exec_command.",
            "tool_calls": [{
                "id": "call_8f3c2a1b9d7e4f60a1b2c3d4",
                "type": "function",
                "function": {"name": "exec_command", "arguments": '{"cmd":"echo hi"}'},
            }],
        },
        {"role": "tool", "tool_call_id": "call_8f3c2a1b9d7e4f60a1b2c3d4", "content": body["input"][5]["output"]},
    ]
    assert [t["function"]["name"] for t in inbound.chat.tools] == [
        "exec_command", "write_stdin", "update_plan",
        "multi_agent_v1__spawn_agent", "multi_agent_v1__wait_agent", "multi_agent_v1__close_agent",
    ]
    exec_tool = body["tools"][0]
    assert inbound.chat.tools[0] == {"type": "function", "function": {
        "name": "exec_command", "description": exec_tool["description"], "parameters": exec_tool["parameters"], "strict": False,
    }}
    assert inbound.chat.tool_choice == "auto"
    assert inbound.chat.max_tokens is None and inbound.chat.temperature is None and inbound.chat.response_format is None
    assert "dropped tool of type 'web_search'" in inbound.notes
    # store, include, prompt_cache_key, client_metadata, reasoning, parallel_tool_calls: ignored silently.
    assert not any(word in note for note in inbound.notes for word in ("store", "include", "prompt_cache_key", "encrypted"))
    assert inbound.options["echo"]["store"] is False and inbound.options["echo"]["parallel_tool_calls"] is True
    # What the engine's template makes of it: the only system message first, the tool turn intact.
    prompt = render(inbound.chat.messages, inbound.chat.tools)
    assert "<function=exec_command>\n<parameter=cmd>\necho hi\n</parameter>" in prompt
    assert "<tool_response>\nChunk ID" in prompt and "multi_agent_v1__spawn_agent" in prompt


def test_codex_echo_is_exactly_what_we_emitted() -> None:
    """Turn 2 echoes turn 1's output items (same ids, call_id, raw compact arguments)."""
    turn1 = responses.to_chat(fixture("codex_turn1.json"), {})
    echoed = fixture("codex_tool_turn.json")["input"][3:5]
    r = reply(reasoning=echoed[0]["summary"][0]["text"], calls=(("exec_command", '{"cmd": "echo hi"}'),), finish="tool_calls",
              options=turn1.options)
    reasoning, call = responses.from_chat(r)["output"]
    assert reasoning["summary"] == echoed[0]["summary"]
    assert {k: v for k, v in call.items() if k != "status"} == echoed[1]


def test_namespace_tools_flatten_and_calls_map_back() -> None:
    inbound = responses.to_chat(fixture("codex_turn1.json"), {})
    assert inbound.options["namespaces"] == {
        "multi_agent_v1__spawn_agent": ["multi_agent_v1", "spawn_agent"],
        "multi_agent_v1__wait_agent": ["multi_agent_v1", "wait_agent"],
        "multi_agent_v1__close_agent": ["multi_agent_v1", "close_agent"],
    }
    spawn = next(t for t in inbound.chat.tools if t["function"]["name"] == "multi_agent_v1__spawn_agent")
    assert spawn["function"]["parameters"]["required"] == ["message"] and spawn["function"]["strict"] is False

    r = reply(calls=(("multi_agent_v1__spawn_agent", '{"message": "count files"}'),), finish="tool_calls", options=inbound.options)
    (item,) = responses.from_chat(r)["output"]
    # Codex builds ToolName::new(namespace, name): the pair, never the flat name.
    assert item["name"] == "spawn_agent" and item["namespace"] == "multi_agent_v1"
    assert item["arguments"] == '{"message":"count files"}'
    done = [e["item"] for e in events(r) if e["type"] == "response.output_item.done"]
    assert done == [item]
    added = next(e["item"] for e in events(r) if e["type"] == "response.output_item.added")
    assert added["namespace"] == "multi_agent_v1" and added["name"] == "spawn_agent"

    # Turn 2: Codex echoes the item with its namespace; the history shows the flat name the model wrote.
    body = fixture("codex_turn1.json")
    body["input"] += [
        {k: v for k, v in item.items() if k != "status"},
        {"type": "function_call_output", "call_id": item["call_id"], "output": "agent 0199 spawned"},
    ]
    (call,) = responses.to_chat(body, {}).chat.messages[-2]["tool_calls"]
    assert call["function"]["name"] == "multi_agent_v1__spawn_agent"
    assert call["id"] == item["call_id"]


def test_plain_tool_calls_carry_no_namespace() -> None:
    inbound = responses.to_chat(fixture("codex_turn1.json"), {})
    (item,) = responses.from_chat(reply(calls=(("exec_command", "{}"),), options=inbound.options))["output"]
    assert "namespace" not in item and item["name"] == "exec_command"


def test_flat_name_follows_codex_canonical_form() -> None:
    assert responses.flat_name("multi_agent_v1", "spawn_agent") == "multi_agent_v1__spawn_agent"
    assert responses.flat_name("mcp__docs_", "_search") == "mcp__docs__search"


def test_dropped_tools_are_noted() -> None:
    body = {
        "input": "hi",
        "tools": [
            {"type": "web_search"},
            {"type": "file_search", "vector_store_ids": ["vs_1"]},
            {"type": "computer_use_preview", "display_width": 1024, "display_height": 768, "environment": "linux"},
            {"type": "custom", "name": "apply_patch", "description": "patch",
             "format": {"type": "grammar", "syntax": "lark", "definition": "start: /.+/"}},
            {"type": "namespace", "name": "ns", "tools": [{"type": "custom", "name": "raw", "format": {"type": "text"}}]},
            {"type": "function", "name": "ok", "parameters": {"type": "object", "properties": {}}},
        ],
    }
    inbound = responses.to_chat(body, {})
    assert [t["function"]["name"] for t in inbound.chat.tools] == ["ok"]
    for kind in ("web_search", "file_search", "computer_use_preview", "custom"):
        assert f"dropped tool of type {kind!r}" in inbound.notes
    assert "dropped tool of type 'custom' in namespace 'ns'" in inbound.notes
    assert inbound.options["namespaces"] == {}


def test_pi_tool_turn_folds_into_one_assistant_message() -> None:
    body = fixture("pi_tool_turn.json")
    inbound = responses.to_chat(body, {})
    assert inbound.chat.messages == [
        {"role": "system", "content": body["input"][0]["content"]},
        {"role": "user", "content": "Run echo hi."},
        {
            "role": "assistant",
            "content": "Running it now.",
            "reasoning_content": "Run the command with bash.",
            "tool_calls": [{"id": "call_5d1e0c9b8a7f6e5d4c3b2a19", "type": "function",
                            "function": {"name": "bash", "arguments": '{"command":"echo hi"}'}}],
        },
        {"role": "tool", "tool_call_id": "call_5d1e0c9b8a7f6e5d4c3b2a19", "content": "hi\n"},
    ]
    assert inbound.chat.max_tokens == 16384 and inbound.notes == []
    render(inbound.chat.messages, inbound.chat.tools)


def test_pi_echo_of_our_reply_round_trips() -> None:
    """pi echoes the reasoning item whole and re-serialises arguments compactly: same Chat turn back."""
    r = reply(content="Running it now.", reasoning="Run the command with bash.", calls=(("bash", '{"command": "echo hi"}'),),
              finish="tool_calls")
    out = responses.from_chat(r)["output"]
    reasoning, message, call = out
    echo = [
        reasoning,
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Running it now.", "annotations": []}],
         "status": "completed", "id": message["id"]},
        {"type": "function_call", "id": call["id"], "call_id": call["call_id"], "name": "bash",
         "arguments": json.dumps({"command": "echo hi"}, separators=(",", ":"))},
    ]
    messages = responses.to_chat({"input": [{"role": "user", "content": "go"}, *echo]}, {}).chat.messages
    assert messages[1] == {
        "role": "assistant", "content": "Running it now.", "reasoning_content": "Run the command with bash.",
        "tool_calls": [{"id": call["call_id"], "type": "function", "function": {"name": "bash", "arguments": call["arguments"]}}],
    }


def test_string_input_and_instructions() -> None:
    inbound = responses.to_chat({"model": "m", "instructions": "Be brief.", "input": "Hello", "temperature": 0.2, "top_p": 0.9}, {})
    assert inbound.chat.messages == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
    assert inbound.chat.temperature == 0.2 and inbound.chat.top_p == 0.9 and inbound.stream is False


def _fc(call_id: str, name: str = "bash") -> dict[str, Any]:
    return {"type": "function_call", "call_id": call_id, "name": name, "arguments": "{}"}


def _out(call_id: str) -> dict[str, Any]:
    return {"type": "function_call_output", "call_id": call_id, "output": "done"}


def _reason(text: str) -> dict[str, Any]:
    return {"type": "reasoning", "summary": [{"type": "summary_text", "text": text}]}


def _said(text: str) -> dict[str, Any]:
    return {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": text}]}


def test_turn_grouping() -> None:
    items = [
        {"role": "user", "content": "go"},
        _fc("a"), _fc("b"),                 # consecutive calls: one assistant message
        _out("a"), _out("b"),
        _fc("c"),                           # after tool output: a new assistant turn
        _out("c"),
        _said("x"), _reason("r2"), _fc("d"),  # reasoning between: the call starts the next turn
        _out("d"),
        _reason("r3"),                      # reasoning with nothing after it: a turn of its own
        {"role": "user", "content": "and?"},
        _reason("r4a"), _reason("r4b"), _said("final"),
    ]
    messages = responses.to_chat({"input": items}, {}).chat.messages
    shape = [(m["role"], m.get("content"), m.get("reasoning_content"), [c["id"] for c in m.get("tool_calls", [])]) for m in messages]
    assert shape == [
        ("user", "go", None, []),
        ("assistant", None, None, ["a", "b"]),
        ("tool", "done", None, []), ("tool", "done", None, []),
        ("assistant", None, None, ["c"]),
        ("tool", "done", None, []),
        ("assistant", "x", None, []),
        ("assistant", None, "r2", ["d"]),
        ("tool", "done", None, []),
        ("assistant", "", "r3", []),
        ("user", "and?", None, []),
        ("assistant", "final", "r4a\n\nr4b", []),
    ]


def test_content_parts_and_other_items() -> None:
    items = [
        {"type": "message", "role": "user", "content": [
            {"type": "input_text", "text": "look "}, {"type": "input_image", "image_url": "data:image/png;base64,AAAA", "detail": "auto"},
            {"type": "input_file", "file_id": "file_1"},
        ]},
        {"type": "message", "role": "system", "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "refusal", "refusal": "no"}]},
        {"type": "web_search_call", "id": "ws_1", "status": "completed", "action": {"type": "search", "query": "q"}},
        {"type": "custom_tool_call", "call_id": "c1", "name": "apply_patch", "input": "*** Begin Patch"},
        {"type": "custom_tool_call_output", "call_id": "c1", "output": "ok"},
        {"type": "local_shell_call", "call_id": "c2", "status": "completed", "action": {"type": "exec", "command": ["ls"]}},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "a.txt"}]},
        {"type": "item_reference", "id": "msg_old"},
    ]
    inbound = responses.to_chat({"input": items, "previous_response_id": "resp_old"}, {})
    m = inbound.chat.messages
    assert m[0] == {"role": "user", "content": [{"type": "text", "text": "look "},
                                                {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}
    assert m[1] == {"role": "system", "content": "ab"}
    # The web_search_call is dropped, so the custom call joins the assistant turn it belonged to.
    assert m[2] == {"role": "assistant", "content": "no", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "apply_patch", "arguments": '{"input":"*** Begin Patch"}'}},
    ]}
    assert m[3] == {"role": "tool", "tool_call_id": "c1", "content": "ok"}
    assert m[4]["tool_calls"][0]["function"] == {"name": "local_shell", "arguments": '{"command":["ls"]}'}
    assert m[5] == {"role": "tool", "tool_call_id": "c2", "content": "a.txt"} and len(m) == 6
    assert "dropped content part of type 'input_file'" in inbound.notes
    assert "dropped input items of type 'web_search_call'" in inbound.notes
    assert any("item_reference" in n for n in inbound.notes) and any("previous_response_id" in n for n in inbound.notes)
    assert inbound.options["echo"]["previous_response_id"] == "resp_old"


def test_generation_settings() -> None:
    body = {
        "input": "hi", "max_output_tokens": 256, "tool_choice": {"type": "function", "name": "spawn_agent", "namespace": "multi_agent_v1"},
        "text": {"format": {"type": "json_schema", "name": "answer", "schema": {"type": "object"}, "strict": True}, "verbosity": "low"},
    }
    chat = responses.to_chat(body, {}).chat
    assert chat.max_tokens == 256
    assert chat.tool_choice == {"type": "function", "function": {"name": "multi_agent_v1__spawn_agent"}}
    assert chat.response_format == {"type": "json_schema", "json_schema": {"name": "answer", "schema": {"type": "object"}, "strict": True}}
    for choice in ("auto", "none", "required"):
        assert responses.to_chat({"input": "hi", "tool_choice": choice}, {}).chat.tool_choice == choice
    dropped = responses.to_chat({"input": "hi", "tool_choice": {"type": "web_search"}, "text": {"format": {"type": "json_object"}}}, {})
    assert dropped.chat.tool_choice is None and dropped.chat.response_format == {"type": "json_object"}
    assert "dropped tool_choice of type 'web_search' (the engine decides)" in dropped.notes


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"model": "m"}, "missing required field 'input'"),
        ({"input": 5}, "field 'input' must be a string or a list of input items"),
        ({"input": []}, "'input' must not be empty"),
        ({"input": ["hi"]}, "input[0] must be an object"),
        ({"input": [{"content": "hi"}]}, "input[0] needs a 'type'"),
        ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role 'tool' is not one of"),
        ({"input": [{"type": "message", "role": "user", "content": 3}]}, "input[0].content must be a string or a list"),
        ({"input": [{"type": "message", "role": "user", "content": [{"text": "x"}]}]},
         "input[0].content[0] must be an object with a string 'type'"),
        ({"input": [{"type": "function_call", "name": "bash", "arguments": "{}"}]}, "input[0].call_id must be a non-empty string"),
        ({"input": [{"type": "function_call", "call_id": "c", "arguments": "{}"}]}, "input[0].name must be a non-empty string"),
        ({"input": [{"type": "function_call", "call_id": "c", "name": "bash", "arguments": 3}]},
         "input[0].arguments must be a JSON string"),
        ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id must be a non-empty string"),
        ({"input": [{"type": "function_call_output", "call_id": "c"}]}, "input[0].output is required"),
        ({"input": [{"type": "reasoning", "summary": "x"}]}, "input[0].summary must be a list"),
        ({"input": "hi", "instructions": ["x"]}, "'instructions' must be a string"),
        ({"input": "hi", "tools": {"type": "function"}}, "'tools' must be a list"),
        ({"input": "hi", "tools": [{"name": "bash"}]}, "tools[0] must be an object with a string 'type'"),
        ({"input": "hi", "tools": [{"type": "function", "parameters": {}}]}, "tools[0].name must be a non-empty string"),
        ({"input": "hi", "tools": [{"type": "function", "name": "f", "parameters": "x"}]}, "tools[0].parameters must be an object"),
        ({"input": "hi", "tools": [{"type": "namespace", "name": "ns"}]}, "tools[0].tools must be a list"),
        ({"input": "hi", "tools": [{"type": "namespace", "tools": []}]}, "tools[0].name must be a non-empty string"),
        ({"input": "hi", "tools": [{"type": "namespace", "name": "ns", "tools": [{"type": "function"}]}]},
         "tools[0].tools[0].name must be"),
        ({"input": "hi", "tool_choice": "sometimes"}, "'tool_choice' must be one of"),
        ({"input": "hi", "tool_choice": 3}, "'tool_choice' must be one of"),
        ({"input": "hi", "max_output_tokens": 0}, "'max_output_tokens' must be a positive integer"),
        ({"input": "hi", "temperature": "hot"}, "'temperature' must be a number"),
        ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x"}}}, "'text.format.schema' must be an object"),
    ],
)
def test_malformed_requests_name_the_field(body: dict[str, Any], message: str) -> None:
    with pytest.raises(RequestError) as info:
        responses.to_chat(body, {})
    assert message in info.value.message and info.value.status == 400


# --- replies -------------------------------------------------------------------------------------


def test_from_chat_text_reply_shape() -> None:
    body = responses.from_chat(reply(content="Hi there."))
    assert body == {
        "id": f"resp_{REQUEST_ID}", "object": "response", "created_at": 1_760_000_000, "status": "completed",
        "background": False, "error": None, "incomplete_details": None, "instructions": None, "max_output_tokens": None,
        "model": "qwen3.5",
        "output": [{
            "type": "message", "id": f"msg_{REQUEST_ID}", "role": "assistant", "status": "completed",
            "content": [{"type": "output_text", "text": "Hi there.", "annotations": [], "logprobs": []}],
        }],
        "parallel_tool_calls": True, "previous_response_id": None, "reasoning": {"effort": None, "summary": None},
        "store": False, "temperature": 1.0, "text": {"format": {"type": "text"}}, "tool_choice": "auto", "tools": [],
        "top_p": 1.0, "truncation": "disabled",
        "usage": {"input_tokens": 4, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": 3,
                  "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 7},
        "user": None, "metadata": {},
    }


def test_from_chat_reasoning_and_calls() -> None:
    inbound = responses.to_chat({"input": "hi", "temperature": 0.6, "tool_choice": "required"}, {})
    r = reply(
        content="Checking.", reasoning="Need two commands.",
        calls=(("bash", '{"command": "ls",  "timeout": 5}'), ("read", '{"path": "a.txt"}')),
        finish="tool_calls", options=inbound.options,
    )
    body = responses.from_chat(r)
    assert body["temperature"] == 0.6 and body["tool_choice"] == "required" and body["status"] == "completed"
    reasoning, message, first, second = body["output"]
    assert reasoning == {"type": "reasoning", "id": f"rs_{REQUEST_ID}", "summary": [{"type": "summary_text", "text": "Need two commands."}]}
    assert message["content"][0]["text"] == "Checking."
    assert first == {
        "type": "function_call", "id": "fc_0a1b2c3d4e5f60718293a4b5", "call_id": "call_0a1b2c3d4e5f60718293a4b5",
        "name": "bash", "arguments": '{"command":"ls","timeout":5}', "status": "completed",
    }
    assert second["arguments"] == '{"path":"a.txt"}' and second["call_id"] != first["call_id"]


def test_tool_only_reply_has_no_message_item_and_empty_reply_has_one() -> None:
    kinds = [i["type"] for i in responses.from_chat(reply(calls=(("bash", "{}"),)))["output"]]
    assert kinds == ["function_call"]
    (empty,) = responses.from_chat(reply(content=""))["output"]
    assert empty["type"] == "message" and empty["content"][0]["text"] == ""


def test_length_finish_is_incomplete() -> None:
    r = reply(content="cut sho", finish="length", options=responses.to_chat({"input": "hi", "max_output_tokens": 3}, {}).options)
    body = responses.from_chat(r)
    assert body["status"] == "incomplete" and body["incomplete_details"] == {"reason": "max_output_tokens"}
    assert body["max_output_tokens"] == 3 and body["output"][0]["status"] == "incomplete"
    last = events(r)[-1]
    # response.completed, not response.incomplete: Codex treats the latter as a stream error and retries.
    assert last["type"] == "response.completed" and last["response"] == body


TEXT_SEQUENCE = [
    "response.output_item.added", "response.content_part.added", "response.output_text.delta",
    "response.output_text.done", "response.content_part.done", "response.output_item.done",
]
REASONING_SEQUENCE = [
    "response.output_item.added", "response.reasoning_summary_part.added", "response.reasoning_summary_text.delta",
    "response.reasoning_summary_text.done", "response.reasoning_summary_part.done", "response.output_item.done",
]
CALL_SEQUENCE = [
    "response.output_item.added", "response.function_call_arguments.delta", "response.function_call_arguments.done",
    "response.output_item.done",
]
HEAD, TAIL = ["response.created", "response.in_progress"], ["response.completed"]


@pytest.mark.parametrize(
    ("r", "sequence"),
    [
        (reply(content="Hello."), HEAD + TEXT_SEQUENCE + TAIL),
        (reply(content="Hello.", reasoning="Think."), HEAD + REASONING_SEQUENCE + TEXT_SEQUENCE + TAIL),
        (reply(calls=(("bash", '{"command": "echo hi"}'),), finish="tool_calls"), HEAD + CALL_SEQUENCE + TAIL),
        (
            reply(content="Both.", reasoning="Two.", calls=(("bash", "{}"), ("read", '{"path": "x"}')), finish="tool_calls"),
            HEAD + REASONING_SEQUENCE + TEXT_SEQUENCE + CALL_SEQUENCE + CALL_SEQUENCE + TAIL,
        ),
    ],
    ids=["text", "reasoning+text", "function_call", "everything"],
)
def test_stream_event_sequence(r: Reply, sequence: list[str]) -> None:
    evs = events(r)
    assert [e["type"] for e in evs] == sequence
    assert [e["sequence_number"] for e in evs] == list(range(len(evs)))
    final = responses.from_chat(r)
    assert evs[-1]["response"] == final
    for opening in evs[:2]:
        assert opening["response"]["status"] == "in_progress" and opening["response"]["output"] == []
        assert opening["response"]["id"] == final["id"] and opening["response"]["usage"] is None


def test_stream_events_carry_their_indexes_and_rebuild_the_output() -> None:
    r = reply(content="Hello, world.", reasoning="Say hello.", calls=(("bash", '{"command": "echo hi"}'),), finish="tool_calls")
    evs = events(r)
    final = responses.from_chat(r)["output"]
    for e in evs:
        if e["type"] not in ("response.created", "response.in_progress", "response.completed"):
            assert final[e["output_index"]]["id"] == e.get("item_id", e.get("item", {}).get("id"))
        if "text" in e["type"] and "part" not in e["type"]:
            assert ("summary_index" in e) == ("reasoning" in e["type"]) and ("content_index" in e) == ("output_text" in e["type"])
    added = [e["item"] for e in evs if e["type"] == "response.output_item.added"]
    assert added[0]["summary"] == [] and added[1]["content"] == [] and added[2]["arguments"] == ""
    assert added[1]["status"] == added[2]["status"] == "in_progress"
    assert [e["item"] for e in evs if e["type"] == "response.output_item.done"] == final

    def joined(kind: str) -> str:
        return "".join(e["delta"] for e in evs if e["type"] == kind)

    done = {e["type"]: e for e in evs if e["type"].endswith(".done")}
    assert joined("response.reasoning_summary_text.delta") == done["response.reasoning_summary_text.done"]["text"] == "Say hello."
    assert joined("response.output_text.delta") == done["response.output_text.done"]["text"] == "Hello, world."
    arguments = done["response.function_call_arguments.done"]["arguments"]
    assert joined("response.function_call_arguments.delta") == arguments == '{"command":"echo hi"}'
    assert done["response.content_part.done"]["part"] == final[1]["content"][0]
    assert done["response.reasoning_summary_part.done"]["part"] == final[0]["summary"][0]
    part_added = next(e for e in evs if e["type"] == "response.content_part.added")
    assert part_added["part"] == {"type": "output_text", "text": "", "annotations": [], "logprobs": []}


def test_error_body() -> None:
    assert responses.error_body(400, "bad") == {"error": {"message": "bad", "type": "invalid_request_error", "param": None, "code": None}}
    assert responses.error_body(401, "key")["error"]["type"] == "authentication_error"
    assert responses.error_body(404, "nope")["error"]["type"] == "not_found_error"
    assert responses.error_body(502, "engine")["error"]["type"] == "server_error"


def test_contract() -> None:
    assert responses.API == "openai_responses"
    assert {(r.method, r.path) for r in responses.ROUTES} == {("POST", "/v1/responses"), ("POST", "/responses")}


async def test_codex_round_trip_through_the_gateway_is_an_exact_token_append(
    scripted_engine: EmbeddedEngine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert PROVIDERS.get(responses.API) is responses  # routes are built from the table
    client, store = await start_gateway(scripted_engine, tmp_path)
    try:
        session = await (await client.post("/sessions", json={}, headers=admin_headers(client))).json()
        headers = {"Authorization": f"Bearer {session['key']}"}
        body = fixture("codex_turn1.json")
        first = await client.post("/v1/responses", json=body, headers=headers)
        assert first.status == 200 and first.content_type == "text/event-stream"
        items = [e["item"] for e in parse_stream(await first.read()) if e["type"] == "response.output_item.done"]
        assert [i["type"] for i in items] == ["reasoning", "function_call"]
        reasoning, call = items
        assert call["name"] == "exec_command" and call["arguments"] == '{"cmd":"echo hi"}'
        body["input"] += [  # what Codex sends next: the items echoed, then the command's output
            {"type": "reasoning", "summary": reasoning["summary"], "encrypted_content": None},
            {k: call[k] for k in ("type", "id", "call_id", "name", "arguments")},
            {"type": "function_call_output", "call_id": call["call_id"], "output": "Chunk ID: 1\nOutput:\nhi\n"},
        ]
        second = await (await client.post("/responses", json={**body, "stream": False}, headers=headers)).json()
        assert second["status"] == "completed" and second["output"][-1]["content"][0]["text"].endswith("hi")
        r1, r2 = store.read(session["session_id"])
        assert r1.provider_api == "openai_responses" and "dropped tool of type 'web_search'" in r1.notes
        assert r2.prompt_ids[: len(r1.prompt_ids) + len(r1.response_ids)] == r1.prompt_ids + r1.response_ids
        refused = await client.post("/v1/responses", json={"model": "m"}, headers=headers)
        assert refused.status == 400 and (await refused.json())["error"]["type"] == "invalid_request_error"
    finally:
        await client.close()
