"""What the engine's chat template would refuse, checked by the gateway before the engine is
called, so a malformed conversation costs no engine time and always gets the same 400.

Every family: content is null, a string or a list of text/image/video parts; tool-call arguments
are a JSON object (or its JSON text). The family's ``RequestRules`` add the rest (Qwen3.5's, the
checks its Jinja render makes: system messages only first, at least one real user query).
Cost is linear in the text, without rendering it (a 1 MB Claude Code history: ~0.3 ms).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from polar_env.chat import RequestRules
from polar_env.chat.content import content_text
from polar_env.errors import RequestError

_ROLES = frozenset({"system", "user", "assistant", "tool"})
ANY_TEMPLATE = RequestRules()  # the checks every family makes
MAX_ARGUMENT_DEPTH = 128  # nesting of tool-call arguments; the template re-parses them recursively


def _too_deep(value: Any, limit: int = MAX_ARGUMENT_DEPTH) -> bool:
    """Whether ``value`` nests deeper than ``limit`` (iterative: no recursion of our own)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, Mapping):
            children: Any = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        if depth > limit:
            return True
        stack.extend((child, depth + 1) for child in children)
    return False


def _check_arguments(call: Any, where: str) -> None:
    fn = call.get("function", call) if isinstance(call, Mapping) else None
    if not isinstance(fn, Mapping) or not isinstance(fn.get("name", ""), str):
        raise RequestError(f"{where} must be an object with function.name")
    args = fn.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as exc:
            raise RequestError(f"{where}: tool call arguments are not valid JSON: {exc}") from exc
        except RecursionError:
            raise RequestError(f"{where}: tool call arguments nest deeper than {MAX_ARGUMENT_DEPTH} levels") from None
    if not isinstance(args, Mapping):
        raise RequestError(f"{where}: tool call arguments must be a JSON object")
    if _too_deep(args):
        raise RequestError(f"{where}: tool call arguments nest deeper than {MAX_ARGUMENT_DEPTH} levels")


def check_messages(messages: Sequence[Mapping[str, Any]], rules: RequestRules = ANY_TEMPLATE, checked: int = 0) -> None:
    """Raise the RequestError the template render would raise, without rendering.
    ``checked``: how many leading messages are the very objects of a list that passed this check
    (shared history, ``proxy/reuse.py``): their content and tool calls are not read again; the
    rules that depend on a message's position still see every message."""
    if not messages:
        raise RequestError("No messages provided.")
    has_query = False
    for index, msg in enumerate(messages):
        role = msg.get("role")
        if role not in _ROLES:
            raise RequestError(f"messages[{index}]: unexpected message role {str(role)[:40]!r}")
        if role == "system" and index != 0 and rules.system_first:
            raise RequestError("System message must be at the beginning.")
        if index < checked and (has_query or role != "user"):
            continue
        try:
            text = content_text(msg.get("content"))
        except RequestError as exc:
            raise RequestError(f"messages[{index}].content: {exc.message}") from exc
        if role == "user":
            if not has_query:  # one real query is enough: later ones need not be stripped
                stripped = text.strip()
                has_query = not (stripped.startswith("<tool_response>") and stripped.endswith("</tool_response>"))
        elif role == "assistant":
            calls = msg.get("tool_calls") or []
            if not isinstance(calls, Sequence) or isinstance(calls, (str, bytes)):
                raise RequestError(f"messages[{index}].tool_calls must be a list")
            for k, call in enumerate(calls):
                _check_arguments(call, f"messages[{index}].tool_calls[{k}]")
    if not has_query and rules.needs_user_query:
        raise RequestError("No user query found in messages.")
