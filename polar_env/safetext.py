"""Text every writer can carry, when names come from the agent's workspace.

A Linux file name is any bytes but ``/`` and NUL. Python reads the bytes that are not UTF-8 as lone
surrogates (``surrogateescape``), which no UTF-8 encoder, JSON writer or runtime file API takes, and
control characters in a name break the lines of logs, diffs and shell commands. So the grader drops
such names before they reach anything (``bad_name``), lists them escaped (``shown``), and the writers
of reports and outcomes escape whatever lone surrogates are left (``json_safe``) instead of failing:
a name the agent chose must never cost a session its outcome (a masked ``node_lost``).
"""

from __future__ import annotations

import re
from typing import Any, TypeVar, cast

T = TypeVar("T")

_SURROGATE = re.compile("[\ud800-\udfff]")
_BAD = re.compile("[\x00-\x1f\x7f-\x9f\ud800-\udfff]")  # C0, DEL, C1, lone surrogates
_SHOWN = re.compile("[\x00-\x1f\x7f-\x9f\ud800-\udfff\\\\]")
_NAMED = {"\n": "\\n", "\t": "\\t", "\r": "\\r", "\\": "\\\\"}


def _escape(match: re.Match[str]) -> str:
    ch = match.group()
    code = ord(ch)
    if ch in _NAMED:
        return _NAMED[ch]
    if 0xDC80 <= code <= 0xDCFF:  # one undecodable byte, as surrogateescape kept it
        return f"\\x{code - 0xDC00:02x}"
    if code >= 0xD800:  # a lone surrogate of another origin
        return f"\\u{code:04x}"
    return f"\\x{code:02x}"


def bad_name(path: str) -> bool:
    """Whether ``path`` is not valid UTF-8 (it holds a lone surrogate) or holds a control character."""
    return _BAD.search(path) is not None


def shown(path: str) -> str:
    """``path`` as valid UTF-8 text: undecodable bytes as ``\\xff``, control characters as ``\\n``,
    ``\\t``, ``\\r`` or ``\\x7f``, and a backslash doubled, so no two names show alike."""
    return _SHOWN.sub(_escape, path)


def escape_surrogates(text: str) -> str:
    """``text`` with each lone surrogate as a backslash escape (the rest as it is)."""
    return _SURROGATE.sub(_escape, text) if _SURROGATE.search(text) is not None else text


def json_safe(value: T) -> T:
    """``value`` with the lone surrogates in its strings (dict keys too, through dicts, lists and
    tuples) escaped, so a JSON writer takes it; the very same object when there is none (the same
    type either way)."""
    return cast(T, _json_safe(value))


def _json_safe(value: Any) -> Any:
    if isinstance(value, str):
        return escape_surrogates(value)
    if isinstance(value, dict):
        pairs = [(_json_safe(k), _json_safe(v)) for k, v in value.items()]
        if all(k is k0 and v is v0 for (k, v), (k0, v0) in zip(pairs, value.items(), strict=True)):
            return value
        return dict(pairs)
    if isinstance(value, list | tuple):
        items = [_json_safe(v) for v in value]
        if all(a is b for a, b in zip(items, value, strict=True)):
            return value
        return items if isinstance(value, list) else tuple(items)
    return value
