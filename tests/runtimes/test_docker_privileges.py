"""The Docker runtime never runs the agent as root (issue 14), tried through a real container on the
private dockerd with the imported test image: the agent's uid is its own unprivileged one, it holds
no capability and cannot gain one (no-new-privileges), a root-only file planted in the image is
unreadable to it (directly and through a symlink handed to ``read_file``), the relay runs as another
uid the agent cannot kill, and the agent still edits its workspace, HOME and /tmp and the diff works.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from polar_env.runtimes.docker import AGENT_UID, RELAY_UID
from tests.runtimes.conftest import GATEWAY_PORT, Gateway

pytestmark = pytest.mark.slow

FETCH = "python3 -c \"import urllib.request as u; print(u.urlopen('http://127.0.0.1:%d/after', timeout=10).read().decode())\""


@pytest.mark.parametrize("variant", ["docker"])
async def test_agent_is_unprivileged_and_still_does_its_work(runtimes: Any, variant: str, task_repo: Path,
                                                             gateway: Gateway) -> None:
    rt = await runtimes(source_dir=task_repo, gateway_socket=gateway.socket_path)
    # a root-only secret in the image, planted by root (the runtime's own root step, not the agent)
    code, out, _ = await rt._exec_raw(["/bin/sh", "-c", "echo top-secret > /etc/polar-secret && chmod 600 /etc/polar-secret"],
                                      None, "/", demux=False, user="0:0")
    assert code == 0, out.text()
    ident = await rt.exec("id -u; id -g; grep -E '^Cap(Eff|Prm)|^NoNewPrivs' /proc/self/status")
    uid, gid, *status = ident.output.split("\n")
    assert int(uid) == rt.uid == AGENT_UID and int(gid) == rt.uid and int(uid) >= 100_000, ident.output
    assert "CapEff:\t0000000000000000" in status and "CapPrm:\t0000000000000000" in status and "NoNewPrivs:\t1" in status
    for probe in ("cat /etc/polar-secret", "cat /etc/shadow", "touch /etc/passwd", "su -c id root </dev/null"):
        res = await rt.exec(probe, timeout_s=20)
        assert res.exit_code != 0 and "top-secret" not in res.output and "root:" not in res.output, (probe, res.output)
    await rt.exec("ln -s /etc/polar-secret /testbed/leak")
    with pytest.raises(Exception, match="Permission denied"):
        await rt.read_file("/testbed/leak")
    # the relay is neither root nor the agent's: `kill -9 -1` cannot take the gateway away
    relay = await rt.exec("for p in /proc/[0-9]*; do tr '\\0' ' ' < $p/cmdline 2>/dev/null | grep -q '^python3 /run/polar/relay.py' "
                          "&& stat -c %u $p; done; true")
    assert relay.output.split() == [str(RELAY_UID)], relay.output
    await rt.exec("kill -9 -1", timeout_s=20)
    assert (await rt.exec(FETCH % GATEWAY_PORT)).output == "hello from the gateway /after\n"
    # the agent's work: the workspace (owned by it), HOME and /tmp are writable; the diff sees the edit
    work = await rt.exec("stat -c %u . .git calc.py && printf 'def add(a, b):\\n    return b + a\\n' > calc.py "
                         "&& mkdir -p $HOME/.cache && echo x > $HOME/.cache/a && echo y > /tmp/b && git status --short")
    assert work.exit_code == 0 and work.output.split()[:3] == [str(rt.uid)] * 3 and "M calc.py" in work.output, work.output
    await rt.write_file("/root/.harness/config.toml", b"a = 1\n")  # what launch.py does with harness config
    assert (await rt.exec("echo 'b = 2' >> /root/.harness/config.toml && cat /root/.harness/config.toml")).output == "a = 1\nb = 2\n"
    patch = await rt.diff()
    assert "+    return b + a" in patch and "leak" in patch
    report = rt.limits_report()
    assert report["uid"].startswith(f"{rt.uid} in container; dockerd userns-remap off; agent is uid {rt.uid}, not root"), report
    assert "no-new-privileges" in report["privileges"]


@pytest.mark.parametrize("variant", ["docker"])
async def test_harbor_verifier_contract_runs_as_the_agent_uid(runtimes: Any, variant: str, task_repo: Path) -> None:
    """Harbor's verifier shell (the evaluator's own script) stages /tests and /logs/verifier and
    writes the reward as the unprivileged uid, in a container whose / is root's."""
    from polar_env.evaluators.harbor import STAGE_OUT, STAGE_TESTS, STAGING_FAILED, VERIFY_SCRIPT

    rt = await runtimes(source_dir=task_repo, network="none")
    await rt.write_file(f"{STAGE_TESTS}/test.sh", b"id -u > /logs/verifier/uid.txt; echo 1 > /logs/verifier/reward.txt\n")
    run = await rt.exec(VERIFY_SCRIPT, timeout_s=60)
    assert run.exit_code == 0 and run.exit_code != STAGING_FAILED, run.output
    assert await rt.read_file(f"{STAGE_OUT}/reward.txt") == b"1\n"
    assert int(await rt.read_file(f"{STAGE_OUT}/uid.txt")) == rt.uid


@pytest.mark.parametrize("variant", ["docker"])
async def test_grading_runtime_is_container_root_on_a_fresh_repo(runtimes: Any, make_spec: Any, variant: str,
                                                                 task_repo: Path) -> None:
    """The node's grading spec (evaluation_runtime_spec) runs as container root, so SWE-bench eval
    scripts can re-install the repo into the image's root-owned environment; the capability set
    stays the agent container's (only DAC_OVERRIDE) and it has no network."""
    from polar_env.staging.lifecycle import evaluation_runtime_spec

    grading = evaluation_runtime_spec(make_spec(source_dir=task_repo))
    assert grading.user == "root" and grading.network == "none"
    rt = await runtimes(**{k: getattr(grading, k) for k in ("source_dir", "user", "network", "gateway_socket")})
    ident = await rt.exec("id -u; grep '^CapEff' /proc/self/status; touch /usr/local/lib/polar-probe && echo wrote")
    uid, capeff, wrote = ident.output.split("\n")[:3]
    assert uid == "0" and rt.uid == 0, ident.output
    assert capeff == "CapEff:\t0000000000000002" and wrote == "wrote", ident.output  # DAC_OVERRIDE only
    assert (await rt.exec("git status --short")).exit_code == 0
    assert rt.limits_report()["uid"].startswith("0 in container")
