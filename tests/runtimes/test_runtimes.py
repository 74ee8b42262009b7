"""The Runtime contract, run against every variant for real: bwrap with the host system and with a
debootstrap rootfs, a container on a private dockerd, and the apptainer lifecycle through the bwrap
shim. Each test gets prepared runtimes from the ``runtimes`` factory (tests/runtimes/conftest.py)."""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import subprocess
from pathlib import Path
from typing import Any

import pytest

from polar_env.errors import ConfigError
from polar_env.runtimes.sandbox import HostWorkspaceRuntime
from tests.runtimes.conftest import GATEWAY_PORT, Gateway, git, host_ipv4_addresses

pytestmark = pytest.mark.slow


def host_pids_matching(needle: str) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if needle.encode() in f.read():
                    pids.append(int(entry))
        except OSError:
            continue
    return pids


async def test_prepare_copies_the_git_repo(runtimes: Any, task_repo: Path) -> None:
    rt = await runtimes(source_dir=task_repo)
    res = await rt.exec("ls -A && git log --format=%s && git status --porcelain && cat pkg/mod.py")
    assert res.exit_code == 0, res.output
    lines = res.output.splitlines()
    assert {".git", ".gitignore", "blob.bin", "calc.py", "pkg"} <= set(lines)
    assert "base" in lines  # the task repo's own commit, not a new baseline
    assert lines[-1] == "X = 1"
    assert await rt.read_file("/testbed/blob.bin") == bytes(range(256))
    assert rt.timings.prepare_s > 0


async def test_prepare_without_a_repo_commits_a_baseline(runtimes: Any, tmp_path: Path) -> None:
    src = tmp_path / "plain"
    src.mkdir()
    (src / "notes.txt").write_text("hi\n")
    rt = await runtimes(source_dir=src)
    await rt.write_file("/testbed/notes.txt", b"hi\nthere\n")
    patch = await rt.diff()
    assert "+there" in patch and "notes.txt" in patch
    assert "-hi" not in patch


async def test_exec_output_exit_codes_env_and_cwd(runtimes: Any, task_repo: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("POLAR_HOST_SECRET", "must-not-leak")
    rt = await runtimes(source_dir=task_repo, env={"SPEC_VAR": "from spec", "SHARED": "spec"})

    res = await rt.exec("echo one; echo two >&2; echo three; exit 7")
    assert (res.exit_code, res.output, res.timed_out) == (7, "one\ntwo\nthree\n", False)
    assert res.duration_s > 0

    res = await rt.exec("echo $SPEC_VAR/$SHARED/$EXEC_VAR/${POLAR_HOST_SECRET:-unset}", env={"EXEC_VAR": "x y", "SHARED": "exec"})
    assert res.output == "from spec/exec/x y/unset\n"

    assert (await rt.exec("pwd")).output == "/testbed\n"
    assert (await rt.exec("pwd", cwd="/testbed/pkg")).output == "/testbed/pkg\n"
    res = await rt.exec(["python3", "-c", "import sys; print(sys.argv[1:])", "a b", "$HOME"])
    assert res.output == "['a b', '$HOME']\n"
    res = await rt.exec(["definitely-not-a-command"])
    assert res.exit_code in (126, 127) and not res.timed_out
    res = await rt.exec("echo $HOME; touch $HOME/.rc && ls -A $HOME")
    assert res.exit_code == 0 and res.output.splitlines()[0] == "/root" and ".rc" in res.output
    assert len(rt.timings.exec_s) >= 6


async def test_system_is_read_only_and_workspace_writable(runtimes: Any, task_repo: Path) -> None:
    rt = await runtimes(source_dir=task_repo)
    res = await rt.exec("touch /usr/polar-probe")
    # docker: the agent's uid does not own the container's system layer (and the host is untouched)
    assert not Path("/usr/polar-probe").exists()
    assert res.exit_code != 0 and ("Read-only" in res.output or "Permission denied" in res.output), res.output
    assert (await rt.exec("echo ok > new.txt && cat new.txt")).output == "ok\n"


async def test_timeout_kills_the_whole_command(runtimes: Any, task_repo: Path) -> None:
    rt = await runtimes(source_dir=task_repo)
    marker = f"4242.{secrets.randbelow(10**6):06d}"  # unique: another xdist worker may run a variant at once
    # 3 s leaves room for sandbox start-up on a loaded 2-core machine before "started" is printed.
    res = await rt.exec(f"echo started; sleep {marker} & sleep 100", timeout_s=3)
    assert res.timed_out and res.exit_code == 124
    assert res.output == "started\n"
    # Nothing of it survives: neither the foreground sleep nor the background one.
    await asyncio.sleep(1.0)
    if isinstance(rt, HostWorkspaceRuntime):
        assert host_pids_matching(marker) == []
    else:
        probe = (
            "import os\nfor p in os.listdir('/proc'):\n    try: argv = open(f'/proc/{p}/cmdline','rb').read().split(b'\\0')\n"
            f"    except OSError: continue\n    if argv[:2] == [b'sleep', b'{marker}']: print(p)\n"
        )
        await rt.write_file("/tmp/ps.py", probe.encode())
        res = await rt.exec(["python3", "/tmp/ps.py"])
        assert res.exit_code == 0 and res.output == "", res.output
    # The runtime is still usable afterwards.
    assert (await rt.exec("echo alive")).output == "alive\n"


async def test_write_and_read_files(runtimes: Any, task_repo: Path) -> None:
    rt = await runtimes(source_dir=task_repo)
    payload = bytes(range(256)) * 10
    await rt.write_file("/testbed/deep/new/dir/data.bin", payload)
    assert await rt.read_file("/testbed/deep/new/dir/data.bin") == payload
    assert (await rt.exec("wc -c < deep/new/dir/data.bin")).output.strip() == "2560"
    # /tmp persists between execs and is reachable from the host side.
    await rt.write_file("/tmp/eval.sh", b"echo from-eval-script\n")
    assert (await rt.exec("sh /tmp/eval.sh")).output == "from-eval-script\n"
    await rt.exec("echo made-inside > /tmp/inside.txt")
    assert await rt.read_file("/tmp/inside.txt") == b"made-inside\n"
    await rt.write_file("/testbed/calc.py", b"overwritten\n")
    assert (await rt.exec("cat calc.py")).output == "overwritten\n"
    with pytest.raises(FileNotFoundError):
        await rt.read_file("/testbed/missing.txt")


async def test_diff_is_an_applicable_binary_patch(runtimes: Any, task_repo: Path, tmp_path: Path) -> None:
    rt = await runtimes(source_dir=task_repo)
    await rt.exec("printf 'def add(a, b):\\n    return b + a\\n' > calc.py && rm pkg/mod.py && echo new > added.txt")
    await rt.write_file("/testbed/blob.bin", bytes(range(255, -1, -1)))
    await rt.exec("echo noise > run.log")  # ignored by the repo's .gitignore
    # The harness cannot bend the patch format through the repo's config.
    await rt.exec("git config color.diff always && git config diff.noprefix true")
    patch = await rt.diff()
    assert "-    return a + b" in patch and "+    return b + a" in patch
    assert "deleted file mode" in patch and "pkg/mod.py" in patch
    assert "added.txt" in patch and "GIT binary patch" in patch
    assert "run.log" not in patch and "\x1b[" not in patch
    # Replaying it on a fresh copy of the task repo reproduces the workspace.
    replay = tmp_path / "replay"

    def replay_patch() -> None:
        subprocess.run(["git", "clone", "-q", str(task_repo), str(replay)], check=True)
        subprocess.run(["git", "apply", "--binary", "-"], input=patch.encode(), cwd=replay, check=True)

    await asyncio.to_thread(replay_patch)
    assert (replay / "calc.py").read_text() == "def add(a, b):\n    return b + a\n"
    assert (replay / "blob.bin").read_bytes() == bytes(range(255, -1, -1))
    assert not (replay / "pkg" / "mod.py").exists() and (replay / "added.txt").read_text() == "new\n"
    # An unchanged workspace gives an empty patch.
    rt2 = await runtimes(source_dir=task_repo)
    assert await rt2.diff() == ""
    assert git(task_repo, "status", "--porcelain") == ""  # the source repo itself is untouched


async def test_stop_cleans_up_and_is_idempotent(runtimes: Any, task_repo: Path, gateway: Gateway) -> None:
    rt = await runtimes(source_dir=task_repo, gateway_socket=gateway.socket_path)
    assert (await rt.exec("echo hi")).exit_code == 0
    if isinstance(rt, HostWorkspaceRuntime):
        root = rt.root
        assert root.exists()
    else:
        container_id = rt._container.id
    pending = asyncio.ensure_future(rt.exec("sleep 300", timeout_s=600))
    await asyncio.sleep(0.5)
    await rt.stop()
    res = await asyncio.wait_for(pending, 30)
    assert res.exit_code != 0
    await rt.stop()  # idempotent
    assert rt.timings.stop_s > 0
    if isinstance(rt, HostWorkspaceRuntime):
        assert not root.exists()
        assert host_pids_matching(str(root)) == []  # no bwrap, relay or command left behind
    else:
        import docker

        client = docker.from_env()
        try:
            with pytest.raises(docker.errors.NotFound):
                client.containers.get(container_id)
        finally:
            client.close()
    with pytest.raises(ConfigError):
        await rt.exec("true")


async def test_concurrent_execs_share_the_workspace(runtimes: Any, task_repo: Path, gateway: Gateway) -> None:
    rt = await runtimes(source_dir=task_repo, gateway_socket=gateway.socket_path)
    fetch = "python3 -c \"import urllib.request as u; print(u.urlopen('http://127.0.0.1:%d/c%d', timeout=10).read().decode())\""
    results = await asyncio.gather(*(rt.exec(fetch % (GATEWAY_PORT, i) + f" > out{i}.txt") for i in range(4)))
    assert all(r.exit_code == 0 for r in results), [r.output for r in results]
    for i in range(4):
        assert await rt.read_file(f"/testbed/out{i}.txt") == f"hello from the gateway /c{i}\n".encode()


async def test_network_reaches_the_gateway_and_nothing_else(runtimes: Any, task_repo: Path, gateway: Gateway) -> None:
    """Through the relay, the gateway answers; the very same server on the host's 127.0.0.1 and any
    other address (this host's own interface addresses: no packet leaves the machine) are unreachable."""
    rt = await runtimes(source_dir=task_repo, gateway_socket=gateway.socket_path)
    script = f"""
import errno, json, socket, urllib.request
out = {{}}
out["gateway"] = urllib.request.urlopen("http://127.0.0.1:{GATEWAY_PORT}/probe", timeout=10).read().decode()
req = urllib.request.Request("http://127.0.0.1:{GATEWAY_PORT}/echo", data=b"x" * 300000 + b"END", method="POST")
body = urllib.request.urlopen(req, timeout=10).read()
out["echo_ok"] = body == (b"x" * 300000 + b"END")[::-1]
def attempt(host, port):
    s = socket.socket(); s.settimeout(3)
    try:
        s.connect((host, port)); return "connected"
    except OSError as e:
        return errno.errorcode.get(e.errno, str(e))
    finally:
        s.close()
out["host_loopback"] = attempt("127.0.0.1", {gateway.tcp_port})
out["others"] = {{a: attempt(a, {gateway.tcp_port}) for a in {host_ipv4_addresses()!r}}}
out["ifaces"] = sorted(l.split(":")[0].strip() for l in open("/proc/net/dev").readlines()[2:])
try:
    socket.getaddrinfo("deb.debian.org", 80); out["dns"] = "resolved"
except OSError:
    out["dns"] = "failed"
print(json.dumps(out))
"""
    await rt.write_file("/tmp/probe.py", script.encode())
    res = await rt.exec(["python3", "/tmp/probe.py"], timeout_s=60)
    assert res.exit_code == 0, res.output
    out = json.loads(res.output.strip().splitlines()[-1])
    assert out["gateway"] == "hello from the gateway /probe"
    assert out["echo_ok"] is True
    assert "/probe" in gateway.hits
    assert out["host_loopback"] == "ECONNREFUSED"  # the host's server is listening there: not reachable
    for addr, outcome in out["others"].items():
        assert outcome in ("ENETUNREACH", "EHOSTUNREACH"), (addr, outcome)
    assert out["ifaces"] == ["lo"]
    assert out["dns"] == "failed"
    # And the host can reach that server on 127.0.0.1 (so the refusal above is the sandbox's doing).
    _reader, writer = await asyncio.open_connection("127.0.0.1", gateway.tcp_port)
    writer.close()
    await writer.wait_closed()


async def test_network_none_has_no_relay(runtimes: Any, task_repo: Path, gateway: Gateway) -> None:
    rt = await runtimes(source_dir=task_repo, gateway_socket=gateway.socket_path, network="none")
    res = await rt.exec(
        f"python3 -c \"import socket; s=socket.socket(); s.settimeout(3); s.connect(('127.0.0.1', {GATEWAY_PORT}))\""
    )
    assert res.exit_code != 0 and "ConnectionRefused" in res.output
    assert (await rt.exec("test -e /run/polar/gw.sock")).exit_code != 0


async def test_read_only_binds(runtimes: Any, task_repo: Path, tmp_path: Path) -> None:
    tools = tmp_path / "tools"
    tools.mkdir()
    (tools / "tool.sh").write_text("echo tool ran\n")
    rt = await runtimes(source_dir=task_repo, binds=[(tools, "/opt/tools")])
    assert (await rt.exec("sh /opt/tools/tool.sh")).output == "tool ran\n"
    assert (await rt.exec("touch /opt/tools/x")).exit_code != 0
    assert await rt.read_file("/opt/tools/tool.sh") == b"echo tool ran\n"
    with pytest.raises(ConfigError):
        await rt.write_file("/opt/tools/y", b"no")
    assert not (tools / "y").exists()


async def test_missing_gateway_socket_is_a_config_error(runtimes: Any, task_repo: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="gateway socket"):
        await runtimes(source_dir=task_repo, gateway_socket=tmp_path / "absent.sock")
