"""``build``, ``verify``, ``export-model`` and ``demo``: what to do with a capture store."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from polar_env.cli.checks import add_command, existing_dir, file_to_write, model_dir, store_to_write
from polar_env.cli.options import choices, metavar, model_default
from polar_env.errors import ConfigError

if TYPE_CHECKING:
    from polar_env.engines.config import EmbeddedEngineConfig


def _trajectories(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    from polar_env.journal.store import JournalStore
    from polar_env.staging.runs import store_roots
    from polar_env.trajectory.builders import BUILDERS
    from polar_env.trajectory.reader import all_session_ids, build_store

    hint = "pass a run folder (OUT/<run id>, OUT/latest) or the folder polar-env gateway --store wrote"
    roots = store_roots(existing_dir(args.store, "--store", hint))
    note = run_note(Path(args.store))
    if note:
        print(f"polar-env {args.command}: note: {note}", file=sys.stderr)
    # journals, and rollout sessions that ended before their first call (an outcome file only)
    stores = {root: JournalStore(root) for root in roots}
    where = {sid: root for root in roots for sid in all_session_ids(stores[root])}
    known = sorted(where)
    if not known:
        raise ConfigError(f"--store {args.store} holds no session journals (*.jsonl); {hint}")
    unknown = [s for s in args.session or () if s not in where]
    if unknown:
        raise ConfigError(f"--session {unknown[0]} has no journal in {args.store}; it has {', '.join(known[:10])}"
                          + (" …" if len(known) > 10 else ""))
    wanted = args.session or known
    per_root = [(root, [s for s in wanted if where[s] == root]) for root in roots]
    build = BUILDERS.get(args.builder)
    return [t for root, sids in per_root if sids for t in build_store(stores[root], build, sids)]


def run_note(store: Path) -> str | None:
    """One line when the run behind ``store`` has not finished: still running (its sessions in
    flight are built as far as they got), or crashed / interrupted (and how to continue it)."""
    from polar_env.observe.liveness import run_state
    from polar_env.staging.runs import is_run_folder

    run = next((p for p in (store, *store.resolve().parents[:2]) if is_run_folder(p)), None)
    if run is None:
        return None
    state = run_state(run)
    if state.state == "running":
        return f"the run is still running ({state.reason}): sessions in flight are built as far as they got"
    if state.state in ("crashed", "interrupted"):
        resume = f"; continue it with: {state.resume}" if state.resume else ""
        return f"the run {state.state} ({state.reason}){resume}"
    return None


def cmd_build(args: argparse.Namespace) -> int:
    """Build trajectories from a capture store; print per-session stats, optionally write JSONL."""
    from polar_env.trajectory.reader import unbuilt

    out_path = file_to_write(args.out, "--out") if args.out else None
    trajectories = _trajectories(args)
    out = open(out_path, "wb") if out_path else None  # noqa: SIM115
    try:
        for traj in trajectories:
            stats = traj.metadata.get("stats", {})
            failure = f" ({traj.failure_kind.value}{', masked' if traj.mask else ''})" if traj.failure_kind else ""
            print(f"{traj.session_id}: {traj.status.value}{failure} {json.dumps(stats or traj.metadata)}")
            if out is not None:
                out.write(traj.to_json() + b"\n")
    finally:
        if out is not None:
            out.close()
    return 1 if any(unbuilt(t) for t in trajectories) else 0  # failed sessions are data; unbuilt journals are not


def run_engine(store: Path) -> EmbeddedEngineConfig | None:
    """The embedded engine the run's ``plan.json`` names (``store`` is the run folder, its
    ``capture/`` or a node's store), None without a plan; another engine kind is one line asking
    for ``--model-dir``: scoring with the default tiny model would report a false FAIL."""
    from pydantic import TypeAdapter, ValidationError

    from polar_env.engines.config import AnyEngineConfig, EmbeddedEngineConfig, EngineConfig
    from polar_env.staging.runs import PLAN_FILE, Plan

    run = next((p for p in (store, *store.resolve().parents[:2]) if (p / PLAN_FILE).is_file()), None)
    if run is None:
        return None
    spec = Plan.read(run).job.get("env", {}).get("engine", {})
    try:
        adapter: TypeAdapter[AnyEngineConfig] = TypeAdapter(EngineConfig)
        engine = adapter.validate_python(spec)
    except ValidationError as exc:
        raise ConfigError(f"{run / PLAN_FILE}: its engine is not readable ({exc.errors()[0]['msg']}); "
                          "pass --model-dir with the weights that sampled") from None
    if not isinstance(engine, EmbeddedEngineConfig):
        raise ConfigError(f"{run / PLAN_FILE}: the run sampled on a {engine.kind} engine; pass --model-dir with its "
                          "weights (a local HF folder or .gguf)")
    return engine


def _sampling_model(args: argparse.Namespace, folder: Path | None) -> tuple[Any, str]:
    """The model that sampled, and where it came from: ``--model-dir``, else ``--seed``'s tiny
    weights, else the run's own engine (its template's or ``model_dir`` weights, else its seeded
    ones), else the seeded tiny model."""
    from polar_env.engines.embedded.model import ModelSpec, build_model, load_model

    if folder is not None:
        return load_model(folder), f"{folder} (--model-dir)"
    engine = run_engine(Path(args.store))
    chat = engine.chat() if engine is not None else None
    if args.seed is not None:
        return build_model(ModelSpec(seed=args.seed), chat), f"seeded tiny weights (--seed {args.seed})"
    if engine is None:
        return build_model(ModelSpec(seed=0)), "seeded tiny weights (seed 0; no plan.json, no --model-dir)"
    weights = engine.weights()
    model = load_model(weights) if weights is not None else build_model(ModelSpec(seed=engine.seed), chat)
    return model, f"{engine.describe()} (the run's plan.json)"


def cmd_verify(args: argparse.Namespace) -> int:
    """Teacher-forced fidelity check of built trajectories against the embedded engine's model."""
    folder = model_dir(args.model_dir) if args.model_dir else None
    trajectories = _trajectories(args)
    from polar_env.trajectory.fidelity import verify
    from polar_env.trajectory.reader import unbuilt

    model, source = _sampling_model(args, folder)
    print(f"model: {source}")
    worst, tokens, failed = 0.0, 0, []
    for traj in trajectories:
        if unbuilt(traj):
            why = traj.failure_detail or traj.metadata.get("error", traj.metadata)
            print(f"{traj.session_id}: not checked, its trajectory is an error: {why}")
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


def add_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    for name, func, text in (
        ("build", cmd_build, "build trajectories from a capture store"),
        ("verify", cmd_verify, "teacher-forced fidelity check of captured trajectories (needs the embedded extra)"),
    ):
        p = add_command(sub, name, text)
        p.add_argument("--store", required=True,
                       help="a run folder (OUT/<run id>, OUT/latest), its capture/<node>/, or what polar-env gateway --store wrote")
        p.add_argument("--session", action="append", help="session id (repeatable; default: every session in the store)")
        p.add_argument("--builder", default=model_default("env.builder"), metavar=metavar(choices("builders")),
                       help="how calls become traces: one per call, or merged along token prefixes (a builders "
                       "registry name or a pkg.module:attr import path)")
        if name == "build":
            p.add_argument("--out", help="write trajectories as JSON lines to this file")
        else:
            p.add_argument("--model-dir", help="local HF folder or .gguf of the model that sampled (default: the "
                           "run's engine in its plan.json, else the seeded tiny model)")
            p.add_argument("--seed", type=int, help="seed of the tiny model that sampled (default: the run's, else 0)")
            p.add_argument("--tolerance", type=float, default=1e-4, help="max |Δlogprob| that passes")
        p.set_defaults(func=func)

    p = add_command(sub, "export-model", "write the seeded tiny model as a HF folder (for vLLM)")
    p.add_argument("directory", help="folder to write (config, safetensors, generation config, tokenizer)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    p.set_defaults(func=cmd_export_model)

    p = add_command(sub, "demo", "one captured tool-use episode through engine + gateway, then its trajectory")
    p.add_argument("--store", help="capture store directory (default: a new temporary one); rerunning on one adds a session")
    p.set_defaults(func=cmd_demo)

