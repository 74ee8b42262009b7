from __future__ import annotations

import json

from polar_env.chat.qwen35.parser import parse_output

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "run",
            "parameters": {
                "type": "object",
                "properties": {
                    "cmd": {"type": "string"},
                    "n": {"type": "integer"},
                    "x": {"type": "number"},
                    "force": {"type": "boolean"},
                    "opts": {"type": "object"},
                    "argv": {"type": "array"},
                },
            },
        },
    }
]

CALL = (
    "<tool_call>\n<function=run>\n<parameter=cmd>\necho 'a b'\n</parameter>\n<parameter=n>\n3\n</parameter>\n"
    "<parameter=x>\n2.5\n</parameter>\n<parameter=force>\ntrue\n</parameter>\n"
    '<parameter=opts>\n{"k": 1}\n</parameter>\n<parameter=argv>\n["bash", "-lc", "ls"]\n</parameter>\n'
    "</function>\n</tool_call>"
)


def test_reasoning_content_and_typed_tool_arguments() -> None:
    msg = parse_output("Plan it.\n</think>\n\nRunning now.\n\n" + CALL, tools=TOOLS, thinking=True)
    assert msg.reasoning == "Plan it."
    assert msg.content == "Running now."
    (call,) = msg.tool_calls
    assert call.name == "run" and call.id.startswith("chatcmpl-tool-")
    assert json.loads(call.arguments) == {
        "cmd": "echo 'a b'", "n": 3, "x": 2.5, "force": True, "opts": {"k": 1}, "argv": ["bash", "-lc", "ls"],
    }
    assert call.arguments.startswith('{"cmd": ')  # vLLM-style spaced JSON; the gateway compacts it


def test_two_calls_and_no_content() -> None:
    msg = parse_output(CALL + "\n" + CALL, tools=TOOLS, thinking=False)
    assert msg.content is None and msg.reasoning is None and len(msg.tool_calls) == 2


def test_unclosed_thinking_is_all_reasoning() -> None:
    msg = parse_output("still thinking", tools=TOOLS, thinking=True)
    assert msg.reasoning == "still thinking" and msg.content is None


def test_truncated_tool_call_stays_text() -> None:
    text = "<tool_call>\n<function=run>\n<parameter=cmd>\nls"
    msg = parse_output(text, tools=TOOLS, thinking=False)
    assert msg.tool_calls == [] and msg.content == text


def test_without_tools_tool_markup_is_content() -> None:
    msg = parse_output(CALL, tools=[], thinking=False)
    assert msg.tool_calls == [] and msg.content == CALL


def test_tool_call_ends_reasoning_without_think_close() -> None:
    """vLLM's qwen3 parser: with thinking on, <tool_call> ends the reasoning too."""
    msg = parse_output("Let me run.\n" + CALL, tools=TOOLS, thinking=True)
    assert msg.reasoning == "Let me run." and len(msg.tool_calls) == 1 and msg.content is None
    bare = parse_output(CALL, tools=TOOLS, thinking=True)
    assert bare.reasoning is None and len(bare.tool_calls) == 1


def test_empty_reasoning_is_null() -> None:
    assert parse_output("</think>\n\nHi", tools=[], thinking=True).reasoning is None
    assert parse_output("", tools=[], thinking=True).reasoning is None
