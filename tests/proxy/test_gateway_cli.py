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
