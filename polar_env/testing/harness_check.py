"""End-to-end check: each real harness CLI, unmodified, against the real gateway and engine.

A test runner (used by ``tests/harnesses/test_real_clients.py`` and ``scripts/check_harnesses.sh``),
not part of the runtime path. Why it exists: the client specs in ``polar_env.harnesses.clients``
(derived from the presets in ``polar_env.harnesses``) were validated against a fake provider, and
the provider translations are unit-tested against recorded bodies. Neither proves that a current
CLI build, talking to the actual gateway (provider translation, quirks, session keys, SSE synthesis)
in front of the embedded engine, completes a tool-using task and leaves token-faithful records
behind. This module runs exactly that, one spec at a time:

- the parent (``python -m polar_env.testing.harness_check``) re-executes itself as a worker inside a
  fresh network namespace (``unshare --net``; ``--map-root-user`` when not root) so the CLI can
  reach nothing but loopback, whatever it tries (telemetry, update checks, model lists);
- the worker (``--inside SPEC_ID``) brings ``lo`` up, refuses to continue if any other interface
  is visible, starts the gateway in-process on ``127.0.0.1`` (port 0) with the embedded engine in
  scripted mode (call the declared shell tool with ``echo hi``, then answer with its output; a
  harness with a ``finish_command``, mini-swe-agent, gets that command called with the answer),
  creates a session, renders the spec into a private temporary ``$HOME``, runs the CLI headless
  (stdin ``/dev/null``, minimal environment, timeout, whole process group killed afterwards),
  reads the session's journal back and writes a JSON verdict;
- the parent prints one table row per spec and exits non-zero if any selected spec failed.

A spec passes when the CLI exits 0, at least two turns were captured, every record has non-empty
prompt and response ids with one logprob per response id, and the journal shows a tool round trip:
a shell tool call, then a request carrying that tool's output (``hi``), answered with text that
contains it, and the CLI printed that answer (so it parsed the gateway's reply, not just sent).

In continuation mode a spec must also merge with zero drift and exact masks (every merged trace is
its last call's prompt + sampled ids, with mask 1 on exactly the ids each call sampled).
``--template`` picks the model family (default ``qwen3.5`` on seeded random weights; ``smollm2``
or ``hf:PATH`` serve that model's own weights, still forced to the scripted turns).

    python -m polar_env.testing.harness_check [--only pi-openai_chat,qwen-openai_chat] [--json OUT]
                                        [--timeout-s 240] [--workdir DIR] [--continuation] [--template T]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from polar_env.harnesses.clients import CLIENTS, ClientSpec, render
from polar_env.harnesses.install import default_cache_dir
from polar_env.harnesses.install import install_hint as _install_hint
from polar_env.harnesses.scripted import is_finish_call, policy_for
from polar_env.records import CompletionRecord, Trace

PROMPT = "Run the shell command `echo hi` with your shell tool, then reply with what it printed."
DEFAULT_TIMEOUT_S = 240.0
WORKER_STARTUP_S = 180.0  # on top of the CLI timeout: engine build, gateway start, journal read
TAIL_CHARS = 3000
_HI = re.compile(r"\bhi\b")

SPECS: dict[str, ClientSpec] = {spec.id: spec for spec in CLIENTS.values()}


def npm_cache() -> Path:
    """Where the harnesses are installed (``scripts/install_harnesses.sh``, ``ensure_installed``)."""
    return default_cache_dir()


def binary_path(spec: ClientSpec) -> Path:
    if spec.install is None:
        return npm_cache() / spec.name / "node_modules" / ".bin" / spec.binary
    return spec.install.binary_path(npm_cache())


def install_hint(spec: ClientSpec) -> str:
    return f"scripts/install_harnesses.sh {spec.name}" if spec.install is None else _install_hint(spec.install)


@dataclass(slots=True)
class CheckResult:
    spec_id: str
    harness: str
    api: str
    exit_code: int | None = None  # the CLI's; None when it never ran or was killed
    timed_out: bool = False
    cli_s: float = 0.0  # the CLI's wall time
    total_s: float = 0.0  # worker wall time (engine build, gateway, CLI, journal read)
    turns: int = 0  # completion records captured for the session
    aligned: bool = False  # every record: prompt ids, response ids, logprobs 1:1, all non-empty
    tool_round_trip: bool = False
    tool_name: str | None = None
    answer: str | None = None  # the final text the engine gave after seeing the tool output
    answer_in_stdout: bool = False  # the CLI printed that answer (it parsed the gateway's reply)
    continuation: bool = False  # the session ran in token-in continuation mode
    template: str = "qwen3.5"  # the engine's (and gateway's) chat format
    merged_traces: int = 0  # prefix-merged traces built from the journal (turns = per-request traces)
    drift: int = 0  # drift boundaries found while merging
    masks_exact: bool = False  # each merged trace: its calls' ids in place, mask 1 on exactly the sampled ones
    problems: list[str] = field(default_factory=list)
    http: list[dict[str, Any]] = field(default_factory=list)  # method, path, status, ms per request
    http_errors: list[dict[str, Any]] = field(default_factory=list)  # >= 400: bodies, for diagnosis
    stdout_tail: str = ""
    stderr_tail: str = ""
    workdir: str | None = None

    def failures(self) -> list[str]:
        """Why this spec failed; empty when it passed."""
        why = list(self.problems)
        if self.timed_out:
            why.append(f"the CLI did not finish within the timeout ({self.cli_s:.0f}s)")
        elif self.exit_code != 0:
            why.append(f"the CLI exited with {self.exit_code}")
        if self.turns < 2:
            why.append(f"{self.turns} turn(s) captured, expected at least 2")
        if not self.aligned:
            why.append("records missing prompt/response ids or logprobs not 1:1 with response ids")
        if not self.tool_round_trip:
            why.append("no tool round trip (shell call, its output 'hi' sent back, answered with it)")
        elif not self.answer_in_stdout:
            why.append(f"the CLI did not print the final answer {self.answer!r}")
        if self.continuation and self.turns and self.drift:
            why.append(f"{self.drift} drift boundaries in token-in continuation mode (expected 0)")
        if self.continuation and self.turns and not self.masks_exact:
            why.append("a merged trace's ids or loss mask differ from what its calls sampled")
        return why

    @property
    def ok(self) -> bool:
        return not self.failures()

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "ok": self.ok}


# -- judging a session's journal ---------------------------------------------------------------


def judge_records(records: Sequence[CompletionRecord], result: CheckResult, finish_command: str | None = None) -> None:
    """Fill ``turns``, ``aligned``, ``tool_round_trip``, ``tool_name`` and ``answer`` from records.
    The answer is a reply without tool calls, or (for a harness with a ``finish_command``) whose
    only tool calls run that command."""
    from polar_env.chat.content import content_text
    from polar_env.engines.embedded.policy import SHELL_TOOLS

    result.turns = len(records)
    result.aligned = bool(records) and all(
        r.prompt_ids and r.response_ids and len(r.response_logprobs) == len(r.response_ids) for r in records
    )
    call_seq: int | None = None
    for record in sorted(records, key=lambda r: r.seq):
        declared = {str((t.get("function") or t).get("name")) for t in record.chat_request.tools}
        if call_seq is None:
            shell_calls = [c for c in record.message.tool_calls if c.name in SHELL_TOOLS and c.name in declared]
            if shell_calls:
                call_seq, result.tool_name = record.seq, shell_calls[0].name
            continue
        saw_output = any(
            m.get("role") == "tool" and _HI.search(content_text(m.get("content"))) for m in record.chat_request.messages
        )
        text = record.message.content or ""
        answered = all(is_finish_call(c.arguments, finish_command) for c in record.message.tool_calls)
        if saw_output and answered and _HI.search(text):
            result.tool_round_trip = True
            result.answer = text.strip()[:300]
            return


def masks_exact(records: Sequence[CompletionRecord], traces: Sequence[Trace]) -> bool:
    """Every merged trace holds each of its calls' sampled ids at that call's prompt length, with
    mask 1 on exactly those ids and their logprobs, and ends as its last call ended."""
    by_seq = {r.seq: r for r in records}
    for trace in traces:
        calls = [by_seq[s] for s in trace.metadata["seqs"]]
        ids, start = trace.prompt_ids + trace.response_ids, len(trace.prompt_ids)
        mask, lps = [0] * len(trace.response_ids), [0.0] * len(trace.response_ids)
        for call in calls:
            at = len(call.prompt_ids)
            if ids[:at] != call.prompt_ids or ids[at: at + len(call.response_ids)] != call.response_ids:
                return False
            mask[at - start: at - start + len(call.response_ids)] = [1] * len(call.response_ids)
            lps[at - start: at - start + len(call.response_ids)] = call.response_logprobs
        if len(ids) != len(calls[-1].prompt_ids) + len(calls[-1].response_ids):
            return False
        if trace.loss_mask != mask or trace.response_logprobs != lps:
            return False
    return True


# -- the worker (inside the network namespace) -------------------------------------------------


def isolate_loopback() -> None:
    """Check that ``lo`` is the only interface this process can see, then bring it up."""
    names = sorted(name for _, name in socket.if_nameindex())
    if names != ["lo"]:
        raise SystemExit(f"refusing to run: interfaces {names} are visible; run through the parent, not directly")
    try:
        subprocess.run(["ip", "link", "set", "lo", "up"], check=True, capture_output=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as exc:
        raise SystemExit(f"cannot bring up lo (is iproute2 installed?): {exc}") from exc


def _cut(data: bytes | str, limit: int = TAIL_CHARS) -> str:
    text = data.decode("utf-8", "replace") if isinstance(data, bytes) else data
    return text[-limit:]


Handler = Callable[[Any], Awaitable[Any]]


def http_logger(result: CheckResult) -> Any:
    """aiohttp middleware: every request's status, plus bodies for the ones that failed."""
    from aiohttp import web

    @web.middleware
    async def log(request: web.Request, handler: Handler) -> web.StreamResponse:
        started = time.perf_counter()
        entry: dict[str, Any] = {"method": request.method, "path": request.path_qs}
        result.http.append(entry)
        try:
            response: web.StreamResponse = await handler(request)
        except web.HTTPException as exc:
            entry["status"] = exc.status
            raise
        except Exception:
            entry["status"] = 500
            result.http_errors.append({**entry, "traceback": traceback.format_exc()[-TAIL_CHARS:],
                                       "request_body": _cut(await request.read())})
            raise
        finally:
            entry["ms"] = round((time.perf_counter() - started) * 1000, 1)
        entry["status"] = response.status
        if response.status >= 400:
            body = response.body if isinstance(response, web.Response) else None
            result.http_errors.append({
                **entry,
                "request_body": _cut(await request.read()) if request.can_read_body or request.body_exists else "",
                "response_body": _cut(body) if isinstance(body, bytes) else None,
            })
        return response

    return log


async def run_cli(spec: ClientSpec, base_url: str, key: str, model: str, workdir: Path, timeout_s: float,
                  result: CheckResult) -> bytes:
    """Render the spec into ``workdir/home`` and run the CLI there; returns its stdout."""
    home = workdir / "home"
    cwd = home / "work"
    cwd.mkdir(parents=True)
    argv, env, files = render(spec, base_url, key, model, str(home), PROMPT)
    for rel, text in files.items():
        path = home / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    binary = binary_path(spec)
    argv[0] = str(binary)
    node = shutil.which("node")
    path_dirs = [str(binary.parent), *([str(Path(node).parent)] if node else []), "/usr/local/bin", "/usr/bin", "/bin"]
    # A minimal environment: nothing from ours (API keys, proxies, config dirs) leaks into the CLI.
    full_env = {"PATH": ":".join(dict.fromkeys(path_dirs)), "LANG": "C.UTF-8", "TERM": "dumb", "NO_COLOR": "1", **env}
    started = time.perf_counter()
    proc = await asyncio.create_subprocess_exec(
        *argv, cwd=cwd, env=full_env, stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, start_new_session=True,
    )
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout_s)
    except TimeoutError:
        result.timed_out = True
        _kill_group(proc.pid)
        out, err = await proc.communicate()
    finally:
        _kill_group(proc.pid)  # background children (shells, MCP servers) go too
    result.cli_s = round(time.perf_counter() - started, 2)
    result.exit_code = None if result.timed_out else proc.returncode
    result.stdout_tail, result.stderr_tail = _cut(out), _cut(err)
    (workdir / "cli.stdout").write_bytes(out)
    (workdir / "cli.stderr").write_bytes(err)
    return out


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


async def check_inside(spec: ClientSpec, workdir: Path, timeout_s: float, continuation: bool = False,
                       template: str = "qwen3.5") -> CheckResult:
    from polar_env.chat import chat_format
    from polar_env.engines.embedded.engine import EmbeddedEngine
    from polar_env.engines.embedded.policy import ScriptedPolicy
    from polar_env.journal.store import JournalStore
    from polar_env.proxy.config import GatewayConfig
    from polar_env.proxy.continuation import Continuation
    from polar_env.proxy.gateway import Gateway
    from polar_env.proxy.providers import PROVIDERS
    from polar_env.trajectory.prefix_merge import build_prefix_merged

    result = CheckResult(spec.id, spec.name, spec.api.value, workdir=str(workdir), continuation=continuation,
                         template=template)
    if spec.api not in PROVIDERS:
        result.problems.append(f"the gateway has no provider registered for {spec.api.value}")
    chat = chat_format(template)
    engine = EmbeddedEngine(model_dir=chat.weights, chat=chat, policy=policy_for(spec, ScriptedPolicy()))
    store = JournalStore(workdir / "capture")
    gateway = Gateway(engine, store, GatewayConfig(engine_model=engine.model_name, template=template))
    gateway.app.middlewares.append(http_logger(result))
    tracker = Continuation(engine.chat) if continuation else False
    session = gateway.open_session(metadata={"check": spec.id}, continuation=tracker)
    assert session.key is not None  # only sessions restored from disk lack their key
    await gateway.start("127.0.0.1", 0)
    try:
        port = gateway.port
        stdout = await run_cli(spec, f"http://127.0.0.1:{port}", session.key, engine.model_name, workdir,
                               timeout_s, result)
    finally:
        await gateway.aclose()
    records = store.read(session.id)
    judge_records(records, result, spec.finish_command)
    if records:
        merged = build_prefix_merged(records)
        stats = merged.metadata["stats"]
        result.merged_traces, result.drift = stats["traces"], stats["drift_boundaries"]
        result.masks_exact = masks_exact(records, merged.traces)
    if result.answer:
        first_line = result.answer.splitlines()[0].strip()
        result.answer_in_stdout = first_line in stdout.decode("utf-8", "replace")
    return result


def worker_main(spec_id: str, out: Path, workdir: Path, timeout_s: float, continuation: bool = False,
                template: str = "qwen3.5") -> int:
    spec = SPECS[spec_id]
    started = time.perf_counter()
    try:
        isolate_loopback()
        result = asyncio.run(check_inside(spec, workdir, timeout_s, continuation, template))
    except BaseException as exc:  # noqa: BLE001 - the verdict file must say what went wrong
        result = CheckResult(spec.id, spec.name, spec.api.value, workdir=str(workdir))
        result.problems.append(f"worker failed: {exc!r}")
        result.stderr_tail = traceback.format_exc()[-TAIL_CHARS:]
    result.total_s = round(time.perf_counter() - started, 2)
    out.write_text(json.dumps(result.to_dict(), indent=1))
    return 0 if result.ok else 1


# -- the parent --------------------------------------------------------------------------------


def isolation_prefix() -> list[str]:
    """The argv prefix that puts a command in a new network namespace with only ``lo``."""
    unshare = shutil.which("unshare")
    if unshare is None:
        raise RuntimeError("unshare (util-linux) is not installed")
    return [unshare, "--net"] if os.geteuid() == 0 else [unshare, "--net", "--map-root-user"]


def isolation_problem() -> str | None:
    """None when loopback-only namespaces work here, else why not."""
    try:
        proc = subprocess.run([*isolation_prefix(), "true"], check=False, capture_output=True, timeout=30)
    except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
        return str(exc)
    if proc.returncode != 0:
        return f"{' '.join(isolation_prefix())} failed: {_cut(proc.stderr, 500).strip()}"
    return None


def check_spec(spec: ClientSpec, timeout_s: float, workdir: Path, continuation: bool = False,
               template: str = "qwen3.5") -> CheckResult:
    """Run one spec in its own network namespace; never raises."""
    if not binary_path(spec).exists():
        result = CheckResult(spec.id, spec.name, spec.api.value)
        result.problems.append(f"{binary_path(spec)} is not installed; run {install_hint(spec)}")
        return result
    shutil.rmtree(workdir, ignore_errors=True)  # a fresh HOME, journal and verdict every run
    workdir.mkdir(parents=True)
    out = workdir / "result.json"
    worker = [sys.executable, "-m", "polar_env.testing.harness_check", "--inside", spec.id, "--out", str(out),
              "--workdir", str(workdir), "--timeout-s", str(timeout_s), "--template", template,
              *(["--continuation"] if continuation else [])]
    try:
        proc = subprocess.run([*isolation_prefix(), *worker], check=False, capture_output=True,
                              stdin=subprocess.DEVNULL, timeout=timeout_s + WORKER_STARTUP_S)
        worker_err = _cut(proc.stderr)
    except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
        worker_err = f"{exc!r}"
    if out.exists():
        data = json.loads(out.read_text())
        data.pop("ok", None)
        return CheckResult(**data)
    result = CheckResult(spec.id, spec.name, spec.api.value, workdir=str(workdir))
    result.problems.append("worker wrote no result")
    result.stderr_tail = worker_err
    return result


def _mark(flag: bool) -> str:
    return "yes" if flag else "NO"


def format_table(results: Sequence[CheckResult]) -> str:
    header = ("harness", "API", "template", "turns", "tool round trip", "ids/logprobs", "answer printed", "merged",
              "drift", "masks", "exit", "cli s", "total s", "result")
    rows = [header]
    for r in results:
        exit_text = "timeout" if r.timed_out else ("-" if r.exit_code is None else str(r.exit_code))
        rows.append((r.harness, r.api, r.template, str(r.turns), _mark(r.tool_round_trip), _mark(r.aligned),
                     _mark(r.answer_in_stdout), f"{r.turns}→{r.merged_traces}", str(r.drift),
                     "exact" if r.masks_exact else "NO", exit_text,
                     f"{r.cli_s:.1f}", f"{r.total_s:.1f}", "ok" if r.ok else "FAIL"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def describe_failure(r: CheckResult) -> str:
    lines = [f"--- {r.spec_id}: FAIL" + (f" (artifacts in {r.workdir})" if r.workdir else "")]
    lines += [f"  problem: {p}" for p in r.failures()]
    for e in r.http_errors[:5]:
        lines.append(f"  HTTP {e.get('status')} {e.get('method')} {e.get('path')}: "
                     f"{(e.get('response_body') or e.get('traceback') or '').strip()[:500]}")
    if r.stdout_tail.strip():
        lines.append("  stdout tail: " + r.stdout_tail.strip()[-800:].replace("\n", "\n    "))
    if r.stderr_tail.strip():
        lines.append("  stderr tail: " + r.stderr_tail.strip()[-800:].replace("\n", "\n    "))
    return "\n".join(lines)


def select(only: str | None) -> list[ClientSpec]:
    if not only:
        return list(SPECS.values())
    wanted = [s.strip() for s in only.split(",") if s.strip()]
    unknown = [s for s in wanted if s not in SPECS]
    if unknown:
        raise SystemExit(f"unknown spec id(s) {unknown}; known: {', '.join(SPECS)}")
    return [SPECS[s] for s in wanted]


def _template(value: str) -> str:
    from polar_env.chat import check_template

    try:
        return check_template(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m polar_env.testing.harness_check", description=__doc__.split("\n\n")[0])
    p.add_argument("--only", help=f"comma-separated spec ids (default: all of {', '.join(SPECS)})")
    p.add_argument("--json", type=Path, help="write every result (with HTTP log and output tails) here")
    p.add_argument("--timeout-s", type=float, default=DEFAULT_TIMEOUT_S, help="per-CLI time limit")
    p.add_argument("--workdir", type=Path, help="keep each spec's HOME, journal and CLI output under this folder")
    p.add_argument("--continuation", action="store_true",
                   help="run sessions in token-in continuation mode (then 0 drift and exact masks are required)")
    p.add_argument("--template", type=_template, default="qwen3.5",
                   help="the model family: qwen3.5 (seeded random weights), smollm2 or hf:PATH (that model's weights)")
    p.add_argument("--inside", metavar="SPEC_ID", help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    if args.inside:
        if args.out is None or args.workdir is None:
            p.error("--inside needs --out and --workdir")
        return worker_main(args.inside, args.out, args.workdir, args.timeout_s, args.continuation, args.template)

    specs = select(args.only)
    problem = isolation_problem()
    if problem:
        print(f"cannot isolate the network (loopback-only namespace): {problem}", file=sys.stderr)
        return 2
    results: list[CheckResult] = []
    with tempfile.TemporaryDirectory(prefix="polar-check-") as scratch:
        root = args.workdir or Path(scratch)
        for spec in specs:
            print(f"checking {spec.id} ...", file=sys.stderr, flush=True)
            result = check_spec(spec, args.timeout_s, root / spec.id, args.continuation, args.template)
            if args.workdir is None:
                result.workdir = None  # the scratch folder is about to go
            results.append(result)
    if args.json:
        args.json.write_text(json.dumps([r.to_dict() for r in results], indent=1))
    print(format_table(results))
    failures = [r for r in results if not r.ok]
    for r in failures:
        print(describe_failure(r))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
