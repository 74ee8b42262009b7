"""vLLM OpenAI-server client: one non-streaming chat completion with exact token ids and logprobs.

Launch the server (Qwen3.5) with::

    vllm serve <model-dir> \\
        --logprobs-mode processed_logprobs \\
        --enable-auto-tool-choice --tool-call-parser qwen3_coder --reasoning-parser qwen3

- ``--logprobs-mode processed_logprobs``: vLLM's default is ``raw_logprobs``, the log-softmax of
  the logits *before* temperature, top-p/top-k, ``logit_bias`` and penalties. Those are not the
  probabilities of the distribution the tokens were sampled from, so an importance ratio built on
  them is silently wrong whenever temperature != 1 or top-p < 1. Pass ``logprobs_mode="raw"`` to
  this client if the server really runs raw, so every Generation records what it carries.
- ``--tool-call-parser qwen3_coder``: Qwen3.5 emits XML tool calls
  (``<function=NAME><parameter=P>…``); ``hermes`` would leave them in ``content``.
- ``--reasoning-parser qwen3``: splits ``<think>…</think>`` into ``message.reasoning``.

Non-streaming on purpose: streaming with a tool parser has returned wrong ids for control tokens.
``return_token_ids`` needs vLLM >= 0.10.2; token-in (``kv_transfer_params.prompt_token_ids``) needs
vLLM >= 0.32. Older servers ignore that field, so the client reads the served version
(``GET /version``) once, before its first token-in call: below 0.32 (NeMo RL pins 0.25.1) a
token-in request goes out as messages (the canonical render), with one warning per client; the
trajectory then measures the drift from the ids the server echoes. A server without ``/version``
(not vLLM's) gets token-in, and the echo check below refuses it if the ids were ignored.
"""

from __future__ import annotations

import asyncio
import logging
import re
import secrets
from collections.abc import Callable, Mapping
from typing import Annotated, Any, Literal

import aiohttp
import msgspec
import orjson
from pydantic import ValidationError

from polar_env.engines.base import new_session, request_json
from polar_env.engines.routing import cached_tokens
from polar_env.errors import EngineHTTPError, EngineProtocolError
from polar_env.records import AssistantMessage, ChatRequest, Generation, ToolCall
from polar_env.stagecpu import stage
from polar_env.tokenids import ECHO_ANCHOR, JsonIds, echoed_ids, ids_json

log = logging.getLogger(__name__)

# Keys this client owns; a caller's extra_body must not switch token capture off or stream.
_FORCED = {"logprobs": True, "top_logprobs": 0, "return_token_ids": True, "stream": False}
TOKEN_IN_MIN = (0, 32)  # the first vLLM that reads kv_transfer_params.prompt_token_ids
_VERSION_TIMEOUT_S = 30.0  # GET /version answers at once on a live server


def release(version: str) -> tuple[int, ...] | None:
    """The numeric release of a version string ("0.25.1" -> (0, 25, 1); "0.32.0rc1.dev5+g1a2b" ->
    (0, 32, 0)), or None when it has none."""
    found = re.match(r"v?(\d+)\.(\d+)(?:\.(\d+))?", version.strip())
    return tuple(int(part) for part in found.groups() if part is not None) if found else None


def reads_token_in(version: str | None) -> bool:
    """Whether a vLLM of ``version`` reads the token-in field; an unknown version (no ``/version``:
    not vLLM's server) is given the benefit of the doubt, since ``parse`` refuses ignored ids."""
    parsed = None if version is None else release(version)
    return parsed is None or parsed[:2] >= TOKEN_IN_MIN


class VLLMClient:
    """EngineClient for a vLLM OpenAI-compatible server (``/v1/chat/completions``)."""

    name = "vllm"

    def __init__(
        self,
        base_url: str,
        model: str,
        *,
        session: aiohttp.ClientSession | None = None,
        timeout_s: float = 3600.0,
        logprobs_mode: Literal["processed", "raw"] = "processed",
        extra_body: dict[str, Any] | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.timeout_s = timeout_s
        self.logprobs_mode: Literal["processed", "raw"] = logprobs_mode
        self.extra_body = dict(extra_body or {})
        self._session = session
        self._owns_session = session is None
        self.served_version: str | None = None  # the server's GET /version, read before the first token-in call
        self.token_in: bool | None = None  # None: not probed yet
        self.canonical_fallbacks = 0  # token-in calls sent as messages because the server predates token-in
        self._probe_lock = asyncio.Lock()

    @property
    def url(self) -> str:
        return f"{self.base_url}/v1/chat/completions"

    async def supports_token_in(self) -> bool:
        """Reads ``GET /version`` once per client (concurrent first calls wait for one probe). A
        server that answers 404 or no version counts as supporting token-in (see the module doc);
        an unreachable one raises the EngineError its chat call would have, and is asked again."""
        if self.token_in is None:
            async with self._probe_lock:
                if self.token_in is None:
                    self.token_in = await self._probe()
        return self.token_in

    async def _probe(self) -> bool:
        url = f"{self.base_url}/version"
        try:
            data = await request_json(self._http(), url, engine=self.name, method="GET",
                                      timeout_s=min(self.timeout_s, _VERSION_TIMEOUT_S))
        except EngineHTTPError:
            data = None  # no such route: not vLLM's own server
        except EngineProtocolError:
            data = None  # not JSON
        version = data.get("version") if isinstance(data, dict) else None
        self.served_version = version if isinstance(version, str) else None
        supported = reads_token_in(self.served_version)
        if not supported:
            log.warning("vLLM %s at %s ignores token-in (kv_transfer_params.prompt_token_ids needs vLLM >= %s): "
                        "continuation prompts go out as messages (canonical render); drift is measured per trajectory",
                        self.served_version, self.base_url, ".".join(map(str, TOKEN_IN_MIN)))
        return supported

    def _http(self) -> aiohttp.ClientSession:
        # Created lazily: aiohttp wants a running loop, and the ctor may run outside one.
        if self._session is None or (self._owns_session and self._session.closed):
            self._session = new_session()
        return self._session

    def build_body(self, req: ChatRequest) -> dict[str, Any]:
        """The exact JSON sent to vLLM for ``req`` (public so the gateway can log it)."""
        return self._body(req, None if req.prompt_ids is None else list(req.prompt_ids))

    def _body(self, req: ChatRequest, prompt_ids: object) -> dict[str, Any]:
        """``build_body`` with the token-in ids given as they are to be serialized."""
        body: dict[str, Any] = openai_chat_body(req, self.model, self.extra_body, req.extra_body)
        # include_reasoning=false makes vLLM return token_ids and logprobs as null, which would
        # make the completion untrainable; the reasoning text is separated anyway, so drop the key.
        body.pop("include_reasoning", None)
        body["model"] = self.model
        if prompt_ids is not None:
            kv = dict(body.get("kv_transfer_params") or {})
            kv["prompt_token_ids"] = prompt_ids
            body["kv_transfer_params"] = kv
        return body

    async def generate(self, request: ChatRequest) -> Generation:
        return (await self.complete(request))[0]

    async def complete(self, request: ChatRequest) -> tuple[Generation, int | None]:
        """``generate``, with the prompt tokens the server took from its prefix cache
        (``usage.prompt_tokens_details.cached_tokens``; None unless the server runs with
        ``--enable-prompt-tokens-details``): what the pool's hit rates are counted from."""
        if request.prompt_ids is not None and not await self.supports_token_in():
            self.canonical_fallbacks += 1
            request = request.model_copy(update={"prompt_ids": None})  # the server renders the messages
        # canonical: the echo decoded by its delta from the session's last one (decode_canonical)
        decode: Callable[[bytes], object] = _canonical_decoder(ECHO_ANCHOR.get())
        with stage("engine_build"):
            fragment = None
            if request.prompt_ids is not None:
                # Token-in: the ids are serialized once (no copy of the list; a continuation's
                # prompt carries its JSON already), and the engine's echo of them is checked
                # against these bytes instead of decoded id by id.
                sent = ids_json(request.prompt_ids)
                fragment = orjson.Fragment(sent)
                decode = _token_in_decoder(sent, request.prompt_ids)
            encoded = [orjson.dumps(self._body(request, fragment))]
        # handed over, not named: request_json releases the body once it is sent (engines/base.py)
        data = await request_json(self._http(), self.url, payload=encoded.pop(), engine=self.name,
                                  timeout_s=self.timeout_s, decode=decode)
        with stage("engine_decode"):
            cached = data.cached_tokens() if isinstance(data, _Body) else _usage_cached(data)
            return self.parse_decoded(data, request), cached

    def parse_decoded(self, data: object, request: ChatRequest) -> Generation:
        """``parse`` for what ``decode_chat_body`` returned: the same Generation, or the same error."""
        if isinstance(data, _Body):
            fast = self._parse_typed(data, request)
            if fast is not None:
                return fast
            data = msgspec.to_builtins(data)  # something is off: parse() says exactly what
        if not isinstance(data, dict):
            raise self._bad(f"expected a JSON object, got {type(data).__name__}")
        return self.parse(data, request)

    def _parse_typed(self, data: _Body, request: ChatRequest) -> Generation | None:
        """The hot path: a body whose types msgspec already checked becomes a Generation without
        a second validation pass. None when anything is missing or misaligned (``parse`` then
        raises the precise error)."""
        choice = data.choices[0] if data.choices else None
        if choice is None or data.prompt_token_ids is None or choice.token_ids is None:
            return None
        content = choice.logprobs.content if choice.logprobs is not None else None
        if content is None or len(content) != len(choice.token_ids) or not isinstance(choice.finish_reason, str):
            return None
        if (request.prompt_ids is not None and data.prompt_token_ids is not request.prompt_ids
                and data.prompt_token_ids != request.prompt_ids):
            return None
        message = chat_message(choice.message, self._bad, engine="vLLM")
        return Generation.model_construct(
            message=message,
            prompt_ids=data.prompt_token_ids,
            response_ids=choice.token_ids,
            response_logprobs=[entry.logprob for entry in content],
            finish_reason=choice.finish_reason,
            stop_reason=choice.stop_reason,
            model=str(data.model or self.model),
            engine=self.name,
            weight_version=None,
            logprobs_mode=self.logprobs_mode,
        )

    def parse(self, data: dict[str, Any], request: ChatRequest) -> Generation:
        """Turn a vLLM chat response into a Generation, or raise EngineProtocolError."""
        choices = data.get("choices")
        if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
            raise self._bad("vLLM response has no choices")
        choice = choices[0]
        prompt_ids = data.get("prompt_token_ids")
        response_ids = choice.get("token_ids")
        fields = (("prompt_token_ids", prompt_ids), ("choices[0].token_ids", response_ids))
        if not isinstance(prompt_ids, list) or not isinstance(response_ids, list):
            missing = [name for name, value in fields if not isinstance(value, list)]
            raise self._bad(
                f"vLLM returned no token ids ({' and '.join(missing)} null, missing or not a list): "
                "`return_token_ids` needs vLLM >= 0.10.2, and `include_reasoning: false` makes vLLM "
                "null them"
            )
        if request.prompt_ids is not None and list(prompt_ids) != list(request.prompt_ids):
            raise self._bad(
                "vLLM ignored token-in: prompt_token_ids differ from kv_transfer_params.prompt_token_ids "
                "(needs vLLM >= 0.32; ignored when `echo` is set or messages contain media)"
            )
        logprobs = chat_logprobs(choice.get("logprobs"), self._bad, engine="vLLM")
        if len(logprobs) != len(response_ids):
            raise self._bad(
                f"vLLM logprobs misaligned: {len(logprobs)} logprobs for {len(response_ids)} token_ids"
            )
        finish = choice.get("finish_reason")
        if not isinstance(finish, str):
            raise self._bad(f"vLLM choice has no finish_reason (got {finish!r})")
        try:
            return Generation(
                message=chat_message(choice.get("message"), self._bad, engine="vLLM"),
                prompt_ids=prompt_ids,
                response_ids=response_ids,
                response_logprobs=logprobs,
                finish_reason=finish,
                stop_reason=choice.get("stop_reason"),
                model=str(data.get("model") or self.model),
                engine=self.name,
                weight_version=None,
                logprobs_mode=self.logprobs_mode,
            )
        except ValidationError as exc:
            raise self._bad(f"vLLM response has ill-typed fields: {exc}") from exc

    def _bad(self, message: str) -> EngineProtocolError:
        return EngineProtocolError(message, engine=self.name, url=self.url)

    async def aclose(self) -> None:
        if self._owns_session and self._session is not None and not self._session.closed:
            await self._session.close()


BadFactory = Callable[[str], EngineProtocolError]


# The fields of a vLLM chat body the gateway reads, typed, for msgspec: decoding into them skips
# everything else (per-token "token"/"bytes"/"top_logprobs" never become Python objects) and
# checks the types in the same pass. A 1k-token reply with logprobs decodes ~3.5x faster than
# orjson.loads + pydantic (scripts/bench_gateway.py). Any mismatch falls back to the orjson path.
# The per-token structs hold only numbers, so they are not tracked by the cyclic GC (gc=False).
# A token id past 64 bits (which orjson could not write to the journal) is refused here, so such
# a body takes the orjson + pydantic path and is handled exactly as before.
_TokenId = Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]


class _Logprob(msgspec.Struct, gc=False):
    logprob: float


class _Logprobs(msgspec.Struct, gc=False):
    content: list[_Logprob] | None = None


class _Choice(msgspec.Struct):
    message: Any = None
    logprobs: _Logprobs | None = None
    token_ids: list[_TokenId] | None = None
    finish_reason: Any = None
    stop_reason: int | str | None = None


class _PromptDetails(msgspec.Struct, gc=False):
    cached_tokens: int | None = None


class _Usage(msgspec.Struct, gc=False):
    prompt_tokens_details: _PromptDetails | None = None


class _Body(msgspec.Struct):
    choices: list[_Choice] | None = None
    prompt_token_ids: list[_TokenId] | None = None
    model: Any = None
    usage: _Usage | None = None

    def cached_tokens(self) -> int | None:
        details = self.usage.prompt_tokens_details if self.usage is not None else None
        return details.cached_tokens if details is not None else None


def _usage_cached(data: object) -> int | None:
    return cached_tokens(data.get("usage")) if isinstance(data, dict) else None


_DECODER = msgspec.json.Decoder(_Body)


def decode_chat_body(raw: bytes) -> object:
    """A typed ``_Body`` when the response has the expected shape, else ``orjson.loads`` (whose
    JSONDecodeError reports malformed JSON; ``parse`` reports a wrong shape precisely)."""
    try:
        return _DECODER.decode(raw)
    except msgspec.DecodeError:  # includes msgspec.ValidationError (a field of another type)
        return orjson.loads(raw)


class _TokenInBody(msgspec.Struct):
    """``_Body`` with the echoed prompt ids kept as raw JSON, to compare with the bytes sent."""

    choices: list[_Choice] | None = None
    prompt_token_ids: msgspec.Raw = msgspec.Raw(b"null")
    model: Any = None
    usage: _Usage | None = None


_TOKEN_IN_DECODER = msgspec.json.Decoder(_TokenInBody)


_ECHO_KEY = b'"prompt_token_ids":'
# What the echo is replaced by before the rest is decoded: random per process, so no engine
# reply can hold it where the cut was not.
_CUT = orjson.dumps(f"polar-env:cut:{secrets.token_hex(16)}")


def decode_token_in(raw: bytes, sent: bytes, prompt_ids: list[int]) -> object:
    """``decode_chat_body`` for a token-in call whose prompt ids were sent as ``sent``: an echo
    that is byte for byte what was sent is not decoded into ints, and the Generation carries the
    ``prompt_ids`` list the gateway sent (equal to the echo by that comparison). Any other echo
    (another serialization, other ids, null) is decoded and compared as before.

    The echo is found by its key and compared as bytes, then cut out (``_CUT``) and the rest
    decoded: even skipping it as ``msgspec.Raw`` scans every byte (~1 ms at 100k ids). The cut
    was the top-level echo only if the decoded top-level field is ``_CUT``; anything else (a
    nested key of that name first, other bytes) decodes the whole body as before."""
    at = raw.find(_ECHO_KEY)
    start = at + len(_ECHO_KEY)
    if at >= 0 and raw.startswith(sent, start):
        view = memoryview(raw)
        try:
            body = _TOKEN_IN_DECODER.decode(b"".join((view[:start], _CUT, view[start + len(sent):])))
        except msgspec.DecodeError:
            body = None
        if body is not None and bytes(body.prompt_token_ids) == _CUT:
            return _Body(choices=body.choices, prompt_token_ids=prompt_ids, model=body.model, usage=body.usage)
    try:
        body = _TOKEN_IN_DECODER.decode(raw)
    except msgspec.DecodeError:
        return decode_chat_body(raw)
    if body.prompt_token_ids != msgspec.Raw(sent):
        return decode_chat_body(raw)
    return _Body(choices=body.choices, prompt_token_ids=prompt_ids, model=body.model, usage=body.usage)


def _token_in_decoder(sent: bytes, prompt_ids: list[int]) -> Callable[[bytes], object]:
    def decode(raw: bytes) -> object:
        with stage("engine_decode"):
            return decode_token_in(raw, sent, prompt_ids)

    return decode


def decode_canonical(raw: bytes, anchor: JsonIds | None) -> object:
    """``decode_chat_body`` for a call the server rendered: the echoed prompt ids become
    ``EchoIds`` carrying their bytes, and when the echo starts with ``anchor``'s bytes (the
    session's previous prompt: append-only history) only the ids after them are decoded
    (``tokenids.echoed_ids``). The echo is found by its key and cut out before the rest is
    decoded, and the cut is proven the top-level field as in ``decode_token_in``; anything else
    decodes the whole body as before. Searched from the end: vLLM writes the echo after the
    choices, where a nested key of that name could only come first."""
    at = raw.rfind(_ECHO_KEY)
    found = echoed_ids(raw, at + len(_ECHO_KEY), anchor) if at >= 0 else None
    if found is not None:
        ids, end = found
        start = at + len(_ECHO_KEY)
        view = memoryview(raw)
        try:
            body = _TOKEN_IN_DECODER.decode(b"".join((view[:start], _CUT, view[end:])))
        except msgspec.DecodeError:
            body = None
        if body is not None and bytes(body.prompt_token_ids) == _CUT:
            return _Body(choices=body.choices, prompt_token_ids=ids, model=body.model, usage=body.usage)
    return decode_chat_body(raw)


def _canonical_decoder(anchor: JsonIds | None) -> Callable[[bytes], object]:
    def decode(raw: bytes) -> object:
        with stage("engine_decode"):
            return decode_canonical(raw, anchor)

    return decode


def openai_chat_body(req: ChatRequest, model: str, *extras: Mapping[str, object]) -> dict[str, object]:
    """The OpenAI chat JSON for ``req`` (vLLM's and SGLang's): its fields, ``extras`` merged over
    them, and token capture forced on, non-streaming (``return_token_ids`` works only so)."""
    body: dict[str, object] = {"model": model, "messages": req.messages}
    if req.tools:
        body["tools"] = req.tools
    if req.tool_choice is not None:
        body["tool_choice"] = req.tool_choice
    for key in ("temperature", "top_p", "max_tokens", "seed", "response_format"):
        value = getattr(req, key)
        if value is not None:
            body[key] = value
    if req.stop:
        body["stop"] = req.stop
    if req.chat_template_kwargs:
        body["chat_template_kwargs"] = req.chat_template_kwargs
    for extra in extras:
        body.update(extra)
    body.pop("stream_options", None)
    body.update(_FORCED)
    return body


def chat_logprobs(block: object, bad: BadFactory, *, engine: str) -> list[float]:
    """The sampled-token logprobs of an OpenAI-style ``choices[].logprobs`` block."""
    content = block.get("content") if isinstance(block, dict) else None
    if not isinstance(content, list):
        raise bad(
            f"{engine} returned no logprobs (choices[0].logprobs.content null or missing) although "
            "`logprobs: true` was sent"
            + ("; `include_reasoning: false` also nulls them" if engine == "vLLM" else "")
        )
    try:
        # Hot path (1k+ entries per call): one comprehension; Generation validates the floats.
        return [entry["logprob"] for entry in content]
    except (TypeError, KeyError):
        pass
    for i, entry in enumerate(content):
        lp = entry.get("logprob") if isinstance(entry, dict) else None
        if not isinstance(lp, (int, float)) or isinstance(lp, bool):
            raise bad(f"{engine} logprobs.content[{i}] has no numeric logprob")
    raise bad(f"{engine} logprobs.content is malformed")


def chat_message(msg: object, bad: BadFactory, *, engine: str) -> AssistantMessage:
    """An OpenAI-style response message; reasoning from ``reasoning`` or ``reasoning_content``."""
    if not isinstance(msg, dict):
        raise bad(f"{engine} choice has no message")
    reasoning = msg.get("reasoning")
    if reasoning is None:
        reasoning = msg.get("reasoning_content")
    calls = msg.get("tool_calls") or []
    if not isinstance(calls, list):
        raise bad(f"{engine} message.tool_calls is not a list")
    return AssistantMessage(
        content=msg.get("content"),
        reasoning=reasoning,
        tool_calls=[_tool_call(tc, bad, engine) for tc in calls],
    )


def _tool_call(tc: Any, bad: BadFactory, engine: str) -> ToolCall:
    fn = tc.get("function") if isinstance(tc, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise bad(f"{engine} tool call without a function name: {tc!r}"[:300])
    args = fn.get("arguments")
    if args is None:
        args = "{}"
    elif not isinstance(args, str):  # engines send JSON text; keep that form if one sends an object
        args = orjson.dumps(args).decode()
    return ToolCall(id=str(tc.get("id") or ""), name=fn["name"], arguments=args)
