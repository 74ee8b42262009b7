"""vLLM-0.33-shaped HTTP API over the embedded engine.

Same field names and shapes as vLLM's OpenAI server: top-level ``prompt_token_ids``,
``choices[].token_ids``, ``logprobs.content[]{token, logprob, bytes, top_logprobs}``,
``finish_reason``/``stop_reason``, ``message.reasoning`` and ``tool_calls``; token-in through
``kv_transfer_params.prompt_token_ids``; errors as ``{"error": {message, type, param, code}}``.
Extra endpoints: ``/tokenize``, ``/detokenize``, ``/v1/models``, ``/health``, and weight sync
(``/update_weights_from_disk`` as SGLang names it, ``/update_weights`` with a safetensors body,
``/get_weight_version``).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path
from typing import Any

import orjson
from aiohttp import web
from aiohttp.typedefs import Handler
from pydantic import ValidationError

from polar_env.engines.embedded.engine import Completion, EmbeddedEngine, SamplingExtras
from polar_env.errors import RequestError
from polar_env.records import ChatRequest, Generation

ENGINE_KEY = web.AppKey("engine", EmbeddedEngine)
ROOT_KEY = web.AppKey("root", str)  # what /v1/models says was loaded: the weights' path, as vLLM's ``root``
_UNSUPPORTED = ("structured_outputs", "prompt_logprobs", "guided_json", "guided_regex", "guided_choice")
MAX_BODY_BYTES = 64 * 1024 * 1024  # 100k-token token-in prompts are ~1 MB; leave ample room


def _json(data: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(data), status=status, content_type="application/json")


def error_response(message: str, status: int, kind: str = "BadRequestError") -> web.Response:
    return _json({"error": {"message": message, "type": kind, "param": None, "code": status}}, status)


@web.middleware
async def _errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except RequestError as exc:
        return error_response(exc.message, exc.status, "NotFoundError" if exc.status == 404 else "BadRequestError")
    except web.HTTPException as exc:
        if exc.status >= 400:
            return error_response(exc.reason, exc.status, "NotFoundError" if exc.status == 404 else "BadRequestError")
        raise


async def _body(request: web.Request) -> dict[str, Any]:
    try:
        data = orjson.loads(await request.read())
    except orjson.JSONDecodeError as exc:
        raise RequestError(f"request body is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise RequestError("request body must be a JSON object")
    return data


def _chat_request(body: dict[str, Any], engine: EmbeddedEngine) -> tuple[ChatRequest, SamplingExtras]:
    if not isinstance(body.get("messages"), list) or not body["messages"]:
        raise RequestError("'messages' must be a non-empty list")
    stop = body.get("stop") or []
    kv = body.get("kv_transfer_params") or {}
    try:
        request = ChatRequest(
            model=str(body.get("model") or engine.model_name),
            messages=body["messages"],
            tools=body.get("tools") or [],
            tool_choice=body.get("tool_choice"),
            temperature=body.get("temperature"),
            top_p=body.get("top_p"),
            max_tokens=body.get("max_completion_tokens") or body.get("max_tokens"),
            stop=[stop] if isinstance(stop, str) else stop,
            seed=body.get("seed"),
            response_format=body.get("response_format"),
            chat_template_kwargs=body.get("chat_template_kwargs") or {},
            prompt_ids=kv.get("prompt_token_ids") if isinstance(kv, dict) else None,
        )
        extras = SamplingExtras(
            top_logprobs=int(body.get("top_logprobs") or 0) if body.get("logprobs") else 0,
            stop_token_ids=[int(t) for t in body.get("stop_token_ids") or []],
            ignore_eos=bool(body.get("ignore_eos", False)),
            # vLLM clamps biases to [-100, 100]; an infinite one would make logprobs non-finite
            logit_bias={int(k): min(100.0, max(-100.0, float(v))) for k, v in (body.get("logit_bias") or {}).items()},
        )
    except (ValidationError, TypeError, ValueError) as exc:
        raise RequestError(f"invalid request: {exc}") from exc
    if extras.top_logprobs > 20:
        raise RequestError("top_logprobs must be at most 20 (--max-logprobs)")
    return request, extras


def _logprob_entry(token: str, logprob: float) -> dict[str, Any]:
    return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}


def _reasoning_tokens(engine: EmbeddedEngine, gen: Generation) -> int:
    """Sampled tokens up to and including the one that completes ``</think>`` (one special token in
    Qwen3.5, several pieces in other vocabularies); all of them if thinking never closed."""
    text = ""
    for i, piece in enumerate(engine.tokenizer.token_texts(gen.response_ids)):
        text = text[-8:] + piece  # only the tail can complete the tag
        if "</think>" in text:
            return i + 1
    only_reasoning = gen.message.reasoning is not None and not gen.message.content and not gen.message.tool_calls
    return len(gen.response_ids) if only_reasoning else 0


def chat_response(engine: EmbeddedEngine, body: dict[str, Any], done: Completion) -> dict[str, Any]:
    gen, decoded = done.generation, done.decoded
    want_ids = bool(body.get("return_token_ids"))
    logprobs = None
    if body.get("logprobs"):
        content = []
        texts = engine.tokenizer.token_texts(gen.response_ids)
        for i, (text, lp) in enumerate(zip(texts, gen.response_logprobs, strict=True)):
            entry = _logprob_entry(text, lp)
            top = decoded.top[i] if decoded.top else []
            entry["top_logprobs"] = [_logprob_entry(engine.tokenizer.token_text(t), v) for t, v in top]
            content.append(entry)
        logprobs = {"content": content}
    message: dict[str, Any] = {
        "role": "assistant",
        "content": gen.message.content,
        "refusal": None,
        "annotations": None,
        "audio": None,
        "function_call": None,
        "reasoning": gen.message.reasoning,
    }
    if gen.message.tool_calls:  # vLLM leaves the key out when there are none
        message["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in gen.message.tool_calls
        ]

    return {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": body.get("model") or engine.model_name,
        "choices": [
            {
                "index": 0,
                "message": message,
                "logprobs": logprobs,
                "finish_reason": gen.finish_reason,
                "stop_reason": gen.stop_reason,
                "token_ids": gen.response_ids if want_ids else None,
            }
        ],
        "service_tier": None,
        "system_fingerprint": None,
        "usage": {
            "prompt_tokens": len(gen.prompt_ids),
            "total_tokens": len(gen.prompt_ids) + len(gen.response_ids),
            "completion_tokens": len(gen.response_ids),
            "prompt_tokens_details": None,
            "completion_tokens_details": {"reasoning_tokens": _reasoning_tokens(engine, gen)},
        },
        "prompt_logprobs": None,
        "prompt_token_ids": gen.prompt_ids if want_ids else None,
        "prompt_text": done.prompt_text if body.get("return_prompt_text") else None,
        "kv_transfer_params": None,
    }


async def chat_completions(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    body = await _body(request)
    if body.get("stream"):
        raise RequestError("the embedded engine answers non-streaming only; the gateway synthesizes streams")
    if body.get("n", 1) != 1:
        raise RequestError("only n=1 is supported")
    unsupported = [k for k in _UNSUPPORTED if body.get(k) is not None]
    if unsupported:
        raise RequestError(f"not supported by the embedded engine: {unsupported}")
    chat, extras = _chat_request(body, engine)  # body validation first, as vLLM does
    if body.get("model") not in (None, "", engine.model_name):
        raise RequestError(f"The model `{body['model']}` does not exist. Valid aliases: {engine.model_name}.", status=404)
    done = await engine.complete_async(chat, extras)
    return _json(chat_response(engine, body, done))


async def tokenize(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    body = await _body(request)
    if "messages" in body:
        chat = ChatRequest(
            messages=body["messages"], tools=body.get("tools") or [], chat_template_kwargs=body.get("chat_template_kwargs") or {}
        )
        text = engine.chat.render(
            chat.messages,
            chat.tools,
            add_generation_prompt=body.get("add_generation_prompt", True),
            enable_thinking=chat.chat_template_kwargs.get("enable_thinking", True) is not False,
        )
    elif isinstance(body.get("prompt"), str):
        text = body["prompt"]
    else:
        raise RequestError("give 'messages' or 'prompt'")
    ids = engine.tokenizer.encode(text)
    out: dict[str, Any] = {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids, "token_strs": None}
    if body.get("return_token_strs"):
        out["token_strs"] = [engine.tokenizer.token_text(i) for i in ids]
    return _json(out)


async def detokenize(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    tokens = (await _body(request)).get("tokens")
    if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
        raise RequestError("'tokens' must be a list of ints")
    return _json({"prompt": engine.tokenizer.decode(tokens)})


async def models(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    card = {
        "id": engine.model_name,
        "object": "model",
        "created": int(time.time()),
        "owned_by": "polar_env",
        "root": request.app[ROOT_KEY],
        "parent": None,
        "max_model_len": engine.max_model_len,
    }
    return _json({"object": "list", "data": [card]})


async def health(request: web.Request) -> web.Response:
    return web.Response(status=200)


async def update_weights_from_disk(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    path = (await _body(request)).get("model_path")
    if not isinstance(path, str) or not Path(path).is_dir():
        raise RequestError(f"model_path {path!r} is not a directory")
    version = await asyncio.to_thread(engine.reload_weights, Path(path))
    return _json({"success": True, "message": "weights updated", "weight_version": str(version)})


async def update_weights(request: web.Request) -> web.Response:
    """Body: a safetensors blob of the full state dict (what ``safetensors.torch.save`` returns)."""
    from safetensors import SafetensorError
    from safetensors.torch import load as load_safetensors

    engine = request.app[ENGINE_KEY]
    try:
        state = load_safetensors(await request.read())
    except (SafetensorError, ValueError) as exc:
        raise RequestError(f"body is not a safetensors state dict: {exc}") from exc
    version = await asyncio.to_thread(engine.reload_weights, state)
    return _json({"success": True, "message": "weights updated", "weight_version": str(version)})


async def weight_version(request: web.Request) -> web.Response:
    return _json({"weight_version": str(request.app[ENGINE_KEY].weight_version)})


def build_app(engine: EmbeddedEngine, root: str | None = None) -> web.Application:
    """``root``: the path of the weights loaded, which ``/v1/models`` reports as vLLM does (so a
    gateway's ``--template auto`` reads the model's own files); default the served name."""
    app = web.Application(middlewares=[_errors], client_max_size=MAX_BODY_BYTES)
    app[ENGINE_KEY] = engine
    app[ROOT_KEY] = root or engine.model_name
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_post("/update_weights_from_disk", update_weights_from_disk)
    app.router.add_post("/update_weights", update_weights)
    app.router.add_get("/get_weight_version", weight_version)
    return app
