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
from polar_env.runtimes.apptainer import find_apptainer, probe
from polar_env.runtimes.hostworkspace import SANDBOX_UID_BASE
from tests.conftest import unavailable
from tests.runtimes.conftest import GATEWAY_PORT, Gateway

pytestmark = pytest.mark.slow


@pytest.fixture
def apptainer() -> str:
    found = find_apptainer()
    if found is None:
        unavailable("no apptainer binary (on PATH or built by scripts/install_apptainer.sh): run that script")
    assert found is not None
    return found


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
