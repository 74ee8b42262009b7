from __future__ import annotations

import asyncio
import copy
import json
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import make_mocked_request

from polar_env.chat.qwen35.template import render
from polar_env.errors import RequestError
from polar_env.proxy.providers import gemini
from polar_env.proxy.providers.base import Reply, compact_arguments
from polar_env.records import AssistantMessage, ChatRequest, Generation, ProviderAPI, ToolCall

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "providers" / "gemini"
STREAM = {"model": "gemini-2.5-pro", "method": "streamGenerateContent"}
UNARY = {"model": "gemini-2.5-pro", "method": "generateContent"}


def load(name: str) -> dict[str, Any]:
    return json.loads((FIXTURES / f"{name}.json").read_text())


def reply(
    content: str | None = None,
    reasoning: str | None = None,
    calls: list[ToolCall] | None = None,
    finish: str = "stop",
    options: dict[str, Any] | None = None,
) -> Reply:
    generation = Generation(
        message=AssistantMessage(content=content, reasoning=reasoning, tool_calls=calls or []),
        prompt_ids=list(range(11)),
        response_ids=[5, 6, 7, 8],
        response_logprobs=[-0.1, -0.2, -0.3, -0.4],
        finish_reason=finish,
    )
    return Reply(generation, model="gemini-2.5-pro", request_id="ab" * 16, created=1_780_300_000, options=options or {})


def frames(chunks: list[bytes]) -> list[dict[str, Any]]:
    out = []
    for chunk in chunks:
        assert chunk.startswith(b"data: ") and chunk.endswith(b"\n\n") and chunk.count(b"\n") == 2, chunk
        out.append(json.loads(chunk[len(b"data: ") : -2]))
    return out


SHELL_CALL = ToolCall(
    id="chatcmpl-tool-0123456789abcdef0123456789abcdef",
    name="run_shell_command",
    arguments='{"command": "echo hi", "description": "Print hi"}',
)


# ---- to_chat: real client bodies ------------------------------------------------------------


def test_cli_tool_round_trip_normalizes_fully() -> None:
    inbound = gemini.to_chat(load("cli_turn2"), STREAM)
    body = load("cli_turn2")
    call_id = "run_shell_command_1780300000123_0"
    expected = ChatRequest(
        messages=[
            {"role": "system", "content": body["systemInstruction"]["parts"][0]["text"]},
            {"role": "user", "content": body["contents"][0]["parts"][0]["text"]},
            {"role": "user", "content": "Run `echo hi` in the shell, then tell me what it printed."},
            {
                "role": "assistant",
                "content": "I'll run the command.",
                "tool_calls": [
                    {
                        "id": call_id,
                        "type": "function",
                        "function": {
                            "name": "run_shell_command",
                            "arguments": '{"command":"echo hi","description":"Print hi"}',
                        },
                    }
                ],
            },
            {"role": "tool", "tool_call_id": call_id, "content": "Output: hi\nProcess Group PGID: 4242"},
        ],
        tools=[
            {
                "type": "function",
                "function": {
                    "name": d["name"],
                    "description": d["description"],
                    "parameters": d["parametersJsonSchema"],
                },
            }
            for d in body["tools"][0]["functionDeclarations"]
        ],
        temperature=1.0,
        top_p=0.95,
        extra_body={"top_k": 64},
    )
    assert inbound.chat == expected
    assert inbound.stream is True
    assert inbound.model == "gemini-2.5-pro"
    assert inbound.notes == []
    assert inbound.options == {"include_thoughts": True}


def test_cli_turn1_messages_are_a_prefix_of_turn2() -> None:
    one = gemini.to_chat(load("cli_turn1"), STREAM).chat
    two = gemini.to_chat(load("cli_turn2"), STREAM).chat
    assert two.messages[: len(one.messages)] == one.messages
    assert one.tools == two.tools


def test_classifier_gets_json_schema_with_lowercase_types() -> None:
    inbound = gemini.to_chat(load("cli_classifier"), UNARY)
    assert inbound.stream is False
    assert inbound.chat.response_format == {
        "type": "json_schema",
        "json_schema": {
            "name": "response",
            "schema": {
                "type": "object",
                "properties": {
                    "complexity_reasoning": {"type": "string", "description": "Brief explanation for the score."},
                    "complexity_score": {"type": "integer", "description": "Complexity score from 1-100."},
                },
                "required": ["complexity_reasoning", "complexity_score"],
            },
        },
    }
    assert inbound.chat.max_tokens == 1024
    assert inbound.chat.temperature == 0.0 and inbound.chat.top_p == 1.0
    assert inbound.chat.chat_template_kwargs == {}  # a 512 budget keeps thinking on
    assert inbound.options == {"include_thoughts": False}
    assert [m["role"] for m in inbound.chat.messages] == ["system", "user"]


def test_pi_google_mode_pairs_id_less_calls_by_name_in_order() -> None:
    inbound = gemini.to_chat(load("pi_google"), STREAM)
    chat = inbound.chat
    assert chat.max_tokens == 16384
    assert inbound.options == {"include_thoughts": True}
    roles = [m["role"] for m in chat.messages]
    assert roles == ["system", "user", "assistant", "tool", "assistant", "tool", "tool"]
    first, second = chat.messages[2], chat.messages[4]
    assert first["reasoning_content"] == "I should list files first."
    assert first["content"] is None
    assert [c["id"] for c in first["tool_calls"]] == ["bash_1_0"]
    assert [c["id"] for c in second["tool_calls"]] == ["read_3_0", "read_3_1"]
    assert [c["function"]["arguments"] for c in second["tool_calls"]] == [
        '{"path":"README.md"}',
        '{"path":"notes.txt"}',
    ]
    assert chat.messages[3] == {"role": "tool", "tool_call_id": "bash_1_0", "content": "README.md\nnotes.txt\n"}
    assert chat.messages[5] == {"role": "tool", "tool_call_id": "read_3_0", "content": "# Demo\n"}
    # Not {"output": str}: the whole response stays, as compact JSON.
    assert chat.messages[6] == {
        "role": "tool",
        "tool_call_id": "read_3_1",
        "content": '{"error":"EACCES: permission denied"}',
    }


# ---- to_chat: id pairing --------------------------------------------------------------------


def _turns(calls: list[dict[str, Any]], responses: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "contents": [
            {"parts": [{"text": "go"}]},  # no role: user
            {"role": "model", "parts": [{"functionCall": c} for c in calls]},
            {"role": "user", "parts": [{"functionResponse": r} for r in responses]},
        ]
    }


def test_responses_pair_by_id_regardless_of_order() -> None:
    calls = [{"name": "f", "args": {}, "id": "a"}, {"name": "f", "args": {}, "id": "b"}]
    responses = [
        {"name": "f", "id": "b", "response": {"output": "B"}},
        {"name": "f", "id": "a", "response": {"output": "A"}},
    ]
    tools = gemini.to_chat(_turns(calls, responses), UNARY).chat.messages[2:]
    assert [(m["tool_call_id"], m["content"]) for m in tools] == [("b", "B"), ("a", "A")]


def test_response_with_unknown_id_falls_back_to_name() -> None:
    calls = [{"name": "f", "args": {"x": 1}}, {"name": "g", "args": {}}]
    responses = [{"name": "g", "id": "zzz", "response": {"output": "G"}}, {"name": "f", "response": {"output": "F"}}]
    chat = gemini.to_chat(_turns(calls, responses), UNARY).chat
    assert [c["id"] for c in chat.messages[1]["tool_calls"]] == ["f_1_0", "g_1_1"]
    assert [m["tool_call_id"] for m in chat.messages[2:]] == ["g_1_1", "f_1_0"]


def test_orphan_response_keeps_its_own_or_a_synthesized_id() -> None:
    body = {
        "contents": [
            {
                "role": "user",
                "parts": [
                    {"functionResponse": {"name": "f", "id": "mine", "response": {"output": "1"}}},
                    {"functionResponse": {"name": "f", "response": {"output": "2"}}},
                ],
            }
        ]
    }
    assert [m["tool_call_id"] for m in gemini.to_chat(body, UNARY).chat.messages] == ["mine", "f_0_1"]


def test_echo_of_our_reply_round_trips() -> None:
    """What we send comes back (with Gemini CLI's signature added) as the same call."""
    sent = gemini.from_chat(reply(content="Sure.", calls=[SHELL_CALL]))["candidates"][0]["content"]
    echoed = copy.deepcopy(sent)
    echoed["parts"][1]["thoughtSignature"] = "skip_thought_signature_validator"
    call = echoed["parts"][1]["functionCall"]
    body = {
        "contents": [
            {"role": "user", "parts": [{"text": "hi"}]},
            echoed,
            {
                "role": "user",
                "parts": [
                    {"functionResponse": {"id": call["id"], "name": call["name"], "response": {"output": "hi\n"}}}
                ],
            },
        ]
    }
    messages = gemini.to_chat(body, STREAM).chat.messages
    (tool_call,) = messages[1]["tool_calls"]
    assert tool_call["id"] == call["id"] == "run_shell_command__0123456789abcdef01234567"
    assert tool_call["function"]["arguments"] == compact_arguments(SHELL_CALL.arguments)
    assert messages[2] == {"role": "tool", "tool_call_id": call["id"], "content": "hi\n"}


def test_user_turn_with_results_and_text_puts_tool_messages_first() -> None:
    body = _turns([{"name": "f", "args": {}}], [{"name": "f", "response": {"output": "ok"}}])
    body["contents"][2]["parts"].insert(0, {"text": "also, "})
    body["contents"][2]["parts"].append({"text": "thanks"})
    messages = gemini.to_chat(body, UNARY).chat.messages
    assert [m["role"] for m in messages] == ["user", "assistant", "tool", "user"]
    assert messages[3]["content"] == "also, thanks"


# ---- to_chat: schemas, tools, config --------------------------------------------------------


def test_schema_normalization_is_recursive_and_leaves_data_alone() -> None:
    schema = {
        "type": "OBJECT",
        "propertyOrdering": ["type", "tags", "choice"],
        "properties": {
            "type": {"type": "STRING", "enum": ["OBJECT", "STRING"], "format": "enum", "nullable": True},
            "tags": {"type": "ARRAY", "items": {"type": "STRING"}, "minItems": "1"},
            "choice": {"anyOf": [{"type": "INTEGER"}, {"type": "BOOLEAN"}], "nullable": True},
            "nested": {"type": "OBJECT", "properties": {"n": {"type": "NUMBER", "default": "OBJECT"}}},
        },
        "required": ["type"],
    }
    assert gemini.normalize_schema(schema) == {
        "type": "object",
        "properties": {
            "type": {"type": ["string", "null"], "enum": ["OBJECT", "STRING"]},
            "tags": {"type": "array", "items": {"type": "string"}, "minItems": 1},
            "choice": {"anyOf": [{"type": "integer"}, {"type": "boolean"}, {"type": "null"}]},
            "nested": {"type": "object", "properties": {"n": {"type": "number", "default": "OBJECT"}}},
        },
        "required": ["type"],
    }
    assert gemini.normalize_schema({"type": "object", "additionalProperties": False}) == {
        "type": "object",
        "additionalProperties": False,
    }


def test_openapi_parameters_and_missing_parameters() -> None:
    body = {
        "contents": [{"role": "user", "parts": [{"text": "x"}]}],
        "tools": [
            {
                "functionDeclarations": [
                    {
                        "name": "get",
                        "description": "Get",
                        "parameters": {"type": "OBJECT", "properties": {"k": {"type": "STRING"}}},
                    },
                    {"name": "ping"},
                ]
            }
        ],
    }
    assert gemini.to_chat(body, UNARY).chat.tools == [
        {
            "type": "function",
            "function": {
                "name": "get",
                "description": "Get",
                "parameters": {"type": "object", "properties": {"k": {"type": "string"}}},
            },
        },
        {"type": "function", "function": {"name": "ping", "parameters": {"type": "object", "properties": {}}}},
    ]


def test_server_side_tools_are_dropped_with_notes() -> None:
    body = load("cli_turn1")
    body["tools"] = [{"googleSearch": {}}, *body["tools"], {"codeExecution": {}, "urlContext": {}}]
    inbound = gemini.to_chat(body, STREAM)
    assert [t["function"]["name"] for t in inbound.chat.tools] == ["run_shell_command", "read_file"]
    assert len(inbound.notes) == 3
    assert all(any(kind in n for n in inbound.notes) for kind in ("googleSearch", "codeExecution", "urlContext"))


@pytest.mark.parametrize(
    ("config", "choice"),
    [
        ({"mode": "AUTO"}, "auto"),
        ({"mode": "NONE"}, "none"),
        ({"mode": "ANY"}, "required"),
        (
            {"mode": "ANY", "allowedFunctionNames": ["read_file"]},
            {"type": "function", "function": {"name": "read_file"}},
        ),
        ({}, "auto"),
    ],
)
def test_function_calling_mode_maps_to_tool_choice(config: dict[str, Any], choice: Any) -> None:
    body = load("cli_turn1") | {"toolConfig": {"functionCallingConfig": config}}
    assert gemini.to_chat(body, STREAM).chat.tool_choice == choice


def test_tool_choice_without_tools_is_dropped() -> None:
    body = {"contents": [{"parts": [{"text": "x"}]}], "toolConfig": {"functionCallingConfig": {"mode": "ANY"}}}
    inbound = gemini.to_chat(body, UNARY)
    assert inbound.chat.tool_choice is None and inbound.notes


def test_generation_config_fields() -> None:
    body = {
        "contents": [{"parts": [{"text": "x"}]}],
        "systemInstruction": "Be brief.",
        "generationConfig": {
            "stopSequences": ["END"],
            "seed": 7,
            "candidateCount": 1,
            "presencePenalty": 0.5,
            "thinkingConfig": {"thinkingBudget": 0},
            "responseMimeType": "application/json",
            "mediaResolution": "MEDIA_RESOLUTION_LOW",
        },
        "safetySettings": [{"category": "HARM_CATEGORY_HARASSMENT", "threshold": "BLOCK_NONE"}],
    }
    chat = gemini.to_chat(body, UNARY).chat
    assert chat.messages[0] == {"role": "system", "content": "Be brief."}
    assert chat.stop == ["END"] and chat.seed == 7
    assert chat.chat_template_kwargs == {"enable_thinking": False}
    assert chat.response_format == {"type": "json_object"}
    assert chat.extra_body == {"presence_penalty": 0.5}


def test_media_and_code_parts() -> None:
    body = {
        "contents": [
            {
                "role": "user",
                "parts": [
                    {"text": "look: "},
                    {"inlineData": {"mimeType": "image/png", "data": "iVBORw0KGgo="}},
                    {"inlineData": {"mimeType": "application/pdf", "data": "JVBERi0="}},
                    {"fileData": {"mimeType": "video/mp4", "fileUri": "gs://bucket/v.mp4"}},
                ],
            },
            {
                "role": "model",
                "parts": [
                    {"executableCode": {"language": "PYTHON", "code": "print(1)"}},
                    {"codeExecutionResult": {"outcome": "OUTCOME_OK", "output": "1\n"}},
                ],
            },
        ]
    }
    inbound = gemini.to_chat(body, UNARY)
    user, model = inbound.chat.messages
    assert user["content"] == [
        {"type": "text", "text": "look: "},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}},
    ]
    assert model["content"] == "```python\nprint(1)\n```Code execution result (OUTCOME_OK):\n1\n"
    assert len(inbound.notes) == 4


def test_signature_only_parts_and_empty_turns_are_tolerated() -> None:
    body = {
        "contents": [
            {"role": "user", "parts": [{"text": "x"}]},
            {"role": "model", "parts": [{"text": "y", "thoughtSignature": "c2ln"}, {"thoughtSignature": "c2ln"}]},
            {"role": "model", "parts": []},
            {"role": "user", "parts": [{"text": "z"}]},
        ]
    }
    inbound = gemini.to_chat(body, UNARY)
    assert [m["content"] for m in inbound.chat.messages] == ["x", "y", "z"]
    assert len(inbound.notes) == 1


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({}, "contents"),
        ({"contents": {"role": "user"}}, "contents"),
        ({"contents": []}, "contents"),
        ({"contents": ["hi"]}, "contents[0]"),
        ({"contents": [{"role": "system", "parts": [{"text": "x"}]}]}, "contents[0].role"),
        ({"contents": [{"role": ["user"], "parts": [{"text": "x"}]}]}, "contents[0].role"),
        ({"contents": [{"role": "user", "parts": "x"}]}, "contents[0].parts"),
        ({"contents": [{"role": "user", "parts": [{}]}]}, "contents[0].parts[0]"),
        ({"contents": [{"role": "user", "parts": [{"blob": 1}]}]}, "contents[0].parts[0]"),
        ({"contents": [{"role": "user", "parts": [{"text": 3}]}]}, "contents[0].parts[0].text"),
        ({"contents": [{"role": "model", "parts": [{"functionCall": {"args": {}}}]}]}, "functionCall.name"),
        (
            {"contents": [{"role": "model", "parts": [{"functionCall": {"name": "f", "args": [1]}}]}]},
            "functionCall.args",
        ),
        ({"contents": [{"role": "user", "parts": [{"functionCall": {"name": "f"}}]}]}, "functionCall"),
        ({"contents": [{"role": "model", "parts": [{"functionResponse": {"name": "f"}}]}]}, "functionResponse"),
        ({"contents": [{"parts": [{"functionResponse": {"response": {}}}]}]}, "functionResponse.name"),
        ({"contents": [{"parts": [{"inlineData": {"mimeType": "image/png"}}]}]}, "inlineData"),
        ({"contents": [{"parts": [{"functionResponse": {"name": "f", "response": {"n": 2**70}}}]}]}, "response"),
        ({"contents": [{"parts": [{"text": "x"}]}], "generationConfig": []}, "generationConfig"),
        ({"contents": [{"parts": [{"text": "x"}]}], "generationConfig": {"candidateCount": 2}}, "candidateCount"),
        ({"contents": [{"parts": [{"text": "x"}]}], "generationConfig": {"temperature": "hot"}}, "temperature"),
        ({"contents": [{"parts": [{"text": "x"}]}], "generationConfig": {"maxOutputTokens": 0}}, "maxOutputTokens"),
        ({"contents": [{"parts": [{"text": "x"}]}], "tools": {"functionDeclarations": []}}, "tools"),
        (
            {"contents": [{"parts": [{"text": "x"}]}], "tools": [{"functionDeclarations": [{"description": "d"}]}]},
            "name",
        ),
        ({"contents": [{"parts": [{"text": "x"}]}], "toolConfig": {"functionCallingConfig": {"mode": "SOME"}}}, "mode"),
        ({"contents": [{"parts": [{"text": "x"}]}], "systemInstruction": 5}, "systemInstruction"),
    ],
)
def test_malformed_requests_name_the_field(body: dict[str, Any], field: str) -> None:
    with pytest.raises(RequestError) as err:
        gemini.to_chat(body, UNARY)
    assert err.value.status == 400
    assert field in err.value.message


def test_unknown_method_is_404() -> None:
    with pytest.raises(RequestError) as err:
        gemini.to_chat(load("cli_turn1"), {"model": "m", "method": "countTokens"})
    assert err.value.status == 404


def test_routes_resolve_model_and_method() -> None:
    app = web.Application()

    async def handler(request: web.Request) -> web.Response:
        return web.Response()

    for route in gemini.ROUTES:
        app.router.add_route(route.method, route.path, handler)

    async def resolve(path: str) -> dict[str, str]:
        return dict(await app.router.resolve(make_mocked_request("POST", path, app=app)))

    assert gemini.API is ProviderAPI.GEMINI
    got = asyncio.run(resolve("/v1beta/models/gemini-2.5-pro:streamGenerateContent?alt=sse"))
    assert got == {"model": "gemini-2.5-pro", "method": "streamGenerateContent"}
    assert asyncio.run(resolve("/v1/models/m-1.5:generateContent")) == {"model": "m-1.5", "method": "generateContent"}


# ---- replies --------------------------------------------------------------------------------


def test_from_chat_shape() -> None:
    body = gemini.from_chat(
        reply(content="Running it.", reasoning="Need a shell.", calls=[SHELL_CALL], finish="tool_calls")
    )
    assert body == {
        "candidates": [
            {
                "content": {
                    "parts": [
                        {"text": "Need a shell.", "thought": True},
                        {"text": "Running it."},
                        {
                            "functionCall": {
                                "name": "run_shell_command",
                                "args": {"command": "echo hi", "description": "Print hi"},
                                "id": "run_shell_command__0123456789abcdef01234567",
                            }
                        },
                    ],
                    "role": "model",
                },
                "finishReason": "STOP",
                "index": 0,
            }
        ],
        "usageMetadata": {"promptTokenCount": 11, "candidatesTokenCount": 4, "totalTokenCount": 15},
        "modelVersion": "gemini-2.5-pro",
        "responseId": "ab" * 16,
    }


def test_from_chat_finish_reasons_and_hidden_thoughts() -> None:
    length = gemini.from_chat(
        reply(content="partial", reasoning="r", finish="length", options={"include_thoughts": False})
    )
    assert length["candidates"][0]["finishReason"] == "MAX_TOKENS"
    assert length["candidates"][0]["content"]["parts"] == [{"text": "partial"}]
    assert gemini.from_chat(reply(finish="abort"))["candidates"][0]["finishReason"] == "OTHER"
    assert gemini.from_chat(reply())["candidates"][0]["content"]["parts"] == []


def test_classifier_reply_is_parseable_json_text() -> None:
    answer = '{"complexity_reasoning": "Simple command.", "complexity_score": 5}'
    body = gemini.from_chat(reply(content=answer, options=gemini.to_chat(load("cli_classifier"), UNARY).options))
    (part,) = body["candidates"][0]["content"]["parts"]
    assert json.loads(part["text"])["complexity_score"] == 5


def test_stream_chunks_concatenate_to_the_reply() -> None:
    content = "hi was printed.\nDone."
    r = reply(content=content, reasoning="The command ran.", calls=[SHELL_CALL], options={"include_thoughts": True})
    chunks = frames(list(gemini.stream_events(r)))
    assert len(chunks) == 3
    parts = [p for c in chunks for p in c["candidates"][0]["content"]["parts"]]
    assert "".join(p["text"] for p in parts if "text" in p and not p.get("thought")) == content
    assert "".join(p["text"] for p in parts if p.get("thought")) == "The command ran."
    assert [p["functionCall"]["name"] for p in parts if "functionCall" in p] == ["run_shell_command"]
    # Thoughts stand alone in the first chunk; only the last chunk finishes and reports usage.
    assert all(p.get("thought") for p in chunks[0]["candidates"][0]["content"]["parts"])
    assert ["finishReason" in c["candidates"][0] for c in chunks] == [False, False, True]
    assert ["usageMetadata" in c for c in chunks] == [False, False, True]
    assert chunks[-1]["usageMetadata"]["totalTokenCount"] == 15
    assert all(c["responseId"] == "ab" * 16 and c["modelVersion"] == "gemini-2.5-pro" for c in chunks)
    # The stream carries the same parts as the unary body.
    assert parts == gemini.from_chat(r)["candidates"][0]["content"]["parts"]


def test_stream_of_only_thinking_ends_with_an_empty_finish_chunk() -> None:
    chunks = frames(list(gemini.stream_events(reply(reasoning="hmm", finish="length"))))
    assert [c["candidates"][0]["content"]["parts"] for c in chunks] == [[{"text": "hmm", "thought": True}], []]
    assert chunks[-1]["candidates"][0]["finishReason"] == "MAX_TOKENS"
    (only,) = frames(list(gemini.stream_events(reply(content="x"))))
    assert only["candidates"][0]["finishReason"] == "STOP" and "usageMetadata" in only


@pytest.mark.parametrize(
    ("status", "kind"),
    [
        (400, "INVALID_ARGUMENT"),
        (401, "UNAUTHENTICATED"),
        (403, "PERMISSION_DENIED"),
        (404, "NOT_FOUND"),
        (429, "RESOURCE_EXHAUSTED"),
        (500, "INTERNAL"),
        (503, "UNAVAILABLE"),
        (504, "DEADLINE_EXCEEDED"),
        (422, "INVALID_ARGUMENT"),
        (502, "INTERNAL"),
    ],
)
def test_error_body(status: int, kind: str) -> None:
    assert gemini.error_body(status, "boom") == {"error": {"code": status, "message": "boom", "status": kind}}


@pytest.mark.parametrize("name", ["cli_turn1", "cli_turn2", "cli_classifier", "pi_google"])
def test_fixtures_render_with_the_engine_template(name: str) -> None:
    chat = gemini.to_chat(load(name), STREAM).chat
    prompt = render(chat.messages, chat.tools, enable_thinking=chat.chat_template_kwargs.get("enable_thinking", True))
    assert prompt.endswith("<|im_start|>assistant\n<think>\n")
    if name != "cli_classifier":
        assert "<tool_response>" in prompt or name == "cli_turn1"
        assert '"parameters": {"type": "object"' in prompt
