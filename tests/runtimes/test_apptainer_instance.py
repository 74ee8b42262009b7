"""One Apptainer instance per session (``runtimes/apptainer_instance.py``): the exact argv, background
processes that live from one exec to the next (the rule Docker already had), the instance gone with
``stop``, and — when the process that started it dies — stopped by ``leftovers.sweep``. Against the
bwrap-backed fake (``tests/fixtures/runtimes/fake_apptainer``, which records instances as Apptainer
does) and the real binary."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from polar_env.runtimes import ApptainerRuntime, RuntimeSpec, leftovers
from polar_env.runtimes.apptainer import apptainer_argv
from polar_env.runtimes.apptainer_instance import config_dir, nsenter_argv, parse_env, records
from tests.conftest import require_bwrap
from tests.runtimes.conftest import FAKE_APPTAINER


def test_instance_start_argv_exact(tmp_path: Path) -> None:
    ws, tmp, home, start = tmp_path / "ws", tmp_path / "tmp", tmp_path / "home", tmp_path / "start"
    argv = apptainer_argv(binary="apptainer", image="/img", workdir="/testbed", workspace=ws, tmp=tmp, home=home,
                          cwd="/", command=[], instance="polar-apptainer-x1", start_script=start)
    assert argv == [
        "apptainer", "instance", "start", "--userns", "--containall", "--cleanenv", "--home", f"{home}:/root",
        "-B", f"{ws}:/testbed", "-B", f"{tmp}:/tmp", "-B", f"{start}:/.singularity.d/actions/start:ro",
        "--net", "--network", "none", "/img", "polar-apptainer-x1",
    ]


def test_nsenter_argv_and_env() -> None:
    assert nsenter_argv("/usr/bin/nsenter", 42, "/testbed/src", ["git", "status"]) == [
        "/usr/bin/nsenter", "-t", "42", "--user", "--mount", "--pid", "--net", "--ipc", "--root", "--wd",
        "--preserve-credentials", "--", "/bin/sh", "-c", 'cd "$1" && shift && exec "$@"', "polar-cd", "/testbed/src",
        "git", "status",
    ]
    assert parse_env(b"A=1\0B=x=y\0junk\0\0") == {"A": "1", "B": "x=y"}


@pytest.fixture(params=["fake", "real"])
def binary(request: pytest.FixtureRequest) -> str:
    if request.param == "fake":
        require_bwrap()
        return str(FAKE_APPTAINER)
    return str(request.getfixturevalue("apptainer"))


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return True
    return state in ("Z", "X")


async def _wait_gone(pid: int) -> bool:
    for _ in range(100):
        if _gone(pid):
            return True
        await asyncio.sleep(0.05)
    return False


async def test_background_processes_live_until_stop(binary: str, rootfs: Path) -> None:
    rt = ApptainerRuntime(RuntimeSpec(kind="apptainer", image=str(rootfs), network="none"), binary=binary)
    await rt.prepare()
    try:
        first = await rt.exec("sleep 300 >/dev/null 2>&1 & echo $!")
        pid = first.output.strip()
        assert first.exit_code == 0 and pid.isdigit(), first.output
        again = await rt.exec(f"kill -0 {pid} && echo alive; cat /proc/{pid}/cmdline | tr '\\0' ' '")
        assert again.exit_code == 0 and again.output.startswith("alive\nsleep 300"), again.output
        instance = rt._instance_pid
        assert instance is not None and len(records(config_dir(rt.root))) == 1
    finally:
        await rt.stop()
    assert await _wait_gone(instance), f"instance PID 1 {instance} outlived stop()"


async def test_sweep_stops_a_dead_process_instance(binary: str, rootfs: Path, tmp_path: Path) -> None:
    """A node process that dies (kill -9) leaves its instance running; the next sweep stops it."""
    base = tmp_path / "runtimes"
    inc = leftovers.claim(base, "node-0")
    rt = ApptainerRuntime(RuntimeSpec(kind="apptainer", image=str(rootfs), network="none"), root_dir=inc.path,
                          binary=binary)
    await rt.prepare()
    try:
        res = await rt.exec("sleep 300 >/dev/null 2>&1 & echo started")
        assert res.exit_code == 0, res.output
        instance = rt._instance_pid
        assert instance is not None and not _gone(instance)
        os.close(inc.fd)  # the process "died": its lock is free
        removed = await asyncio.to_thread(leftovers.sweep, base)
        assert removed == [str(inc.path)]
        assert await _wait_gone(instance), f"instance PID 1 {instance} survived the sweep"
    finally:
        await rt.stop()
