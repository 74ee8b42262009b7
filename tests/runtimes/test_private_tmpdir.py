"""Issue 23: a ``TMPDIR`` inside a 0700 folder (SLURM's and systemd's ``/tmp/job123/tmp``). As root,
every exec drops to the runtime's unprivileged uid and bwrap resolves its bind sources as that uid,
which cannot traverse the 0700 folder: every session failed in INIT with bwrap's "Can't find source
path", reported as "needs python3". Real bwrap, real uid drop, a real relay to a unix-socket server
placed where a node puts its gateway socket (``$TMPDIR/polar-node-*``)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from aiohttp import web

from polar_env.errors import ConfigError
from polar_env.runtimes import RuntimeSpec, SandboxRuntime, leftovers
from polar_env.runtimes.hostworkspace import drops_privileges
from polar_env.staging.node import NodeConfig, runtime_base
from tests.conftest import require_bwrap

PORT = 8100
GET = f"import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:{PORT}/hi', timeout=10).read().decode())"


@pytest.fixture
def private_tmpdir(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """``$TMPDIR`` = ``<job>/tmp`` with ``<job>`` 0700 and owned by root, as a job gets it."""
    require_bwrap()
    if not drops_privileges():
        pytest.skip("only root (with setpriv and unshare) drops to an unprivileged uid")
    job = Path(tempfile.mkdtemp(prefix="job", dir="/tmp"))  # not under pytest's own 0700 folder
    (job / "tmp").mkdir()
    job.chmod(0o700)
    monkeypatch.setenv("TMPDIR", str(job / "tmp"))
    monkeypatch.setattr(tempfile, "tempdir", None)  # gettempdir() reads TMPDIR again
    yield job / "tmp"
    shutil.rmtree(job, ignore_errors=True)


@pytest.fixture
async def node_socket(private_tmpdir: Path) -> AsyncIterator[Path]:
    """A server on a unix socket in a private folder under TMPDIR, as ``GatewayNode.start`` makes it."""
    async def hello(request: web.Request) -> web.Response:
        return web.Response(text=f"gateway says {request.path}")

    app = web.Application()
    app.router.add_get("/{tail:.*}", hello)
    runner = web.AppRunner(app)
    await runner.setup()
    sock = Path(tempfile.mkdtemp(prefix="polar-node-")) / "gw.sock"
    assert sock.is_relative_to(private_tmpdir)
    await web.UnixSite(runner, str(sock)).start()
    try:
        yield sock
    finally:
        await runner.cleanup()


def as_uid(uid: int, *argv: str) -> subprocess.CompletedProcess[str]:
    drop = ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--"]
    return subprocess.run([*drop, *argv], capture_output=True, text=True, check=False)


@pytest.mark.slow
async def test_sessions_run_under_a_private_tmpdir_and_stay_apart(private_tmpdir: Path, node_socket: Path) -> None:
    base = runtime_base(NodeConfig())
    assert base.is_relative_to(private_tmpdir)
    inc = leftovers.claim(base, "node-0")
    spec = RuntimeSpec(kind="sandbox", gateway_socket=node_socket, gateway_port=PORT, source_dir=None)
    one, two = SandboxRuntime(spec, root_dir=inc.path), SandboxRuntime(spec, root_dir=inc.path)
    try:
        await one.prepare()  # INIT: the relay starts, the git baseline is made
        await two.prepare()
        res = await one.exec(["python3", "-c", GET], timeout_s=60)
        assert res.exit_code == 0 and "gateway says /hi" in res.output, res.output
        await one.write_file("/testbed/secret.txt", b"mine\n")
        assert "secret.txt" in await one.diff()
        for rt in (one, two):
            assert rt.uid is not None and rt.root.is_relative_to(private_tmpdir)
            assert rt._stage_base is not None and not rt._stage_base.is_relative_to(private_tmpdir)
            st = os.stat(rt._stage_base)
            assert (st.st_uid, st.st_mode & 0o777) == (rt.uid, 0o700)
            assert (os.stat(rt.root).st_uid, os.stat(rt.root).st_mode & 0o777) == (rt.uid, 0o700)
        assert one.uid != two.uid
        # the other session's uid reaches neither this session's folder nor its stage
        assert one._stage_base is not None and two.uid is not None
        for path in (one.root / "workspace" / "secret.txt", one._stage_base):
            denied = as_uid(two.uid, "cat" if path.name == "secret.txt" else "ls", str(path))
            assert denied.returncode != 0 and "Permission denied" in denied.stderr, denied
        stages = [one._stage_base, two._stage_base]
    finally:
        await one.stop()
        await two.stop()
        inc.release()
    assert not any(s is not None and s.exists() for s in stages)


async def test_an_unreachable_bind_source_is_named_not_python3(private_tmpdir: Path, node_socket: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """What INIT said before the fix: with nothing staged, bwrap (as the dropped uid) cannot find its
    bind sources under the 0700 folder; the error names that folder and the fix, not python3."""
    monkeypatch.setattr("polar_env.runtimes.hostworkspace.reachable", lambda path, uid: True)  # stage nothing
    rt = SandboxRuntime(RuntimeSpec(kind="sandbox", gateway_socket=node_socket, gateway_port=PORT))
    with pytest.raises(ConfigError) as err:
        await rt.prepare()
    message = str(err.value)
    job = private_tmpdir.parent
    assert "python3" not in message, message
    assert f"{job} (mode 0700, owner uid 0) is not traversable by it" in message, message
    assert "Can't find source path" not in message and "TMPDIR=" in message and "\n" not in message, message


async def test_no_traversable_stage_dir_is_one_line_before_any_exec(private_tmpdir: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("polar_env.runtimes.hostworkspace.stage_parent", lambda: None)
    rt = SandboxRuntime(RuntimeSpec(kind="sandbox"))
    with pytest.raises(ConfigError, match=r"keeps the runtime's uid \d+ from .*TMPDIR=/tmp.*chmod o\+x"):
        await rt.prepare()
    assert not list(private_tmpdir.glob("polar-sandbox-*"))  # cleaned up


def test_sweep_finds_a_dead_runtimes_stage_outside_the_private_tmpdir(private_tmpdir: Path) -> None:
    """The stage of a runtime under a private TMPDIR sits in /tmp; the next node's sweep clears it."""
    base = runtime_base(NodeConfig())
    code = ("import sys; from pathlib import Path; from polar_env.runtimes import leftovers; "
            "inc = leftovers.claim(Path(sys.argv[1]), 'node-0'); (inc.path / sys.argv[2]).mkdir(); print(inc.path)")
    name = f"polar-sandbox-{os.getpid()}dead"
    stage = Path("/tmp") / f"polar-stage-{name}"
    (stage / "r").mkdir(parents=True)
    out = subprocess.run([sys.executable, "-c", code, str(base), name], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    dead = out.stdout.strip()  # its process has exited: its lock is free
    assert leftovers.sweep(base) == [dead]
    assert not stage.exists() and not Path(dead).exists()
