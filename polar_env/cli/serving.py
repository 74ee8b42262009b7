"""``engine`` and ``gateway``: the embedded CPU engine and the provider gateway as servers."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from aiohttp import web

from polar_env.cli.checks import add_command, check_numbers, load_script, model_dir, store_to_write
from polar_env.cli.options import ENGINE_URL_HELP, TEMPLATE_HELP, choices, engine_kind, literal_values, metavar, model_default
from polar_env.errors import ConfigError

EMBEDDED_MODEL_NAME = "polar-tiny-qwen3"
EMBEDDED_MAX_TOKENS = 1024  # a random tiny model rarely samples EOS: the engine's own cap when none is given
# The embedded engine's own options, with their defaults: with --engine vllm/sglang they do nothing.
EMBEDDED_DEFAULTS: dict[str, Any] = {
    "model_dir": None, "seed": 0, "scripted": False, "script": None,
    "script_command": "echo hi", "script_answer": "The command printed: {tool_output}",
}


def _template(value: str) -> str:
    from polar_env.chat import check_template

    try:
        return check_template(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _template_given(args: argparse.Namespace, kind: str) -> str:
    """``--template`` as given; unset, ``auto`` for a model given by path (its own chat format),
    else the default (what the seeded weights are built for)."""
    if args.template is not None:
        return str(args.template)
    return "auto" if kind == "embedded" and getattr(args, "model_dir", None) else str(model_default("env.engine.template"))


def _resolved_template(args: argparse.Namespace, kind: str = "embedded") -> str:
    """``--template``, with ``auto`` read off the model: its ``--model-dir``, or what the engine at
    ``--engine-url`` says it serves (ask after the engine answers)."""
    template = _template_given(args, kind)
    if template != "auto":
        return template
    from polar_env.engines.config import engine_config

    fields = {"model_dir": getattr(args, "model_dir", None)} if kind == "embedded" else {"url": args.engine_url}
    return engine_config({"kind": kind, "template": "auto", **fields}).resolved_template()


def _engine_from_args(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    from polar_env.chat import chat_format
    from polar_env.chat.detect import check_vocabulary, served_name
    from polar_env.engines.embedded.engine import EmbeddedEngine
    from polar_env.engines.embedded.model import ModelSpec
    from polar_env.engines.embedded.policy import ScriptedPolicy, ScriptStep

    policy = None
    if args.script:
        policy = load_script(args.script)
    elif args.scripted:
        policy = ScriptedPolicy(
            steps=(
                ScriptStep(command=args.script_command, reasoning="I should run the command."),
                ScriptStep(text=args.script_answer, reasoning="The tool answered."),
            )
        )
    weights = model_dir(args.model_dir) if args.model_dir else None  # a bad path: one line before any detection
    chat = chat_format(_resolved_template(args))
    named = chat.weights  # hf:PATH / smollm2: the template's own model unless --model-dir gives one
    weights = weights or (model_dir(str(named)) if named else None)
    if weights is not None:  # a tokenizer with ids past the embedding: refused now, not per request
        check_vocabulary(weights, chat.tokenizer.n_vocab, _template_given(args, "embedded"))
    return EmbeddedEngine(
        model_dir=weights,
        spec=ModelSpec(seed=args.seed),
        chat=chat,
        policy=policy,
        logprobs_mode=args.logprobs_mode,
        max_tokens=args.max_tokens or EMBEDDED_MAX_TOKENS,
        model_name=args.served_model_name or (served_name(weights) if args.model_dir and weights else EMBEDDED_MODEL_NAME),
    )


def _add_engine_options(p: argparse.ArgumentParser, *, gateway: bool = False) -> None:
    d = EMBEDDED_DEFAULTS
    p.add_argument("--model-dir", help="load this local HF model folder or .gguf file (default: the model an hf:/smollm2 "
                                       "template names, else seeded random weights)")
    p.add_argument("--seed", type=int, default=d["seed"], help="seed of the random weights")
    p.add_argument("--served-model-name", help=(
        "model name sent to the engine (default: the one model a vllm/sglang engine lists at /v1/models; "
        f"{EMBEDDED_MODEL_NAME} for the embedded engine)") if gateway else
        f"model name served (default: --model-dir's file or folder name, else {EMBEDDED_MODEL_NAME})")
    p.add_argument("--template", type=_template, metavar=metavar(choices("templates")), help=(
        f"{TEMPLATE_HELP} (default: auto with --model-dir, else {model_default('env.engine.template')})"))
    p.add_argument("--logprobs-mode", choices=literal_values("env.engine.logprobs_mode"), default=model_default("env.engine.logprobs_mode"),
                   help="logprobs of the sampled distribution (processed) or of the raw logits")
    if not gateway:  # the gateway's --max-tokens caps every engine, this one included
        p.add_argument("--max-tokens", type=int, help=f"most tokens sampled per request (default {EMBEDDED_MAX_TOKENS})")
    p.add_argument("--scripted", action="store_true", help="force decoding to the scripted tool-then-answer turns")
    p.add_argument("--script", help="JSON file with a scripted policy ({steps: [{command|text, reasoning}]})")
    p.add_argument("--script-command", default=d["script_command"], help="--scripted: the shell command the model calls")
    p.add_argument("--script-answer", default=d["script_answer"], help="--scripted: the final answer ({tool_output} is replaced)")


# The flags of engine and gateway that mirror a config field, and the plain bounds of the others.
MIRRORED = {"seed": "env.engine.seed", "max_tokens": "env.sampling.max_tokens",
            "temperature": "env.sampling.temperature", "top_p": "env.sampling.top_p"}
BOUNDS = {"port": (0.0, 65535.0), "engine_wait_s": (0.0, 86400.0), "engine_timeout": (0.001, 1e9)}


def cmd_engine(args: argparse.Namespace) -> int:
    from polar_env.engines.embedded.server import build_app

    check_numbers(args, MIRRORED, BOUNDS)
    started = time.perf_counter()
    engine = _engine_from_args(args)
    what = f"polar-env engine ({json.dumps(engine.describe())})"
    weights = Path(args.model_dir).expanduser().resolve() if args.model_dir else engine.chat.weights
    asyncio.run(_serve(build_app(engine, root=str(weights) if weights else None), args.host, args.port, what, started))
    return 0


# -- gateway -----------------------------------------------------------------------------------


def resolve_engine_kind(args: argparse.Namespace) -> str:
    """``--engine`` as given, or inferred from ``--engine-url`` by ``options.engine_kind`` (the rule
    every command shares); a contradiction is an error, not a silently ignored option."""
    url = args.engine_url
    kind = engine_kind(args.engine, url)
    if kind == "embedded":
        if url:
            raise ConfigError("--engine-url is for --engine vllm or sglang; the embedded engine runs in-process (drop one of them)")
        return kind
    if not url:
        raise ConfigError(f"--engine {kind} needs --engine-url (the server's base URL, e.g. http://127.0.0.1:8000)")
    unused = [f"--{k.replace('_', '-')}" for k, v in EMBEDDED_DEFAULTS.items() if getattr(args, k) != v]
    if unused:
        raise ConfigError(f"{', '.join(unused)} only appl{'y' if len(unused) > 1 else 'ies'} to --engine embedded, "
                          f"not --engine {kind}; drop them")
    return kind


def gateway_engines() -> list[str]:
    """The ENGINES the gateway can front: the embedded one (in-process, built from this command's
    own options) and every served kind (those with a URL)."""
    from polar_env.engines.config import ENGINES

    return [n for n in ENGINES.names() if n == "embedded" or "url" in ENGINES.get(n).model_fields]


async def _gateway_engine(args: argparse.Namespace, kind: str):  # type: ignore[no-untyped-def]
    """The engine client and the model name to send it, after checking the engine answers."""
    if kind == "embedded":
        engine = _engine_from_args(args)
        return engine, engine.model_name, "embedded (in-process)"
    from polar_env.engines.config import engine_config
    from polar_env.engines.probe import choose_model, wait_for_engine

    options = {"logprobs_mode": args.logprobs_mode} if kind == "vllm" else {}
    engine = engine_config({"kind": kind, "url": args.engine_url, "model": args.served_model_name or "", **options}).build()
    try:
        served = await wait_for_engine(engine, wait_s=args.engine_wait_s, on_wait=lambda line: print(line, file=sys.stderr, flush=True))
        first_url, first_served = next(iter(served.items()))
        model = choose_model(args.served_model_name, first_served, first_url, strict=kind == "vllm")
    except BaseException:
        await engine.aclose()
        raise
    engine.model = model  # type: ignore[attr-defined]  # vllm/sglang clients send this name; EngineClient has none
    return engine, model, f"{kind} {', '.join(served)}"


def cmd_gateway(args: argparse.Namespace) -> int:
    check_numbers(args, MIRRORED, BOUNDS)
    kind = resolve_engine_kind(args)
    store_root = store_to_write(args.store)
    from polar_env import eventloop

    eventloop.run(_run_gateway(args, kind, store_root))  # uvloop where installed: less CPU per hop
    return 0


async def _run_gateway(args: argparse.Namespace, kind: str, store_root: Path) -> None:
    from polar_env import eventloop
    from polar_env.journal.store import JournalStore
    from polar_env.proxy.admin import load_or_create_admin_token
    from polar_env.proxy.config import GatewayConfig, Sampling
    from polar_env.proxy.gateway import Gateway

    started = time.perf_counter()
    engine, model, engine_text = await _gateway_engine(args, kind)
    store = JournalStore(store_root, fsync=args.fsync)
    token, token_path = load_or_create_admin_token(store.root, args.admin_token)
    config = GatewayConfig(
        engine_model=model,
        public_url=args.public_url,
        sampling=Sampling(temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens),
        admin_token=token,
        template=await asyncio.to_thread(_resolved_template, args, kind),
        continuation=args.continuation,
        engine_timeout_s=args.engine_timeout,
    )
    gateway = Gateway(engine, store, config)
    where = f"; store {store_root}; " + (f"admin token in {token_path}" if token_path else "admin token from --admin-token")
    what = f"polar-env gateway (engine: {engine_text}, model {model!r}, {eventloop.loop_name()} loop)"
    # sandboxes get the provider routes only (runtimes/relay.py)
    sandbox = gateway.provider_app if args.unix_socket else None
    await _serve(gateway.app, args.host, args.port, what, started, unix_socket=args.unix_socket, unix_app=sandbox, suffix=where)


# -- serving -----------------------------------------------------------------------------------


def _tune_gc() -> None:
    """Server processes parse and build large acyclic JSON trees per request (a 1k-token vLLM
    response is ~10k containers), which sets off the cyclic GC many times per request. Freezing
    start-up objects and raising the gen-0 threshold cut the gateway's CPU per request by ~40%
    (scripts/bench_gateway.py); acyclic garbage is still freed at once by reference counting."""
    import gc

    gc.freeze()
    gc.set_threshold(100_000, 50, 100)


async def _serve(app: web.Application, host: str, port: int, what: str, started: float, *,
                 unix_socket: str | None = None, unix_app: web.Application | None = None, suffix: str = "") -> None:
    from aiohttp import web

    from polar_env.access_log import LOGGER, AccessLogger
    from polar_env.proxy.gateway import UNIX_BACKLOG
    from polar_env.staging.interrupt import until_signal

    _tune_gc()
    runner = web.AppRunner(app, access_log=LOGGER, access_log_class=AccessLogger)
    await runner.setup()
    runners = [runner]
    try:
        try:
            await web.TCPSite(runner, host, port).start()
        except OSError as exc:
            raise ConfigError(f"cannot listen on {host}:{port} ({exc.strerror or exc}); "
                              "pick another --port or --host, or stop the process that holds it") from exc
        if unix_socket:  # what sandboxes reach through their relay (runtimes/base.py)
            unix_runner = web.AppRunner(unix_app, access_log=None) if unix_app is not None else runner
            if unix_runner is not runner:
                await unix_runner.setup()
                runners.insert(0, unix_runner)
            try:
                await web.UnixSite(unix_runner, unix_socket, backlog=UNIX_BACKLOG).start()
            except OSError as exc:
                raise ConfigError(f"cannot listen on --unix-socket {unix_socket} ({exc.strerror or exc}); "
                                  "give a path in an existing, writable folder") from exc
        # Printed only once the socket listens: callers wait for this line.
        print(f"{what} ready in {time.perf_counter() - started:.1f}s on http://{host}:{port}{suffix}", flush=True)
        await until_signal()
    finally:
        for r in runners:
            await r.cleanup()


# -- trajectories ------------------------------------------------------------------------------

def _add_server_options(p: argparse.ArgumentParser, *, port: int) -> None:
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=port, help="port to listen on")
    p.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"],
                   help="stderr log: warning logs every 4xx/5xx answer with its error, info every request")



def add_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = add_command(sub, "engine", "serve the embedded CPU engine (vLLM-shaped OpenAI chat API)")
    _add_server_options(p, port=8000)
    _add_engine_options(p)
    p.set_defaults(func=cmd_engine)

    p = add_command(sub, "gateway", "serve the provider gateway in front of an engine")
    _add_server_options(p, port=8100)
    p.add_argument("--engine", choices=gateway_engines(),
                   help="embedded runs the CPU engine in-process; the others need --engine-url. When not given: "
                        "sglang for --engine-url router:URL, vllm for any other --engine-url (one URL or a "
                        "comma-separated pool), else embedded (default: inferred)")
    p.add_argument("--engine-url", help=f"{ENGINE_URL_HELP} (default: none: the embedded engine)")
    p.add_argument("--engine-wait-s", type=float, default=30.0,
                   help="how long to wait at start for the engine to answer GET /v1/models before failing")
    p.add_argument("--store", required=True, help="directory of per-session journals (created if absent)")
    p.add_argument("--fsync", action="store_true", help="fsync every record (survives machine crashes)")
    p.add_argument("--unix-socket", help="also listen on this unix socket (bridged into sandboxes)")
    p.add_argument("--public-url", help="base URL handed to harnesses (default: the request's Host)")
    p.add_argument("--temperature", type=float, help="override every request's temperature")
    p.add_argument("--top-p", type=float, help="override every request's top_p")
    p.add_argument("--max-tokens", type=int, help="cap every request's max_tokens (any engine; embedded default 1024)")
    p.add_argument("--admin-token", help="bearer token for /sessions and /admin/* (default: read or create "
                   "<store>/admin_token, mode 0600)")
    p.add_argument("--engine-timeout", type=float, default=1800.0,
                   help="seconds one engine call may take before the harness gets a 504")
    p.add_argument("--continuation", action="store_true",
                   help="token-in continuation mode for every session (append-only prompts)")
    _add_engine_options(p, gateway=True)
    p.set_defaults(func=cmd_gateway)

