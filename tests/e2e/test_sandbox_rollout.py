"""End to end: a real harness CLI, unmodified, inside the bubblewrap sandbox, solves a toy SWE task
through the gateway, and the ``swebench`` evaluator grades the workspace diff in a fresh sandbox.

Per case: the gateway runs in-process on a unix socket, in front of the embedded engine in scripted
mode; the sandbox binds that socket and relays it to ``127.0.0.1:8100`` inside, the only address it
can reach. The harness preset (``polar_env.harnesses``) is rendered for the session and run headless
in ``/testbed``, a copy of the toy repo. The script either applies the task's gold patch with the
harness's shell tool (→ resolved) or does something useless (→ not resolved). A last test checks,
from inside the same kind of sandbox, that nothing but the gateway is reachable.

Prerequisites: bubblewrap, node, the pi / qwen CLIs (``scripts/install_harnesses.sh pi qwen``),
mini-swe-agent (``python -m polar_env.harnesses install mini_swe_agent``),
python3 in ``/usr/bin`` (the relay) and the swebench extra. Missing ones skip locally and fail
under ``CI``.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from polar_env.engines.embedded.policy import ScriptedPolicy, ScriptStep
from polar_env.harnesses import HarnessSpec, get_harness, install_hint, is_installed
from polar_env.harnesses.launch import run_harness, with_harness
from polar_env.harnesses.scripted import policy_for
from polar_env.records import ProviderAPI
from polar_env.tasks.swe import SweTask

pytestmark = pytest.mark.slow

GATEWAY_PORT = 8100
HARNESS_TIMEOUT_S = 180.0
TOY_ID = "toy__calc-1"
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def _unavailable(reason: str) -> None:
    if os.environ.get("CI"):
        pytest.fail(f"{reason} (CI must provide it)")
    pytest.skip(reason)


@pytest.fixture(scope="module")
def sandbox_ready() -> None:
    if shutil.which("bwrap") is None:
        _unavailable("bubblewrap is not installed (apt-get install -y bubblewrap)")
    if not os.access("/usr/bin/python3", os.X_OK):
        _unavailable("/usr/bin/python3 is missing (the sandbox's gateway relay runs on it): apt-get install -y python3")
    try:
        import swebench.harness.grading  # noqa: F401
    except ImportError:
        _unavailable("the swebench extra is not installed (pip install -e '.[swebench]')")


def _harness(name: str) -> HarnessSpec:
    harness = get_harness(name)
    if harness.needs == "node" and shutil.which("node") is None:
        _unavailable("node is not on PATH: apt-get install -y nodejs npm")
    if not is_installed(harness):
        _unavailable(f"{harness.name} is not installed; run {install_hint(harness)}")
    return harness


@pytest.fixture(scope="module")
def task(tmp_path_factory: pytest.TempPathFactory) -> SweTask:
    from polar_env.tasks.toy import toy_tasks

    return toy_tasks(tmp_path_factory.mktemp("toy"), ids=[TOY_ID])[0]


# -- the gateway, in-process on a unix socket ----------------------------------------------------


@dataclass
class Gateway:
    socket: Path
    key: str
    session_id: str
    model: str
    store: Any

    def records(self) -> list[Any]:
        return list(self.store.read(self.session_id))


@contextlib.asynccontextmanager
async def gateway(policy: ScriptedPolicy, capture_dir: Path) -> AsyncIterator[Gateway]:
    from polar_env.engines.embedded.engine import EmbeddedEngine
    from polar_env.journal.store import JournalStore
    from polar_env.proxy.config import GatewayConfig
    from polar_env.proxy.gateway import Gateway as LiveGateway

    engine = EmbeddedEngine(policy=policy)
    store = JournalStore(capture_dir)
    gw = LiveGateway(engine, store, GatewayConfig(engine_model=engine.model_name))
    session = gw.open_session(metadata={"test": "e2e"})
    # unix socket paths are limited to ~107 bytes: pytest's tmp_path can be longer
    sock_dir = Path(tempfile.mkdtemp(prefix="polar-gw-"))
    # the sandbox's socket serves the provider routes only (as polar-env gateway --unix-socket does)
    try:
        sock = sock_dir / "gw.sock"
        await gw.start(port=None, unix_socket=sock)
        yield Gateway(sock, session.key, session.id, engine.model_name, store)
    finally:
        await gw.aclose()
        shutil.rmtree(sock_dir, ignore_errors=True)


# -- scripts -------------------------------------------------------------------------------------


def apply_patch_command(patch: str) -> str:
    """One line (harness shell tools wrap commands, which breaks heredocs): decode and git-apply."""
    blob = base64.b64encode(patch.encode()).decode()
    return f"cd /testbed && echo {blob} | base64 -d | git -c 'safe.directory=*' apply && git status --short"


def fixing_policy(task: SweTask) -> ScriptedPolicy:
    return ScriptedPolicy(steps=(
        ScriptStep(command=apply_patch_command(task.patch), reasoning="Apply the fix."),
        ScriptStep(text="Fixed. git status: {tool_output}", reasoning="Done."),
    ))


USELESS_POLICY = ScriptedPolicy(steps=(
    ScriptStep(command="cd /testbed && echo 'looked around' > NOTES.txt && ls", reasoning="Look around."),
    ScriptStep(text="I looked around: {tool_output}", reasoning="Done."),
))


# -- one rollout ---------------------------------------------------------------------------------


@dataclass
class Rollout:
    exit_code: int
    output: str
    diff: str
    records: list[Any]
    result: Any  # EvalResult
    timings: dict[str, float] = field(default_factory=dict)


def grading_spec(task: SweTask) -> Any:
    """A fresh sandbox on the task's repo. The host's /usr python has no pytest: bind this
    interpreter's prefix and put it first on PATH (as tests/evaluators does)."""
    from polar_env.runtimes import RuntimeSpec

    prefixes = sorted({sys.base_prefix, sys.prefix})
    return RuntimeSpec(kind="sandbox", source_dir=task.repo_dir, network="none",
                       binds=[(Path(p), p) for p in prefixes],
                       env={"PATH": f"{Path(sys.executable).parent}:{DEFAULT_PATH}"})


async def rollout(harness: HarnessSpec, api: ProviderAPI, task: SweTask, policy: ScriptedPolicy,
                  tmp: Path) -> Rollout:
    from polar_env.evaluators import EvalContext, run_evaluator
    from polar_env.runtimes import RuntimeSpec, make_runtime

    timings: dict[str, float] = {}
    started = time.monotonic()
    # harnesses that end by a command (mini-swe-agent) get it appended to the final answer
    async with gateway(policy_for(harness, policy), tmp / "capture") as gw:
        timings["gateway_start"] = time.monotonic() - started
        spec = with_harness(RuntimeSpec(kind="sandbox", source_dir=task.repo_dir, gateway_socket=gw.socket,
                                        gateway_port=GATEWAY_PORT), harness)
        runtime = make_runtime(spec)
        t = time.monotonic()
        await runtime.prepare()
        timings["agent_prepare"] = time.monotonic() - t
        try:
            t = time.monotonic()
            run = await run_harness(runtime, harness, api=api, key=gw.key, model=gw.model,
                                    prompt=task.problem_statement, timeout_s=HARNESS_TIMEOUT_S)
            timings["harness"] = time.monotonic() - t
            t = time.monotonic()
            diff = await runtime.diff()
            timings["diff"] = time.monotonic() - t
            ctx = EvalContext(task=task, runtime=runtime, exit_code=run.exit_code, timed_out=run.timed_out,
                              runtime_factory=lambda: make_runtime(grading_spec(task)))
            t = time.monotonic()
            result = await run_evaluator("swebench", ctx, timeout_s=300)
            timings["evaluate"] = time.monotonic() - t
        finally:
            await runtime.stop()
        records = gw.records()
    timings["total"] = time.monotonic() - started
    out = Rollout(run.exit_code, run.output, diff, records, result, {k: round(v, 2) for k, v in timings.items()})
    print(f"\n{harness.name}/{api.value}: exit {run.exit_code}, {len(records)} turns, "
          f"reward {result.reward}, timings {json.dumps(out.timings)}")
    return out


def _why(r: Rollout) -> str:
    report = {k: v for k, v in r.result.report.items() if k not in ("traceback",)}
    return f"harness output:\n{r.output[-3000:]}\ndiff:\n{r.diff}\nreport: {json.dumps(report, default=str)[:4000]}"


CASES = [("pi", ProviderAPI.OPENAI_CHAT), ("qwen_code", ProviderAPI.OPENAI_CHAT), ("mini_swe_agent", ProviderAPI.OPENAI_CHAT)]


@pytest.mark.parametrize(("name", "api"), CASES, ids=[f"{n}-{a.value}" for n, a in CASES])
async def test_harness_in_sandbox_fixes_toy_task(name: str, api: ProviderAPI, task: SweTask, tmp_path: Path,
                                                 sandbox_ready: None) -> None:
    harness = _harness(name)
    r = await rollout(harness, api, task, fixing_policy(task), tmp_path)
    assert r.exit_code == 0, _why(r)
    assert len(r.records) >= 2, _why(r)  # the tool call and the answer went through the gateway
    assert any(c.name for rec in r.records for c in rec.message.tool_calls), _why(r)
    assert "calc.py" in r.diff and "return None" in r.diff, _why(r)
    assert r.result.report.get("resolved") is True and r.result.reward == 1.0, _why(r)


async def test_useless_script_is_not_resolved(task: SweTask, tmp_path: Path, sandbox_ready: None) -> None:
    harness = _harness("pi")
    r = await rollout(harness, ProviderAPI.OPENAI_CHAT, task, USELESS_POLICY, tmp_path)
    assert r.exit_code == 0, _why(r)
    assert len(r.records) >= 2, _why(r)
    assert "NOTES.txt" in r.diff and "calc.py" not in r.diff, _why(r)
    # the diff was graded for real (eval script ran), and the failing test still fails
    assert r.result.reward == 0.0 and r.result.report.get("resolved") is False, _why(r)
    assert "FAIL_TO_PASS failed" in r.result.report.get("reason", ""), _why(r)


# -- network isolation ---------------------------------------------------------------------------

# Runs inside the sandbox. Refuses to try an outside address unless `lo` is the only interface, so a
# broken sandbox can never send traffic off the machine.
PROBE = r"""
import json, socket, sys, time, urllib.request
out = {"interfaces": sorted(n for _, n in socket.if_nameindex())}
def attempt(host, port):
    t = time.monotonic()
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.settimeout(2.0)
    try:
        s.connect((host, port))
        what = "connected"
    except OSError as e:
        what = type(e).__name__ + ":" + str(e.errno)
    finally:
        s.close()
    return [what, round(time.monotonic() - t, 3)]
if out["interfaces"] == ["lo"]:
    out["host_loopback"] = attempt("127.0.0.1", int(sys.argv[1]))
    out["outside"] = attempt("1.1.1.1", 80)
    with urllib.request.urlopen("http://127.0.0.1:%d/v1/models" % int(sys.argv[2]), timeout=10) as r:
        out["gateway"] = [r.status, json.load(r)["object"]]
print("PROBE " + json.dumps(out))
"""


async def test_sandbox_reaches_only_the_gateway(tmp_path: Path, sandbox_ready: None) -> None:
    from polar_env.runtimes import RuntimeSpec, make_runtime

    accepted: list[object] = []

    async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(writer.get_extra_info("peername"))
        writer.close()

    server = await asyncio.start_server(on_connect, "127.0.0.1", 0)
    host_port = server.sockets[0].getsockname()[1]
    try:
        async with gateway(ScriptedPolicy(), tmp_path / "capture") as gw:
            harness = _harness("pi")
            spec = with_harness(RuntimeSpec(kind="sandbox", gateway_socket=gw.socket, gateway_port=GATEWAY_PORT),
                                harness)
            runtime = make_runtime(spec)
            await runtime.prepare()
            try:
                await runtime.write_file("/tmp/probe.py", PROBE.encode())
                t = time.monotonic()
                res = await runtime.exec(["python3", "/tmp/probe.py", str(host_port), str(GATEWAY_PORT)], timeout_s=60)
                elapsed = time.monotonic() - t
            finally:
                await runtime.stop()
    finally:
        server.close()
        await server.wait_closed()
    line = next((ln for ln in res.output.splitlines() if ln.startswith("PROBE ")), None)
    assert res.exit_code == 0 and line is not None, res.output
    probe = json.loads(line.removeprefix("PROBE "))
    print(f"\nprobe {probe} in {elapsed:.2f}s")
    assert probe["interfaces"] == ["lo"], probe
    # the host's loopback is another network namespace: refused, and the host server saw nothing
    assert probe["host_loopback"][0] == "ConnectionRefusedError:111", probe
    assert accepted == []
    # no route out at all: fails at once (ENETUNREACH), not after the 2 s timeout
    assert probe["outside"][0] == "OSError:101" and probe["outside"][1] < 1.0, probe
    # while the gateway, through the relay, answers
    assert probe["gateway"] == [200, "list"], probe
