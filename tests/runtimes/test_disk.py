"""The disk bound is the kernel's (a sized tmpfs on the runtime root, as root) and teardown cannot
fail or stall: real bubblewrap sessions against the bypasses the watchdog walk missed (a file
deleted while held open, many directories), a 3,000-level tree removed by ``stop()`` with and
without the tmpfs, and ``leftovers.sweep`` clearing a dead node's mounted, deep runtime folder."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from polar_env.runtimes import RuntimeSpec, SandboxRuntime, diskfs, leftovers
from tests.conftest import require_bwrap

MIB = 1024 * 1024
DEEP = 3000
# writes until the disk refuses, unlinks the file, keeps it open and sleeps (the watchdog walk saw nothing)
HELD_OPEN = ("import os, time\n"
             "f = open('/tmp/held', 'wb'); n = 0\n"
             "try:\n"
             "    while n < 200 * 2**20: f.write(b'x' * 2**20); f.flush(); n += 2**20\n"
             "except OSError as e: print('stopped', e.errno, flush=True)\n"
             "os.unlink('/tmp/held'); print('written', n, flush=True); time.sleep(30)\n")
MANY_DIRS = ("import os\ni = 0\n"
             "try:\n"
             "    while i < 100000: os.mkdir(f'/testbed/d{i}'); i += 1\n"
             "except OSError as e: print('stopped', e.errno)\n"
             "print('made', i)\n")
DEEP_TREE = (f"import os\nfor i in range({DEEP}):\n"
             "    os.mkdir('d'); os.chdir('d')\n"
             "    if i % 1000 == 999: os.chmod('..', 0o500)\n"
             "open('bottom', 'w').write('x')\nprint('deep', flush=True)\n")


def _need_tmpfs() -> None:
    why = diskfs.tmpfs_wanted()
    if why is not None:
        pytest.skip(f"no tmpfs bound here: {why}")


def _py(code: str) -> str:
    return "python3 -c " + shlex.quote(code)


@pytest.mark.slow
async def test_tmpfs_bounds_a_file_deleted_while_held_open(tmp_path: Path) -> None:
    require_bwrap()
    _need_tmpfs()
    rt = SandboxRuntime(RuntimeSpec(network="none", disk_mb=32), root_dir=tmp_path)
    await rt.prepare()
    try:
        assert rt.limits_report()["mechanisms"]["disk_mb"].startswith("tmpfs size=32m")
        res = await rt.exec(_py(HELD_OPEN), timeout_s=60)
        assert "stopped 28" in res.output, res.output  # ENOSPC from the kernel
        written = int(res.output.split("written ")[1].split()[0])
        assert written <= 32 * MIB
        assert res.limit is not None and res.limit.startswith("disk_mb=32 (tmpfs") and not res.timed_out
    finally:
        await rt.stop()
    assert not any(tmp_path.iterdir())


@pytest.mark.slow
async def test_tmpfs_bounds_inodes_of_many_directories(tmp_path: Path) -> None:
    require_bwrap()
    _need_tmpfs()
    rt = SandboxRuntime(RuntimeSpec(network="none", disk_mb=16), root_dir=tmp_path)
    await rt.prepare()
    try:
        res = await rt.exec(_py(MANY_DIRS), timeout_s=60)
        made = int(res.output.split("made ")[1].split()[0])
        assert "stopped 28" in res.output and made < diskfs.inodes_for(16), res.output
        assert res.limit is not None and "inodes exhausted" in res.limit
    finally:
        await rt.stop()


@pytest.mark.slow
@pytest.mark.parametrize("tmpfs", [True, False])
async def test_stop_removes_a_3000_level_tree(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tmpfs: bool) -> None:
    require_bwrap()
    if tmpfs:
        _need_tmpfs()
    else:
        monkeypatch.setenv("POLAR_DISK_TMPFS", "0")
    rt = SandboxRuntime(RuntimeSpec(network="none", disk_mb=64), root_dir=tmp_path)
    await rt.prepare()
    root = rt.root
    try:
        assert (root in map(Path, diskfs.mounts_under(tmp_path))) is tmpfs
        res = await rt.exec(_py(DEEP_TREE), timeout_s=120)
        assert "deep" in res.output, res.output
    finally:
        await rt.stop()
    assert not root.exists() and not diskfs.mounts_under(tmp_path)


def _deep(top: Path, levels: int) -> None:
    fd = os.open(top, os.O_DIRECTORY)
    for i in range(levels):
        os.mkdir("d", dir_fd=fd)
        child = os.open("d", os.O_DIRECTORY, dir_fd=fd)
        if i == levels // 2:
            os.chmod("d", 0, dir_fd=fd)  # what the agent may leave: a directory no one may enter
        os.close(fd)
        fd = child
    os.close(fd)


def test_remove_tree_has_no_depth_limit(tmp_path: Path) -> None:
    top = tmp_path / "t"
    top.mkdir()
    _deep(top, DEEP)
    (top / "f").write_text("x")
    os.symlink("/etc", top / "link")
    assert diskfs.remove_tree(top) is None
    assert not top.exists() and Path("/etc").is_dir()


_DEAD_NODE = """
import os, sys, time
from pathlib import Path
from polar_env.runtimes import diskfs, leftovers
inc = leftovers.claim(Path(sys.argv[1]), "node-0")
runtime = inc.path / "polar-sandbox-dead"
runtime.mkdir()
assert diskfs.mount_tmpfs(runtime, 64) is None
fd = os.open(runtime, os.O_DIRECTORY)
for i in range(3000):
    os.mkdir("d", dir_fd=fd); child = os.open("d", os.O_DIRECTORY, dir_fd=fd); os.close(fd); fd = child
held = os.open("held", os.O_CREAT | os.O_WRONLY, 0o600, dir_fd=fd)  # open when the node dies
os.write(held, b"x" * 4096)
print(inc.path, flush=True)
time.sleep(60)
"""


def test_sweep_clears_a_dead_nodes_mounted_deep_runtime_and_never_raises(tmp_path: Path) -> None:
    _need_tmpfs()
    proc = subprocess.Popen([sys.executable, "-c", _DEAD_NODE, str(tmp_path)], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    try:
        assert proc.stdout is not None
        dead = Path(proc.stdout.readline().strip())
        assert diskfs.mounts_under(dead) == [str(dead / "polar-sandbox-dead")]
        deep_outside = dead / "outside"  # a deep tree on the underlying disk too
        deep_outside.mkdir()
        _deep(deep_outside, DEEP)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
    (tmp_path / "node-0" / "not-an-incarnation").write_text("")  # odd entries are skipped, not fatal
    assert leftovers.sweep(tmp_path) == [str(dead)]
    assert not dead.exists() and not diskfs.mounts_under(tmp_path)
    assert [p.name for p in (tmp_path / "node-0").iterdir()] == ["not-an-incarnation"]
    assert leftovers.sweep(tmp_path / "missing") == []


@pytest.mark.slow
async def test_without_the_tmpfs_the_watchdog_walk_trips_and_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The fallback (rootless hosts; forced here): the mechanism names the walk and why there is no tmpfs."""
    require_bwrap()
    monkeypatch.setenv("POLAR_DISK_TMPFS", "0")
    rt = SandboxRuntime(RuntimeSpec(network="none", disk_mb=16), root_dir=tmp_path)
    await rt.prepare()
    try:
        mechanism = rt.limits_report()["mechanisms"]["disk_mb"]
        assert mechanism.startswith("watchdog tree walk") and "no tmpfs: POLAR_DISK_TMPFS=0" in mechanism
        assert not diskfs.mounts_under(tmp_path)
        res = await rt.exec("for i in 1 2 3; do head -c 10000000 /dev/zero > /testbed/f$i; done; sleep 60", timeout_s=50)
        assert not res.timed_out and res.limit is not None and res.limit.startswith("disk_mb=16 (watchdog")
    finally:
        await rt.stop()
