"""The dashboard's aiohttp application: the shipped page (``static/``, no CDN), a JSON API over
the runs (``runs.py``) and sessions (``session.py``), and server-sent events for the live view.

Reading files and building trajectories runs in worker threads, so a slow journal never stalls
the event stream. On 127.0.0.1 no token is needed; bound anywhere else, ``build_dashboard`` is
given one and every route asks for it (``Authorization: Bearer``, or ``?token=`` once, which
sets a cookie for the page's own requests).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
import urllib.request
from collections.abc import Awaitable, Callable, Mapping
from importlib import resources
from pathlib import Path
from typing import Any

import orjson
from aiohttp import web

from polar_env.dashboard.compare import Comparison, compare, compare_page
from polar_env.dashboard.health import curves, topology
from polar_env.dashboard.research import (
    group_view,
    integrity,
    progress_so_far,
    siblings,
    tasks_page,
    tests_table,
    train_view,
    trainer_view,
)
from polar_env.dashboard.runs import FINISHED, PLANNED, STOPPED, Run, discover, page
from polar_env.dashboard.session import (
    JournalPage,
    SessionCache,
    TracePage,
    TranscriptPage,
    journal_page,
    tokenizer,
    trace_page,
    trace_summaries,
    transcript_page,
)
from polar_env.journal.protocols import JournalSource
from polar_env.journal.store import JournalStore  # the dashboard server is a root: it names the store
from polar_env.observe.liveness import RunState, run_state
from polar_env.records import Trajectory

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
COOKIE = "polar_dashboard"
STATIC = {"index.html": "text/html", "app.js": "text/javascript", "research.js": "text/javascript",
          "runviews.js": "text/javascript", "style.css": "text/css"}
# The page shows what agents wrote; nothing in it may load or run anything but the shipped assets.
CSP = ("default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
       "frame-ancestors 'none'; base-uri 'none'; form-action 'none'")


class Dashboard:
    """The runs being shown (re-discovered on each runs-list request, so new run folders appear)."""

    def __init__(self, paths: list[Path], server_url: str | None = None, server_token: str | None = None,
                 live_interval_s: float = 1.0) -> None:
        self.paths = paths
        self.server_url = server_url.rstrip("/") if server_url else None
        self.server_token = server_token
        self.live_interval_s = live_interval_s
        self.runs: dict[str, Run] = {}
        self.cache = SessionCache()
        self.compared: dict[tuple[str, str], tuple[object, Comparison]] = {}  # Compare answers (and the runs' versions), per pair
        self.refresh()

    def refresh(self) -> dict[str, Run]:
        known = {run.path.resolve(): run for run in self.runs.values()}
        runs: dict[str, Run] = {}
        served = self.runs.get("server") or (ServerRun(self.server_url, self.server_token, self.paths) if self.server_url else None)
        for path in discover(self.paths):
            if served is not None and path.resolve() == served.path.resolve():
                continue  # the server's store is the server's run, listed once
            name = path.name or str(path)
            while name in runs:
                name += "'"
            runs[name] = known.get(path.resolve()) or Run(path, name, JournalStore)
        if served is not None:
            runs["server"] = served
        self.runs = runs
        return runs

    def run(self, name: str) -> Run:
        run = self.runs.get(name) or self.refresh().get(name)
        if run is None:
            raise web.HTTPNotFound(text=json.dumps({"error": f"no run {name!r}"}), content_type="application/json")
        return run


class ServerRun(Run):
    """A live ``polar-env serve``: live figures from its ``/rollout/status``; sessions from its
    store folder when one of the dashboard's paths is it, each unfinished one with the stage its
    node reports (the server's state is the truth, not a file), and those of its pending tasks that
    no node has yet as ``queued``."""

    POLL_S = 1.0  # rows, the live page and its events all ask: one /rollout/status a second

    def __init__(self, url: str, token: str | None, paths: list[Path]) -> None:
        store = next((p for p in paths if (Path(p) / "capture").is_dir()), Path("/nonexistent-polar-store"))
        super().__init__(store, "server", JournalStore)
        self.url = url
        self.token = token
        self._t0: float | None = None
        self._stage_history: list[list[Any]] = []  # [seconds since the dashboard first asked, {stage: n}]
        self._polled: tuple[float, dict[str, Any]] = (0.0, {})
        self._stages: dict[str, str] = {}
        self._stages_version = 0

    def poll(self, max_age_s: float = POLL_S) -> dict[str, Any]:
        """``status()``, reused for ``max_age_s``."""
        at, status = self._polled
        if not status or time.monotonic() - at > max_age_s:
            status = self.status()
            self._polled = (time.monotonic(), status)
            stages = {sid: st for n in status.get("nodes") or [] if "dead" not in n
                      for sid, st in (n.get("session_stages") or {}).items()}
            if stages != self._stages:
                self._stages, self._stages_version = stages, self._stages_version + 1
        return status

    def state(self) -> RunState:
        """Running while the server answers; else what its store's heartbeat says."""
        status = self.poll()
        if "error" not in status:
            return RunState(state="running", reason=f"{self.url} answers /rollout/status", source="server")
        found = run_state(self.path)
        return found if found.state != "unknown" else RunState(state="unknown", reason=str(status["error"]),
                                                               source="server")

    def live_snapshot(self) -> dict[str, Any] | None:
        """The server's nodes as ``live.json`` would give them: each session's stage, dead nodes."""
        status = self.poll()
        if "error" in status:
            return None
        nodes = status.get("nodes") or []
        return {"state": "running", "session_stages": dict(self._stages), "nodes": nodes,
                "dead_nodes": [n.get("node_id") for n in nodes if "dead" in n]}

    def live_version(self) -> int:
        return self._stages_version

    def _planned_rows(self, seen: set[str]) -> list[dict[str, Any]]:
        """The sessions of the server's pending and running tasks that no node has yet: ``queued``."""
        out = []
        for task in self.poll().get("tasks") or []:
            if task.get("state") not in ("pending", "running"):
                continue
            for i in range(int(task.get("num_samples") or 0)):
                sid = f"{task['group_id']}-{i}"
                if sid not in seen and sid not in self._stages:
                    out.append({**dict.fromkeys(("failure_kind", "reason", "reward", "calls", "tokens", "drift", "wall_s",
                                                  "node_id", "mask", "trainable_tokens", "harness", "repo")),
                                "session_id": sid, "task_id": str(task.get("task_id")), "sample_index": i,
                                "status": PLANNED, "group_id": str(task["group_id"]), "traces": None,
                                "failure_detail": None, "ended_at": None, "rollout_id": None})
        return out

    def summary(self) -> dict[str, Any]:
        live = self.live()
        return {**super().summary(), "state": live["state"], "path": self.url,
                "engine_busy_fraction": live.get("engine_busy")}

    def status(self) -> dict[str, Any]:
        """The server's ``/rollout/status`` (nodes' stats and tasks); ``{"error": ...}`` when it does not answer."""
        request = urllib.request.Request(self.url + "/rollout/status",
                                         headers={"Authorization": f"Bearer {self.token or ''}"})
        try:
            with urllib.request.urlopen(request, timeout=5) as resp:  # noqa: S310 - the user's own server
                data = json.loads(resp.read())
        except OSError as exc:
            return {"error": str(exc)}
        return data if isinstance(data, dict) else {"error": "not a status object"}

    def live(self) -> dict[str, Any]:
        status = self.poll(max_age_s=0.0)  # the live page asks once a second: always the server's word now
        if "error" in status:
            return {"state": "unreachable", "error": status["error"], "total": 0, "done": 0, "stages": {},
                    "history": self._stage_history}
        stages: dict[str, int] = {}
        live = [n for n in status.get("nodes", []) if "dead" not in n]
        for node in live:
            for stage, n in node.get("counts", {}).items():
                stages[stage] = stages.get(stage, 0) + int(n)
        tasks = status.get("tasks", [])
        done = sum(t["done"] for t in tasks)
        rewarded = [(t["mean_reward"], t["done"]) for t in tasks if t.get("mean_reward") is not None]
        busy = [n.get("engine_busy_fraction", 0.0) for n in live]
        now = time.monotonic()
        self._t0 = now if self._t0 is None else self._t0
        if not self._stage_history or self._stage_history[-1][1] != stages:  # the server keeps no history: we do
            self._stage_history.append([round(now - self._t0, 3), stages])
            del self._stage_history[:-2000]
        return {"state": "running" if any(t["state"] in ("pending", "running") for t in tasks) else "idle",
                "total": sum(t["num_samples"] for t in tasks), "done": done, "stages": stages,
                "mean_reward": sum(r * n for r, n in rewarded) / max(1, sum(n for _, n in rewarded)) if rewarded else None,
                "engine_busy": sum(busy) / len(busy) if busy else None, "history": list(self._stage_history),
                "now_s": round(now - self._t0, 3), "elapsed_s": round(now - self._t0, 3),
                "in_flight": {sid: st for n in live for sid, st in (n.get("session_stages") or {}).items()},
                "nodes": len(live), "dead_nodes": len(status.get("nodes", [])) - len(live)}


DASHBOARD = web.AppKey("dashboard", Dashboard)
TOKEN = web.AppKey("dashboard_token", str)


def _json(data: Any) -> web.Response:
    return web.Response(body=orjson.dumps(data, default=str), content_type="application/json")


def _int(request: web.Request, name: str, default: int) -> int:
    try:
        return int(request.query.get(name, default))
    except ValueError:
        raise web.HTTPBadRequest(text=json.dumps({"error": f"{name} must be an integer"}),
                                 content_type="application/json") from None


@web.middleware
async def _auth(request: web.Request, handler: Handler) -> web.StreamResponse:
    token = request.app[TOKEN]
    if not token:
        return await handler(request)
    sent = request.headers.get("Authorization", "").removeprefix("Bearer ")
    cookie = request.cookies.get(COOKIE, "")
    query = request.query.get("token", "")
    if any(hmac.compare_digest(v.encode(), token.encode()) for v in (sent, cookie, query) if v):
        response = await handler(request)
        if query:
            response.set_cookie(COOKIE, token, httponly=True, samesite="Strict")
        return response
    return web.json_response({"error": "this dashboard needs its token: open it with ?token=TOKEN"}, status=401)


async def _static(request: web.Request) -> web.Response:
    name = request.match_info.get("name", "index.html")
    if name not in STATIC:
        raise web.HTTPNotFound()
    body = resources.files("polar_env.dashboard").joinpath("static", name).read_bytes()
    return web.Response(body=body, content_type=STATIC[name], charset="utf-8",
                        headers={"Cache-Control": "no-cache", "Content-Security-Policy": CSP})


async def _runs(request: web.Request) -> web.Response:
    dash = request.app[DASHBOARD]
    runs = await asyncio.to_thread(lambda: [run.summary() for run in dash.refresh().values()])
    return _json({"runs": runs})


async def _sessions(request: web.Request) -> web.Response:
    run = request.app[DASHBOARD].run(request.match_info["run"])
    q = request.query
    rows = await asyncio.to_thread(run.rows)
    data = page(rows, q=q.get("q", ""), status=q.get("status", ""), harness=q.get("harness", ""),
                sort=q.get("sort", "session_id"), desc=q.get("desc") == "1", reason=q.get("reason", ""),
                failure_kind=q.get("failure_kind", ""), task=q.get("task", ""),
                offset=_int(request, "offset", 0), limit=_int(request, "limit", 50))
    return _json({**data, "finished": run.finished or not run.is_live()})  # nothing more to re-read


async def _tasks(request: web.Request) -> web.Response:
    run = request.app[DASHBOARD].run(request.match_info["run"])
    q = request.query
    return _json(await asyncio.to_thread(lambda: tasks_page(
        run, q=q.get("q", ""), state=q.get("state", ""), sort=q.get("sort", "task_id"), desc=q.get("desc") == "1",
        offset=_int(request, "offset", 0), limit=_int(request, "limit", 50))))


async def _train(request: web.Request) -> web.Response:
    run = request.app[DASHBOARD].run(request.match_info["run"])
    return _json(await asyncio.to_thread(train_view, run))


async def _group(request: web.Request) -> web.Response:
    run = request.app[DASHBOARD].run(request.match_info["run"])
    data = await asyncio.to_thread(group_view, run, request.match_info["group"])
    if data is None:
        raise web.HTTPNotFound(text=json.dumps({"error": f"no group {request.match_info['group']!r}"}),
                               content_type="application/json")
    return _json(data)


async def _topology(request: web.Request) -> web.Response:
    run = request.app[DASHBOARD].run(request.match_info["run"])
    server = run.poll if isinstance(run, ServerRun) else None
    return _json(await asyncio.to_thread(lambda: topology(run, server() if server else None)))


async def _curves(request: web.Request) -> web.Response:
    run = request.app[DASHBOARD].run(request.match_info["run"])
    return _json(await asyncio.to_thread(curves, run))


async def _live(request: web.Request) -> web.Response:
    run = request.app[DASHBOARD].run(request.match_info["run"])
    return _json(await asyncio.to_thread(run.live))


async def _live_events(request: web.Request) -> web.StreamResponse:
    """Server-sent events: one ``data:`` line of the live snapshot whenever it changes."""
    dash = request.app[DASHBOARD]
    run = dash.run(request.match_info["run"])
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                       "X-Accel-Buffering": "no"})
    await resp.prepare(request)
    last = b""
    idle = 0.0
    try:
        while True:
            body = orjson.dumps(await asyncio.to_thread(run.live), default=str)
            if body != last:
                await resp.write(b"data: " + body + b"\n\n")
                last, idle = body, 0.0
            elif idle >= 15.0:
                await resp.write(b": keep-alive\n\n")
                idle = 0.0
            await asyncio.sleep(dash.live_interval_s)
            idle += dash.live_interval_s
    except (ConnectionResetError, ConnectionError, asyncio.CancelledError):
        pass
    return resp


def _session(request: web.Request) -> tuple[Run, JournalSource | None, dict[str, Any]]:
    run = request.app[DASHBOARD].run(request.match_info["run"])
    found = run.locate(request.match_info["session"])
    if found is None:
        raise web.HTTPNotFound(text=json.dumps({"error": f"no session {request.match_info['session']!r}"}),
                               content_type="application/json")
    return run, found[0], found[1]


def _load(request: web.Request) -> tuple[Run, dict[str, Any], dict[str, Any], list[Any], Any]:
    """The session's run, row, outcome, records and trajectory."""
    run, store, row = _session(request)
    if store is None:  # planned: no node has it yet
        return run, row, {}, [], Trajectory(session_id=row["session_id"], traces=[])
    outcome = run.outcome(store, row["session_id"])
    builder = (outcome.get("metadata") or {}).get("builder", "prefix_merge")
    records, trajectory = request.app[DASHBOARD].cache.get(store, row["session_id"], builder)
    return run, row, outcome, records, trajectory


def in_flight(run: Run, row: Mapping[str, object]) -> bool:
    """Still on a live node (queued, being set up, run or graded): no outcome yet is no failure.
    Live is measured (the job's heartbeat, the server's answer), not what a file last said."""
    dead = (run.live_snapshot() or {}).get("dead_nodes") or []
    return run.is_live() and row["status"] not in FINISHED and row.get("node_id") not in dead


def stopped_note(run: Run, row: Mapping[str, object]) -> str | None:
    """Why a session of a crashed or interrupted job has no outcome: the job, not its node, went."""
    state = run.state()
    if state.state not in STOPPED or row["status"] in FINISHED:
        return None
    where = f" in {row['last_stage']}" if row.get("last_stage") else ""
    rerun = f"; {state.resume} reruns it" if state.resume else ""
    return f"the job {state.state}{where} before this session finished ({state.reason}){rerun}"


async def _session_detail(request: web.Request) -> web.Response:
    def detail() -> dict[str, Any]:
        run, row, outcome, records, trajectory = _load(request)
        stage_times = outcome.get("stage_times") or {}
        order = sorted(stage_times, key=stage_times.__getitem__)
        stage_s = {a: round(stage_times[b] - stage_times[a], 4) for a, b in zip(order, order[1:], strict=False)}
        traces = trace_summaries(trajectory)
        sampled = sum(t["sampled_tokens"] for t in traces)
        evaluation = outcome.get("evaluation") or {}
        pending = in_flight(run, row)  # the reader calls a session without an outcome lost; a live one is not
        stopped = stopped_note(run, row)  # ... and one whose job crashed was lost with the job, not its node
        trainer = trainer_view(row, outcome, trajectory)
        return {"in_flight": pending, "run": run.name, "row": {**row, "tokens": row["tokens"] if row["tokens"] is not None else sampled},
                "evaluation": evaluation, "tests": tests_table(evaluation), "integrity": integrity(evaluation),
                "graded_patch": evaluation.get("graded_patch"), "trainer": trainer,
                "siblings": siblings(run, row), "stage_seconds": stage_s, "stage_times": stage_times,
                "metadata": outcome.get("metadata") or {}, **progress_so_far(row, stage_times, pending),
                "failure_detail": (outcome.get("failure_detail") or outcome.get("error") or trajectory.failure_detail
                                   or trajectory.metadata.get("error")),
                "trajectory_status": trajectory.status.value, "stats": trajectory.metadata.get("stats", {}),
                "traces": traces, "calls": len(records), "journal": f"/api/runs/{run.name}/sessions/{row['session_id']}/journal",
                **({"failure_detail": None, "trainer": {**trainer, "mask": None}} if pending else {}),
                **({"failure_detail": stopped} if stopped else {})}

    return _json(await asyncio.to_thread(detail))


async def _trace(request: web.Request) -> web.Response:
    def one() -> TracePage:
        run, _row, _outcome, _records, trajectory = _load(request)
        index = int(request.match_info["index"])
        if not 0 <= index < len(trajectory.traces):
            raise web.HTTPNotFound(text=json.dumps({"error": f"no trace {index}"}), content_type="application/json")
        return trace_page(trajectory, index, _int(request, "offset", 0), _int(request, "limit", 2000),
                          tokenizer(run.template()))

    return _json(await asyncio.to_thread(one))


async def _transcript(request: web.Request) -> web.Response:
    def one() -> TranscriptPage:
        records = _load(request)[3]
        return transcript_page(records, _int(request, "offset", 0), _int(request, "limit", 20))

    return _json(await asyncio.to_thread(one))


async def _journal(request: web.Request) -> web.Response:
    def one() -> JournalPage:
        records = _load(request)[3]
        return journal_page(records, _int(request, "offset", 0), _int(request, "limit", 5))

    return _json(await asyncio.to_thread(one))


async def _compare(request: web.Request) -> web.Response:
    dash = request.app[DASHBOARD]
    a, b = dash.run(request.query.get("a", "")), dash.run(request.query.get("b", ""))

    def cached() -> Comparison:  # recomputed only when either run's rows change
        key = (a.version(), b.version())
        hit = dash.compared.get((a.name, b.name))
        if hit is None or hit[0] != key:
            hit = dash.compared[(a.name, b.name)] = (key, compare(a, b))
        return hit[1]

    q = request.query
    return _json(compare_page(await asyncio.to_thread(cached), q=q.get("q", ""), offset=_int(request, "offset", 0),
                              limit=_int(request, "limit", 50)))


def build_dashboard(dashboard: Dashboard, token: str | None = None) -> web.Application:
    app = web.Application(middlewares=[_auth])
    app[DASHBOARD] = dashboard
    app[TOKEN] = token or ""
    r = app.router
    r.add_get("/", _static)
    r.add_get("/static/{name}", _static)
    r.add_get("/api/runs", _runs)
    r.add_get("/api/compare", _compare)
    r.add_get("/api/runs/{run}/live", _live)
    r.add_get("/api/runs/{run}/live/events", _live_events)
    r.add_get("/api/runs/{run}/sessions", _sessions)
    r.add_get("/api/runs/{run}/tasks", _tasks)
    r.add_get("/api/runs/{run}/topology", _topology)
    r.add_get("/api/runs/{run}/curves", _curves)
    r.add_get("/api/runs/{run}/train", _train)
    r.add_get("/api/runs/{run}/groups/{group}", _group)
    r.add_get("/api/runs/{run}/sessions/{session}", _session_detail)
    r.add_get("/api/runs/{run}/sessions/{session}/trace/{index:\\d+}", _trace)
    r.add_get("/api/runs/{run}/sessions/{session}/transcript", _transcript)
    r.add_get("/api/runs/{run}/sessions/{session}/journal", _journal)
    return app
