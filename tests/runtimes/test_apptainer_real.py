"""The Apptainer runtime against a real ``apptainer`` binary. CI has none (Debian 12 has no package),
so this is skipped there; on a cluster node it checks the same contract as the shim-backed tests:
exec, the gateway relay, network isolation, files and diff, with the rootfs as a sandbox directory
image (or ``POLAR_APPTAINER_IMAGE``: a .sif or docker:// URI with python3 and git)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from polar_env.runtimes import ApptainerRuntime, RuntimeSpec
from tests.runtimes.conftest import GATEWAY_PORT, Gateway

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("apptainer") is None,
                       reason="no apptainer binary on PATH: install Apptainer from its release packages "
                              "(https://apptainer.org/docs/admin/main/installation.html; Debian 12 has none in apt)"),
]


async def test_real_apptainer_contract(request: pytest.FixtureRequest, task_repo: Path, gateway: Gateway) -> None:
    image = os.environ.get("POLAR_APPTAINER_IMAGE") or str(request.getfixturevalue("rootfs"))
    rt = ApptainerRuntime(
        RuntimeSpec(kind="apptainer", image=image, source_dir=task_repo, gateway_socket=gateway.socket_path, gateway_port=GATEWAY_PORT)
    )
    await rt.prepare()
    try:
        res = await rt.exec("echo out; echo err >&2; pwd; echo $HOME; exit 4")
        assert res.exit_code == 4 and "out\nerr\n/testbed\n/root\n" in res.output
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
