"""Server-sent-event framing shared by every provider's stream_events."""

from __future__ import annotations

from typing import Any

import orjson

DONE = b"data: [DONE]\n\n"


def sse(data: Any, event: str | None = None) -> bytes:
    """One SSE frame: optional ``event:`` line, one ``data:`` line of compact JSON, blank line."""
    payload = b"data: " + orjson.dumps(data) + b"\n\n"
    return b"event: " + event.encode() + b"\n" + payload if event else payload
