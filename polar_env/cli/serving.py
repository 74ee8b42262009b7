"""``engine`` and ``gateway``: the embedded CPU engine and the provider gateway as servers."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from polar_env.cli.checks import add_command, check_numbers, model_dir, store_to_write
from polar_env.cli.options import add_flags, engine_kind, flags_for, given, numeric_paths, settings
from polar_env.errors import ConfigError

if TYPE_CHECKING:
    from aiohttp import web

    from polar_env.engines.base import EngineClient
    from polar_env.engines.config import AnyEngineConfig
    from polar_env.engines.embedded.engine import EmbeddedEngine
    from polar_env.engines.embedded.policy import ScriptedPolicy
    from polar_env.proxy.config import GatewayConfig, Sampling

# --scripted: the built-in tool-then-answer policy (a demo double; --engine-script takes a file)
SCRIPTED_DEFAULTS: dict[str, Any] = {"scripted": False, "script_command": "echo hi",
                                     "script_answer": "The command printed: {tool_output}"}


def _scripted_policy(args: argparse.Namespace) -> ScriptedPolicy | None:
    if not args.scripted:
        return None
    from polar_env.engines.embedded.policy import ScriptedPolicy, ScriptStep

    return ScriptedPolicy(steps=(ScriptStep(command=args.script_command, reasoning="I should run the command."),
                                 ScriptStep(text=args.script_answer, reasoning="The tool answered.")))


def engine_settings(args: argparse.Namespace, command: str, kind: str) -> AnyEngineConfig:
    """The engine the flags of ``command`` stand for (the table's ``env.engine.`` paths), checked
    as ``PolarEnvConfig.engine`` is: a bad value is one line naming its flag."""
    from polar_env.engines.config import engine_config

    if getattr(args, "model_dir", None):
        model_dir(args.model_dir)  # a bad path: one line naming --model-dir, before any detection
    return settings(args, command, "env.engine.", engine_config, {"kind": kind})


def sampling_settings(args: argparse.Namespace, command: str) -> Sampling:
    from polar_env.proxy.config import Sampling

    return settings(args, command, "env.sampling.", Sampling.model_validate)


def embedded_engine(args: argparse.Namespace, command: str) -> EmbeddedEngine:
    """The in-process engine of ``engine`` and ``gateway --engine embedded``: its config's own
    ``build`` (so its token cap is the config's: 256, 4096 scripted), forced to ``--scripted``."""
    from polar_env.engines.config import EmbeddedEngineConfig
    from polar_env.engines.embedded.engine import EmbeddedEngine

    config = engine_settings(args, command, "embedded")
    assert isinstance(config, EmbeddedEngineConfig)  # the kind given is the union's tag
    config.check_fits()  # a tokenizer with ids past the embedding: refused now, not per request
    engine = config.build(sampling_settings(args, command).max_tokens)
    assert isinstance(engine, EmbeddedEngine)
    policy = _scripted_policy(args)
    if policy is not None:
        engine.policy = policy
    return engine


BOUNDS = {"port": (0.0, 65535.0), "engine_wait_s": (0.0, 86400.0)}  # command options: no model holds them


def cmd_engine(args: argparse.Namespace) -> int:
    from polar_env.engines.embedded.server import build_app

    check_numbers(args, numeric_paths("engine"), BOUNDS)
    started = time.perf_counter()
    engine = embedded_engine(args, "engine")
    what = f"polar-env engine ({json.dumps(engine.describe())})"
    weights = Path(args.model_dir).expanduser().resolve() if args.model_dir else engine.chat.weights
    asyncio.run(_serve_engine(build_app(engine, root=str(weights) if weights else None), args.host, args.port, what, started))
    return 0


# -- gateway -----------------------------------------------------------------------------------


def resolve_engine_kind(args: argparse.Namespace) -> str:
    """``--engine`` as given, or inferred from ``--engine-url`` by ``options.engine_kind`` (the rule
    every command shares); a contradiction is an error, not a silently ignored option."""
    from polar_env.engines.config import ENGINES

    url = args.engine_url
    kind = engine_kind(args.engine, url)
    if kind == "embedded":
        if url:
            raise ConfigError("--engine-url is for --engine vllm or sglang; the embedded engine runs in-process (drop one of them)")
        return kind
    if kind not in ENGINES or "url" not in ENGINES.get(kind).model_fields:
        raise ConfigError(f"--engine {kind}: the gateway fronts embedded (in-process) or a served engine "
                          f"({', '.join(n for n in ENGINES.names() if 'url' in ENGINES.get(n).model_fields)})")
    if not url:
        raise ConfigError(f"--engine {kind} needs --engine-url (the server's base URL, e.g. http://127.0.0.1:8000)")
    fields = ENGINES.get(kind).model_fields
    unused = [f.name for f in flags_for("gateway") if f.path.startswith("env.engine.")
              and f.path.removeprefix("env.engine.") not in fields and given(args, (f,))]
    unused += [f"--{k.replace('_', '-')}" for k, v in SCRIPTED_DEFAULTS.items() if getattr(args, k) != v]
    if unused:
        raise ConfigError(f"{', '.join(unused)} only appl{'y' if len(unused) > 1 else 'ies'} to --engine embedded, "
                          f"not --engine {kind}; drop them")
    return kind


async def _gateway_engine(args: argparse.Namespace, kind: str) -> tuple[EngineClient, str, str]:
    """The engine client and the model name to send it, after checking the engine answers."""
    if kind == "embedded":
        local = embedded_engine(args, "gateway")
        return local, local.model_name, "embedded (in-process)"
    from polar_env.engines.probe import choose_model, wait_for_engine

    # no --served-model-name: the one model the engine lists (asked below), not the config's default
    engine = engine_settings(args, "gateway", kind).model_copy(update={"model": args.served_model_name or ""}).build()
    try:
        served = await wait_for_engine(engine, wait_s=args.engine_wait_s, on_wait=lambda line: print(line, file=sys.stderr, flush=True))
        first_url, first_served = next(iter(served.items()))
        model = choose_model(args.served_model_name, first_served, first_url, strict=kind == "vllm")
    except BaseException:
        await engine.aclose()
        raise
    engine.model = model  # type: ignore[attr-defined]  # vllm/sglang clients send this name; EngineClient has none
    return engine, model, f"{kind} {', '.join(served)}"


def gateway_settings(args: argparse.Namespace, **derived: object) -> GatewayConfig:
    """The ``GatewayConfig`` the gateway's flags stand for (the table's ``gateway.`` paths and the
    sampling flags), with what the command derived (the engine's model and template, the token)."""
    from polar_env.proxy.config import GatewayConfig

    return settings(args, "gateway", "gateway.", GatewayConfig.model_validate,
                    {"sampling": sampling_settings(args, "gateway"), **derived})


def cmd_gateway(args: argparse.Namespace) -> int:
    check_numbers(args, numeric_paths("gateway"), BOUNDS)
    kind = resolve_engine_kind(args)
    engine_settings(args, "gateway", kind)  # a bad engine setting: one line before the store is made
    sampling_settings(args, "gateway")
    store_root = store_to_write(args.store)
    from polar_env import eventloop

    eventloop.run(_run_gateway(args, kind, store_root))  # uvloop where installed: less CPU per hop
    return 0


async def _run_gateway(args: argparse.Namespace, kind: str, store_root: Path) -> None:
    """Serve the gateway the one way every caller does (``Gateway.start``) until a signal."""
    from polar_env import eventloop
    from polar_env.access_log import LOGGER, AccessLogger
    from polar_env.journal.store import JournalStore
    from polar_env.proxy.admin import load_or_create_admin_token
    from polar_env.proxy.gateway import Gateway
    from polar_env.staging.interrupt import until_signal

    started = time.perf_counter()
    engine, model, engine_text = await _gateway_engine(args, kind)
    try:  # template auto: read off what the engine serves, asked once it answers
        template = await asyncio.to_thread(lambda: engine_settings(args, "gateway", kind).resolved_template())
        store = JournalStore(store_root, fsync=args.fsync)
        token, token_path = load_or_create_admin_token(store.root, args.admin_token)
        config = gateway_settings(args, engine_model=model, admin_token=token, template=template)
    except BaseException:
        await engine.aclose()
        raise
    gateway = Gateway(engine, store, config)  # from here the gateway closes the engine and the store
    _tune_gc()
    try:  # sandboxes get the provider routes only, on the unix socket (runtimes/relay.py)
        await gateway.start(args.host, args.port, args.unix_socket, access_log=LOGGER, access_log_class=AccessLogger)
    except OSError as exc:  # start closed what it had opened; the TCP listener is bound first
        if gateway.port is None:
            raise ConfigError(f"cannot listen on {args.host}:{args.port} ({exc.strerror or exc}); "
                              "pick another --port or --host, or stop the process that holds it") from exc
        raise ConfigError(f"cannot listen on --unix-socket {args.unix_socket} ({exc.strerror or exc}); "
                          "give a path in an existing, writable folder") from exc
    try:
        where = f"; store {store_root}; " + (f"admin token in {token_path}" if token_path else "admin token from --admin-token")
        what = f"polar-env gateway (engine: {engine_text}, model {model!r}, {eventloop.loop_name()} loop)"
        # Printed only once the sockets listen: callers wait for this line.
        print(f"{what} ready in {time.perf_counter() - started:.1f}s on {gateway.url}{where}", flush=True)
        await until_signal()
    finally:
        await gateway.aclose()


# -- serving -----------------------------------------------------------------------------------


def _tune_gc() -> None:
    """Server processes parse and build large acyclic JSON trees per request (a 1k-token vLLM
    response is ~10k containers), which sets off the cyclic GC many times per request. Freezing
    start-up objects and raising the gen-0 threshold cut the gateway's CPU per request by ~40%
    (scripts/bench_gateway.py); acyclic garbage is still freed at once by reference counting."""
    import gc

    gc.freeze()
    gc.set_threshold(100_000, 50, 100)


async def _serve_engine(app: web.Application, host: str, port: int, what: str, started: float) -> None:
    """The embedded engine's OpenAI-shaped app on ``host:port`` until a signal."""
    from aiohttp import web

    from polar_env.access_log import LOGGER, AccessLogger
    from polar_env.staging.interrupt import until_signal

    _tune_gc()
    runner = web.AppRunner(app, access_log=LOGGER, access_log_class=AccessLogger)
    await runner.setup()
    try:
        try:
            await web.TCPSite(runner, host, port).start()
        except OSError as exc:
            raise ConfigError(f"cannot listen on {host}:{port} ({exc.strerror or exc}); "
                              "pick another --port or --host, or stop the process that holds it") from exc
        # Printed only once the socket listens: callers wait for this line.
        print(f"{what} ready in {time.perf_counter() - started:.1f}s on http://{host}:{port}", flush=True)
        await until_signal()
    finally:
        await runner.cleanup()


def _add_server_options(p: argparse.ArgumentParser, *, port: int) -> None:
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=port, help="port to listen on")
    p.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"],
                   help="stderr log: warning logs every 4xx/5xx answer with its error, info every request")


def _add_scripted_options(p: argparse.ArgumentParser) -> None:
    d = SCRIPTED_DEFAULTS
    p.add_argument("--scripted", action="store_true", help="force decoding to the built-in tool-then-answer turns "
                   "(a demo double; --engine-script: a policy file) (default: off)")
    p.add_argument("--script-command", default=d["script_command"], help="--scripted: the shell command the model calls")
    p.add_argument("--script-answer", default=d["script_answer"], help="--scripted: the final answer ({tool_output} is replaced)")


def add_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = add_command(sub, "engine", "serve the embedded CPU engine (vLLM-shaped OpenAI chat API)")
    _add_server_options(p, port=8000)
    add_flags(p, flags_for("engine"))
    _add_scripted_options(p)
    p.set_defaults(func=cmd_engine)

    p = add_command(sub, "gateway", "serve the provider gateway in front of an engine")
    _add_server_options(p, port=8100)
    p.add_argument("--engine-wait-s", type=float, default=30.0,
                   help="how long to wait at start for the engine to answer GET /v1/models before failing")
    p.add_argument("--store", required=True, help="directory of per-session journals (created if absent)")
    p.add_argument("--fsync", action="store_true", help="fsync every record (survives machine crashes)")
    p.add_argument("--unix-socket", help="also listen on this unix socket (bridged into sandboxes)")
    add_flags(p, flags_for("gateway"))
    _add_scripted_options(p)
    p.set_defaults(func=cmd_gateway)
