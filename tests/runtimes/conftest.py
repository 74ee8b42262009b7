"""Fixtures for the runtime tests: a task repo, a real gateway stand-in on a unix socket, a rootfs,
a private dockerd, and one factory that builds every runtime variant.

Availability policy: locally, variants whose prerequisites are missing are skipped with the reason
(bwrap not installed, no cached rootfs, no dockerd). With ``CI`` set they must run: the fixtures
build the rootfs (scripts/build_rootfs.sh) and start dockerd (scripts/start_dockerd.sh) themselves
and *fail* if they cannot. ``POLAR_BUILD_ROOTFS=1`` / ``POLAR_START_DOCKERD=1`` opt in locally.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import shutil
import socket
import struct
import subprocess
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from polar_env.runtimes import ApptainerRuntime, DockerRuntime, RuntimeSpec, SandboxRuntime
from polar_env.runtimes.docker import unix_daemon_problem

REPO_ROOT = Path(__file__).resolve().parents[2]
BUILD_ROOTFS = REPO_ROOT / "scripts" / "build_rootfs.sh"
START_DOCKERD = REPO_ROOT / "scripts" / "start_dockerd.sh"
FAKE_APPTAINER = REPO_ROOT / "tests" / "fixtures" / "runtimes" / "fake_apptainer"
DOCKER_IMAGE = os.environ.get("POLAR_ROOTFS_TAG", "polar-test/py:bookworm")
GATEWAY_PORT = 8100  # the port the relay listens on inside every runtime
IN_CI = bool(os.environ.get("CI"))
GIT = ["git", "-c", "user.name=t", "-c", "user.email=t@example.invalid", "-c", "init.defaultBranch=main"]

VARIANTS = ["sandbox-host", "sandbox-rootfs", "docker", "apptainer-fake"]


def unavailable(reason: str) -> None:
    """Skip locally; fail in CI, where every runtime variant must run."""
    if IN_CI:
        pytest.fail(f"CI is set but a runtime prerequisite is missing: {reason}", pytrace=False)
    pytest.skip(reason)


# ----- timings report ------------------------------------------------------------------------------
@dataclass
class TimingLog:
    rows: dict[str, list[tuple[float, float]]] = field(default_factory=dict)

    def add(self, variant: str, prepare_s: float, stop_s: float) -> None:
        self.rows.setdefault(variant, []).append((prepare_s, stop_s))


TIMINGS = TimingLog()


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if not TIMINGS.rows:
        return
    terminalreporter.write_sep("-", "runtime prepare/stop times (s): median [min-max] over n runtimes")
    for variant, rows in sorted(TIMINGS.rows.items()):
        prep = sorted(r[0] for r in rows)
        stop = sorted(r[1] for r in rows)
        terminalreporter.write_line(
            f"{variant:16s} n={len(rows):3d}  prepare {prep[len(prep) // 2]:.3f} [{prep[0]:.3f}-{prep[-1]:.3f}]"
            f"  stop {stop[len(stop) // 2]:.3f} [{stop[0]:.3f}-{stop[-1]:.3f}]"
        )


# ----- task repo -----------------------------------------------------------------------------------
def git(cwd: Path, *args: str) -> str:
    return subprocess.run([*GIT, *args], cwd=cwd, check=True, capture_output=True, text=True).stdout


@pytest.fixture
def task_repo(tmp_path: Path) -> Path:
    """A committed git repo: text files, a subdirectory, a binary file and an ignored file."""
    repo = tmp_path / "repo"
    (repo / "pkg").mkdir(parents=True)
    (repo / "calc.py").write_text("def add(a, b):\n    return a + b\n")
    (repo / "pkg" / "mod.py").write_text("X = 1\n")
    (repo / "blob.bin").write_bytes(bytes(range(256)))
    (repo / ".gitignore").write_text("*.log\n")
    git(repo, "init", "-q")
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "base")
    return repo


# ----- gateway stand-in ----------------------------------------------------------------------------
@dataclass
class Gateway:
    socket_path: Path
    tcp_port: int  # the same server, also on the host's 127.0.0.1
    hits: list[str]


@pytest.fixture
async def gateway() -> AsyncIterator[Gateway]:
    """A real aiohttp server on a unix socket (what runtimes bridge in) and on host 127.0.0.1:<port>."""
    hits: list[str] = []

    async def hello(request: web.Request) -> web.Response:
        hits.append(request.path)
        return web.Response(text=f"hello from the gateway {request.path}")

    async def echo(request: web.Request) -> web.Response:
        body = await request.read()
        return web.Response(body=body[::-1])

    app = web.Application()
    app.router.add_get("/{tail:.*}", hello)
    app.router.add_post("/echo", echo)
    runner = web.AppRunner(app)
    await runner.setup()
    sock_dir = Path(tempfile.mkdtemp(prefix="pgw-"))  # short: unix socket paths are limited to 108 bytes
    sock = sock_dir / "gw.sock"
    await web.UnixSite(runner, str(sock)).start()
    tcp = web.TCPSite(runner, "127.0.0.1", 0)
    await tcp.start()
    port = tcp._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    assert port != GATEWAY_PORT
    try:
        yield Gateway(sock, port, hits)
    finally:
        await runner.cleanup()
        shutil.rmtree(sock_dir, ignore_errors=True)


def host_ipv4_addresses() -> list[str]:
    """This host's own non-loopback IPv4 addresses (connecting to them never leaves the machine)."""
    out = []
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        for _idx, name in socket.if_nameindex():
            if name == "lo":
                continue
            with contextlib.suppress(OSError):
                raw = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))  # SIOCGIFADDR
                out.append(socket.inet_ntoa(raw[20:24]))
    finally:
        s.close()
    return out


# ----- rootfs and dockerd --------------------------------------------------------------------------
def _rootfs_path() -> Path:
    out = subprocess.run(["bash", str(BUILD_ROOTFS), "--print"], check=True, capture_output=True, text=True).stdout
    return Path(out.strip().splitlines()[-1])


@pytest.fixture(scope="session")
def rootfs() -> Path:
    """The debootstrap bookworm rootfs (python3, pytest, git); built here only in CI or on request."""
    path = _rootfs_path()
    if (path / ".polar-complete").exists():
        return path
    if not (IN_CI or os.environ.get("POLAR_BUILD_ROOTFS")):
        pytest.skip(f"no cached rootfs at {path}; run scripts/build_rootfs.sh (or set POLAR_BUILD_ROOTFS=1)")
    if os.geteuid() != 0:
        unavailable("building the rootfs needs root (debootstrap)")
    proc = subprocess.run(["bash", str(BUILD_ROOTFS)], capture_output=True, text=True, timeout=1200, check=False)
    if proc.returncode != 0 or not (path / ".polar-complete").exists():
        unavailable(f"scripts/build_rootfs.sh failed: {proc.stderr[-2000:]}")
    return path


def _docker_client() -> Any:
    import docker

    client = docker.from_env()
    client.ping()
    return client


@pytest.fixture(scope="session")
def docker_host(request: pytest.FixtureRequest) -> Iterator[str]:
    """A reachable Docker daemon with the test image; starts a private dockerd when needed."""
    try:
        import docker  # noqa: F401
    except ImportError:
        unavailable("the docker SDK is not installed (pip install 'docker>=7')")
    started = False
    saved = os.environ.get("DOCKER_HOST")
    problem = unix_daemon_problem()
    if problem is not None:
        can_start = shutil.which("dockerd") is not None or IN_CI or os.environ.get("POLAR_START_DOCKERD")
        if not can_start:
            unavailable(f"no Docker daemon ({problem}) and no dockerd; run scripts/start_dockerd.sh")
        if os.geteuid() != 0:
            unavailable("starting dockerd needs root")
        proc = subprocess.run(["bash", str(START_DOCKERD)], capture_output=True, text=True, timeout=300, check=False)
        if proc.returncode != 0:
            unavailable(f"scripts/start_dockerd.sh failed: {proc.stderr[-2000:]}")
        export = proc.stdout.strip().splitlines()[-1]
        assert export.startswith("export DOCKER_HOST="), export
        os.environ["DOCKER_HOST"] = export.split("=", 1)[1]
        started = "starting dockerd" in proc.stderr  # not when it reused one already running
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
    if started:
        subprocess.run(["bash", str(START_DOCKERD), "--stop"], capture_output=True, timeout=120, check=False)
        if saved is None:
            os.environ.pop("DOCKER_HOST", None)
        else:
            os.environ["DOCKER_HOST"] = saved


def require_bwrap() -> None:
    if shutil.which("bwrap") is None:
        unavailable("bubblewrap is not installed (apt-get install -y bubblewrap)")


# ----- the runtime factory -------------------------------------------------------------------------
RuntimeFactory = Callable[..., Any]


@pytest.fixture(params=VARIANTS)
def variant(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def make_spec(variant: str, request: pytest.FixtureRequest) -> Callable[..., RuntimeSpec]:
    """RuntimeSpec for this variant; keyword overrides are passed through."""
    if variant in ("sandbox-host", "sandbox-rootfs", "apptainer-fake"):
        require_bwrap()
    image: str | None = None
    kind = {"sandbox-host": "sandbox", "sandbox-rootfs": "sandbox", "docker": "docker", "apptainer-fake": "apptainer"}[variant]
    if variant in ("sandbox-rootfs", "apptainer-fake"):
        image = str(request.getfixturevalue("rootfs"))
    elif variant == "docker":
        request.getfixturevalue("docker_host")
        image = DOCKER_IMAGE

    def build(**kw: Any) -> RuntimeSpec:
        fields: dict[str, Any] = {"kind": kind, "image": image, "gateway_port": GATEWAY_PORT, **kw}
        return RuntimeSpec(**fields)

    return build


@pytest.fixture
async def runtimes(variant: str, make_spec: Callable[..., RuntimeSpec]) -> AsyncIterator[RuntimeFactory]:
    """``await runtimes(**spec_fields)`` -> a prepared runtime of this variant; all are stopped after
    the test and their prepare/stop times are logged for the summary."""
    made: list[Any] = []

    async def build(**kw: Any) -> Any:
        spec = make_spec(**kw)
        rt: Any
        if spec.kind == "sandbox":
            rt = SandboxRuntime(spec)
        elif spec.kind == "docker":
            rt = DockerRuntime(spec)
        else:
            rt = ApptainerRuntime(spec, binary=str(FAKE_APPTAINER))
        made.append(rt)
        await rt.prepare()
        return rt

    try:
        yield build
    finally:
        for rt in made:
            t0 = time.monotonic()
            await rt.stop()
            if rt.timings.prepare_s:
                TIMINGS.add(variant, rt.timings.prepare_s, rt.timings.stop_s or (time.monotonic() - t0))
        await asyncio.sleep(0)
