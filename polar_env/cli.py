"""``polar-env`` command line: the only place that reads argv and the environment.

Every subcommand is a ``cmd_*`` function. A user's mistake raises ``ConfigError`` (or another
``PolarError``), and ``main`` turns it into one line on stderr and exit code 2, never a traceback.
A missing optional extra is reported the same way, with the command that installs it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
import time
from pathlib import Path
from typing import Any

from polar_env import __version__
from polar_env.errors import ConfigError, PolarError
from polar_env.qwen.template import QUIRKS

EMBEDDED_MODEL_NAME = "polar-tiny-qwen3"
# Top-level modules that come from an optional extra: a missing one names the extra to install.
EXTRA_OF_MODULE = {
    "torch": "embedded",
    "transformers": "embedded",
    "safetensors": "embedded",
    "swebench": "swebench",
    "pyarrow": "parquet",
    "docker": "docker",
}
# The embedded engine's own options, with their defaults: with --engine vllm/sglang they do nothing.
EMBEDDED_DEFAULTS: dict[str, Any] = {
    "model_dir": None, "seed": 0, "max_tokens_cap": 1024, "scripted": False, "script": None,
    "script_command": "echo hi", "script_answer": "The command printed: {tool_output}",
}


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows ``(default: X)`` only where there is a default worth showing (not None, not off)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False or action.default == argparse.SUPPRESS:
            return action.help
        return super()._get_help_string(action)


# -- checks of user input: each failure is one line that says what, where and how to fix ------------


def existing_dir(path: str, flag: str, hint: str) -> Path:
    p = Path(path)
    if not p.exists():
        raise ConfigError(f"{flag} {path}: no such folder; {hint}")
    if not p.is_dir():
        raise ConfigError(f"{flag} {path} is a file, not a folder; {hint}")
    return p


def store_to_write(path: str) -> Path:
    """The gateway's capture store: created if absent, but never on top of a file."""
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise ConfigError(f"--store {path} is a file, not a folder; pass a directory for the session journals")
    if not p.exists() and not p.parent.is_dir():
        raise ConfigError(f"--store {path}: its parent folder {p.parent} does not exist; create it (mkdir -p {p.parent})")
    return p.resolve()


def file_to_write(path: str, flag: str) -> Path:
    p = Path(path)
    if p.is_dir():
        raise ConfigError(f"{flag} {path} is a folder; give a file path such as {p / 'out.jsonl'}")
    if not p.parent.is_dir():
        raise ConfigError(f"{flag} {path}: folder {p.parent} does not exist; create it first (mkdir -p {p.parent})")
    return p


def model_dir(path: str) -> Path:
    """A local HF folder (nothing is ever downloaded: transformers would read a missing path as a
    hub repo id and fail with a misleading message)."""
    p = existing_dir(path, "--model-dir", "give a HF model folder (polar-env export-model DIR writes one)")
    if not (p / "config.json").is_file():
        raise ConfigError(f"--model-dir {path} has no config.json; give a HF model folder (polar-env export-model DIR writes one)")
    return p


def load_script(path: str) -> Any:
    """The scripted policy from ``--script FILE`` (JSON: ``{"steps": [{command|text, reasoning}]}``)."""
    from polar_env.engines.embedded.policy import ScriptedPolicy

    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"--script {path}: no such file; write a JSON policy there "
                          '(e.g. {"steps": [{"command": "ls"}, {"text": "done"}]}) or drop --script')
    try:
        return ScriptedPolicy.from_dict(json.loads(p.read_text()))
    except json.JSONDecodeError as exc:
        raise ConfigError(f"--script {path} is not JSON: {exc}") from exc
    except (TypeError, ValueError, AttributeError) as exc:
        raise ConfigError(f"--script {path} is not a scripted policy ({exc}); "
                          'expected {"steps": [{"command": ...} or {"text": ...}, ...]}') from exc


def missing_extra_message(exc: ModuleNotFoundError, command: str) -> str | None:
    top = (exc.name or "").split(".")[0]
    extra = EXTRA_OF_MODULE.get(top)
    if extra is None:
        return None
    hint = " (CPU-only machine: pip install torch --index-url https://download.pytorch.org/whl/cpu first)" if extra == "embedded" else ""
    return (f"polar-env {command} needs the '{extra}' extra ({top} is not installed): "
            f"pip install 'polar-env[{extra}]', or pip install -e '.[{extra}]' in a checkout{hint}")


# -- engine ------------------------------------------------------------------------------------


def _engine_from_args(args: argparse.Namespace):  # type: ignore[no-untyped-def]
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
    return EmbeddedEngine(
        model_dir=model_dir(args.model_dir) if args.model_dir else None,
        spec=ModelSpec(seed=args.seed),
        quirks=QUIRKS[args.template],
        policy=policy,
        logprobs_mode=args.logprobs_mode,
        max_tokens_cap=args.max_tokens_cap,
        model_name=args.served_model_name or EMBEDDED_MODEL_NAME,
    )


def _add_engine_options(p: argparse.ArgumentParser, *, gateway: bool = False) -> None:
    d = EMBEDDED_DEFAULTS
    p.add_argument("--model-dir", help="load this local HF Qwen3 folder instead of seeded random weights")
    p.add_argument("--seed", type=int, default=d["seed"], help="seed of the random weights")
    p.add_argument("--served-model-name", help=(
        "model name sent to the engine (default: the one model a vllm/sglang engine lists at /v1/models; "
        f"{EMBEDDED_MODEL_NAME} for the embedded engine)") if gateway else f"model name served (default: {EMBEDDED_MODEL_NAME})")
    p.add_argument("--template", choices=sorted(QUIRKS), default="qwen3.5",
                   help="chat template quirks (qwen3.5: what vLLM does; append_only: none)")
    p.add_argument("--logprobs-mode", choices=["processed", "raw"], default="processed",
                   help="logprobs of the sampled distribution (processed) or of the raw logits")
    p.add_argument("--max-tokens-cap", type=int, default=d["max_tokens_cap"],
                   help="most tokens the embedded engine samples per request")
    p.add_argument("--scripted", action="store_true", help="force decoding to the scripted tool-then-answer turns")
    p.add_argument("--script", help="JSON file with a scripted policy ({steps: [{command|text, reasoning}]})")
    p.add_argument("--script-command", default=d["script_command"], help="--scripted: the shell command the model calls")
    p.add_argument("--script-answer", default=d["script_answer"], help="--scripted: the final answer ({tool_output} is replaced)")


def cmd_engine(args: argparse.Namespace) -> int:
    from polar_env.engines.embedded.server import build_app

    started = time.perf_counter()
    engine = _engine_from_args(args)
    what = f"polar-env engine ({json.dumps(engine.describe())})"
    asyncio.run(_serve(build_app(engine), args.host, args.port, what, started))
    return 0


# -- gateway -----------------------------------------------------------------------------------


def resolve_engine_kind(args: argparse.Namespace) -> str:
    """``--engine`` as given, or inferred from ``--engine-url`` (vllm; sglang for worker lists and
    ``router:``); a contradiction is an error, not a silently ignored option."""
    url = args.engine_url
    kind = args.engine or ("embedded" if not url else "sglang" if url.startswith("router:") or "," in url else "vllm")
    if kind == "embedded":
        if url:
            raise ConfigError("--engine-url is for --engine vllm or sglang; the embedded engine runs in-process (drop one of them)")
        return kind
    if not url:
        raise ConfigError(f"--engine {kind} needs --engine-url (the server's base URL, e.g. http://127.0.0.1:8000)")
    unused = [f"--{k.replace('_', '-')}" for k, v in EMBEDDED_DEFAULTS.items() if getattr(args, k) != v]
    if unused:
        raise ConfigError(f"{', '.join(unused)} only appl{'y' if len(unused) > 1 else 'ies'} to --engine embedded, not --engine {kind}; drop them")
    return kind


async def _gateway_engine(args: argparse.Namespace, kind: str):  # type: ignore[no-untyped-def]
    """The engine client and the model name to send it, after checking the engine answers."""
    if kind == "embedded":
        engine = _engine_from_args(args)
        return engine, engine.model_name, "embedded (in-process)"
    from polar_env.engines import make_engine
    from polar_env.engines.probe import choose_model, wait_for_engine

    engine = make_engine(kind, args.engine_url, args.served_model_name or "", logprobs_mode=args.logprobs_mode)
    try:
        served = await wait_for_engine(engine, wait_s=args.engine_wait_s, on_wait=lambda line: print(line, file=sys.stderr, flush=True))
        first_url, first_served = next(iter(served.items()))
        model = choose_model(args.served_model_name, first_served, first_url, strict=kind == "vllm")
    except BaseException:
        await engine.aclose()
        raise
    engine.model = model
    return engine, model, f"{kind} {', '.join(served)}"


def cmd_gateway(args: argparse.Namespace) -> int:
    kind = resolve_engine_kind(args)
    store_root = store_to_write(args.store)
    asyncio.run(_run_gateway(args, kind, store_root))
    return 0


async def _run_gateway(args: argparse.Namespace, kind: str, store_root: Path) -> None:
    from polar_env.proxy.admin import load_or_create_admin_token
    from polar_env.proxy.capture import CaptureStore
    from polar_env.proxy.gateway import Gateway, GatewayConfig

    started = time.perf_counter()
    engine, model, engine_text = await _gateway_engine(args, kind)
    store = CaptureStore(store_root, fsync=args.fsync)
    token, token_path = load_or_create_admin_token(store.root, args.admin_token)
    config = GatewayConfig(
        engine_model=model,
        public_url=args.public_url,
        temperature=args.temperature,
        top_p=args.top_p,
        max_tokens_cap=args.gateway_max_tokens,
        admin_token=token,
        template=QUIRKS[args.template],
        continuation=args.continuation,
        engine_timeout_s=args.engine_timeout,
    )
    gateway = Gateway(engine, store, config)
    where = f"; store {store_root}; " + (f"admin token in {token_path}" if token_path else "admin token from --admin-token")
    what = f"polar-env gateway (engine: {engine_text}, model {model!r})"
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


async def _serve(app, host: str, port: int, what: str, started: float, *,  # type: ignore[no-untyped-def]
                 unix_socket: str | None = None, unix_app=None, suffix: str = "") -> None:  # type: ignore[no-untyped-def]
    from aiohttp import web

    from polar_env.access_log import LOGGER, AccessLogger

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
                await web.UnixSite(unix_runner, unix_socket).start()
            except OSError as exc:
                raise ConfigError(f"cannot listen on --unix-socket {unix_socket} ({exc.strerror or exc}); "
                                  "give a path in an existing, writable folder") from exc
        # Printed only once the socket listens: callers wait for this line.
        print(f"{what} ready in {time.perf_counter() - started:.1f}s on http://{host}:{port}{suffix}", flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
    finally:
        for r in runners:
            await r.cleanup()


# -- trajectories ------------------------------------------------------------------------------


def _trajectories(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    from polar_env.proxy.capture import CaptureStore
    from polar_env.trajectory.reader import build_trajectories

    root = existing_dir(args.store, "--store", "pass the folder polar-env gateway --store wrote")
    store = CaptureStore(root)
    known = store.session_ids()
    if not known:
        raise ConfigError(f"--store {args.store} holds no session journals (*.jsonl); pass the folder polar-env gateway --store wrote")
    unknown = [s for s in args.session or () if s not in known]
    if unknown:
        raise ConfigError(f"--session {unknown[0]} has no journal in {args.store}; it has {', '.join(known[:10])}"
                          + (" …" if len(known) > 10 else ""))
    return build_trajectories(root, args.builder, args.session or known)


def cmd_build(args: argparse.Namespace) -> int:
    """Build trajectories from a capture store; print per-session stats, optionally write JSONL."""
    out_path = file_to_write(args.out, "--out") if args.out else None
    trajectories = _trajectories(args)
    out = open(out_path, "wb") if out_path else None  # noqa: SIM115
    try:
        for traj in trajectories:
            stats = traj.metadata.get("stats", {})
            print(f"{traj.session_id}: {traj.status.value} {json.dumps(stats or traj.metadata)}")
            if out is not None:
                out.write(traj.to_json() + b"\n")
    finally:
        if out is not None:
            out.close()
    return 0 if all(t.status.value != "error" for t in trajectories) else 1


def cmd_verify(args: argparse.Namespace) -> int:
    """Teacher-forced fidelity check of built trajectories against the embedded engine's model."""
    folder = model_dir(args.model_dir) if args.model_dir else None
    trajectories = _trajectories(args)
    from polar_env.engines.embedded.model import ModelSpec, build_model, load_model
    from polar_env.trajectory.fidelity import verify

    model = load_model(folder) if folder else build_model(ModelSpec(seed=args.seed))
    worst, tokens, failed = 0.0, 0, []
    for traj in trajectories:
        if traj.status.value == "error":
            print(f"{traj.session_id}: not checked, its trajectory is an error: {traj.metadata.get('error', traj.metadata)}")
            failed.append(traj.session_id)
            continue
        report = verify([traj], model)
        worst, tokens = max(worst, report.max_abs_delta), tokens + report.tokens_checked
        drift = traj.metadata.get("stats", {}).get("drift_boundaries", 0)
        print(f"{traj.session_id}: {report.line()}; drift boundaries {drift}")
        for w in report.worst[:3]:
            print(f"    trace {w['trace']} position {w['position']}: |Δ| {w['delta']:.3g}")
        if report.max_abs_delta > args.tolerance:
            failed.append(traj.session_id)
    verdict = "FAIL" if failed else "PASS"
    print(f"{verdict}: max |Δlogprob| {worst:.3g} {'>' if worst > args.tolerance else '<='} tolerance {args.tolerance:g} "
          f"over {tokens} sampled tokens in {len(trajectories)} sessions"
          + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


def cmd_export_model(args: argparse.Namespace) -> int:
    from polar_env.engines.embedded.model import ModelSpec, build_model, save_model

    out = Path(args.directory)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"{out} is a file; give a folder to write the model into")
    save_model(build_model(ModelSpec(seed=args.seed)), out)
    print(f"wrote {out} (config, safetensors, generation_config, tokenizer)")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from polar_env.demo import run_demo

    store = str(store_to_write(args.store)) if args.store else None
    return asyncio.run(run_demo(store_dir=store))


# -- parser ------------------------------------------------------------------------------------


def _add_server_options(p: argparse.ArgumentParser, *, port: int) -> None:
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=port, help="port to listen on")
    p.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"],
                   help="stderr log: warning logs every 4xx/5xx answer with its error, info every request")


# -- rollouts: rollout / eval / serve / submit / status ---------------------------------------


def _env_config(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    """PolarEnvConfig from --config (YAML) with the flags given on the command line on top."""
    from polar_env.engines.config import EngineConfig
    from polar_env.env import PolarEnvConfig
    from polar_env.evaluators.base import EvaluatorSpec
    from polar_env.staging.pools import PoolLimits

    try:
        return _env_config_unchecked(args)
    except ValueError as exc:  # pydantic's ValidationError, bad --evaluator JSON
        raise ConfigError(f"invalid option: {' '.join(str(exc).split())[:400]}") from None


def _env_config_unchecked(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    from polar_env.engines.config import EngineConfig
    from polar_env.env import PolarEnvConfig
    from polar_env.evaluators.base import EvaluatorSpec
    from polar_env.staging.pools import PoolLimits

    config = PolarEnvConfig.from_yaml(args.config) if args.config else PolarEnvConfig()
    engine = config.engine.model_dump()
    for flag, key in (("engine", "kind"), ("engine_url", "url"), ("model_dir", "model_dir"), ("seed", "seed"),
                      ("engine_script", "script"), ("max_tokens_per_turn", "max_tokens_cap"),
                      ("served_model_name", "model")):
        if getattr(args, flag, None) is not None:
            engine[key] = getattr(args, flag)
    if args.engine_url and args.engine is None and not args.config:
        engine["kind"] = "vllm"  # a URL means a served engine
    limits = config.limits.model_dump()
    for key in ("max_running", "max_init", "max_postrun", "ready_buffer"):
        if getattr(args, key, None) is not None:
            limits[key] = getattr(args, key)
    if args.max_running is not None and args.ready_buffer is None:
        limits["ready_buffer"] = None  # re-derive from the new limits
    update: dict = {"engine": EngineConfig.model_validate(engine), "limits": PoolLimits.model_validate(limits)}
    for flag in ("harness", "api", "builder", "temperature", "top_p", "timeout_s", "nodes", "ray_address"):
        if getattr(args, flag, None) is not None:
            update[flag] = getattr(args, flag)
    if args.ray or args.ray_address:
        update["ray"] = True
    if args.canonical:
        update["continuation"] = False
    if args.runtime is not None:
        update["runtime"] = config.runtime.model_copy(update={"kind": args.runtime})
    if args.evaluator is not None:
        text = args.evaluator.strip()
        update["evaluator"] = EvaluatorSpec.model_validate(json.loads(text) if text.startswith("{") else text)
    return PolarEnvConfig.model_validate({**config.model_dump(), **{k: v for k, v in update.items()}})


def _add_env_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("environment (override --config)")
    g.add_argument("--config", help="YAML file of PolarEnvConfig fields (engine, harness, runtime, limits, ...)")
    g.add_argument("--harness", help="harness preset (pi, qwen_code, mini_swe_agent, claude_code, codex, "
                   "gemini_cli, opencode), a harness file, or 'loop' (built-in agent loop); default pi")
    g.add_argument("--api", help="wire format the harness speaks (default: its own)")
    g.add_argument("--engine", choices=["embedded", "vllm", "sglang", "simulated"],
                   help="embedded: the CPU engine in-process (default); simulated: a test double")
    g.add_argument("--engine-url", help="vLLM base URL (several, comma-separated: a session-sticky pool), or SGLang worker URLs (comma-separated) / router:URL")
    g.add_argument("--served-model-name", help="the engine's model name")
    g.add_argument("--model-dir", help="embedded: a HF Qwen3 folder (default: seeded random tiny weights)")
    g.add_argument("--seed", type=int, help="embedded: seed of the random weights")
    g.add_argument("--engine-script", help="embedded: scripted policy JSON forcing the tokens (a test double)")
    g.add_argument("--max-tokens-per-turn", type=int, help="embedded: cap on sampled tokens per call (default 256)")
    g.add_argument("--temperature", type=float, help="trainer-owned sampling temperature (overrides harnesses)")
    g.add_argument("--top-p", type=float, help="trainer-owned top_p")
    g.add_argument("--runtime", choices=["sandbox", "docker", "apptainer"], help="default sandbox (bubblewrap)")
    g.add_argument("--builder", choices=["prefix_merge", "per_request", "prefix_merge_strict"],
                   help="trajectory builder (default prefix_merge)")
    g.add_argument("--evaluator", help="evaluator name or JSON spec (default: swebench for SWE tasks)")
    g.add_argument("--canonical", action="store_true", help="canonical templating instead of token-in continuation")
    g.add_argument("--timeout-s", type=float, help="agent budget per session in seconds (default 600)")
    g.add_argument("--nodes", type=int, help="gateway nodes (default 1)")
    g.add_argument("--ray", action="store_true", help="run nodes as Ray actors (ray.init() locally)")
    g.add_argument("--ray-address", help="join an existing Ray cluster (implies --ray)")
    g.add_argument("--max-running", type=int, help="RUNNING slots per node (match the engine's capacity)")
    g.add_argument("--max-init", type=int, help="INIT workers per node")
    g.add_argument("--max-postrun", type=int, help="POSTRUN workers per node")
    g.add_argument("--ready-buffer", type=int, help="prepared runtimes per node (INIT + READY)")


def _add_job_options(p: argparse.ArgumentParser, samples: int) -> None:
    p.add_argument("--tasks", default="toy", help="'toy' (the offline toy SWE set), a .jsonl/.json/.parquet file, or a folder of Harbor tasks")
    p.add_argument("--task-id", action="append", help="only this task (repeatable)")
    p.add_argument("--limit", type=int, help="at most this many tasks")
    p.add_argument("--samples", type=int, default=samples, help="sessions per task (the GRPO group size)")
    p.add_argument("--out", default="polar_rollouts", help="output folder (journals, trajectories, report)")
    p.add_argument("--early-stop", type=int, dest="early_stop", help="finish a group after this many usable sessions")
    p.add_argument("--no-progress", action="store_true", help="no live table (e.g. in CI logs)")
    p.add_argument("--tracker", choices=["wandb", "tensorboard"], help="also log the figures there (W&B offline by default)")
    _add_env_options(p)


def cmd_rollout(args: argparse.Namespace) -> int:
    from polar_env.staging.job import RolloutJob, run_job
    from polar_env.staging.progress import LiveProgress, print_summary

    job = RolloutJob(env=_env_config(args), tasks=args.tasks, task_ids=args.task_id, limit=args.limit,
                     samples=args.samples, out=Path(args.out), mode=args.command,
                     pass_k=sorted(set(getattr(args, "k", None) or [1])), early_stop_min_usable=args.early_stop,
                     tracker=args.tracker)
    env = job.env
    print(f"polar-env {args.command}: {env.engine.describe()}; harness {env.harness}; runtime {env.runtime.kind}; "
          f"{'continuation' if env.continuation else 'canonical'} mode; {env.nodes} node(s){' on Ray' if env.ray else ''}; "
          f"output {job.out}", flush=True)
    live = None if args.no_progress else LiveProgress()
    try:
        report = asyncio.run(run_job(job, live))
    finally:
        if live is not None:
            live.stop()
    print_summary(report)
    print(f"wrote {job.out}/: {', '.join(report['files'])}")
    return 0 if report["statuses"].get("completed", 0) > 0 else 1


def _server_token(args: argparse.Namespace) -> str:
    if getattr(args, "token", None):
        return str(args.token)
    path = Path(args.token_file)
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        from polar_env.errors import ConfigError

        raise ConfigError(f"token file {path} does not exist; pass --token or the --token-file polar-env serve wrote") from None


def cmd_serve(args: argparse.Namespace) -> int:
    from polar_env.staging.cluster import serve

    config = _env_config(args)
    if not args.local:
        config = config.model_copy(update={"ray": True})
    store = Path(args.store)
    config = config.model_copy(update={"store": store / "capture"})
    return asyncio.run(serve(config, args.host, args.port, store, args.token))


def _http(method: str, url: str, token: str, body: bytes | None = None) -> tuple[int, dict]:
    import urllib.error
    import urllib.request

    req = urllib.request.Request(url, data=body, method=method,
                                 headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read() or b"{}")
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")
    except OSError as exc:
        from polar_env.errors import ConfigError

        raise ConfigError(f"cannot reach the rollout server at {url}: {exc} (is polar-env serve running?)") from None


def cmd_submit(args: argparse.Namespace) -> int:
    from polar_env.env import task_request
    from polar_env.staging.models import TaskRequest
    from polar_env.tasks.sources import read_rows

    token = _server_token(args)
    config = _env_config(args)
    groups = []
    for row in read_rows(Path(args.tasks)):
        is_request = isinstance(row, dict) and "task_id" in row and "instruction" in row and "agent" in row
        req = TaskRequest.model_validate(row) if is_request else task_request(row, config, args.samples)
        status, body = _http("POST", f"{args.server}/rollout/task/submit", token, req.model_dump_json().encode())
        if status != 202:
            print(f"{req.task_id}: refused ({status}): {body.get('error', body)}", file=sys.stderr)
            continue
        groups.append(body["group_id"])
        print(f"{req.task_id}: submitted as group {body['group_id']} ({req.num_samples} samples)")
    while args.wait and groups:
        time.sleep(2)
        for gid in list(groups):
            status, body = _http("GET", f"{args.server}/rollout/task/{gid}?results=0", token)
            if body.get("state") in ("done", "cancelled"):
                print(json.dumps(body))
                groups.remove(gid)
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    token = _server_token(args)
    path = f"/rollout/task/{args.ref}?results=0" if args.ref else "/rollout/status"
    status, body = _http("GET", args.server + path, token)
    print(json.dumps(body, indent=2))
    return 0 if status == 200 else 1


def _add_rollout_commands(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    def command(name: str, text: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=text, description=text, formatter_class=_HelpFormatter)

    p = command("rollout", "the main job: staged rollouts of a task set, rewarded trajectories + report")
    _add_job_options(p, samples=2)
    p.set_defaults(func=cmd_rollout)

    p = command("eval", "the rollout pipeline in evaluation mode: pass@1 / pass@k per repo, cost")
    _add_job_options(p, samples=1)
    p.add_argument("-k", type=int, action="append", help="report pass@k (repeatable; default 1)")
    p.set_defaults(func=cmd_rollout)

    p = command("serve", "rollout server + N gateway nodes (Ray actors) behind an HTTP task API")
    p.add_argument("--host", default="127.0.0.1", help="address of the task API (keep it off the sandboxes' reach)")
    p.add_argument("--port", type=int, default=8080, help="port of the task API")
    p.add_argument("--store", default="polar_serve", help="journals and the server's token file go here")
    p.add_argument("--token", help="bearer token for the task API (default: generated into STORE/rollout_token)")
    p.add_argument("--local", action="store_true", help="nodes in this process instead of Ray actors")
    _add_env_options(p)
    p.set_defaults(func=cmd_serve)

    for name, func, text in (("submit", cmd_submit, "submit a JSONL/JSON/Parquet file of tasks to polar-env serve"),
                             ("status", cmd_status, "status of polar-env serve, or of one task group")):
        p = command(name, text)
        if name == "submit":
            p.add_argument("tasks", help="task rows (SWE rows, {task_id, instruction, ...}, or full TaskRequests)")
            p.add_argument("--samples", type=int, default=1, help="sessions per task")
            p.add_argument("--wait", action="store_true", help="poll until every submitted group is done")
            _add_env_options(p)
        else:
            p.add_argument("ref", nargs="?", help="group id or task id (default: the whole server)")
        p.add_argument("--server", default="http://127.0.0.1:8080", help="the rollout server's URL")
        p.add_argument("--token", help="the server's bearer token")
        p.add_argument("--token-file", default="polar_serve/rollout_token", help="file holding the token")
        p.set_defaults(func=func)


# -- trainer integrations: slime-args / sft ---------------------------------------------------


def cmd_slime_args(args: argparse.Namespace) -> int:
    """Print the slime launch a recipe stands for; write the files it names; --run launches it."""
    import importlib.util
    import os
    import subprocess

    from polar_env.integrations.slime_recipe import Recipe, render

    launch = render(Recipe.from_yaml(args.recipe), Path(args.out))
    launch.write_files()
    script = Path(args.out).resolve() / "launch_slime.sh"
    script.write_text(launch.script)
    print(json.dumps(launch.flags) if args.argv else launch.script, end="" if not args.argv else "\n")
    if not args.run:
        print(f"# wrote {script} and {len(launch.files)} file(s) in {Path(args.out).resolve()}", file=sys.stderr)
        return 0
    slime_dir = os.environ.get("SLIME_DIR")
    if importlib.util.find_spec("slime") is None and not (slime_dir and Path(slime_dir, "train.py").is_file()):
        print("polar-env slime-args --run: slime is not installed here (import slime fails and $SLIME_DIR has no "
              "train.py); git clone https://github.com/THUDM/slime and pip install -e slime --no-deps, or run "
              "inside the slimerl/slime image", file=sys.stderr)
        return 2
    return subprocess.call(["bash", str(script)])


def cmd_sft(args: argparse.Namespace) -> int:
    """Roll tasks out, keep the evaluator-accepted sessions, export SFT rows, print the table."""
    from polar_env.integrations.sft import export_job
    from polar_env.staging.job import RolloutJob, load_tasks, run_job
    from polar_env.staging.progress import LiveProgress

    job = RolloutJob(env=_env_config(args), tasks=args.tasks, task_ids=args.task_id, limit=args.limit,
                     samples=args.samples, out=Path(args.out), early_stop_min_usable=args.early_stop)
    repo_of = {r.task_id: str(r.task.get("repo") or r.task_id) for r in load_tasks(job)}
    print(f"polar-env sft: {len(repo_of)} task(s) x {args.samples} sample(s); {job.env.engine.describe()}; "
          f"harness {job.env.harness}; output {job.out}", flush=True)
    live = None if args.no_progress else LiveProgress()
    try:
        asyncio.run(run_job(job, live))
    finally:
        if live is not None:
            live.stop()
    summary = export_job(Path(args.out), repo_of, min_reward=args.min_reward)
    print(summary.table())
    print(f"wrote {Path(args.out)}/: {', '.join(summary.files)}")
    return 0 if summary.rows else 1


def _add_integration_commands(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    def command(name: str, text: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=text, description=text, formatter_class=_HelpFormatter)

    p = command("slime-args", "a slime recipe YAML -> the exact slime launch (bash script)")
    p.add_argument("recipe", help="recipe YAML (see recipes/)")
    p.add_argument("--out", default="slime_run", help="folder for polar.yaml, the custom config and launch_slime.sh")
    p.add_argument("--argv", action="store_true", help="print the flags as a JSON list instead of the script")
    p.add_argument("--run", action="store_true", help="launch it (needs slime installed, or $SLIME_DIR)")
    p.set_defaults(func=cmd_slime_args)

    p = command("sft", "offline SFT data: roll out, keep evaluator-accepted sessions, export JSONL + Parquet")
    _add_job_options(p, samples=4)
    p.add_argument("--min-reward", type=float, default=1.0,
                   help="acceptance for evaluators without a resolved verdict (swebench: resolved)")
    p.set_defaults(func=cmd_sft)


def cmd_train(args: argparse.Namespace) -> int:
    from polar_env.train.command import run_train

    overrides = {"seed": args.seed, "steps": args.steps, "control": True if args.control else None, "out_dir": args.out_dir}
    return run_train(Path(args.recipe), overrides, tracker=args.tracker)


def cmd_dashboard(args: argparse.Namespace) -> int:
    from polar_env.dashboard.command import run_dashboard

    return run_dashboard(args.paths, args.host, args.port, args.token, args.server, args.server_token)


def _add_dashboard_command(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    text = "web dashboard over run folders, capture stores or a live rollout server (runs, live, sessions, traces)"
    p = sub.add_parser("dashboard", help=text, description=text, formatter_class=_HelpFormatter)
    p.add_argument("paths", nargs="*", help="run folders (polar-env rollout --out), capture stores, or folders of them")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (anything but loopback requires a token)")
    p.add_argument("--port", type=int, default=8765, help="port to listen on (0: any free port)")
    p.add_argument("--token", help="access token (generated and printed when --host is not loopback)")
    p.add_argument("--server", help="also show a live polar-env serve (its URL)")
    p.add_argument("--server-token", help="that server's bearer token")
    p.set_defaults(func=cmd_dashboard)


def _add_train_command(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    text = "reference GRPO loop on CPU: rollouts, step-0 check, update, weight sync, run report"
    p = sub.add_parser("train", help=text, description=text, formatter_class=_HelpFormatter)
    p.add_argument("recipe", help="recipe YAML, e.g. recipes/cpu_grpo_toy.yaml")
    p.add_argument("--seed", type=int, help="override the recipe's seed")
    p.add_argument("--steps", type=int, help="override the recipe's number of steps")
    p.add_argument("--control", action="store_true", help="shuffled-reward control run")
    p.add_argument("--out-dir", help="report directory (default: the recipe's out_dir)")
    p.add_argument("--tracker", choices=["wandb", "tensorboard"], help="also log each step there (W&B offline by default)")
    p.set_defaults(func=cmd_train)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="polar-env", description="Unmodified agent harnesses as token-faithful RL environments.",
                                     formatter_class=_HelpFormatter)
    parser.add_argument("--version", action="version", version=f"polar-env {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, text: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=text, description=text, formatter_class=_HelpFormatter)

    p = command("engine", "serve the embedded CPU engine (vLLM-shaped OpenAI chat API)")
    _add_server_options(p, port=8000)
    _add_engine_options(p)
    p.set_defaults(func=cmd_engine)

    p = command("gateway", "serve the provider gateway in front of an engine")
    _add_server_options(p, port=8100)
    p.add_argument("--engine", choices=["embedded", "vllm", "sglang"],
                   help="embedded runs the CPU engine in-process; vllm/sglang need --engine-url "
                        "(default: vllm when --engine-url is given, else embedded)")
    p.add_argument("--engine-url", help="vLLM base URL (a /v1 suffix is fine; several, comma-separated, with --engine vllm: a session-sticky pool); SGLang worker URLs (comma-separated) or router:URL")
    p.add_argument("--engine-wait-s", type=float, default=30.0,
                   help="how long to wait at start for the engine to answer GET /v1/models before failing")
    p.add_argument("--store", required=True, help="directory of per-session journals (created if absent)")
    p.add_argument("--fsync", action="store_true", help="fsync every record (survives machine crashes)")
    p.add_argument("--unix-socket", help="also listen on this unix socket (bridged into sandboxes)")
    p.add_argument("--public-url", help="base URL handed to harnesses (default: the request's Host)")
    p.add_argument("--temperature", type=float, help="override every request's temperature")
    p.add_argument("--top-p", type=float, help="override every request's top_p")
    p.add_argument("--gateway-max-tokens", type=int, help="cap every request's max_tokens")
    p.add_argument("--admin-token", help="bearer token for /sessions and /admin/* (default: read or create "
                   "<store>/admin_token, mode 0600)")
    p.add_argument("--engine-timeout", type=float, default=1800.0,
                   help="seconds one engine call may take before the harness gets a 504")
    p.add_argument("--continuation", action="store_true",
                   help="token-in continuation mode for every session (append-only prompts)")
    _add_engine_options(p, gateway=True)
    p.set_defaults(func=cmd_gateway)

    for name, func, text in (
        ("build", cmd_build, "build trajectories from a capture store"),
        ("verify", cmd_verify, "teacher-forced fidelity check of captured trajectories (needs the embedded extra)"),
    ):
        p = command(name, text)
        p.add_argument("--store", required=True, help="capture store directory (what polar-env gateway --store wrote)")
        p.add_argument("--session", action="append", help="session id (repeatable; default: every session in the store)")
        p.add_argument("--builder", default="prefix_merge", choices=["per_request", "prefix_merge", "prefix_merge_strict"],
                       help="how calls become traces: one per call, or merged along token prefixes")
        if name == "build":
            p.add_argument("--out", help="write trajectories as JSON lines to this file")
        else:
            p.add_argument("--model-dir", help="local HF folder of the model that sampled (default: the seeded tiny model)")
            p.add_argument("--seed", type=int, default=0, help="seed of the tiny model that sampled")
            p.add_argument("--tolerance", type=float, default=1e-4, help="max |Δlogprob| that passes")
        p.set_defaults(func=func)

    p = command("export-model", "write the seeded tiny model as a HF folder (for vLLM)")
    p.add_argument("directory", help="folder to write (config, safetensors, generation config, tokenizer)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    p.set_defaults(func=cmd_export_model)

    p = command("demo", "one captured tool-use episode through engine + gateway, then its trajectory")
    p.add_argument("--store", help="capture store directory (default: a new temporary one); rerunning on one adds a session")
    p.set_defaults(func=cmd_demo)

    _add_rollout_commands(sub)
    _add_integration_commands(sub)
    _add_train_command(sub)
    _add_dashboard_command(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one subcommand; a user's mistake is one line on stderr and exit code 2."""
    args = build_parser().parse_args(argv)
    if hasattr(args, "log_level"):
        from polar_env.access_log import configure

        configure(args.log_level)
    try:
        return int(args.func(args))
    except KeyboardInterrupt:
        return 130
    except PolarError as exc:
        print(f"polar-env {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as exc:
        message = missing_extra_message(exc, args.command)
        if message is None:
            raise
        print(f"polar-env {args.command}: error: {message}", file=sys.stderr)
        return 2
    except OSError as exc:  # a path the user gave that cannot be read or written
        print(f"polar-env {args.command}: error: {exc.strerror or exc}: {exc.filename or ''}".rstrip(": "), file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
