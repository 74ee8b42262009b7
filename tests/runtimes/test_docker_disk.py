"""The Docker runtime's ``disk_mb`` is the kernel's (a sized host tmpfs bind-mounted over the
workdir, /tmp, HOME and /var/tmp, ``docker_disk.py``), tried through real containers on the private
dockerd: a file deleted while held open in /tmp and many directories in HOME are refused with
ENOSPC and trip the limit with the tmpfs named; ``write_file`` and the diff still work; ``stop`` and
``leftovers.sweep`` leave no mount behind; without the tmpfs the mechanism says why."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from polar_env.runtimes import DockerRuntime, diskfs, leftovers
from polar_env.runtimes.docker_disk import CACHE_DIR
from tests.runtimes.test_disk import HELD_OPEN, MANY_DIRS, _py

pytestmark = pytest.mark.slow
MIB = 1024 * 1024
FINDW = "find / -xdev \\( -path /proc -o -path /sys \\) -prune -o -type d -writable -print 2>/dev/null | sort"  # bind mounts too
SAME_FS = "stat -f -c '%T %b %c' /testbed /tmp /var/tmp /run/lock $HOME /logs /tests"


def _need_tmpfs() -> None:
    why = diskfs.tmpfs_wanted()
    if why is not None:
        pytest.skip(f"no tmpfs bound here: {why}")


def _left(base: Path) -> list[str]:
    """What a runtime left under ``base``: folders other than the image cache, and mounts."""
    return [p.name for p in base.iterdir() if p.name != CACHE_DIR] + diskfs.mounts_under(base)


@pytest.mark.parametrize("variant", ["docker"])
async def test_held_open_file_in_tmp_is_refused_and_trips(make_spec: Any, variant: str, task_repo: Path,
                                                          tmp_path: Path) -> None:
    _need_tmpfs()
    rt = DockerRuntime(make_spec(source_dir=task_repo, network="none", disk_mb=64), root_dir=tmp_path / "rt")
    await rt.prepare()
    try:
        mechanism = rt.limits_report()["mechanisms"]["disk_mb"]
        assert mechanism.startswith("tmpfs size=64m nr_inodes=4096 on the container's writable trees (bind mounts"), mechanism
        assert (await rt.exec(FINDW)).output.split() == ["/logs", "/root", "/run/lock", "/testbed", "/tests", "/tmp", "/var/tmp"]
        fs = (await rt.exec(SAME_FS)).output.split("\n")
        assert len(set(fs[:7])) == 1 and fs[0].startswith("tmpfs "), fs  # one filesystem for all the agent can write
        await rt.write_file("/root/.harness/config.toml", b"a = 1\n")  # put_archive reaches the bind mount
        assert (await rt.exec("cat $HOME/.harness/config.toml && stat -c %u calc.py")).output == f"a = 1\n{rt.uid}\n"
        await rt.exec("echo 'x = 2' >> calc.py")
        assert "+x = 2" in await rt.diff()
        res = await rt.exec(_py(HELD_OPEN), timeout_s=60)
        assert "stopped 28" in res.output, res.output  # ENOSPC from the kernel
        assert int(res.output.split("written ")[1].split()[0]) <= 64 * MIB
        assert res.limit is not None and res.limit.startswith("disk_mb=64 (tmpfs size=64m") and not res.timed_out, res.limit
        assert rt.limits_report()["hit"] == res.limit
    finally:
        await rt.stop()
    assert _left(tmp_path / "rt") == []


@pytest.mark.parametrize("variant", ["docker"])
async def test_many_directories_in_home_are_refused_and_trip(make_spec: Any, variant: str, tmp_path: Path) -> None:
    """No source_dir: the image's own workdir comes from the node's cache of the agent image."""
    _need_tmpfs()
    rt = DockerRuntime(make_spec(network="none", disk_mb=64), root_dir=tmp_path / "rt")
    await rt.prepare()
    try:
        assert (await rt.exec("git log --oneline | wc -l")).output.strip() == "1"  # the baseline commit
        res = await rt.exec(_py(MANY_DIRS.replace("/testbed/", "/root/")), timeout_s=120)
        made = int(res.output.split("made ")[1].split()[0])
        assert "stopped 28" in res.output and made < diskfs.inodes_for(64), res.output
        assert res.limit is not None and res.limit.startswith("disk_mb=64 (tmpfs") and "inodes exhausted" in res.limit
    finally:
        await rt.stop()
    assert _left(tmp_path / "rt") == []


@pytest.mark.parametrize("variant", ["docker"])
async def test_sweep_clears_a_dead_nodes_docker_tmpfs(make_spec: Any, variant: str, task_repo: Path, tmp_path: Path) -> None:
    _need_tmpfs()
    inc = leftovers.claim(tmp_path, "node-a")
    rt = DockerRuntime(make_spec(source_dir=task_repo, network="none", disk_mb=64), root_dir=inc.path)
    await rt.prepare()
    try:
        assert diskfs.mounts_under(inc.path)
        os.close(inc.fd)  # the node "dies": its lock goes, its container and mount stay
        assert leftovers.sweep(tmp_path) == [str(inc.path)]
        assert diskfs.mounts_under(tmp_path) == [] and list((tmp_path / "node-a").iterdir()) == []
    finally:
        await rt.stop()  # never raises, with its folder already gone


@pytest.mark.parametrize("variant", ["docker"])
async def test_without_the_tmpfs_the_mechanism_says_why(make_spec: Any, variant: str, task_repo: Path,
                                                        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("POLAR_DISK_TMPFS", "0")
    rt = DockerRuntime(make_spec(source_dir=task_repo, network="none", disk_mb=64), root_dir=tmp_path / "rt")
    grading = DockerRuntime(make_spec(source_dir=task_repo, network="none", disk_mb=64, user="root"), root_dir=tmp_path / "rt")
    try:
        for runtime, why in ((rt, "POLAR_DISK_TMPFS=0"), (grading, "grading runtime runs as root (user=root)")):
            await runtime.prepare()
            mechanism = runtime.limits_report()["mechanisms"]["disk_mb"]
            assert mechanism.startswith("watchdog (du -x inside") and mechanism.endswith(f"no tmpfs: {why}"), mechanism
            assert (await runtime.exec("stat -f -c %T /tmp")).output.strip() != "tmpfs"
    finally:
        await rt.stop()
        await grading.stop()
    assert not (tmp_path / "rt").exists()  # nothing mounted, nothing made
