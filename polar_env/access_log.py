"""One structured log line per HTTP request, for the servers ``polar-env`` runs (gateway, engine).

Fields are ``key=value`` pairs (values JSON-quoted when they hold spaces) so that grep, awk and
log shippers all read them. Answers of 400 and above are logged at WARNING with the message of the
provider-shaped error body, so the default level is an error log. Everything else is logged at
INFO: ``--log-level info`` turns it into an access log. Only the path is logged, never the query
string, because Gemini clients send their session key as ``?key=``.
"""

from __future__ import annotations

import logging

import orjson
from aiohttp import web
from aiohttp.abc import AbstractAccessLogger

LOGGER = logging.getLogger("polar_env.access")
_MESSAGE_LIMIT = 300


def error_text(body: object) -> str:
    """The human message in an error body (OpenAI/Anthropic/Gemini/vLLM shapes), or its first bytes."""
    if not isinstance(body, bytes | bytearray) or not body:
        return ""
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        return body[:_MESSAGE_LIMIT].decode("utf-8", "replace").strip()
    if isinstance(data, dict):
        err = data.get("error", data)
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])[:_MESSAGE_LIMIT]
        if isinstance(err, str):
            return err[:_MESSAGE_LIMIT]
    return orjson.dumps(data)[:_MESSAGE_LIMIT].decode("utf-8", "replace")


def _field(key: str, value: object) -> str:
    text = str(value)
    if not text or any(c in text for c in ' "=\n'):
        text = orjson.dumps(text).decode()
    return f"{key}={text}"


class AccessLogger(AbstractAccessLogger):
    """aiohttp's per-request hook: ``method path status bytes ms`` (+ ``error`` for 4xx/5xx)."""

    def log(self, request: web.BaseRequest, response: web.StreamResponse, time: float) -> None:
        level = logging.WARNING if response.status >= 400 else logging.INFO
        if not self.logger.isEnabledFor(level):
            return
        fields = [
            _field("method", request.method),
            _field("path", request.path),
            _field("status", response.status),
            _field("bytes", response.body_length),
            _field("ms", f"{time * 1000:.1f}"),
        ]
        if response.status >= 400 and isinstance(response, web.Response):
            fields.append(_field("error", error_text(response.body)))
        self.logger.log(level, " ".join(fields))


def configure(level: str) -> None:
    """Root logging for a server process: one line per event on stderr, at ``level``."""
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s %(message)s")
