"""The sandboxes' socket takes a node's whole burst of connects (polar_env/proxy/gateway.py).

Past a full accept queue a non-blocking unix connect fails with EAGAIN, and asyncio's client takes
that for a connect in progress: the socket polls writable, SO_ERROR reads 0, and its first write
fails with ENOTCONN, so the harness's call is lost. With aiohttp's default queue of 128, 7 of 256
sessions were lost at bench_scale's full size. The queue must hold a node's sessions at once.
"""

from __future__ import annotations

import errno
import shutil
import socket
import tempfile
from pathlib import Path

import pytest

from polar_env.journal.store import JournalStore
from polar_env.proxy.config import GatewayConfig
from polar_env.proxy.gateway import UNIX_BACKLOG, Gateway
from tests.proxy.conftest import FakeEngine

BURST = 600  # more than aiohttp's default of 128, and than a node's 256 sessions


def _connect_burst(path: str, n: int) -> list[str]:
    """``n`` non-blocking connects while the server's loop cannot accept: what each one got."""
    got, socks = [], []
    for _ in range(n):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.setblocking(False)
        socks.append(s)
        try:
            s.connect(path)
            got.append("connected")
        except BlockingIOError:
            got.append("EAGAIN")
    for s in socks:
        s.close()
    return got


async def test_a_burst_of_connects_past_the_default_queue_is_queued(tmp_path: Path) -> None:
    assert UNIX_BACKLOG >= 1024
    gw = Gateway(FakeEngine(), JournalStore(tmp_path / "capture"), GatewayConfig(engine_model="m"))
    sock_dir = Path(tempfile.mkdtemp(prefix="pgw-"))  # short: a unix socket path has ~108 bytes
    path = str(sock_dir / "gw.sock")
    try:
        await gw.start(port=None, unix_socket=path)
        somaxconn = int(Path("/proc/sys/net/core/somaxconn").read_text())
        n = min(BURST, somaxconn)
        # the connects run on this loop's thread, so the gateway cannot accept until they are done:
        # only the kernel's accept queue holds them, as when the node's loop is busy with a call
        got = _connect_burst(path, n)
        assert got.count("EAGAIN") == 0, f"{got.count('EAGAIN')} of {n} connects refused by a full accept queue"
    finally:
        await gw.aclose()
        shutil.rmtree(sock_dir, ignore_errors=True)


def test_the_failure_it_prevents_is_real() -> None:
    """The mechanism above, on a plain socket with a small queue: EAGAIN, SO_ERROR 0, ENOTCONN."""
    sock_dir = Path(tempfile.mkdtemp(prefix="pbl-"))
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        server.bind(str(sock_dir / "s.sock"))
        server.listen(1)
        got = _connect_burst(str(sock_dir / "s.sock"), 8)
        assert "EAGAIN" in got
        late = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        late.setblocking(False)
        try:
            assert late.connect_ex(str(sock_dir / "s.sock")) == errno.EAGAIN
            assert late.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0  # what asyncio reads as "connected"
            with pytest.raises(OSError) as refused:  # its first write: the call is lost
                late.send(b"x")
            assert refused.value.errno == errno.ENOTCONN
        finally:
            late.close()
    finally:
        server.close()
        shutil.rmtree(sock_dir, ignore_errors=True)
