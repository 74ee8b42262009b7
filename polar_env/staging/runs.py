"""Run folders, plans and resume bookkeeping for the main job.

Every ``polar-env rollout`` / ``eval`` / ``sft`` writes ``OUT/<run-id>/`` (run ids sort by start time,
UTC: ``20261201-173012-rollout-ab12cd``) and points ``OUT/latest`` at it (a symlink, replaced
atomically). ``plan.json`` is written before any session starts: the job's configuration, every
TaskRequest with its group id, and every session id, so an interrupted run knows its full plan and
``--resume`` reruns exactly the sessions that did not finish (interrupted, or lost with their node), under
the same ids.

Group ids are deterministic from the plan (``<task id>-<run token>``, the run id's random tail; a
task listed twice gets ``.2``, ``.3``...), and session ids are ``<group id>-<sample index>`` as the
rollout server makes them. Interrupted attempts' journals are moved out of ``capture/`` into
``attempts/<n>/`` before a rerun, so ``capture/`` holds one attempt per session and ``polar-env build``
on the run never mixes attempts or runs.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from polar_env.errors import ConfigError
from polar_env.journal.protocols import JournalOpener, JournalSource
from polar_env.records import FailureKind, Trajectory
from polar_env.staging.models import SessionResult, SessionStatus, TaskRequest

PLAN_FILE = "plan.json"
LATEST = "latest"
ATTEMPTS = "attempts"
_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]")
_RUN_ID = re.compile(r"^\d{8}-\d{6}-[a-z]+-[0-9a-f]{6}$")
_RUN_FILES = (PLAN_FILE, "report.json", "sessions.jsonl", "live.json", "heartbeat.json")


def new_run_id(kind: str, now: float | None = None) -> str:
    """``YYYYMMDD-HHMMSS-<kind>-<6 hex>`` (UTC): sortable by start time, unique across runs."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime(time.time() if now is None else now))
    return f"{stamp}-{kind}-{secrets.token_hex(3)}"


def check_run_id(run_id: str) -> str:
    if not run_id or len(run_id) > 120 or _UNSAFE.search(run_id) or run_id.startswith(".") or run_id == LATEST:
        raise ConfigError(f"--run-id {run_id!r}: use 1-120 letters, digits, '_', '.', '-' (not starting with '.', "
                          f"not {LATEST!r})")
    return run_id


def run_token(run_id: str) -> str:
    """The part of the run id that makes its group ids unique: the random tail of a generated id,
    else the whole (sanitized) id."""
    return run_id.rsplit("-", 1)[-1] if _RUN_ID.match(run_id) else _UNSAFE.sub("_", run_id)


def is_run_folder(path: Path) -> bool:
    """A folder one run wrote (its plan, report, sessions or live progress)."""
    return path.is_dir() and any((path / f).exists() for f in _RUN_FILES)


def runs_in(folder: Path) -> list[Path]:
    """The run folders directly inside ``folder`` (the ``latest`` pointer not counted), oldest first."""
    if not folder.is_dir():
        return []
    return sorted(p for p in folder.iterdir() if not p.is_symlink() and is_run_folder(p))


def create_run_dir(out: Path, run_id: str) -> Path:
    """``out/run_id`` (new), with ``out/latest`` pointing at it."""
    try:
        out.mkdir(parents=True, exist_ok=True)
        run_dir = out / run_id
        run_dir.mkdir()
    except FileExistsError:
        raise ConfigError(f"run folder {out / run_id} already exists; continue it with --resume {out / run_id}, "
                          "or pick another --run-id") from None
    except OSError as exc:
        raise ConfigError(f"cannot create output folder {out / run_id}: {exc.strerror or exc}") from None
    point_latest(out, run_id)
    return run_dir


def point_latest(out: Path, run_id: str) -> None:
    """Replace ``out/latest`` atomically (a new symlink renamed over the old one)."""
    link = out / LATEST
    if link.exists() and not link.is_symlink():
        return  # a real folder named latest: never replace the user's data
    tmp = out / f".{LATEST}.{os.getpid()}.tmp"
    try:
        tmp.unlink(missing_ok=True)
        tmp.symlink_to(run_id, target_is_directory=True)
        os.replace(tmp, link)
    except OSError:
        tmp.unlink(missing_ok=True)  # a filesystem without symlinks: the run folder is still there


# -- the plan ------------------------------------------------------------------------------------------


class PlannedGroup(BaseModel):
    model_config = ConfigDict(extra="forbid")

    task_id: str
    group_id: str
    session_ids: list[str]


class Plan(BaseModel):
    """What a run was asked to do, written before anything starts; ``--resume`` reads it."""

    model_config = ConfigDict(extra="forbid")

    version: int = 1
    run_id: str
    command: str  # rollout, eval or sft
    created_at: float = Field(default_factory=time.time)
    job: dict[str, Any]  # the RolloutJob as JSON
    groups: list[PlannedGroup]
    requests: list[TaskRequest]  # group_id set on each

    def session_ids(self) -> list[str]:
        return [sid for g in self.groups for sid in g.session_ids]

    def write(self, run_dir: Path) -> None:
        path = run_dir / PLAN_FILE
        tmp = path.with_name(PLAN_FILE + ".tmp")
        tmp.write_bytes(orjson.dumps(self.model_dump(mode="json"), option=orjson.OPT_INDENT_2))
        os.replace(tmp, path)

    @classmethod
    def read(cls, run_dir: Path) -> Plan:
        path = run_dir / PLAN_FILE
        try:
            return cls.model_validate(orjson.loads(path.read_bytes()))
        except (orjson.JSONDecodeError, ValidationError) as exc:
            raise ConfigError(f"{path} is not a valid run plan: {' '.join(str(exc).split())[:200]}") from None


def session_ids(group_id: str, n: int) -> list[str]:
    """The rollout server's session ids of a group (``RolloutServer`` names them the same way)."""
    return [f"{group_id}-{i}" for i in range(n)]


def plan_groups(reqs: Sequence[TaskRequest], run_id: str) -> list[TaskRequest]:
    """``reqs`` with deterministic group ids: ``<task id>-<run token>`` (``.2``, ``.3`` for repeats)."""
    token, seen, out = run_token(run_id), dict[str, int](), []
    for req in reqs:
        base = f"{_UNSAFE.sub('_', req.task_id).lstrip('_.-')[:100] or 'task'}-{token}"
        seen[base] = seen.get(base, 0) + 1
        group_id = base if seen[base] == 1 else f"{base}.{seen[base]}"
        out.append(req.model_copy(update={"group_id": group_id}))
    return out


def make_plan(reqs: Sequence[TaskRequest], run_id: str, command: str, job: dict[str, Any]) -> Plan:
    planned = plan_groups(reqs, run_id)
    groups = [PlannedGroup(task_id=r.task_id, group_id=str(r.group_id), session_ids=session_ids(str(r.group_id), r.num_samples))
              for r in planned]
    return Plan(run_id=run_id, command=command, job=job, groups=groups, requests=planned)


# -- resume ---------------------------------------------------------------------------------------------


def resolve_run(path: Path) -> Path:
    """The run folder ``--resume`` names, or one line saying why it is not one."""
    if not path.is_dir():
        raise ConfigError(f"--resume {path}: no such folder; give a run folder, e.g. polar_rollouts/{LATEST}")
    from polar_env.observe.liveness import run_state

    if (path / PLAN_FILE).is_file():
        state = run_state(path)
        if state.running:  # two jobs writing one folder would mix their sessions
            raise ConfigError(f"--resume {path}: the run is still running ({state.reason}); stop it first (Ctrl-C "
                              "writes every output), then resume it")
        return path.resolve()
    inside = runs_in(path)
    if inside:
        stopped = [p for p in inside if run_state(p).state in ("crashed", "interrupted")]
        raise ConfigError(f"--resume {path}: this is a folder of {len(inside)} run(s), not one run; give one of them, "
                          f"e.g. --resume {path / LATEST} or --resume {(stopped or inside)[-1]}"
                          + (f" ({len(stopped)} of them crashed or were interrupted)" if stopped else ""))
    raise ConfigError(f"--resume {path}: not a run folder (no {PLAN_FILE}); give a folder polar-env rollout wrote, "
                      f"e.g. polar_rollouts/{LATEST}")


def differences(plan: dict[str, Any], given: dict[str, Any], prefix: str = "") -> list[str]:
    """Each setting whose value in ``given`` differs from the plan's, as ``name=<plan> ... <given>``."""
    out: list[str] = []
    for key in sorted(set(plan) | set(given)):
        p, g, name = plan.get(key), given.get(key), f"{prefix}{key}"
        if isinstance(p, dict) and isinstance(g, dict):
            out += differences(p, g, name + ".")
        elif p != g:
            out.append(f"{name}={orjson.dumps(p).decode()} in the plan but {orjson.dumps(g).decode()} from the flags")
    return out


def read_results(run_dir: Path) -> list[SessionResult]:
    """The previous attempt's sessions (``sessions.jsonl``) with their trajectories (``trajectories.jsonl``)."""
    path = run_dir / "sessions.jsonl"
    if not path.exists():
        return []
    trajectories = {}
    if (run_dir / "trajectories.jsonl").exists():
        for line in (run_dir / "trajectories.jsonl").read_bytes().splitlines():
            try:
                trajectory = Trajectory.from_json(line)
            except (orjson.JSONDecodeError, ValidationError):
                continue
            trajectories[trajectory.session_id] = trajectory
    results = []
    for line in path.read_bytes().splitlines():
        try:
            r = SessionResult.model_validate(orjson.loads(line))
        except (orjson.JSONDecodeError, ValidationError):  # a line torn by a kill: recover() reads its outcome
            continue
        results.append(r.model_copy(update={"trajectory": trajectories.get(r.session_id)}))
    return results


def recover(run_dir: Path, plan: Plan, known: Iterable[str], open_journal: JournalOpener) -> dict[str, SessionResult]:
    """Sessions of the plan not in ``known`` whose POSTRUN finished although the job's own outputs
    were never written (the process was killed: a second signal, SIGKILL, the OOM killer): their
    outcome files and journals give the same result and rewarded trajectory ``polar-env build``
    rebuilds. Cancelled ones, and those ``RERUN_KINDS`` name, are left to run again.
    ``open_journal`` opens each ``capture/<node>/`` store (the job names it)."""
    from polar_env.trajectory.builders import BUILDERS
    from polar_env.trajectory.reader import build_session

    skip, out = set(known), {}
    capture = run_dir / "capture"
    nodes = [(p.name, open_journal(p)) for p in sorted(capture.iterdir()) if p.is_dir()] if capture.is_dir() else []
    for req, group in zip(plan.requests, plan.groups, strict=True):
        for index, sid in enumerate(group.session_ids):
            if sid in skip:
                continue
            for node_id, store in nodes:
                outcome = store.read_outcome(sid)
                if outcome is None or outcome.get("status") in (None, SessionStatus.CANCELLED.value) \
                        or outcome.get("failure_kind") in RERUN_KINDS:
                    continue
                try:  # a table name or a pkg.module:attr import path, as validation accepted
                    build = BUILDERS.get(req.builder)
                except ConfigError:
                    build = None
                trajectory = build_session(store, sid, build) if build is not None else None
                fields = {k: outcome[k] for k in ("status", "reward", "evaluation", "stage_times", "harness_exit_code",
                                                  "error", "limits", "failure_kind", "failure_detail", "mask")
                          if outcome.get(k) is not None}
                out[sid] = SessionResult.model_validate({
                    **fields, "session_id": sid, "task_id": req.task_id, "group_id": group.group_id,
                    "sample_index": index, "node_id": node_id, "records": _records(store, sid), "trajectory": trajectory})
                break
    return out


def _records(store: JournalSource, sid: str) -> int:
    from polar_env.errors import PolarError

    try:
        return len(store.read(sid))
    except (PolarError, OSError):
        return 0


RERUN_KINDS = frozenset({FailureKind.INTERRUPTED, FailureKind.NODE_LOST})
"""What a resume runs again: the run stopped them, or the host under them went (nothing of the policy's)."""


def finished(results: Iterable[SessionResult]) -> dict[str, SessionResult]:
    """The results a resume keeps: every session that ended for a reason other than ``RERUN_KINDS``."""
    return {r.session_id: r for r in results if r.failure_kind not in RERUN_KINDS}


def set_aside(run_dir: Path, sids: Iterable[str], attempt: int) -> int:
    """Move the journals, state and outcome files of ``sids`` (interrupted attempts) from
    ``capture/<node>/`` to ``attempts/<attempt>/<node>/``; returns how many files moved."""
    moved, wanted = 0, set(sids)
    capture = run_dir / "capture"
    if not wanted or not capture.is_dir():
        return 0
    for node in sorted(p for p in capture.iterdir() if p.is_dir()):
        for folder in (node, node / "sessions"):
            if not folder.is_dir():
                continue
            for path in list(folder.iterdir()):
                if _session_of(path.name) not in wanted:
                    continue
                dest = run_dir / ATTEMPTS / str(attempt) / path.parent.relative_to(capture) / path.name
                dest.parent.mkdir(parents=True, exist_ok=True)
                shutil.move(str(path), dest)
                moved += 1
    return moved


_SESSION_FILES = (".result.json", ".result.tmp", ".json.tmp", ".jsonl", ".json")


def _session_of(name: str) -> str | None:
    """The session a store file belongs to (``<sid>.jsonl``, ``<sid>.result.json``, ``sessions/<sid>.json``)."""
    return next((name[: -len(s)] for s in _SESSION_FILES if name.endswith(s)), None)


def next_attempt(run_dir: Path) -> int:
    folder = run_dir / ATTEMPTS
    numbers = [int(p.name) for p in folder.iterdir() if p.name.isdigit()] if folder.is_dir() else []
    return max(numbers, default=0) + 1


# -- interrupted sessions -----------------------------------------------------------------------------


def interrupted(result: SessionResult, signal_name: str) -> SessionResult:
    """``result`` (cancelled by the interruption) marked so a trainer drops it and ``--resume`` reruns it."""
    started = "running" in result.stage_times
    where = f"in RUNNING after {result.records} call(s)" if started else "before RUNNING (never started its agent)"
    detail = f"interrupted by {signal_name} {where}; --resume reruns it"
    marks = {"status": SessionStatus.CANCELLED, "failure_kind": FailureKind.INTERRUPTED, "failure_detail": detail,
             "mask": True}
    trajectory = result.trajectory.model_copy(update={**marks, "metadata": {
        **result.trajectory.metadata, "failure_kind": FailureKind.INTERRUPTED.value, "failure_detail": detail, "mask": True}})
    return result.model_copy(update={**marks, "trajectory": trajectory})


def not_started(req: TaskRequest, session_id: str, sample_index: int, signal_name: str) -> SessionResult:
    """The result of a planned session the interruption kept from being dispatched at all."""
    result = SessionResult.model_validate({  # its trajectory: the empty, masked row SessionResult fills in
        "session_id": session_id, "task_id": req.task_id, "group_id": str(req.group_id), "sample_index": sample_index,
        "status": SessionStatus.CANCELLED, "failure_kind": FailureKind.INTERRUPTED, "mask": True,
        "stage_times": {"done": time.time()}})
    return interrupted(result, signal_name)


def mark_outcome_files(run_dir: Path, results: Iterable[SessionResult], open_journal: JournalOpener) -> None:
    """Carry the interruption marks into the outcome files, so a later ``polar-env build`` agrees."""
    for r in results:
        root = run_dir / "capture" / (r.node_id or "")
        if r.failure_kind is not FailureKind.INTERRUPTED or not r.node_id or not root.is_dir():
            continue
        store = open_journal(root)
        outcome = store.read_outcome(r.session_id)
        if outcome is not None:
            store.write_outcome(r.session_id, {**outcome, "failure_kind": FailureKind.INTERRUPTED.value,
                                                "failure_detail": r.failure_detail, "mask": True})


def store_roots(path: Path) -> list[Path]:
    """The capture stores behind ``path``: a store itself, a run folder (its ``capture/<node>/``), or
    ``capture/``; a folder of runs is refused (one run at a time, so runs never mix)."""
    def is_store(p: Path) -> bool:
        return p.is_dir() and ((p / "sessions").is_dir() or any(p.glob("*.jsonl")))

    if is_store(path) and not is_run_folder(path):
        return [path]
    inside = [] if is_run_folder(path) else runs_in(path)
    if inside:
        raise ConfigError(f"--store {path} is a folder of {len(inside)} run(s); give one run so runs never mix, "
                          f"e.g. --store {path / LATEST} or --store {inside[-1]}")
    capture = path / "capture" if (path / "capture").is_dir() else path
    return sorted(p for p in capture.iterdir() if p.is_dir() and not p.is_symlink() and not is_run_folder(p)
                  and is_store(p)) if capture.is_dir() else []
