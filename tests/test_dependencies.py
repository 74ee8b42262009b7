"""The dependency split: everything but the embedded engine imports and runs without torch and
transformers (users install polar_env next to vLLM, SGLang or Megatron, each with its own torch),
and asking for the embedded engine without its extra is one line naming the install command.

Each check runs in a fresh interpreter in which ``torch``, ``transformers`` and ``safetensors``
cannot be imported (a ``sys.meta_path`` blocker installed before anything else), as on a machine
where they are not installed.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # fresh interpreters and rollouts without torch

REPO_ROOT = Path(__file__).resolve().parents[1]
BLOCKED = ("torch", "transformers", "safetensors")

BLOCKER = f"""
import sys

class NotInstalled:
    '''Import finder that reports {BLOCKED} as not installed.'''
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {BLOCKED!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None

sys.meta_path.insert(0, NotInstalled())
sys.path[:0] = [{str(REPO_ROOT)!r}, {str(REPO_ROOT / "tests")!r}]
"""


def run_without_torch(code: str, tmp_path: Path, timeout_s: float = 120) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "no_torch.py"
    script.write_text(BLOCKER + textwrap.dedent(code))
    return subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=timeout_s,
                          cwd=tmp_path, check=False)


def test_blocker_really_blocks(tmp_path: Path) -> None:
    proc = run_without_torch("import torch\n", tmp_path)
    assert proc.returncode == 1 and "ModuleNotFoundError: No module named 'torch'" in proc.stderr


def test_gateway_trajectories_runtimes_evaluators_run_without_torch(tmp_path: Path) -> None:
    """A real gateway app in front of FakeVLLM (a named test double of a vLLM server): one session,
    one captured chat call, trajectories built from the journal, a runtime made, an evaluator run."""
    proc = run_without_torch(
        f"""
        import asyncio
        from pathlib import Path

        from aiohttp.test_utils import TestClient, TestServer
        from fake_engines import MODEL, fake_vllm_app

        import polar_env
        from polar_env.engines.config import VLLMEngineConfig
        from polar_env.evaluators import EvalContext, run_evaluator
        from polar_env.journal.store import JournalStore
        from polar_env.proxy.config import GatewayConfig
        from polar_env.proxy.gateway import Gateway
        from polar_env.runtimes import RuntimeSpec, make_runtime
        from polar_env.tasks import toy
        from polar_env.trajectory.builders import BUILDERS

        async def main():
            engine_server = TestServer(fake_vllm_app())
            await engine_server.start_server()
            store = JournalStore(Path({str(tmp_path / "capture")!r}))
            engine = VLLMEngineConfig(url=str(engine_server.make_url("/v1")), model=MODEL).build()
            gw = Gateway(engine, store, GatewayConfig(engine_model=MODEL))
            admin = {{"Authorization": f"Bearer {{gw.config.admin_token}}"}}
            gateway = TestClient(TestServer(gw.app))
            await gateway.start_server()
            try:
                session = await (await gateway.post("/sessions", json={{"session_id": "nt"}}, headers=admin)).json()
                resp = await gateway.post("/v1/messages", json={{"model": "claude", "max_tokens": 64,
                    "messages": [{{"role": "user", "content": "weather?"}}]}}, headers={{"x-api-key": session["key"]}})
                assert resp.status == 200, await resp.text()
                assert (await resp.json())["content"][-1]["type"] == "tool_use"
            finally:
                await gateway.close()
                await engine_server.close()
            records = store.read("nt")
            assert len(records) == 1 and records[0].response_ids
            for name, build in BUILDERS.items():
                assert build(records).status.value == "completed", name
            runtime = make_runtime(RuntimeSpec())
            result = await run_evaluator("output", EvalContext(task={{}}, params={{"regex": "42"}}, final_answer="42"))
            assert result.reward == 1.0, result
            print("ok", type(runtime).__name__, toy.toy_tasks.__name__)

        asyncio.run(main())
        loaded = sorted(m for m in sys.modules if m.split(".")[0] in {BLOCKED!r})
        assert not loaded, loaded
        """,
        tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("ok "), proc.stdout


@pytest.mark.parametrize(
    "argv",
    [["demo"], ["engine"], ["gateway", "--store", "s"], ["verify", "--store", "s"], ["export-model", "m"]],
    ids=lambda argv: argv[0],
)
def test_embedded_engine_without_the_extra_is_one_line(argv: list[str], tmp_path: Path) -> None:
    (tmp_path / "s").mkdir()
    (tmp_path / "s" / "a.jsonl").write_bytes(b"")
    proc = run_without_torch(f"from polar_env.cli import main\nraise SystemExit(main({argv!r}))\n", tmp_path)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-3000:]
    assert lines[0].startswith(f"polar-env {argv[0]}: error: polar-env {argv[0]} needs the 'embedded' extra"), lines
    assert "pip install -e '.[embedded]'" in lines[0] and "download.pytorch.org/whl/cpu" in lines[0]


def test_torch_is_an_extra_with_a_lower_bound() -> None:
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    core = " ".join(project["dependencies"])
    assert all(name not in core for name in BLOCKED), core
    embedded = project["optional-dependencies"]["embedded"]
    torch_req = next(r for r in embedded if r.startswith("torch"))
    assert ">=" in torch_req and "==" not in torch_req and "<" not in torch_req, torch_req
    assert "polar-env[embedded]" in project["optional-dependencies"]["dev"]  # the tests need the engine


def test_staged_rollouts_run_without_torch(tmp_path: Path) -> None:
    """PolarEnv and the staging pipeline (a node, the loop harness, the simulated engine test double,
    a SimulatedRuntime test double) import and roll out with torch unimportable."""
    proc = run_without_torch(
        f"""
        import asyncio, sys
        from pathlib import Path

        from polar_env import PolarEnvConfig, TaskRequest
        from polar_env.testing.simulated_runtime import SimulatedRuntime
        from polar_env.staging.node import GatewayNode, NodeConfig
        from polar_env.staging.server import LocalNode, RolloutServer

        class SimNode(GatewayNode):
            def make_runtime(self, spec, session_id, **options):
                return SimulatedRuntime(spec)

        async def main():
            config = NodeConfig(engine={{"kind": "simulated", "latency_s": 0.0}}, store=Path({str(tmp_path / "s")!r}),
                                tcp_port=None)
            node = SimNode(config)
            await node.start()
            server = RolloutServer([LocalNode(node)])
            status = await server.run(TaskRequest(task_id="t", instruction="run echo hi", num_samples=2,
                                                  agent={{"harness": "loop"}},
                                                  evaluator={{"name": "output", "regex": "printed"}}))
            await server.aclose()
            print([r.reward for r in status.results], [m for m in ("torch", "ray") if m in sys.modules])

        asyncio.run(main())
        """,
        tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "[1.0, 1.0] []"
