"""Production shape on one node: N concurrent sessions × T turns with contexts growing to C tokens,
through the real node and gateway, then POSTRUN — this tree against a baseline tree, side by side.

Per variant, a child process runs one ``GatewayNode`` (real gateway, journal, continuation mode,
staged pools) whose sessions are the built-in ``loop`` harness on ``SimulatedRuntime`` (a test
double: tool calls run nothing and echo their command). By default the harnesses run in a
process of their own, as CLIs run in their sandboxes in production: the node's ``loop`` call is
handed to a harness host (``scripts/harness_host.py``) that runs the same ``run_loop_agent`` against the
node's gateway socket, so the node's figures are the node's work; its CPU per call is printed on
its own row. ``--harness node`` keeps them in the node process (the ``loop`` deployment). The engine is a mock vLLM server in its
own process (a test double): every reply has realistic token data — ``prompt_token_ids`` (the
token-in ids it was sent, or ids derived from the messages), ``R`` sampled ids with logprobs and
a ``bash`` tool call whose command is long enough that each turn adds ``C/T`` tokens — after
``--engine-ms`` of simulated generation. The last turn answers without a tool call. Each
session's first call waits a session-dependent extra (up to half a session's length), so
sessions finish — and enter POSTRUN — while others still run. Sessions go straight to
``node.run``; each result is consumed as a trainer's callback would (its trajectory is not kept),
so the node's RSS is the node's own state.

Sessions are graded by ``GradeLog`` (``--eval-log-lines`` > 0): a fresh bwrap sandbox holding a
copy of a synthetic repo (``--eval-repo-files`` files, pre-warmed while the agent runs), one
command printing a pytest-style log of that many lines, parsed line by line in Python as
swebench's log parsers do — the CPU an SWE evaluation spends in whichever process runs it.

Printed per variant: journal bytes per session and per final-context token; peak RSS of the node
process (and of its largest child: POSTRUN workers); the gateway's added latency (a record's
``total_ms - engine_ms``: receipt to durable record, engine time excluded) p50/p99 for calls that
ran while no session was in POSTRUN ("quiet") and while ≥1 was ("postrun"); calls per second of
the node process; POSTRUN seconds per session; errors. The baseline is another source tree (by
default the commit before this benchmark's changes, unpacked with ``git archive``) run by the
same child code, so "before" is the pre-change code path, not a flag.

    python scripts/bench_scale.py [--sessions 256] [--turns 100] [--context 100000]
        [--engine-ms 2000] [--eval-log-lines 50000] [--eval-repo-files 500]
        [--baseline-rev fd45cad | --no-baseline] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
DEFAULT_BASELINE = "fd45cad"  # main before issue 15 (Gateway object, journal v2, POSTRUN pool)
RESPONSE_IDS = 200  # sampled ids per turn; the rest of each turn's growth is the tool output
ENDS = 10  # calls at each end of a run whose CPU per call is printed (the history's growth)


# -- the evaluator (importable as bench_scale:GradeLog, so a worker process can load it too) ------

class GradeLog:
    """Grades in a fresh runtime: runs ``params['lines']`` pytest-style result lines and parses them."""

    name = "bench_grade_log"

    def wants_fresh_runtime(self, ctx: Any) -> bool:
        return True

    async def evaluate(self, ctx: Any) -> Any:
        from polar_env.evaluators import EvalResult

        runtime = await ctx.fresh_runtime()
        lines = int(ctx.params.get("lines", 50_000))
        script = ("import sys\nw = sys.stdout.write\n"
                  f"for i in range({lines}):\n"
                  "    w(f'tests/test_mod{i % 97}.py::test_case_{i} {\"PASSED\" if i % 13 else \"FAILED\"}\\n')\n")
        res = await runtime.exec(["python3", "-c", script], timeout_s=120)
        passed = failed = 0
        for line in res.output.split("\n"):  # swebench's parse_log_pytest shape: split, look at the status word
            parts = line.split()
            if len(parts) == 2 and parts[1] in ("PASSED", "FAILED", "SKIPPED", "ERROR"):
                passed += parts[1] == "PASSED"
                failed += parts[1] == "FAILED"
        ok = res.exit_code == 0 and passed + failed == lines
        return EvalResult(reward=1.0 if ok else 0.0, report={"passed": passed, "failed": failed, "exit": res.exit_code})


def make_repo(root: Path, files: int) -> Path:
    """A synthetic task repo (``files`` source files of ~2 KB), the fresh runtime's source_dir."""
    repo = root / "repo"
    for i in range(files):
        path = repo / f"pkg{i % 20}" / f"mod{i}.py"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(f"def f{i}_{j}(x):\n    return x + {j}\n\n" for j in range(60)))
    return repo


# -- the mock engine (a test double in its own process) ------------------------------------------

def run_mock_engine(port: int, engine_ms: float, turns: int, context: int) -> None:
    import orjson
    from aiohttp import web

    grow_tokens = max(0, (context // max(1, turns)) - RESPONSE_IDS - 40)  # 40: template and tool framing
    # What a SWE tool call reads: source code, a different stretch every turn (the stdlib's own,
    # ~4.5 characters a Qwen token), so prompts hold the thousands of distinct ids real ones do.
    import argparse as m1
    import asyncio.base_events as m2
    import inspect as m3
    import typing as m4
    corpus = "".join(Path(str(m.__file__)).read_text() for m in (m1, m2, m3, m4))
    chars = min(len(corpus) // 2, grow_tokens * 9 // 2)

    def filler(turn: int) -> str:
        start = (turn * chars) % (len(corpus) - chars)
        return corpus[start:start + chars]
    logprob_entries = [{"token": f"t{i}", "logprob": -0.5 - (i % 7) * 0.1, "bytes": [116], "top_logprobs": []}
                       for i in range(RESPONSE_IDS)]

    def derived_ids(messages: list[dict[str, Any]]) -> list[int]:
        """Prompt ids for a templated request: deterministic and append-only in the messages."""
        out: list[int] = []
        for m in messages:
            text = m.get("content") if isinstance(m.get("content"), str) else json.dumps(m.get("content"))
            data = (str(m.get("role")) + (text or "") + json.dumps(m.get("tool_calls") or "")).encode()
            out.extend(1000 + b for b in data[::4])
        return out

    async def chat(request: web.Request) -> web.Response:
        body = orjson.loads(await request.read())
        messages = body.get("messages") or []
        prompt = (body.get("kv_transfer_params") or {}).get("prompt_token_ids") or derived_ids(messages)
        turn = sum(1 for m in messages if m.get("role") == "assistant")
        delay = engine_ms / 1000
        if turn == 0:  # stagger sessions over half a session's length, so some run while others finish
            digest = hashlib.blake2b(str(body.get("session_id")).encode(), digest_size=2).digest()
            delay += int.from_bytes(digest, "big") / 65535 * 0.5 * turns * engine_ms / 1000
        await asyncio.sleep(delay)
        ids = [50_000 + (turn * 7 + i) % 100_000 for i in range(RESPONSE_IDS - 1)] + [248046]
        if turn + 1 >= turns:
            message = {"role": "assistant", "content": f"Done after {turn + 1} turns.", "tool_calls": []}
            finish = "stop"
        else:
            command = f"echo step-{turn} {filler(turn)}"
            message = {"role": "assistant", "content": None, "reasoning": f"Turn {turn}: look further.",
                       "tool_calls": [{"id": f"call-{turn}", "type": "function",
                                       "function": {"name": "bash", "arguments": orjson.dumps({"command": command}).decode()}}]}
            finish = "tool_calls"
        reply = {"id": "chatcmpl-mock", "object": "chat.completion", "created": 0, "model": "bench",
                 "prompt_token_ids": prompt,
                 "choices": [{"index": 0, "message": message, "logprobs": {"content": logprob_entries},
                              "token_ids": ids, "finish_reason": finish, "stop_reason": None}],
                 "usage": {"prompt_tokens": len(prompt), "completion_tokens": RESPONSE_IDS}}
        return web.Response(body=orjson.dumps(reply), content_type="application/json")

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "bench", "object": "model"}]})

    app = web.Application(client_max_size=256 * 1024 * 1024)
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/v1/models", models)
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None, backlog=4096)


# -- the child: one node under load ---------------------------------------------------------------

def _rss(pid: int | str) -> int:
    try:
        for line in open(f"/proc/{pid}/status"):
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                ppid = int(open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], list(children.get(pid, []))
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def _rss_sampler(peak: list[int], stop: Any) -> None:
    """Peak RSS of this process (the node) and of its descendants together (POSTRUN workers)."""
    me = os.getpid()
    while not stop.is_set():
        peak[0] = max(peak[0], _rss(me))
        peak[1] = max(peak[1], sum(_rss(p) for p in _descendants(me)))
        stop.wait(0.5)


def child(args: argparse.Namespace) -> dict[str, Any]:
    import gc
    import threading

    from polar_env.engines.config import VLLMEngineConfig
    from polar_env.evaluators.base import EvaluatorSpec
    from polar_env.runtimes.base import RuntimeSpec
    from polar_env.staging.models import (
        AgentSpec,
        SessionSpec,
        SessionStatus,
        TaskRequest,
    )
    from polar_env.staging.node import GatewayNode, NodeConfig
    from polar_env.staging.pools import PoolLimits
    from polar_env.testing.simulated_runtime import SimulatedRuntime

    gc.freeze()
    gc.set_threshold(100_000, 50, 100)  # as the gateway CLI does (cli.serving._tune_gc)
    gc_pauses: list[float] = []  # the cyclic GC's pauses of this process (they stop the event loop)
    gc_gen2: list[float] = []  # of them, the full collections (every generation)
    gc_started = [0.0]

    def on_gc(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            gc_started[0] = time.perf_counter()
        else:
            gc_pauses.append((time.perf_counter() - gc_started[0]) * 1000)
            if info.get("generation") == 2:
                gc_gen2.append(gc_pauses[-1])

    gc.callbacks.append(on_gc)
    if args.harness_host:
        from harness_host import ask_host, loop_in_host

        from polar_env.harnesses import loop

        loop.run_loop_agent = loop_in_host(args.harness_host)  # the node calls it through the module

    class SimulatedNode(GatewayNode):
        def make_runtime(self, spec: Any, session_id: str, **options: Any) -> Any:
            return SimulatedRuntime(spec)  # a test double: runs nothing

    store = Path(args.store)
    limits = PoolLimits(max_running=args.sessions, max_init=min(args.sessions, 64), max_postrun=2,
                        ready_buffer=min(args.sessions, 64))
    config = NodeConfig(engine=VLLMEngineConfig(url=f"http://127.0.0.1:{args.engine_port}/v1", model="bench"),
                        store=store, limits=limits, tcp_port=None, install_harnesses=False)
    peak = [0, 0]
    stop = threading.Event()
    sampler = threading.Thread(target=_rss_sampler, args=(peak, stop), daemon=True)
    sampler.start()
    grading: dict[str, Any] = {}
    if args.eval_log_lines > 0:
        repo = make_repo(store.parent, args.eval_repo_files)
        grading = {"evaluator": EvaluatorSpec(name="bench_scale:GradeLog", params={"lines": args.eval_log_lines}),
                   "runtime": RuntimeSpec(source_dir=repo, disk_mb=None)}
    request = TaskRequest(task_id="scale", instruction="Fix the failing test. " * 20, num_samples=args.sessions,
                          agent=AgentSpec(harness="loop", settings={"max_turns": args.turns + 1}), **grading,
                          continuation=not args.canonical, timeout_s=24 * 3600.0)  # measure the load, not the agent budget

    class Done:
        """What the bench keeps of a SessionResult; the trajectory goes on, as to a trainer's
        callback — a node does not keep its finished sessions' trajectories."""

        def __init__(self, result: Any) -> None:
            self.status, self.failure_detail, self.stage_times = result.status, result.failure_detail, result.stage_times
            self.traced = bool(result.trajectory.traces)
            self.reward, self.where = result.reward, result.evaluation.get("evaluated_in", "node")

    stage_ns: dict[str, int] = {}
    # (process CPU s, of it kernel s, stage CPU ns) at each recorded call, in order: CPU per call at
    # the start and at the end of the sessions (one session: its first and last turns)
    marks: list[tuple[float, float, dict[str, int]]] = []
    harness_s = [float("nan")]  # the harness host's CPU over the run (NaN: harnesses in the node)
    thread_s: dict[str, float] = {}  # CPU s per thread over the run (threads alive at its end)

    async def run() -> tuple[list[Done], float, float, str]:
        node = SimulatedNode(config)
        await node.start()
        if node.gateway is not None:
            node.gateway.events.subscribe(
                lambda e: marks.append((time.process_time(), os.times().system, _stage_cpu()))
                if e.kind == "call_recorded" else None)
        # The tokenizer's one-off load (~0.5 s of CPU, once per node process) is kept out of the
        # per-call figures: at the default size it is 0.02 ms of a call; in an 8-session run, ~3 ms.
        await asyncio.to_thread(lambda: config.engine.chat().tokenizer)
        specs = [SessionSpec(session_id=f"scale-{i}", sample_index=i, group_id="scale", request=request)
                 for i in range(args.sessions)]

        async def one(spec: SessionSpec) -> Done:
            return Done(await node.run(spec))

        stages0, threads0 = _stage_cpu(), _thread_cpu()
        host0 = (await ask_host(args.harness_host, {"op": "cpu"}))["cpu_s"] if args.harness_host else 0.0
        cpu0, t0 = time.process_time(), time.monotonic()
        done = await asyncio.gather(*(one(spec) for spec in specs))
        wall, cpu = time.monotonic() - t0, time.process_time() - cpu0
        if args.harness_host:
            harness_s[0] = (await ask_host(args.harness_host, {"op": "cpu"}))["cpu_s"] - host0
        stage_ns.update({k: v - stages0.get(k, 0) for k, v in _stage_cpu().items()})
        threads = _thread_cpu()
        thread_s.update({k: v - threads0.get(k, 0.0) for k, v in threads.items()})
        thread_s["(exited threads)"] = max(0.0, cpu - sum(thread_s.values()))
        root = str(node.store.root)
        await node.stop()
        return list(done), wall, cpu, root

    try:  # the loop the node's command runs on (uvloop where installed; POLAR_ENV_LOOP=asyncio: the default)
        from polar_env import eventloop
    except ImportError:  # a baseline tree from before polar_env.eventloop
        results, wall, cpu, root = asyncio.run(run())
        loop_name = "asyncio"
    else:
        results, wall, cpu, root = eventloop.run(run())
        loop_name = eventloop.loop_name()
    stop.set()
    windows = sorted((r.stage_times["postrun"], r.stage_times.get("done", r.stage_times["postrun"])) for r in results)
    postrun_s = [b - a for a, b in windows]
    quiet: list[float] = []
    busy: list[float] = []
    journal_bytes = 0
    final_tokens = 0
    calls = 0
    for path in Path(root).glob("*.jsonl"):
        journal_bytes += path.stat().st_size
        last: dict[str, Any] | None = None
        with open(path, "rb") as f:
            for line in f:
                rec = json.loads(line)
                if "timings" not in rec:
                    continue
                calls += 1
                t = rec["timings"]
                added = t["total_ms"] - t["engine_ms"]
                at = t["received_at"]  # epoch seconds; stage_times are epoch too
                (busy if any(a <= at <= b for a, b in windows) else quiet).append(added)
                last = rec
        if last is not None:
            prompt = last.get("prompt_ids")
            if prompt is None:  # v2: the final context's length from its reference
                stored = last["prompt"]
                prompt_len = len(stored["ids"]) if "ids" in stored else stored["keep"] + len(stored["suffix"])
            else:
                prompt_len = len(prompt)
            final_tokens += prompt_len + len(last["response_ids"])
    sessions = len(results)
    errors = sum(1 for r in results if r.status is not SessionStatus.COMPLETED or not r.traced
                 or (args.eval_log_lines > 0 and r.reward != 1.0))
    return {
        "sessions": sessions, "calls": calls, "errors": errors, "loop": loop_name,
        "error_samples": [r.failure_detail for r in results if r.status is not SessionStatus.COMPLETED][:3],
        "journal_mb_per_session": journal_bytes / max(1, sessions) / 1e6,
        "journal_bytes_per_token": journal_bytes / max(1, final_tokens),
        "final_context_tokens": final_tokens / max(1, sessions),
        "peak_rss_mb": peak[0] / 1e6, "peak_child_rss_mb": peak[1] / 1e6,
        "added_ms_quiet_p50": _pct(quiet, 50), "added_ms_quiet_p99": _pct(quiet, 99),
        "added_ms_postrun_p50": _pct(busy, 50), "added_ms_postrun_p99": _pct(busy, 99),
        "calls_during_postrun": len(busy),
        "rps": calls / wall if wall else 0.0, "cpu_ms_per_call": cpu * 1000 / max(1, calls),
        "harness_cpu_ms_per_call": harness_s[0] * 1000 / max(1, calls),
        "postrun_s_per_session": statistics.mean(postrun_s) if postrun_s else 0.0,
        "wall_s": wall, "evaluated_in_worker": sum(1 for r in results if r.where == "worker"),
        "gc_pause_max_ms": max(gc_pauses, default=0.0), "gc_pause_total_s": sum(gc_pauses) / 1000,
        "gc_full_count": len(gc_gen2), "gc_full_max_ms": max(gc_gen2, default=0.0),
        "stage_ms_per_call": {k: v / 1e6 / max(1, calls) for k, v in stage_ns.items()},
        **_ends(marks),
        "thread_ms_per_call": {k: v * 1000 / max(1, calls) for k, v in sorted(thread_s.items(), key=lambda kv: -kv[1])},
    }


def _ends(marks: list[tuple[float, float, dict[str, int]]], n: int = ENDS) -> dict[str, Any]:
    """Node CPU ms per call over the ``n`` calls after the first recorded one and over the last
    ``n`` (CPU between records: with one session, that call's own work), of it in the kernel
    (10 ms ticks), and by stage."""
    if len(marks) < 2 * n + 1:
        return {}

    def per_call(a: int, b: int) -> tuple[float, float, dict[str, float]]:
        (c0, k0, s0), (c1, k1, s1) = marks[a], marks[b]
        return ((c1 - c0) * 1000 / (b - a), (k1 - k0) * 1000 / (b - a),
                {k: (v - s0.get(k, 0)) / 1e6 / (b - a) for k, v in s1.items()})

    first, first_sys, first_stages = per_call(0, n)
    last, last_sys, last_stages = per_call(len(marks) - 1 - n, len(marks) - 1)
    return {"cpu_ms_first": first, "cpu_ms_last": last, "cpu_last_over_first": last / first if first else float("nan"),
            "sys_ms_first": first_sys, "sys_ms_last": last_sys, "stage_ms_first": first_stages, "stage_ms_last": last_stages}


def _thread_cpu() -> dict[str, float]:
    """CPU seconds per live thread of this process, keyed by its Python name (pools' numbered
    workers summed under one name); from ``/proc/self/task/<tid>/stat`` utime + stime."""
    import re
    import threading

    names = {t.native_id: re.sub(r"[-_]\d+(?:_\d+)?$", "", t.name) for t in threading.enumerate()}
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            fields = open(f"/proc/self/task/{tid}/stat").read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        name = "main" if int(tid) == os.getpid() else names.get(int(tid), "other")
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return out


def _stage_cpu() -> dict[str, int]:
    """The node's cumulative CPU ns per call stage (``polar_env.stagecpu``); {} for a tree without it."""
    try:
        from polar_env import stagecpu
    except ImportError:
        return {}
    return {name: v["cpu_ns"] for name, v in stagecpu.snapshot().items()}


def _pct(values: list[float], q: int) -> float:
    if not values:
        return float("nan")
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


# -- the parent: engine, variants, table ----------------------------------------------------------

def baseline_tree(rev: str) -> Path:
    out = Path(tempfile.gettempdir()) / f"polar-bench-baseline-{rev}"
    if not (out / "polar_env").is_dir():
        out.mkdir(parents=True, exist_ok=True)
        archive = subprocess.run(["git", "-C", str(REPO), "archive", rev, "polar_env"], check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(out)], input=archive, check=True)
    return out


# cProfile's default clock is wall time, which charges other threads' and processes' CPU to
# whatever the main thread was running; the thread's CPU clock charges only its own work.
PROFILED_CHILD = """import cProfile, runpy, sys, time
out, script = sys.argv[1], sys.argv[2]
sys.argv = sys.argv[2:]
profile = cProfile.Profile(time.thread_time)
profile.enable()
try:
    runpy.run_path(script, run_name="__main__")
finally:
    profile.disable()
    profile.dump_stats(out)
"""


def run_variant(tree: Path, args: argparse.Namespace, engine_port: int, host: str | None) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="polar-scale-") as store:
        out = Path(store) / "result.json"
        env = {**os.environ, "PYTHONPATH": f"{tree}{os.pathsep}{HERE}"}
        cmd = [sys.executable, __file__, "--child", "--engine-port", str(engine_port), "--store", str(Path(store) / "capture"),
               "--sessions", str(args.sessions), "--turns", str(args.turns), "--context", str(args.context),
               "--eval-log-lines", str(args.eval_log_lines), "--eval-repo-files", str(args.eval_repo_files),
               "--result", str(out)]
        if host is not None:
            cmd += ["--harness-host", host]
        if args.canonical:
            cmd.append("--canonical")
        if args.profile:  # the node's main thread (gateway, loop harness, staging), timed by its own CPU clock
            cmd[1:2] = ["-c", PROFILED_CHILD, f"{args.profile}.{tree.name}.prof", __file__]
        proc = subprocess.run(cmd, env=env, cwd=str(tree), check=False)
        if proc.returncode != 0:
            raise SystemExit(f"variant {tree} failed (exit {proc.returncode})")
        return dict(json.loads(out.read_text()))


ROWS = [
    ("journal MB / session", "journal_mb_per_session", "{:.2f}"),
    ("journal bytes / token", "journal_bytes_per_token", "{:.1f}"),
    ("final context tokens", "final_context_tokens", "{:,.0f}"),
    ("peak node RSS MB", "peak_rss_mb", "{:,.0f}"),
    ("peak workers RSS MB", "peak_child_rss_mb", "{:,.0f}"),
    ("added ms p50 (quiet)", "added_ms_quiet_p50", "{:.2f}"),
    ("added ms p99 (quiet)", "added_ms_quiet_p99", "{:.2f}"),
    ("added ms p50 (POSTRUN)", "added_ms_postrun_p50", "{:.2f}"),
    ("added ms p99 (POSTRUN)", "added_ms_postrun_p99", "{:.2f}"),
    ("calls during POSTRUN", "calls_during_postrun", "{:,}"),
    ("calls / s (node)", "rps", "{:.1f}"),
    ("node CPU ms / call", "cpu_ms_per_call", "{:.2f}"),
    (f"  first {ENDS} calls", "cpu_ms_first", "{:.2f}"),
    (f"  last {ENDS} calls", "cpu_ms_last", "{:.2f}"),
    ("  last / first", "cpu_last_over_first", "{:.2f}"),
    (f"  first {ENDS}: in the kernel", "sys_ms_first", "{:.2f}"),
    (f"  last {ENDS}: in the kernel", "sys_ms_last", "{:.2f}"),
    ("harness host CPU ms / call", "harness_cpu_ms_per_call", "{:.2f}"),
    ("POSTRUN s / session", "postrun_s_per_session", "{:.2f}"),
    ("calls", "calls", "{:,}"),
    ("errors", "errors", "{}"),
    ("evaluated in a worker", "evaluated_in_worker", "{}"),
    ("wall s", "wall_s", "{:.1f}"),
    ("node event loop", "loop", "{}"),
    ("GC pause max ms (node)", "gc_pause_max_ms", "{:.1f}"),
    ("GC pause total s (node)", "gc_pause_total_s", "{:.2f}"),
    ("GC full collections (node)", "gc_full_count", "{}"),
    ("GC full collection max ms", "gc_full_max_ms", "{:.1f}"),
]


def table(results: dict[str, dict[str, Any]]) -> str:
    names = list(results)
    lines = [f"{'':28}" + "".join(f"{n:>16}" for n in names) + ("       after/before" if len(names) == 2 else "")]
    for label, key, fmt in ROWS:
        if any(key not in results[n] for n in names):
            continue  # e.g. first/last calls of a run too short to have them
        cells = [fmt.format(results[n][key]) for n in names]
        line = f"{label:28}" + "".join(f"{c:>16}" for c in cells)
        if len(names) == 2:
            before, after = results[names[0]][key], results[names[1]][key]
            if isinstance(before, (int, float)) and before:
                line += f"{after / before:>19.2f}"
        lines.append(line)
    stages = list(dict.fromkeys(k for n in names for k in results[n].get("stage_ms_per_call", {})))
    for key in stages:  # CPU ms per call by stage: a regression names its stage
        cells = [results[n].get("stage_ms_per_call", {}).get(key) for n in names]
        lines.append(f"{'  cpu ms/call ' + key:28}" + "".join(f"{'-' if c is None else f'{c:.3f}':>16}" for c in cells))
    for end in ("first", "last"):  # by stage at each end: which stage grows with the history
        for key in stages:
            cells = [results[n].get(f"stage_ms_{end}", {}).get(key) for n in names]
            if any(c is not None for c in cells):
                lines.append(f"{f'  {end} {ENDS} ' + key:28}" + "".join(f"{'-' if c is None else f'{c:.3f}':>16}" for c in cells))
    threads = list(dict.fromkeys(k for n in names for k in results[n].get("thread_ms_per_call", {})))
    for key in threads:  # node CPU ms per call by thread (clock ticks: 10 ms resolution per thread)
        cells = [results[n].get("thread_ms_per_call", {}).get(key) for n in names]
        lines.append(f"{'  thread ms/call ' + key:28}" + "".join(f"{'-' if c is None else f'{c:.3f}':>16}" for c in cells))
    p99q, p99b = results[names[-1]]["added_ms_quiet_p99"], results[names[-1]]["added_ms_postrun_p99"]
    lines.append(f"POSTRUN p99 / quiet p99 ({names[-1]}): {p99b / p99q:.2f} (target <= 1.5)")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sessions", type=int, default=256)
    ap.add_argument("--turns", type=int, default=100)
    ap.add_argument("--context", type=int, default=100_000)
    ap.add_argument("--engine-ms", type=float, default=2000.0, help="simulated generation time per call")
    ap.add_argument("--baseline-rev", default=DEFAULT_BASELINE)
    ap.add_argument("--no-baseline", action="store_true")
    ap.add_argument("--json", help="also write the figures here")
    ap.add_argument("--profile", help="write each variant's cProfile to PROFILE.<tree>.prof (pstats; inflates CPU)")
    ap.add_argument("--eval-log-lines", type=int, default=50_000, help="GradeLog's test log (0: no evaluator)")
    ap.add_argument("--eval-repo-files", type=int, default=500, help="files in the grading runtime's repo copy")
    ap.add_argument("--canonical", action="store_true",
                    help="sessions without token-in continuation: the engine renders the messages (an engine without token-in)")
    ap.add_argument("--harness", choices=("process", "node"), default="process",
                    help="where the loop harnesses run: a process of their own (as sandboxed CLIs) or the node's")
    # child mode (internal)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--engine-port", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--store", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    ap.add_argument("--harness-host", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        Path(args.result).write_text(json.dumps(child(args)))
        return

    from bench_gateway import free_port, wait_port

    port = free_port()
    import multiprocessing

    engine = multiprocessing.get_context("spawn").Process(
        target=run_mock_engine, args=(port, args.engine_ms, args.turns, args.context), daemon=True)
    engine.start()
    host_dir = tempfile.TemporaryDirectory(prefix="polar-harness-host-")
    host = str(Path(host_dir.name) / "host.sock") if args.harness == "process" else None
    harnesses = None
    if host is not None:
        from harness_host import run_harness_host

        harnesses = multiprocessing.get_context("spawn").Process(target=run_harness_host, args=(host,), daemon=True)
        harnesses.start()
    try:
        wait_port(port)
        while harnesses is not None and not Path(str(host)).exists():
            if not harnesses.is_alive():
                raise SystemExit(f"the harness host exited ({harnesses.exitcode}) before it listened")
            time.sleep(0.05)
        results: dict[str, dict[str, Any]] = {}
        if not args.no_baseline:
            results[f"before({args.baseline_rev})"] = run_variant(baseline_tree(args.baseline_rev), args, port, host)
        results["after"] = run_variant(REPO, args, port, host)
    finally:
        for process in (engine, harnesses):
            if process is not None:
                process.terminate()
                process.join(10)
        host_dir.cleanup()
    print(f"bench_scale: {args.sessions} sessions x {args.turns} turns, contexts to ~{args.context:,} tokens, "
          f"engine {args.engine_ms:g} ms/call, {RESPONSE_IDS} sampled ids/turn, "
          f"{'canonical (messages to the engine)' if args.canonical else 'token-in continuation'}, harnesses in "
          f"{'their own process' if host else 'the node'}, "
          + (f"graded: {args.eval_log_lines:,}-line log, {args.eval_repo_files}-file repo" if args.eval_log_lines else "no evaluator"))
    print(table(results))
    for name, r in results.items():
        if r["error_samples"]:
            print(f"{name} errors: {r['error_samples']}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
