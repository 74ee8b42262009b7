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


# -- rollouts: rollout / eval / serve / submit / status ---------------------------------------


def _env_config(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    """PolarEnvConfig from --config (YAML) with the flags given on the command line on top."""
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
    g.add_argument("--engine-url", help="vLLM base URL, or SGLang worker URLs (comma-separated) / router:URL")
    g.add_argument("--served-model-name", help="the engine's model name")
    g.add_argument("--model-dir", help="embedded: a HF Qwen3 folder (default: seeded random tiny weights)")
    g.add_argument("--seed", type=int, help="embedded: seed of the random weights")
    g.add_argument("--engine-script", help="embedded: scripted policy JSON forcing the tokens (a test double)")
    g.add_argument("--max-tokens-per-turn", type=int, help="embedded: cap on sampled tokens per call (default 256)")
    g.add_argument("--temperature", type=float, help="trainer-owned sampling temperature (overrides harnesses)")
    g.add_argument("--top-p", type=float, help="trainer-owned top_p")
    g.add_argument("--runtime", choices=["sandbox", "docker", "apptainer"], help="default sandbox (bubblewrap)")
    g.add_argument("--builder", choices=["prefix_merge", "per_request", "prefix_merge_strict"])
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
    p.add_argument("--tasks", default="toy", help="'toy' (the offline toy SWE set) or a .jsonl/.json/.parquet file")
    p.add_argument("--task-id", action="append", help="only this task (repeatable)")
    p.add_argument("--limit", type=int, help="at most this many tasks")
    p.add_argument("--samples", type=int, default=samples, help="sessions per task (the GRPO group size)")
    p.add_argument("--out", default="polar_rollouts", help="output folder (journals, trajectories, report)")
    p.add_argument("--early-stop", type=int, dest="early_stop", help="finish a group after this many usable sessions")
    p.add_argument("--no-progress", action="store_true", help="no live table (e.g. in CI logs)")
    _add_env_options(p)


def cmd_rollout(args: argparse.Namespace) -> int:
    from polar_env.staging.job import RolloutJob, run_job
    from polar_env.staging.progress import LiveProgress, print_summary

    job = RolloutJob(env=_env_config(args), tasks=args.tasks, task_ids=args.task_id, limit=args.limit,
                     samples=args.samples, out=Path(args.out), mode=args.command,
                     pass_k=sorted(set(getattr(args, "k", None) or [1])), early_stop_min_usable=args.early_stop)
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
    p = sub.add_parser("rollout", help="the main job: staged rollouts of a task set, rewarded trajectories + report")
    _add_job_options(p, samples=2)
    p.set_defaults(func=cmd_rollout)

    p = sub.add_parser("eval", help="the rollout pipeline in evaluation mode: pass@1 / pass@k per repo, cost")
    _add_job_options(p, samples=1)
    p.add_argument("-k", type=int, action="append", help="report pass@k (repeatable; default 1)")
    p.set_defaults(func=cmd_rollout)

    p = sub.add_parser("serve", help="rollout server + N gateway nodes (Ray actors) behind an HTTP task API")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--store", default="polar_serve", help="journals and the server's token file go here")
    p.add_argument("--token", help="bearer token for the task API (default: generated into STORE/rollout_token)")
    p.add_argument("--local", action="store_true", help="nodes in this process instead of Ray actors")
    _add_env_options(p)
    p.set_defaults(func=cmd_serve)

    for name, func, text in (("submit", cmd_submit, "submit a JSONL/JSON/Parquet file of tasks to polar-env serve"),
                             ("status", cmd_status, "status of polar-env serve, or of one task group")):
        p = sub.add_parser(name, help=text)
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

    from polar_env.errors import ConfigError
    from polar_env.integrations.slime_recipe import Recipe, render

    try:
        launch = render(Recipe.from_yaml(args.recipe), Path(args.out))
    except ConfigError as exc:
        print(f"polar-env slime-args: {exc}", file=sys.stderr)
        return 2
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
    from polar_env.errors import ConfigError
    from polar_env.integrations.sft import export_job
    from polar_env.staging.job import RolloutJob, load_tasks, run_job
    from polar_env.staging.progress import LiveProgress

    try:
        job = RolloutJob(env=_env_config(args), tasks=args.tasks, task_ids=args.task_id, limit=args.limit,
                         samples=args.samples, out=Path(args.out), early_stop_min_usable=args.early_stop)
        repo_of = {r.task_id: str(r.task.get("repo") or r.task_id) for r in load_tasks(job)}
    except ConfigError as exc:
        print(f"polar-env sft: {exc}", file=sys.stderr)
        return 2
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
    p = sub.add_parser("slime-args", help="a slime recipe YAML -> the exact slime launch (bash script)")
    p.add_argument("recipe", help="recipe YAML (see recipes/)")
    p.add_argument("--out", default="slime_run", help="folder for polar.yaml, the custom config and launch_slime.sh")
    p.add_argument("--argv", action="store_true", help="print the flags as a JSON list instead of the script")
    p.add_argument("--run", action="store_true", help="launch it (needs slime installed, or $SLIME_DIR)")
    p.set_defaults(func=cmd_slime_args)

    p = sub.add_parser("sft", help="offline SFT data: roll out, keep evaluator-accepted sessions, export JSONL + Parquet")
    _add_job_options(p, samples=4)
    p.add_argument("--min-reward", type=float, default=1.0,
                   help="acceptance for evaluators without a resolved verdict (swebench: resolved)")
    p.set_defaults(func=cmd_sft)


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

    _add_rollout_commands(sub)
    _add_integration_commands(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
