"""The TCP -> unix-socket relay on its own: foreground, --background and launch (``-- CMD``) modes,
byte-exact both ways with half-close, an absent gateway, and runnable as a lone copied file."""

from __future__ import annotations

import ast
import asyncio
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from aiohttp import ClientSession, web

from polar_env.runtimes import relay
from polar_env.runtimes.argv import RELAY_SOURCE


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def sock_dir() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="prl-"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
async def http_unix(sock_dir: Path) -> AsyncIterator[Path]:
    async def hello(request: web.Request) -> web.Response:
        return web.Response(text=f"hi {request.path}")

    async def stream(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse()
        await resp.prepare(request)
        for i in range(50):
            await resp.write(b"chunk%02d;" % i)
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_get("/stream", stream)
    app.router.add_get("/{tail:.*}", hello)
    runner = web.AppRunner(app)
    await runner.setup()
    path = sock_dir / "gw.sock"
    await web.UnixSite(runner, str(path)).start()
    yield path
    await runner.cleanup()


async def start_relay(*args: str, source: str | None = None) -> asyncio.subprocess.Process:
    cmd = [sys.executable, "-I", source] if source else [sys.executable, "-m", "polar_env.runtimes.relay"]
    return await asyncio.create_subprocess_exec(*cmd, *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)


async def wait_listening(port: int, timeout: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        try:
            _r, w = await asyncio.open_connection("127.0.0.1", port)
            w.close()
            await w.wait_closed()
            return
        except OSError:
            if loop.time() > deadline:
                raise
            await asyncio.sleep(0.05)


async def stop(proc: asyncio.subprocess.Process) -> bytes:
    if proc.returncode is None:
        proc.kill()
    _out, err = await proc.communicate()
    return err


async def test_foreground_relay_serves_http_and_streams(http_unix: Path) -> None:
    port = free_port()
    proc = await start_relay("--listen", f"127.0.0.1:{port}", "--socket", str(http_unix))
    try:
        await wait_listening(port)
        async with ClientSession() as http:
            for path in ("/a", "/b/c"):  # keep-alive: two requests on one connection
                async with http.get(f"http://127.0.0.1:{port}{path}") as r:
                    assert r.status == 200 and await r.text() == f"hi {path}"
            async with http.get(f"http://127.0.0.1:{port}/stream") as r:
                assert await r.read() == b"".join(b"chunk%02d;" % i for i in range(50))
    finally:
        await stop(proc)


async def test_half_close_and_bytes_are_exact(sock_dir: Path) -> None:
    """The client sends, shuts its write side; the server answers only after EOF, and closes."""
    path = sock_dir / "echo.sock"

    async def on_conn(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        data = await r.read()  # until EOF: needs the relay to forward the half-close
        w.write(data[::-1])
        await w.drain()
        w.close()

    server = await asyncio.start_unix_server(on_conn, str(path))
    port = free_port()
    proc = await start_relay("--listen", f"127.0.0.1:{port}", "--socket", str(path))
    try:
        await wait_listening(port)
        payload = bytes(range(256)) * 4096  # 1 MiB, every byte value
        r, w = await asyncio.open_connection("127.0.0.1", port)
        w.write(payload)
        await w.drain()
        w.write_eof()
        got = await asyncio.wait_for(r.read(), 10)
        assert got == payload[::-1]
        w.close()
        await w.wait_closed()
    finally:
        await stop(proc)
        server.close()
        await server.wait_closed()


async def test_absent_gateway_closes_the_client(sock_dir: Path) -> None:
    port = free_port()
    proc = await start_relay("--listen", f"127.0.0.1:{port}", "--socket", str(sock_dir / "nobody.sock"))
    try:
        await wait_listening(port)
        r, w = await asyncio.open_connection("127.0.0.1", port)
        assert await asyncio.wait_for(r.read(), 10) == b""  # closed at once, nothing sent
        w.close()
        await w.wait_closed()
    finally:
        err = await stop(proc)
    assert b"cannot reach" in err


async def test_launch_mode_binds_before_the_command_runs(http_unix: Path) -> None:
    """``-- CMD``: the port is bound before CMD starts, CMD keeps the pid and exit status."""
    port = free_port()
    code = (
        "import urllib.request, sys; "
        f"print(urllib.request.urlopen('http://127.0.0.1:{port}/launched', timeout=10).read().decode()); sys.exit(3)"
    )
    proc = await start_relay("--listen", f"127.0.0.1:{port}", "--socket", str(http_unix), "--", sys.executable, "-c", code)
    try:
        out, err = await asyncio.wait_for(proc.communicate(), 30)
        assert proc.returncode == 3, err
        assert out.decode() == "hi /launched\n"
    finally:
        # The forked relay child outlives CMD by design (inside a runtime it ends with the pid
        # namespace); on the host nothing ends it, so the test must, and prove it is gone.
        pid = kill_listener(port)
    assert pid is not None, "the detached relay child was not listening"
    assert_gone(pid, port)


async def test_background_mode_and_standalone_copy(http_unix: Path, tmp_path: Path) -> None:
    """A lone copy of relay.py (no polar_env on the path: python -I) returns once bound."""
    lone = tmp_path / "relay.py"
    shutil.copy(RELAY_SOURCE, lone)
    port = free_port()
    proc = await start_relay("--listen", f"127.0.0.1:{port}", "--socket", str(http_unix), "--background", source=str(lone))
    _out, err = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == 0, err
    async with ClientSession() as http, http.get(f"http://127.0.0.1:{port}/bg") as r:
        assert await r.text() == "hi /bg"
    # The detached child keeps serving; end it by its listening port's owner.
    pid = kill_listener(port)
    assert pid is not None, "the detached relay child was not listening"
    assert_gone(pid, port)


def listener_inode(port: int) -> str | None:
    with open("/proc/net/tcp") as f:
        for line in f.readlines()[1:]:
            parts = line.split()
            if parts[1].endswith(f":{port:04X}") and parts[3] == "0A":
                return parts[9]
    return None


def kill_listener(port: int) -> int | None:
    """Kill the process that owns 127.0.0.1:<port> (the relay child we started), by pid; its pid."""
    inode = listener_inode(port)
    if inode is None:
        return None
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}") == f"socket:[{inode}]":
                    os.kill(int(pid), signal.SIGKILL)
                    return int(pid)
            except OSError:
                continue
    return None


def assert_gone(pid: int, port: int, timeout_s: float = 10.0) -> None:
    """The killed relay child no longer runs (gone, or a zombie its new parent has yet to reap)
    and nothing listens on its port."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            state = "gone"
        if state in ("gone", "Z", "X") and listener_inode(port) is None:
            return
        assert time.monotonic() < deadline, f"relay child {pid} still {state} after SIGKILL"
        time.sleep(0.05)


async def test_port_in_use_is_reported() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        proc = await start_relay("--listen", f"127.0.0.1:{port}", "--socket", "/nonexistent.sock", "--background")
        _out, err = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == 125 and b"cannot listen" in err


def test_relay_is_stdlib_only() -> None:
    tree = ast.parse(RELAY_SOURCE.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, "relative import"
            names.add((node.module or "").split(".")[0])
    assert names and names <= set(sys.stdlib_module_names), names - set(sys.stdlib_module_names)


def test_parse_listen() -> None:
    assert relay.parse_listen("127.0.0.1:8100") == ("127.0.0.1", 8100)
    assert relay.parse_listen("[::1]:80") == ("::1", 80)
    with pytest.raises(Exception, match="HOST:PORT"):
        relay.parse_listen("8100x")
