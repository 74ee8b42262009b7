"""``polar-env`` command line: the only place that reads argv and the environment."""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
import time
from pathlib import Path

from polar_env.qwen.template import QUIRKS


def _engine_from_args(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    from polar_env.engines.embedded.engine import EmbeddedEngine
    from polar_env.engines.embedded.model import ModelSpec
    from polar_env.engines.embedded.policy import ScriptedPolicy, ScriptStep

    policy = None
    if args.script:
        policy = ScriptedPolicy.from_dict(json.loads(Path(args.script).read_text()))
    elif args.scripted:
        policy = ScriptedPolicy(
            steps=(
                ScriptStep(command=args.script_command, reasoning="I should run the command."),
                ScriptStep(text=args.script_answer, reasoning="The tool answered."),
            )
        )
    return EmbeddedEngine(
        model_dir=Path(args.model_dir) if args.model_dir else None,
        spec=ModelSpec(seed=args.seed),
        quirks=QUIRKS[args.template],
        policy=policy,
        logprobs_mode=args.logprobs_mode,
        max_tokens_cap=args.max_tokens_cap,
        model_name=args.served_model_name,
    )


def _add_engine_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model-dir", help="load a HF Qwen3 folder instead of seeded random weights")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    p.add_argument("--served-model-name", default="polar-tiny-qwen3")
    p.add_argument("--template", choices=sorted(QUIRKS), default="qwen3.5")
    p.add_argument("--logprobs-mode", choices=["processed", "raw"], default="processed")
    p.add_argument("--max-tokens-cap", type=int, default=1024)
    p.add_argument("--scripted", action="store_true", help="force decoding to the scripted tool-then-answer turns")
    p.add_argument("--script", help="JSON file with a scripted policy ({steps: [{command|text, reasoning}]})")
    p.add_argument("--script-command", default="echo hi")
    p.add_argument("--script-answer", default="The command printed: {tool_output}")


def cmd_engine(args: argparse.Namespace) -> int:
    from polar_env.engines.embedded.server import build_app

    started = time.perf_counter()
    engine = _engine_from_args(args)
    what = f"polar-env engine ({json.dumps(engine.describe())})"
    asyncio.run(_serve(build_app(engine), args.host, args.port, what, started))
    return 0


def _engine_client(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    from polar_env.engines import make_engine

    if args.engine == "embedded":
        return _engine_from_args(args)
    return make_engine(args.engine, args.engine_url, args.served_model_name, logprobs_mode=args.logprobs_mode)


def cmd_gateway(args: argparse.Namespace) -> int:
    from polar_env.proxy.app import GatewayConfig, build_app
    from polar_env.proxy.capture import CaptureStore

    started = time.perf_counter()
    engine = _engine_client(args)
    config = GatewayConfig(
        engine_model=args.served_model_name,
        public_url=args.public_url,
        temperature=args.temperature,
        top_p=args.top_p,
        max_tokens_cap=args.gateway_max_tokens,
        admin_token=args.admin_token,
        template=QUIRKS[args.template],
        continuation=args.continuation,
    )
    app = build_app(engine, CaptureStore(Path(args.store), fsync=args.fsync), config)
    what = f"polar-env gateway (engine: {args.engine})"
    asyncio.run(_serve(app, args.host, args.port, what, started, unix_socket=args.unix_socket))
    return 0


def _tune_gc() -> None:
    """Server processes parse and build large acyclic JSON trees per request (a 1k-token vLLM
    response is ~10k containers), which sets off the cyclic GC many times per request. Freezing
    start-up objects and raising the gen-0 threshold cut the gateway's CPU per request by ~40%
    (scripts/bench_gateway.py); acyclic garbage is still freed at once by reference counting."""
    import gc

    gc.freeze()
    gc.set_threshold(100_000, 50, 100)


async def _serve(app, host: str, port: int, what: str, started: float, unix_socket: str | None = None) -> None:  # type: ignore[no-untyped-def]
    from aiohttp import web

    _tune_gc()
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    if unix_socket:  # what sandboxes reach through their relay (runtimes/base.py)
        await web.UnixSite(runner, unix_socket).start()
    # Printed only once the socket listens: callers wait for this line.
    print(f"{what} ready in {time.perf_counter() - started:.1f}s on http://{host}:{port}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()


def _trajectories(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    from polar_env.proxy.capture import CaptureStore
    from polar_env.trajectory.builders import BUILDERS

    store = CaptureStore(Path(args.store))
    sessions = args.session or store.session_ids()
    build = BUILDERS[args.builder]
    return [build(store.read(sid)) for sid in sessions]


def cmd_build(args: argparse.Namespace) -> int:
    """Build trajectories from a capture store; print per-session stats, optionally write JSONL."""
    trajectories = _trajectories(args)
    out = open(args.out, "wb") if args.out else None  # noqa: SIM115
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
    from polar_env.engines.embedded.model import ModelSpec, build_model, load_model
    from polar_env.trajectory.fidelity import verify

    model = load_model(Path(args.model_dir)) if args.model_dir else build_model(ModelSpec(seed=args.seed))
    trajectories = _trajectories(args)
    worst = 0.0
    for traj in trajectories:
        report = verify([traj], model)
        worst = max(worst, report.max_abs_delta)
        drift = traj.metadata.get("stats", {}).get("drift_boundaries", 0)
        print(f"{traj.session_id}: {report.line()}; drift boundaries {drift}")
        for w in report.worst[:3]:
            print(f"    trace {w['trace']} position {w['position']}: |Δ| {w['delta']:.3g}")
    return 0 if worst <= args.tolerance else 1


def cmd_export_model(args: argparse.Namespace) -> int:
    from polar_env.engines.embedded.model import ModelSpec, build_model, save_model

    out = Path(args.directory)
    save_model(build_model(ModelSpec(seed=args.seed)), out)
    print(f"wrote {out} (config, safetensors, generation_config, tokenizer)")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from polar_env.demo import run_demo

    return asyncio.run(run_demo(store_dir=args.store))


def cmd_train(args: argparse.Namespace) -> int:
    from polar_env.train.command import run_train

    overrides = {"seed": args.seed, "steps": args.steps, "control": True if args.control else None, "out_dir": args.out_dir}
    return run_train(Path(args.recipe), overrides)


def _add_train_command(sub) -> None:  # type: ignore[no-untyped-def]
    p = sub.add_parser("train", help="reference GRPO loop on CPU: rollouts, step-0 check, update, weight sync")
    p.add_argument("recipe", help="recipe YAML, e.g. recipes/cpu_grpo_toy.yaml")
    p.add_argument("--seed", type=int, help="override the recipe's seed")
    p.add_argument("--steps", type=int, help="override the recipe's number of steps")
    p.add_argument("--control", action="store_true", help="shuffled-reward control run")
    p.add_argument("--out-dir", help="report directory (default: the recipe's out_dir)")
    p.set_defaults(func=cmd_train)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="polar-env", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("engine", help="serve the embedded CPU engine (vLLM-shaped OpenAI chat API)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    _add_engine_options(p)
    p.set_defaults(func=cmd_engine)

    p = sub.add_parser("gateway", help="serve the provider gateway in front of an engine")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8100)
    p.add_argument("--engine", choices=["embedded", "vllm", "sglang"], default="embedded",
                   help="embedded runs the CPU engine in-process; vllm/sglang need --engine-url")
    p.add_argument("--engine-url", help="vLLM base URL; SGLang worker URLs (comma-separated) or router:URL")
    p.add_argument("--store", default="polar_capture", help="directory of per-session journals")
    p.add_argument("--fsync", action="store_true", help="fsync every record (survives machine crashes)")
    p.add_argument("--unix-socket", help="also listen on this unix socket (bridged into sandboxes)")
    p.add_argument("--public-url", help="base URL handed to harnesses (default: the request's Host)")
    p.add_argument("--temperature", type=float, help="override every request's temperature")
    p.add_argument("--top-p", type=float, help="override every request's top_p")
    p.add_argument("--gateway-max-tokens", type=int, help="cap every request's max_tokens")
    p.add_argument("--admin-token", help="require this bearer token on /admin/*")
    p.add_argument("--continuation", action="store_true",
                   help="token-in continuation mode for every session (append-only prompts)")
    _add_engine_options(p)
    p.set_defaults(func=cmd_gateway)

    for name, func, text in (
        ("build", cmd_build, "build trajectories from a capture store"),
        ("verify", cmd_verify, "teacher-forced fidelity check of captured trajectories"),
    ):
        p = sub.add_parser(name, help=text)
        p.add_argument("--store", required=True, help="capture store directory (polar-env gateway --store)")
        p.add_argument("--session", action="append", help="session id (repeatable; default: all)")
        p.add_argument("--builder", default="prefix_merge", choices=["per_request", "prefix_merge", "prefix_merge_strict"])
        if name == "build":
            p.add_argument("--out", help="write trajectories as JSON lines here")
        else:
            p.add_argument("--model-dir", help="HF folder of the model that sampled (default: seeded tiny model)")
            p.add_argument("--seed", type=int, default=0)
            p.add_argument("--tolerance", type=float, default=1e-4, help="max |Δlogprob| that passes")
        p.set_defaults(func=func)

    p = sub.add_parser("export-model", help="write the seeded tiny model as a HF folder (for vLLM)")
    p.add_argument("directory")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=cmd_export_model)

    p = sub.add_parser("demo", help="one captured tool-use episode through engine + gateway, then its trajectory")
    p.add_argument("--store", help="capture store directory (default: a temporary one)")
    p.set_defaults(func=cmd_demo)

    _add_train_command(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
