from __future__ import annotations

import json
from pathlib import Path

import pytest

from polar_env.chat.qwen35.template import APPEND_ONLY, QWEN35, TemplateQuirks, render, render_assistant_body
from polar_env.errors import RequestError

GOLDEN = json.loads((Path(__file__).parents[1] / "fixtures" / "qwen" / "template_golden.json").read_text())


@pytest.mark.parametrize("case", GOLDEN["cases"],
                         ids=lambda c: f"{len(c['messages'])}msgs-tools{bool(c['tools'])}-think{c['enable_thinking']}")
def test_matches_published_template(case: dict) -> None:
    assert render(case["messages"], case["tools"], enable_thinking=case["enable_thinking"]) == case["expected"]


TOOL_LOOP = [
    {"role": "system", "content": "You are a coder."},
    {"role": "user", "content": "list files"},
    {
        "role": "assistant",
        "content": "",
        "reasoning_content": "Need tool.",
        "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "bash", "arguments": '{"command": "ls"}'}}],
    },
    {"role": "tool", "tool_call_id": "c1", "content": "a.py"},
    {"role": "assistant", "content": "Found a.py.", "reasoning_content": "Done."},
]


def test_think_stripped_before_last_user_query() -> None:
    loop = render(TOOL_LOOP, add_generation_prompt=False)
    assert "Need tool." in loop  # inside the tool loop reasoning survives
    after_user = render(TOOL_LOOP + [{"role": "user", "content": "thanks"}], add_generation_prompt=False)
    assert "Need tool." not in after_user and "Done." not in after_user
    assert not after_user.startswith(loop)  # the Qwen3.5 "false fork"


def test_append_only_quirks_keep_prefix() -> None:
    loop = render(TOOL_LOOP, add_generation_prompt=False, quirks=APPEND_ONLY)
    after_user = render(TOOL_LOOP + [{"role": "user", "content": "thanks"}], add_generation_prompt=False, quirks=APPEND_ONLY)
    assert after_user.startswith(loop)
    assert "Need tool." in after_user


def test_trim_and_newline_switches() -> None:
    msgs = [{"role": "user", "content": "  padded  "}]
    assert "<|im_start|>user\npadded<|im_end|>\n" in render(msgs)
    assert "<|im_start|>user\n  padded  <|im_end|><|im_start|>" in render(msgs, quirks=APPEND_ONLY)
    only_trim_off = TemplateQuirks(trim_content=False)
    assert "  padded  <|im_end|>\n" in render(msgs, quirks=only_trim_off)


def test_generation_prompt_thinking_switch() -> None:
    msgs = [{"role": "user", "content": "hi"}]
    assert render(msgs).endswith("<|im_start|>assistant\n<think>\n")
    assert render(msgs, enable_thinking=False).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_tool_argument_rendering_follows_jinja_string() -> None:
    body = render_assistant_body(
        {"role": "assistant", "content": None, "tool_calls": [
            {"function": {"name": "f", "arguments": {"flag": True, "n": 1.0, "obj": {"k": [1, "é"]}, "none": None}}}
        ]},
        with_think=False,
    )
    assert "<parameter=flag>\nTrue\n</parameter>" in body
    assert "<parameter=n>\n1.0\n</parameter>" in body
    assert '<parameter=obj>\n{"k": [1, "é"]}\n</parameter>' in body
    assert "<parameter=none>\nNone\n</parameter>" in body


@pytest.mark.parametrize(
    "messages, error",
    [
        ([], "No messages"),
        ([{"role": "assistant", "content": "x"}], "No user query"),
        ([{"role": "user", "content": "a"}, {"role": "system", "content": "late"}], "System message must be at the beginning"),
        ([{"role": "user", "content": "a"}, {"role": "wizard", "content": "b"}], "Unexpected message role"),
        ([{"role": "user", "content": [{"type": "audio"}]}], "Unexpected item type"),
        ([{"role": "user", "content": "a"}, {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{bad"}}]}],
         "not valid JSON"),
    ],
)
def test_template_errors_are_request_errors(messages: list, error: str) -> None:
    with pytest.raises(RequestError, match=error):
        render(messages, quirks=QWEN35)
