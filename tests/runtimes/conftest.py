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
import shutil
import socket
import struct
import subprocess
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from polar_env.runtimes import ApptainerRuntime, DockerRuntime, RuntimeSpec, SandboxRuntime
from tests.conftest import DOCKER_IMAGE, IN_CI, REPO_ROOT, require_bwrap, unavailable  # noqa: F401

FAKE_APPTAINER = REPO_ROOT / "tests" / "fixtures" / "runtimes" / "fake_apptainer"
GATEWAY_PORT = 8100  # the port the relay listens on inside every runtime
GIT = ["git", "-c", "user.name=t", "-c", "user.email=t@example.invalid", "-c", "init.defaultBranch=main"]

VARIANTS = ["sandbox-host", "sandbox-rootfs", "docker", "apptainer-fake"]


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
