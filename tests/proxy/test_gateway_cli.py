"""``polar-env gateway`` as a process: the admin token is created 0600 in the store and named in the
ready line, the control plane refuses requests without it, and the unix socket (what sandboxes
reach) serves no control plane at all."""

from __future__ import annotations

import json
import os
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
from pathlib import Path

from polar_env import eventloop
from tests.conftest import REPO_ROOT


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _unix_get(path: str, url: str, headers: dict[str, str]) -> int:
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(path)
        head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        s.sendall(f"GET {url} HTTP/1.1\r\nHost: x\r\n{head}Connection: close\r\n\r\n".encode())
        return int(s.recv(4096).split(b" ", 2)[1])


def test_gateway_process_admin_token_and_sandbox_socket(tmp_path: Path, fake_vllm: str) -> None:
    port = _free_port()
    sock_dir = Path(tempfile.mkdtemp(prefix="polar-gw-"))
    sock = sock_dir / "gw.sock"
    store = tmp_path / "store"
    proc = subprocess.Popen(
        [sys.executable, "-m", "polar_env.cli", "gateway", "--port", str(port), "--engine", "vllm",
         "--engine-url", fake_vllm, "--store", str(store), "--unix-socket", str(sock), "--engine-timeout", "5"],
        cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        token_file = store / "admin_token"
        assert "ready" in line and str(token_file) in line, line
        assert f"{eventloop.loop_name()} loop" in line, line  # uvloop where installed (polar_env/eventloop.py)
        assert stat.S_IMODE(os.stat(token_file).st_mode) == 0o600
        token = token_file.read_text().strip()
        base = f"http://127.0.0.1:{port}"
        try:
            urllib.request.urlopen(urllib.request.Request(f"{base}/sessions", data=b"{}", method="POST"), timeout=10)
            raise AssertionError("POST /sessions without the admin token was accepted")
        except urllib.error.HTTPError as exc:
            assert exc.code == 401
        req = urllib.request.Request(f"{base}/sessions", data=b"{}", method="POST",
                                     headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=10) as resp:
            assert resp.status == 201 and json.load(resp)["key"].startswith("sk-polar-")
        auth = {"Authorization": f"Bearer {token}"}
        assert _unix_get(str(sock), "/admin/status", auth) == 404
        assert _unix_get(str(sock), "/v1/models", {}) == 200
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=20)
        if proc.stdout is not None:
            proc.stdout.close()
        for p in sock_dir.iterdir():
            p.unlink()
        sock_dir.rmdir()
    assert proc.returncode == 0


VLLM_BODY = (b'{"model":"m","prompt_token_ids":[1,2,3],"choices":[{"index":0,"message":{"role":"assistant","content":"ok"},'
             b'"logprobs":{"content":[{"token":"o","logprob":-0.5},{"token":"k","logprob":-0.25}]},'
             b'"finish_reason":"stop","stop_reason":null,"token_ids":[4,248046]}]}')


async def test_gateway_process_outlives_a_1024_fd_limit(tmp_path: Path) -> None:
    """Finding 5, end to end: 1,100 undeleted sessions against a gateway started with
    ``ulimit -n 1024`` (it used to stop accepting at ~1,000). The engine is a test double: a
    fixed vLLM-shaped answer."""
    import asyncio
    import resource

    import aiohttp
    from aiohttp import web

    async def chat(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(body=VLLM_BODY, content_type="application/json")

    async def models(request: web.Request) -> web.Response:  # the gateway's start-up engine check
        return web.json_response({"object": "list", "data": [{"id": "polar-tiny-qwen3", "object": "model"}]})

    engine_app = web.Application()
    engine_app.router.add_post("/v1/chat/completions", chat)
    engine_app.router.add_get("/v1/models", models)
    runner = web.AppRunner(engine_app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    engine_url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]
    port = _free_port()

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (1024, 1024))

    proc = subprocess.Popen(
        [sys.executable, "-m", "polar_env.cli", "gateway", "--port", str(port), "--engine", "vllm", "--engine-url", engine_url,
         "--store", str(tmp_path / "store"), "--admin-token", "adm"],
        cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, preexec_fn=limit,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        assert proc.stdout is not None
        assert b"ready" in await asyncio.to_thread(proc.stdout.readline)
        ok = 0
        timeout = aiohttp.ClientTimeout(total=10)
        async with aiohttp.ClientSession(timeout=timeout) as http:
            sem = asyncio.Semaphore(16)

            async def one() -> None:
                nonlocal ok
                async with sem:
                    async with http.post(f"{base}/sessions", json={}, headers={"Authorization": "Bearer adm"}) as resp:
                        key = (await resp.json())["key"]
                    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
                    async with http.post(f"{base}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}) as resp:
                        await resp.read()
                        ok += resp.status == 200

            await asyncio.gather(*(one() for _ in range(1100)))
            fds = len(os.listdir(f"/proc/{proc.pid}/fd"))
            async with http.get(f"{base}/health") as resp:
                assert resp.status == 200
        assert ok == 1100 and fds < 200, (ok, fds)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=20)
        if proc.stdout is not None:
            proc.stdout.close()
        await runner.cleanup()
