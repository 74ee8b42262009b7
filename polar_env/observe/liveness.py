"""A job's liveness, measured: ``heartbeat.json`` in its run folder, and the run's state read from it.

Files alone cannot tell a running job from a dead one: a job killed with SIGKILL, or ended by an
exception before its ``report.json``, leaves a ``live.json`` that says ``running`` forever. So every
job (``rollout``, ``eval``, ``serve``, ``train``) runs a ``Heartbeat``: a daemon thread that rewrites
``heartbeat.json`` every ``interval_s`` (atomically) with its pid, host, boot id, the process's
start time (``/proc/<pid>/stat``), its own start time and the last beat; ``stop(state)`` writes the
job's end (``done``, ``interrupted``, ``crashed`` with its one-line error) where the process can.

``run_state(folder)`` is the pure reader every view uses. A recorded end is the truth. A beat
without one is ``running`` while its process is: on the same host (hostname and boot id) the pid
must exist, not be a zombie, and have the recorded start time (a reused pid has another); on another
host the last beat must be younger than ``STALE_INTERVALS`` intervals. Otherwise the job died
without a word (SIGKILL, the OOM killer, a second Ctrl-C, a lost host): ``crashed``. Folders from
before heartbeats fall back to ``report.json`` and the age of ``live.json``.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
from pathlib import Path
from types import TracebackType
from typing import Any, Literal

import orjson
from pydantic import BaseModel

HEARTBEAT_FILE = "heartbeat.json"
STALE_INTERVALS = 3.0
"""A beat from another host older than this many intervals (plus ``_SLACK_S``) is a dead job."""
LEGACY_STALE_S = 120.0
"""A folder without a heartbeat whose ``live.json`` is older than this is not running (an older job
wrote it twice a second; a long start-up phase wrote it once, so the margin is wide)."""
_SLACK_S = 1.0
JobState = Literal["running", "done", "interrupted", "crashed", "unknown"]
ENDS = ("done", "interrupted", "crashed")
INTERRUPTING = (KeyboardInterrupt, SystemExit)


def read_json(path: Path) -> dict[str, object] | None:
    """The JSON object in ``path``; None when it is missing, unreadable or not an object."""
    try:
        data = orjson.loads(path.read_bytes())
    except (OSError, orjson.JSONDecodeError):
        return None
    return data if isinstance(data, dict) else None


def json_object(value: object) -> dict[str, object]:
    """``value`` if it is a JSON object (a field of one read back), else an empty one."""
    return value if isinstance(value, dict) else {}


def _seconds(value: object, default: float) -> float:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else default


def boot_id() -> str | None:
    """This machine's boot id: equal hostnames on two machines (containers) are not the same host."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return None


def proc_start(pid: int) -> int | None:
    """The start time of process ``pid`` (clock ticks since boot, ``/proc/<pid>/stat`` field 22);
    None when there is no such live process (gone, or a zombie waiting to be reaped)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rfind(")") + 2:].split()  # the command name may hold spaces and parentheses
    if not fields or fields[0] in ("Z", "X"):
        return None
    try:
        return int(fields[19])
    except (IndexError, ValueError):
        return None


def one_line(exc: BaseException) -> str:
    """``Type: message`` on one line, at most 400 characters."""
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}"[:400] if text else type(exc).__name__


_BEATING: set[Heartbeat] = set()  # this process's heartbeats not yet stopped (for end_all)


def end_all(state: str, *, signal: str | None = None, error: str | None = None) -> None:
    """Record ``state`` in every heartbeat still beating here: for an exit that skips the job's own
    ending (a second signal, the shutdown watchdog; both leave with ``os._exit``), so the run reads
    as what it was, not as a crash."""
    for beat in list(_BEATING):
        beat.stop(state, signal=signal, error=error)


class Heartbeat:
    """Beats into ``folder/heartbeat.json`` from a daemon thread until ``stop``."""

    def __init__(self, folder: Path, kind: str, interval_s: float = 2.0) -> None:
        self.path = Path(folder) / HEARTBEAT_FILE
        self.interval_s = interval_s
        self.body: dict[str, Any] = {
            "version": 1, "kind": kind, "pid": os.getpid(), "host": socket.gethostname(), "boot_id": boot_id(),
            "proc_start": proc_start(os.getpid()), "started_at": time.time(), "interval_s": interval_s,
            "state": "running"}
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._made = False
        self.ended: str | None = None

    def start(self) -> Heartbeat:
        self._made = not self.path.parent.exists()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._write()
        self._thread = threading.Thread(target=self._run, name="polar-heartbeat", daemon=True)
        self._thread.start()
        _BEATING.add(self)
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self._write()
            except OSError:  # a full or vanished disk: the reader calls the job stale, not us
                continue

    def _write(self, **end: Any) -> None:
        with self._lock:
            if self.ended is not None:
                return
            if end:
                self.ended = str(end["state"])
            self.body = {**self.body, **end, "beat_at": time.time()}
            tmp = self.path.with_name(f".{HEARTBEAT_FILE}.{os.getpid()}.tmp")
            tmp.write_bytes(orjson.dumps(self.body))
            os.replace(tmp, self.path)  # readers never see half a file

    def stop(self, state: str, *, error: str | None = None, signal: str | None = None) -> None:
        """Record the job's end (``done``, ``interrupted`` or ``crashed``) and stop beating."""
        _BEATING.discard(self)
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        try:
            self._write(state=state, ended_at=time.time(), error=error, signal=signal)
        except OSError:
            pass

    def discard(self) -> None:
        """Stop and leave no trace: a command refused for the user's mistake creates nothing."""
        self.stop("discarded")
        self.path.unlink(missing_ok=True)
        if self._made:
            try:
                self.path.parent.rmdir()  # only if empty: what else the job wrote stays
            except OSError:
                pass

    def stop_for(self, exc: BaseException | None) -> None:
        """Record the end an exception (or none) means: Ctrl-C / exit interrupt, anything else crashes."""
        if exc is None:
            self.stop("done")
        elif isinstance(exc, INTERRUPTING) or type(exc).__name__ == "CancelledError":
            self.stop("interrupted", error=one_line(exc))
        else:
            self.stop("crashed", error=one_line(exc))

    def __enter__(self) -> Heartbeat:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop_for(exc)


def current_exception() -> BaseException | None:
    """The exception being propagated (a ``finally`` clause sees it), if any."""
    return sys.exc_info()[1]


class RunState(BaseModel):
    """What a run folder's job is doing now, and why the reader thinks so."""

    state: JobState
    reason: str
    source: str  # heartbeat.json, report.json, live.json, plan.json or none
    kind: str | None = None
    pid: int | None = None
    host: str | None = None
    started_at: float | None = None
    beat_at: float | None = None
    ended_at: float | None = None
    error: str | None = None
    signal: str | None = None
    resume: str | None = None  # the command that continues it, where one does

    @property
    def running(self) -> bool:
        return self.state == "running"


def _alive(beat: dict[str, object], now: float) -> tuple[bool, str]:
    """Is the beating process still there, and the evidence."""
    pid, interval = beat.get("pid"), _seconds(beat.get("interval_s") or 2.0, 2.0)
    age = now - _seconds(beat.get("beat_at") or beat.get("started_at") or 0.0, 0.0)
    here = beat.get("host") == socket.gethostname() and beat.get("boot_id") == boot_id() and boot_id() is not None
    if here and isinstance(pid, int):
        started = proc_start(pid)
        if started is None:
            return False, f"its process {pid} is gone (last beat {age:.0f} s ago)"
        if beat.get("proc_start") is not None and started != beat["proc_start"]:
            return False, f"its process {pid} is gone (the pid now belongs to another process; last beat {age:.0f} s ago)"
        return True, f"process {pid} is alive (last beat {age:.1f} s ago)"
    limit = STALE_INTERVALS * interval + _SLACK_S
    if age > limit:
        return False, f"no heartbeat from {beat.get('host')} for {age:.0f} s (every {interval:g} s expected)"
    return True, f"beating on {beat.get('host')} (last beat {age:.1f} s ago)"


def _resume(folder: Path) -> str | None:
    plan = read_json(folder / "plan.json")
    if plan is None or not plan.get("command"):
        return None
    return f"polar-env {plan['command']} --resume {folder}"


def run_state(folder: Path, now: float | None = None) -> RunState:
    """The state of the job that writes ``folder``; see the module docstring for the rules."""
    folder, now = Path(folder), time.time() if now is None else now
    beat = read_json(folder / HEARTBEAT_FILE)
    report = read_json(folder / "report.json")
    stopped = json_object((report or {}).get("interrupted"))
    resume = _resume(folder)
    if beat is not None:
        info = {k: beat.get(k) for k in ("kind", "pid", "host", "started_at", "beat_at", "ended_at", "error", "signal")}
        recorded = beat.get("state")
        # the beat's fields as it wrote them: RunState validates them
        if recorded == "done" and stopped:
            return RunState.model_validate({
                "state": "interrupted", "reason": f"stopped by {stopped.get('signal')}; every output written",
                "source": HEARTBEAT_FILE, "resume": resume, **info, "signal": stopped.get("signal")})
        if recorded in ENDS:
            why = {"done": "finished", "crashed": "ended by an error",
                   "interrupted": f"stopped by {beat.get('signal') or 'an interruption'} before the end"}[str(recorded)]
            return RunState.model_validate({
                "state": recorded, "reason": f"{why}{': ' + str(beat['error']) if beat.get('error') else ''}",
                "source": HEARTBEAT_FILE, "resume": None if recorded == "done" else resume, **info})
        alive, evidence = _alive(beat, now)
        if alive:
            return RunState.model_validate({"state": "running", "reason": evidence, "source": HEARTBEAT_FILE, **info})
        if report is not None:  # it wrote its report, then died before its last beat
            state: JobState = "interrupted" if stopped else "done"
            return RunState.model_validate({"state": state, "reason": f"report.json written; {evidence}",
                                            "source": "report.json", "resume": resume if stopped else None, **info})
        return RunState.model_validate({
            "state": "crashed", "reason": f"ended without recording its end: {evidence} (killed: SIGKILL, the OOM "
            "killer, a second Ctrl-C, or its host went)", "source": HEARTBEAT_FILE, "resume": resume, **info})
    return _legacy(folder, now, report, stopped, resume)


def _legacy(folder: Path, now: float, report: dict[str, object] | None, stopped: dict[str, object],
            resume: str | None) -> RunState:
    """A folder without a heartbeat (written before heartbeats, or a bare store): the files' word."""
    if report is not None:
        if stopped:
            return RunState.model_validate({"state": "interrupted", "reason": f"stopped by {stopped.get('signal')} (report.json)",
                                            "source": "report.json", "signal": stopped.get("signal"), "resume": resume})
        return RunState(state="done", reason="report.json written", source="report.json")
    live = read_json(folder / "live.json")
    if live is not None:
        age = now - _seconds(live.get("updated_at") or 0.0, 0.0)
        if live.get("state") in ("running", "starting") and age <= LEGACY_STALE_S:
            return RunState.model_validate({
                "state": "running", "reason": f"live.json updated {age:.0f} s ago (no heartbeat: an older job)",
                "source": "live.json", "started_at": live.get("started_at")})
        return RunState.model_validate({
            "state": "crashed", "reason": f"no report.json; live.json last said {live.get('state')!r} {age:.0f} s ago "
            "(no heartbeat: an older job)", "source": "live.json", "started_at": live.get("started_at"), "resume": resume})
    if (folder / "plan.json").exists():  # killed before its first progress tick, or a folder from before live.json
        return RunState(state="unknown", reason="no heartbeat, report or progress: the job never got going",
                        source="plan.json", resume=resume)
    return RunState(state="unknown", reason="no heartbeat, report, progress or plan (a bare capture store)", source="none")
