"""The Apptainer runtime against a real ``apptainer`` binary (``scripts/install_apptainer.sh`` builds
one; ``.ci/run`` runs it, so under ``CI`` a missing binary fails instead of skipping). The same
contract as the shim-backed tests — exec, the gateway relay, network isolation, files and diff —
with the rootfs as a sandbox directory image (or ``POLAR_APPTAINER_IMAGE``: a .sif or docker://
URI with python3 and git), plus the privilege drop and the preflight probe."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import pytest

from polar_env.runtimes import ApptainerRuntime, RuntimeSpec
from polar_env.runtimes.apptainer import probe
from polar_env.runtimes.hostworkspace import SANDBOX_UID_BASE
from tests.runtimes.conftest import GATEWAY_PORT, Gateway

pytestmark = pytest.mark.slow


@pytest.fixture
def image(request: pytest.FixtureRequest) -> str:
    return os.environ.get("POLAR_APPTAINER_IMAGE") or str(request.getfixturevalue("rootfs"))


async def test_real_apptainer_contract(apptainer: str, image: str, task_repo: Path, gateway: Gateway) -> None:
    rt = ApptainerRuntime(RuntimeSpec(kind="apptainer", image=image, source_dir=task_repo,
                                      gateway_socket=gateway.socket_path, gateway_port=GATEWAY_PORT), binary=apptainer)
    await rt.prepare()
    try:
        res = await rt.exec("echo out; echo err >&2; pwd; echo $HOME; exit 4")
        assert res.exit_code == 4 and "out\nerr\n/testbed\n/root\n" in res.output, res.output
        res = await rt.exec(
            f"python3 -c \"import urllib.request as u; print(u.urlopen('http://127.0.0.1:{GATEWAY_PORT}/x', timeout=10).read().decode())\""
        )
        assert res.exit_code == 0 and "hello from the gateway /x" in res.output, res.output
        res = await rt.exec(
            f"python3 -c \"import socket; s=socket.socket(); s.settimeout(3); s.connect(('127.0.0.1', {gateway.tcp_port}))\""
        )
        assert res.exit_code != 0 and "ConnectionRefused" in res.output
        res = await rt.exec("sleep 100", timeout_s=1)
        assert res.timed_out and res.exit_code == 124
        await rt.write_file("/testbed/new.txt", b"new\n")
        assert "+new" in await rt.diff()
    finally:
        await rt.stop()


async def test_real_apptainer_never_host_root(apptainer: str, image: str, task_repo: Path) -> None:
    """As root, the agent is the runtime's own unprivileged uid: with --userns and no --fakeroot
    Apptainer maps the caller to itself, so without the drop it would be real root on the binds."""
    if os.geteuid() != 0:
        pytest.skip("the uid drop is what root callers get; rootless, the caller's own uid is the bound")
    rt = ApptainerRuntime(RuntimeSpec(kind="apptainer", image=image, source_dir=task_repo, network="none"),
                          binary=apptainer)
    await rt.prepare()
    try:
        assert rt.uid is not None and rt.uid >= SANDBOX_UID_BASE
        res = await rt.exec("id -u; touch /testbed/mine /tmp/mine /root/mine && stat -c %u /testbed/mine; cat /proc/self/status")
        lines = res.output.splitlines()
        assert res.exit_code == 0 and lines[0] == lines[1] == str(rt.uid), res.output
        assert "CapEff:\t0000000000000000" in res.output, res.output
        assert (rt.workspace / "mine").stat().st_uid == rt.uid  # the host sees the same unprivileged owner
        res = await rt.exec("cat /etc/shadow; touch /etc/owned")  # the image is read-only and not root's
        assert res.exit_code != 0
    finally:
        await rt.stop()


async def test_real_apptainer_probe_and_exec_cost(apptainer: str, image: str) -> None:
    """The preflight probe passes on a good image and names the failure on a bad one; reports the
    per-exec cost (compare bwrap's in tests/runtimes/test_runtimes.py's summary)."""
    assert await probe(image, binary=apptainer) is None
    bad = await probe("/nonexistent/image", binary=apptainer)
    assert bad is not None and "does not exist" in bad
    rt = ApptainerRuntime(RuntimeSpec(kind="apptainer", image=image, network="none"), binary=apptainer)
    await rt.prepare()
    try:
        t0 = time.monotonic()
        results = [await rt.exec(["true"]) for _ in range(5)]
        per_exec = (time.monotonic() - t0) / 5
        assert all(r.exit_code == 0 for r in results)
        many = await asyncio.gather(*(rt.exec(["true"]) for _ in range(4)))  # concurrent execs are independent
        assert all(r.exit_code == 0 for r in many)
        print(f"apptainer exec true: {per_exec:.3f} s per exec (serial, 5)")
        assert per_exec < 10
    finally:
        await rt.stop()


async def test_real_apptainer_limits_are_the_runtimes_own_cgroup(apptainer: str, image: str) -> None:
    """Rootless Apptainer cannot apply --memory/--pids-limit on cgroups v1; every exec joins the
    runtime's own cgroup before apptainer starts instead, and the report names it."""
    rt = ApptainerRuntime(RuntimeSpec(kind="apptainer", image=image, network="none", pids_limit=32, memory_mb=128),
                          binary=apptainer)
    await rt.prepare()
    try:
        if rt.limits is None or rt.limits.cgroup is None:
            pytest.skip(f"no writable cgroup here: {rt.limits_report().get('mechanisms')}")
        assert "cgroup" in rt.limits_report()["mechanisms"]["pids_limit"]
        res = await rt.exec("for i in $(seq 64); do sleep 30 & done; wait", timeout_s=30)
        assert res.limit is not None and res.limit.startswith("pids_limit=32 (cgroup"), (res.limit, res.output[-300:])
    finally:
        await rt.stop()
    rt = ApptainerRuntime(RuntimeSpec(kind="apptainer", image=image, network="none", memory_mb=128), binary=apptainer)
    await rt.prepare()
    try:
        res = await rt.exec("python3 -c \"b = bytearray(512 << 20); print(len(b))\"", timeout_s=60)
        assert res.limit is not None and res.limit.startswith("memory_mb=128 (cgroup"), (res.limit, res.output[-300:])
    finally:
        await rt.stop()


async def test_real_apptainer_sif(apptainer: str, rootfs: Path, tmp_path: Path) -> None:
    """A .sif runs either way: mounted with squashfuse where the exec's uid can open /dev/fuse, else
    (0600, as on our CI machines) unpacked once into the store by prepare and run as that folder —
    reused, not unpacked again, by the next session."""
    sif = tmp_path / "py.sif"
    build = await asyncio.create_subprocess_exec(apptainer, "build", str(sif), str(rootfs), stdout=asyncio.subprocess.DEVNULL,
                                                 stderr=asyncio.subprocess.PIPE)
    _, err = await build.communicate()
    assert build.returncode == 0, err.decode()[-500:]
    os.environ["POLAR_IMAGES"] = str(tmp_path / "store")
    try:
        for _session in range(2):
            rt = ApptainerRuntime(RuntimeSpec(kind="apptainer", image=str(sif), network="none"), binary=apptainer)
            unpacked = not rt._fuse_usable()
            await rt.prepare()
            try:
                res = await rt.exec("python3 -c 'print(6 * 7)'; id -u")
                assert res.exit_code == 0 and res.output.splitlines()[0] == "42", res.output
                image = rt.limits_report().get("image")
                if unpacked:
                    assert image is not None and image["built"] == (_session == 0), image
                    assert Path(image["sandbox"]).parent == tmp_path / "store", image
                else:
                    assert image is None
            finally:
                await rt.stop()
    finally:
        del os.environ["POLAR_IMAGES"]
