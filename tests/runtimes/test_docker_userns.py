"""SWE images as their agents expect them: root inside the container, an unprivileged uid outside.

The real tests start their own ``--userns-remap`` dockerd (``scripts/start_dockerd.sh`` with
``POLAR_DOCKERD_USERNS=1`` and its own ``POLAR_DOCKER_DIR``, stopped at the end when they started it)
and build an image shaped like SWE-Gym's from the test rootfs: a root-owned venv at
``/opt/miniconda3/envs/testbed`` first on PATH, a tiny setuptools package committed at ``/testbed``.
"""

from __future__ import annotations

import os
import shutil
import signal
import stat
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from polar_env.errors import ConfigError
from polar_env.runtimes import DockerRuntime, RuntimeSpec, diskfs, leftovers
from polar_env.runtimes import docker_leftovers as dl
from polar_env.runtimes.docker import AGENT_UID, CAPS_KEPT
from polar_env.runtimes.docker_disk import no_tmpfs_reason
from polar_env.runtimes.docker_userns import Userns, agent_uid, describe, parse_info
from tests.conftest import BUILD_ROOTFS, DOCKER_IMAGE, IN_CI, start_dockerd, stop_dockerd, unavailable
from tests.machine import DaemonUsers
from tests.runtimes.conftest import GATEWAY_PORT, Gateway
from tests.runtimes.test_docker_privileges import FETCH

pytestmark = pytest.mark.slow  # its own remapped dockerd

REMAP_DIR = "/tmp/polar-dockerd-userns"  # its own daemon: the default one (/tmp/polar-dockerd) stays as it is
BASE, COUNT = 1_000_000, 262_144  # start_dockerd.sh's default range
SWE_IMAGE = "polar-test/swe:bookworm"
SWE_SETUP = """set -e
python3 -m venv /opt/miniconda3/envs/testbed
mkdir -p /testbed/toypkg && cd /testbed
printf 'def answer():\\n    return 42\\n' > toypkg/__init__.py
printf 'from setuptools import setup\\nsetup(name="toypkg", version="0.1", packages=["toypkg"])\\n' > setup.py
git -c init.defaultBranch=main init -q && git add -A && git -c user.name=t -c user.email=t@x commit -qm base
"""
OFF = Userns(False, 0, "dockerd userns-remap off")
ON = Userns(True, BASE, f"dockerd userns-remap on (container root = host uid {BASE})")


# ----- without a daemon ----------------------------------------------------------------------------
def test_the_daemon_info_decides_who_the_agent_is() -> None:
    on = parse_info({"SecurityOptions": ["name=seccomp,profile=default", "name=userns"], "DockerRootDir": f"/d/data/{BASE}.{BASE}"})
    assert on == ON and on.host_uid(0) == BASE and on.host_uid(AGENT_UID) == BASE + AGENT_UID
    assert parse_info({"SecurityOptions": ["name=seccomp,profile=default"], "DockerRootDir": "/var/lib/docker"}) == OFF
    rootless = parse_info({"SecurityOptions": ["name=rootless", "name=userns"]})
    assert rootless.remaps and rootless.host_uid(0) is None
    assert agent_uid("agent", "auto", ON, AGENT_UID)[0] == 0
    assert agent_uid("agent", "auto", OFF, AGENT_UID) == (AGENT_UID, f"agent is uid {AGENT_UID}, not root: the daemon "
                                                          "does not remap uids (pip into root-owned envs fails)")
    assert agent_uid("agent", "off", ON, AGENT_UID)[0] == AGENT_UID
    assert agent_uid("root", "off", OFF, AGENT_UID)[0] == 0  # grading is container root on every daemon
    with pytest.raises(ConfigError, match="^agent_root=require, but the Docker daemon does not remap uids") as err:
        agent_uid("agent", "require", OFF, AGENT_UID)
    assert "\n" not in str(err.value) and "POLAR_DOCKERD_USERNS=1" in str(err.value)
    assert describe(ON, "require", AGENT_UID).startswith("agent is root in the container")
    assert f"container uid 0 = host uid {BASE}" in describe(ON, "auto", AGENT_UID)


def test_the_disk_tmpfs_follows_the_host_uid() -> None:
    assert no_tmpfs_reason(64, "agent", BASE, "/testbed", ("/root",), ON.line) == diskfs.tmpfs_wanted()  # remapped: mounted
    assert no_tmpfs_reason(64, "root", BASE, "/testbed", ("/root",), ON.line) == "grading runtime runs as root (user=root)"
    assert "host uid is unknown" in str(no_tmpfs_reason(64, "agent", None, "/testbed", ("/root",), "rootless dockerd"))


def test_owner_labels_tell_dead_processes_from_live_ones() -> None:
    assert not dl.owner_dead(dl.owner())
    proc = subprocess.Popen(["sleep", "30"])
    label = dl.owner(proc.pid)
    assert not dl.owner_dead(label)
    proc.kill()
    proc.wait()
    assert dl.owner_dead(label)
    host, pid, start = label.split(":")
    assert not dl.owner_dead(f"another-host:{pid}:{start}")  # a shared daemon's other hosts are theirs to sweep
    assert dl.owner_dead(f"{host}:{os.getpid()}:1")  # a reused pid is not the owner


# ----- a real remapped daemon ----------------------------------------------------------------------
@dataclass
class Remapped:
    client: Any
    data_root: Path


def _build_swe_image(client: Any) -> None:
    """``SWE_IMAGE`` from the test image, rebuilt when that image changed."""
    import docker

    base = client.images.get(DOCKER_IMAGE)
    try:
        if client.images.get(SWE_IMAGE).labels.get("polar.base") == base.id:
            return
    except docker.errors.ImageNotFound:
        pass
    box = client.containers.run(base.id, ["/bin/sh", "-c", SWE_SETUP], network_mode="none", detach=True)
    try:
        assert box.wait(timeout=300)["StatusCode"] == 0, box.logs().decode()
        box.commit(repository=SWE_IMAGE.split(":")[0], tag=SWE_IMAGE.split(":")[1], conf={
            "Env": ["PATH=/opt/miniconda3/envs/testbed/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"],
            "WorkingDir": "/testbed", "Labels": {"polar.base": base.id}})
    finally:
        box.remove(force=True)


@pytest.fixture(scope="module")
def remapped(request: pytest.FixtureRequest) -> Iterator[Remapped]:
    try:
        import docker
    except ImportError:
        unavailable("the docker extra is not installed: pip install -e '.[docker]'")
    if os.geteuid() != 0:
        unavailable("a userns-remapped dockerd needs root (useradd, /etc/subuid, dockerd)")
    if shutil.which("dockerd") is None and not (IN_CI or os.environ.get("POLAR_START_DOCKERD")):
        unavailable("no dockerd; run scripts/start_dockerd.sh once (it installs docker.io)")
    env = {**os.environ, "POLAR_DOCKER_DIR": REMAP_DIR, "POLAR_DOCKERD_USERNS": "1"}
    users = DaemonUsers(Path(REMAP_DIR))
    saved = os.environ.get("DOCKER_HOST")
    with users.lock():  # this module's tests may run in both xdist workers
        host, started = start_dockerd(env)
        users.join(started)
        os.environ["DOCKER_HOST"] = host
        client = docker.from_env()
        try:
            request.getfixturevalue("rootfs")
            proc = subprocess.run(["bash", str(BUILD_ROOTFS)], env={**os.environ, "DOCKER_HOST": host}, capture_output=True,
                                  text=True, timeout=1200, check=False)
            if proc.returncode != 0:
                unavailable(f"could not import {DOCKER_IMAGE} into the remapped daemon: {proc.stderr[-2000:]}")
            _build_swe_image(client)
        except BaseException:
            client.close()
            raise
    try:
        yield Remapped(client, Path(client.info()["DockerRootDir"]))
    finally:
        client.close()
        if saved is None:
            os.environ.pop("DOCKER_HOST", None)
        else:
            os.environ["DOCKER_HOST"] = saved
        with users.lock():
            if users.leave():
                stop_dockerd(env)


def _upper(rt: DockerRuntime) -> Path:
    """The container layer's host directory: what the agent wrote outside the bind mounts."""
    c = rt._live()
    c.reload()
    return Path(c.attrs["GraphDriver"]["Data"]["UpperDir"])


PIP = ("id -u && pip install -e . --no-build-isolation --no-deps && cd / && "
       "python -c 'import toypkg; print(toypkg.answer(), toypkg.__file__)' && echo note > /testbed/agent_note")


@pytest.mark.parametrize("disk_mb", [None, 64], ids=["layer", "tmpfs"])
async def test_swe_agent_is_root_inside_and_unprivileged_outside(remapped: Remapped, tmp_path: Path, disk_mb: int | None,
                                                                gateway: Gateway) -> None:
    assert remapped.data_root.name == f"{BASE}.{BASE}"
    (tmp_path / "harness").mkdir()
    (tmp_path / "harness" / "tool").write_text("installed on the host\n")  # host root's, 0644
    spec = RuntimeSpec(kind="docker", image=SWE_IMAGE, gateway_socket=gateway.socket_path, disk_mb=disk_mb,
                       binds=[(tmp_path / "harness", "/opt/harness")])
    rt = DockerRuntime(spec, root_dir=tmp_path)
    await rt.prepare()
    try:
        bound = await rt.exec("stat -c %u /opt/harness/tool && cat /opt/harness/tool && touch /opt/harness/x")
        assert bound.output.startswith("65534\ninstalled on the host\n") and bound.exit_code != 0, bound.output  # nobody, ro
        assert (await rt.exec(FETCH % GATEWAY_PORT)).output == "hello from the gateway /after\n"  # the relay, remapped
        res = await rt.exec(PIP, timeout_s=300)
        assert res.exit_code == 0, res.output
        assert res.output.startswith("0\n") and "Successfully installed toypkg-0.1" in res.output, res.output
        assert "42 /testbed/toypkg/__init__.py" in res.output
        site = await rt.exec("stat -c '%u %n' /opt/miniconda3/envs/testbed/lib/python3.11/site-packages/toypkg.egg-link")
        assert site.output.startswith("0 "), site.output  # the root-owned env took the install
        report = rt.limits_report()
        assert report["uid"].startswith(f"0 in container; {ON.line}; agent is root in the container"), report
        if disk_mb is None:  # the workspace is the container layer
            assert report["mechanisms"]["disk_mb"] == "none"
            tree = _upper(rt) / "testbed"
        else:  # the workspace is the host tmpfs, chowned to the host uid of container root
            assert report["mechanisms"]["disk_mb"].startswith("tmpfs size=64m"), report
            tree = next(tmp_path.glob("polar-docker-*/workspace"))
        # overlayfs whiteouts (0/0 character devices the kernel makes, as the daemon, where the history
        # scrub removed the image's old .git objects) are layer metadata, not files anyone wrote
        wrote = [p for p in tree.rglob("*") if not p.is_symlink() and not stat.S_ISCHR(p.lstat().st_mode)]
        assert tree / "agent_note" in wrote and tree / "toypkg.egg-info" in wrote
        owners = {p.lstat().st_uid for p in [tree / "agent_note", tree / "toypkg.egg-info", *wrote]}
        assert owners == {BASE}, owners  # never 0: container root is host uid BASE
        assert "agent_note" in await rt.diff()
    finally:
        await rt.stop()


async def test_agent_root_off_keeps_the_unprivileged_uid_and_pip_fails(remapped: Remapped, tmp_path: Path) -> None:
    rt = DockerRuntime(RuntimeSpec(kind="docker", image=SWE_IMAGE, network="none", disk_mb=None, agent_root="off"))
    await rt.prepare()
    try:
        res = await rt.exec(PIP, timeout_s=300)
        assert res.output.startswith(f"{AGENT_UID}\n") and res.exit_code != 0, res.output
        assert "Permission denied" in res.output, res.output  # what the agent gets without root
        await rt.exec("echo note > /testbed/agent_note")
        assert (_upper(rt) / "testbed" / "agent_note").stat().st_uid == BASE + AGENT_UID
    finally:
        await rt.stop()


async def test_grading_on_the_remapped_daemon_is_still_a_fresh_root_container(remapped: Remapped) -> None:
    agent = DockerRuntime(RuntimeSpec(kind="docker", image=SWE_IMAGE, network="none", disk_mb=None))
    await agent.prepare()
    try:
        await agent.exec("echo planted > /testbed/planted && touch /tmp/planted")
        grade = DockerRuntime(RuntimeSpec(kind="docker", image=SWE_IMAGE, network="none", disk_mb=64, user="root"))
        await grade.prepare()
        try:
            res = await grade.exec("id -u; ls /testbed/planted /tmp/planted 2>&1; grep ^CapEff /proc/self/status; "
                                   "python3 -c \"import socket; socket.create_connection(('1.1.1.1', 80), 3)\" 2>&1 | tail -1")
            assert res.output.startswith("0\n") and res.output.count("No such file") == 2, res.output
            assert "CapEff:\t0000000000000002" in res.output and "Network is unreachable" in res.output, res.output
            report = grade.limits_report()
            assert CAPS_KEPT == ["DAC_OVERRIDE"] and "grading runtime: container root" in report["uid"]
            assert "grading runtime runs as root" in report["mechanisms"]["disk_mb"]  # unchanged: the du watchdog
        finally:
            await grade.stop()
    finally:
        await agent.stop()


def test_a_killed_node_leaves_nothing_the_next_sweep_keeps(remapped: Remapped, tmp_path: Path) -> None:
    """kill -9 with a container running: the next node's sweeps remove its container and tmpfs; a live
    owner's container stays; derived images beyond the bound go."""
    code = ("import asyncio, sys; from pathlib import Path; from polar_env.runtimes import DockerRuntime, RuntimeSpec, leftovers\n"
            "inc = leftovers.claim(Path(sys.argv[1]), 'node-0')\n"
            f"rt = DockerRuntime(RuntimeSpec(kind='docker', image={SWE_IMAGE!r}, network='none', disk_mb=32), root_dir=inc.path)\n"
            "asyncio.run(rt.prepare()); print(rt._live().id, flush=True)\n"
            "import time; time.sleep(120)\n")
    proc = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert proc.stdout is not None
    dead_id = proc.stdout.readline().strip()
    live = remapped.client.containers.run(SWE_IMAGE, ["sleep", "120"], detach=True, network_mode="none",
                                          labels={dl.LABEL: "docker", dl.OWNER: dl.owner()})
    try:
        assert dl.sweep(remapped.client) == []  # both owners alive: nothing goes
        assert remapped.client.containers.get(dead_id).status == "running"
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        proc.stdout.close()
        assert remapped.client.containers.get(dead_id).status == "running"  # the daemon keeps it: a leftover
        assert len(leftovers.sweep(tmp_path)) == 1 and not list(tmp_path.glob("node-0/*/polar-docker-*"))
        gone = dl.sweep(remapped.client)
        assert any(g.startswith("container polar-") for g in gone), gone
        assert dead_id not in {c.id for c in remapped.client.containers.list(all=True)}
        live.reload()
        assert live.status == "running"
    finally:
        live.remove(force=True)
    # the image bound: the newest `keep` derived images stay
    for _ in range(2):
        box = remapped.client.containers.create(SWE_IMAGE, ["true"], network_mode="none")
        box.commit(repository="polar-agent", tag=f"sweeptest{_}", conf={"Labels": {dl.LABEL: dl.AGENT_IMAGE_LABEL}})
        box.remove()
    dl.sweep(remapped.client, keep_images=1)
    kept = remapped.client.images.list(filters={"label": f"{dl.LABEL}={dl.AGENT_IMAGE_LABEL}"})
    assert [t for i in kept for t in i.tags] == ["polar-agent:sweeptest1"], kept
