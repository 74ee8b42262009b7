"""Isolation, tried from inside a real bubblewrap sandbox: a process holding one session's key can
reach that session's provider routes and nothing else. Session and admin routes do not exist on the
socket a sandbox gets (404), another session's routes refuse its key (401), and going around the
relay straight to the bound unix socket changes nothing. The engine is ``FakeEngine`` (a test
double); gateway, relay and sandbox are the real ones.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

from polar_env.journal.store import JournalStore
from polar_env.proxy.config import GatewayConfig
from polar_env.proxy.gateway import Gateway
from polar_env.runtimes import RuntimeSpec, make_runtime
from tests.conftest import require_bwrap
from tests.proxy.conftest import FakeEngine

PORT = 8100

# Runs inside the sandbox: each probe goes once through the relay (TCP) and once straight to the
# unix socket, and reports the HTTP status.
PROBE = r"""
import http.client, json, socket, sys
key, other, admin = sys.argv[1], sys.argv[2], sys.argv[3]
chat = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
class Unix(http.client.HTTPConnection):
    def connect(self):
        self.sock = socket.socket(socket.AF_UNIX)
        self.sock.connect("/run/polar/gw.sock")
def status(conn, method, path, headers, body=None):
    conn.request(method, path, body=body, headers={"Content-Type": "application/json", **headers})
    resp = conn.getresponse()
    resp.read()
    return resp.status
probes = {
    "own_chat": ("POST", "/v1/chat/completions", {"Authorization": "Bearer " + key}, chat),
    "own_prefixed": ("POST", "/s/%s/v1/chat/completions" % sys.argv[4], {"Authorization": "Bearer " + key}, chat),
    "other_prefixed": ("POST", "/s/%s/v1/chat/completions" % other, {"Authorization": "Bearer " + key}, chat),
    "made_up_key": ("POST", "/v1/chat/completions", {"Authorization": "Bearer sk-polar-guess"}, chat),
    "create_session": ("POST", "/sessions", {"Authorization": "Bearer " + admin}, "{}"),
    "other_completions": ("GET", "/sessions/%s/completions" % other, {"Authorization": "Bearer " + key}, None),
    "other_info": ("GET", "/sessions/%s" % other, {"Authorization": "Bearer " + admin}, None),
    "close_other": ("DELETE", "/sessions/%s" % other, {"Authorization": "Bearer " + admin}, None),
    "pause": ("POST", "/admin/pause?timeout_s=1", {"Authorization": "Bearer " + admin}, None),
    "status": ("GET", "/admin/status", {"Authorization": "Bearer " + admin}, None),
}
out = {}
for name, (method, path, headers, body) in probes.items():
    out[name] = [status(http.client.HTTPConnection("127.0.0.1", @PORT@, timeout=10), method, path, headers, body),
                 status(Unix("gw", timeout=10), method, path, headers, body)]
print("PROBE " + json.dumps(out))
""".replace("@PORT@", str(PORT))


async def test_sandboxed_process_reaches_only_its_own_provider_routes(tmp_path: Path) -> None:
    require_bwrap()
    engine = FakeEngine()
    gw = Gateway(engine, JournalStore(tmp_path / "capture"), GatewayConfig(engine_model="m"))
    mine = gw.open_session("mine")
    theirs = gw.open_session("theirs")
    # the admin token is handed in only to prove it does not help: sandboxes never get it
    admin = gw.config.admin_token or ""
    sock_dir = Path(tempfile.mkdtemp(prefix="pgw-"))
    try:
        await gw.start(port=None, unix_socket=sock_dir / "gw.sock")
        runtime = make_runtime(RuntimeSpec(kind="sandbox", gateway_socket=sock_dir / "gw.sock", gateway_port=PORT))
        await runtime.prepare()
        try:
            await runtime.write_file("/tmp/probe.py", PROBE.encode())
            res = await runtime.exec(["python3", "/tmp/probe.py", mine.key or "", theirs.id, admin, mine.id], timeout_s=60)
        finally:
            await runtime.stop()
    finally:
        await gw.aclose()
        shutil.rmtree(sock_dir, ignore_errors=True)
    line = next((ln for ln in res.output.splitlines() if ln.startswith("PROBE ")), None)
    assert res.exit_code == 0 and line is not None, res.output
    got = json.loads(line.removeprefix("PROBE "))
    expected = {"own_chat": 200, "own_prefixed": 200, "other_prefixed": 401, "made_up_key": 401,
                "create_session": 404, "other_completions": 404, "other_info": 404, "close_other": 404,
                "pause": 404, "status": 404}
    assert got == {name: [code, code] for name, code in expected.items()}, got  # relay and raw socket alike
    store = gw.store
    assert len(store.read("mine")) == 4 and store.read("theirs") == []
    assert gw.gate.paused is False and not gw.sessions.get("theirs").closed
    assert len(gw.sessions) == 2
