"""Pure pieces of the runtimes: argv builders (bwrap, apptainer, docker timeout), image naming,
the RUNTIMES table, path mapping, and the ConfigErrors for missing binaries, daemons and images."""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
from pathlib import Path

import pytest

from polar_env.errors import ConfigError
from polar_env.runtimes import (
    RUNTIMES,
    ApptainerRuntime,
    DockerRuntime,
    RuntimeSpec,
    SandboxRuntime,
    make_runtime,
)
from polar_env.runtimes.apptainer import apptainer_argv, apptainer_env
from polar_env.runtimes.argv import RELAY_SOURCE, relay_argv, shell_argv
from polar_env.runtimes.docker import timeout_argv, unix_daemon_problem
from polar_env.runtimes.sandbox import bwrap_argv, system_mounts
from polar_env.tasks.images import swebench_image, swegym_image


def test_runtimes_table_and_factory() -> None:
    assert dict(RUNTIMES.items()) == {"sandbox": SandboxRuntime, "docker": DockerRuntime, "apptainer": ApptainerRuntime}
    for kind, cls in RUNTIMES.items():
        rt = make_runtime(RuntimeSpec(kind=kind))  # type: ignore[arg-type]
        assert isinstance(rt, cls) and rt.name == kind and rt.spec.kind == kind
        assert rt.timings.prepare_s == 0.0 and rt.timings.stop_s == 0.0


def test_image_names() -> None:
    assert swegym_image("getmoto__moto-7365") == "docker.io/xingyaoww/sweb.eval.x86_64.getmoto_s_moto-7365:latest"
    assert swegym_image("Project-MONAI__MONAI-3403") == "docker.io/xingyaoww/sweb.eval.x86_64.project-monai_s_monai-3403:latest"
    assert swebench_image("astropy__astropy-12907") == "swebench/sweb.eval.x86_64.astropy_1776_astropy-12907:latest"


def test_shell_and_relay_argv() -> None:
    assert shell_argv("echo hi") == ["/bin/sh", "-c", "echo hi"]
    assert shell_argv(["a", "b c"]) == ["a", "b c"]
    with pytest.raises(ConfigError):
        shell_argv([])
    assert relay_argv(8100, ["cmd", "x"]) == [
        "python3", "/run/polar/relay.py", "--listen", "127.0.0.1:8100", "--socket", "/run/polar/gw.sock", "--", "cmd", "x",
    ]  # fmt: skip


def test_docker_timeout_argv() -> None:
    assert timeout_argv(["make", "test"], 1.5) == [
        "timeout", "-s", "KILL", "1.500", "/bin/sh", "-c", 'exec "$@" 2>&1', "sh", "make", "test",
    ]  # fmt: skip


def test_apptainer_argv_exact(tmp_path: Path) -> None:
    ws, tmp, home = tmp_path / "workspace", tmp_path / "tmp", tmp_path / "home"
    sock = Path("/run/gw/gw.sock")
    argv = apptainer_argv(
        binary="apptainer",
        image="/images/task.sif",
        workdir="/testbed",
        workspace=ws,
        tmp=tmp,
        home=home,
        cwd="/testbed/src",
        command=["bash", "-lc", "pytest -q"],
        gateway_socket=sock,
        binds=[(Path("/opt/npm"), "/opt/npm"), (Path("/usr/local/bin/node"), "/usr/local/bin/node")],
    )
    assert argv == [
        "apptainer", "exec", "--userns", "--containall", "--cleanenv", "--home", f"{home}:/root", "--pwd", "/testbed/src",
        "-B", f"{ws}:/testbed", "-B", f"{tmp}:/tmp",
        "-B", f"{RELAY_SOURCE}:/run/polar/relay.py:ro", "-B", "/run/gw/gw.sock:/run/polar/gw.sock",
        "-B", "/opt/npm:/opt/npm:ro", "-B", "/usr/local/bin/node:/usr/local/bin/node:ro",
        "--net", "--network", "none",
        "/images/task.sif", "bash", "-lc", "pytest -q",
    ]  # fmt: skip
    # No gateway: no relay or socket binds; docker:// URIs pass through untouched.
    # userns=False: Apptainer picks its path itself (a setuid install takes its privileged starter)
    argv = apptainer_argv(
        binary="/x/apptainer", image="docker://docker.io/xingyaoww/sweb.eval.x86_64.a_s_b-1:latest", workdir="/testbed",
        workspace=ws, tmp=tmp, home=home, cwd="/testbed", command=["true"], userns=False,
    )  # fmt: skip
    assert argv == [
        "/x/apptainer", "exec", "--containall", "--cleanenv", "--home", f"{home}:/root", "--pwd", "/testbed",
        "-B", f"{ws}:/testbed", "-B", f"{tmp}:/tmp", "--net", "--network", "none",
        "docker://docker.io/xingyaoww/sweb.eval.x86_64.a_s_b-1:latest", "true",
    ]  # fmt: skip
    with pytest.raises(ConfigError, match="cannot contain"):
        apptainer_argv(binary="a", image="i", workdir="/w", workspace=Path("/a:b"), tmp=tmp, home=home, cwd="/w", command=["x"])
    # cgroup_flags: Apptainer's own limits (clusters where its cgroup support works)
    limited = apptainer_argv(binary="a", image="i.sif", workdir="/w", workspace=ws, tmp=tmp, home=home, cwd="/w",
                             command=["x"], memory_mb=512, pids_limit=100)
    i = limited.index("--memory")
    assert limited[i:i + 6] == ["--memory", "512M", "--memory-swap", "512M", "--pids-limit", "100"]
    assert limited.index("--pids-limit") < limited.index("i.sif")


def test_apptainer_env_passes_values_outside_argv() -> None:
    env = apptainer_env(
        {"PATH": "/usr/bin", "APPTAINERENV_STALE": "x", "SINGULARITYENV_OLD": "y", "SECRET": "host"},
        {"OPENAI_API_KEY": "k", "HOME": "/elsewhere", "LANG": "C.UTF-8"},
    )
    assert env == {"PATH": "/usr/bin", "SECRET": "host", "APPTAINERENV_OPENAI_API_KEY": "k", "APPTAINERENV_LANG": "C.UTF-8"}


def test_bwrap_argv_order_and_isolation_flags(tmp_path: Path) -> None:
    spec = RuntimeSpec(gateway_socket=Path("/g/gw.sock"), binds=[(Path("/opt/node"), "/opt/node")], workdir="/tmp/work")
    argv = bwrap_argv(
        spec, bwrap="bwrap", workspace=tmp_path / "ws", tmp=tmp_path / "tmp", home=tmp_path / "home", command=["true"], cwd="/tmp/work"
    )
    assert argv[:12] == [
        "bwrap", "--unshare-all", "--die-with-parent", "--new-session", "--hostname", "sandbox",
        "--uid", "0", "--gid", "0", "--cap-drop", "ALL",
    ]  # fmt: skip
    assert "--share-net" not in argv and "--clearenv" not in argv  # env comes as the process env
    joined = " ".join(argv)
    # /tmp first, the workdir (under /tmp here) after it, or the tmp bind would hide it.
    assert joined.index(f"--bind {tmp_path / 'tmp'} /tmp") < joined.index(f"--bind {tmp_path / 'ws'} /tmp/work")
    assert f"--ro-bind {RELAY_SOURCE} /run/polar/relay.py --bind /g/gw.sock /run/polar/gw.sock" in joined
    assert joined.index("--tmpfs /run") < joined.index("/run/polar/gw.sock")
    assert "--ro-bind /opt/node /opt/node" in joined
    assert argv[-4:] == ["--chdir", "/tmp/work", "--", "true"]
    none = bwrap_argv(
        RuntimeSpec(gateway_socket=Path("/g/gw.sock"), network="none"),
        bwrap="bwrap", workspace=tmp_path, tmp=tmp_path, home=tmp_path, command=["true"], cwd="/",
    )  # fmt: skip
    assert "/run/polar/gw.sock" not in none


def test_system_mounts_make_missing_targets_creatable(tmp_path: Path) -> None:
    root = tmp_path / "rootfs"
    for d in ("usr/bin", "opt/existing", "etc", "proc", "tmp"):
        (root / d).mkdir(parents=True)
    (root / "bin").symlink_to("usr/bin")
    (root / ".marker").write_text("")
    args = system_mounts(root, ["/testbed", "/opt/tools/x", "/opt/existing"])
    assert args == [
        "--symlink", "usr/bin", "/bin",
        "--ro-bind", str(root / "etc"), "/etc",
        "--dir", "/opt",  # /opt/tools is missing: /opt is rebuilt on the tmpfs ...
        "--ro-bind", str(root / "opt/existing"), "/opt/existing",  # ... with its entries bound one level down
        "--ro-bind", str(root / "usr"), "/usr",
    ]  # fmt: skip
    assert system_mounts(root) == [
        "--symlink", "usr/bin", "/bin", "--ro-bind", str(root / "etc"), "/etc",
        "--ro-bind", str(root / "opt"), "/opt", "--ro-bind", str(root / "usr"), "/usr",
    ]  # fmt: skip


async def test_missing_bwrap_is_a_config_error_with_the_install_command() -> None:
    rt = SandboxRuntime(RuntimeSpec(), bwrap="definitely-not-bwrap-here")
    with pytest.raises(ConfigError, match="apt-get install -y bubblewrap"):
        await rt.prepare()
    await rt.stop()


async def test_sandbox_image_must_be_a_directory(tmp_path: Path) -> None:
    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap is not installed: apt-get install -y bubblewrap")
    rt = SandboxRuntime(RuntimeSpec(image=str(tmp_path / "nope")))
    with pytest.raises(ConfigError, match="root-filesystem directory"):
        await rt.prepare()


async def test_missing_apptainer_is_a_config_error() -> None:
    rt = ApptainerRuntime(RuntimeSpec(kind="apptainer", image="docker://x"), binary="definitely-not-apptainer")
    with pytest.raises(ConfigError, match="apptainer binary"):
        await rt.prepare()


async def test_absent_docker_daemon_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("docker", reason="the docker extra is not installed: pip install -e '.[docker]'")
    d = tempfile.mkdtemp(prefix="pdk-")
    try:
        monkeypatch.setenv("DOCKER_HOST", f"unix://{d}/docker.sock")
        assert unix_daemon_problem() is not None
        rt = DockerRuntime(RuntimeSpec(kind="docker", image="polar-test/py:bookworm"))
        with pytest.raises(ConfigError, match="scripts/start_dockerd.sh"):
            await rt.prepare()
        await rt.stop()
        # A socket nobody accepts on is reported the same way.
        s = socket.socket(socket.AF_UNIX)
        s.bind(f"{d}/docker.sock")
        s.close()
        assert unix_daemon_problem() is not None
    finally:
        shutil.rmtree(d, ignore_errors=True)


async def test_absent_docker_image_is_a_config_error_naming_it(request: pytest.FixtureRequest) -> None:
    request.getfixturevalue("docker_host")
    image = swegym_image("getmoto__moto-7365")
    rt = DockerRuntime(RuntimeSpec(kind="docker", image=image))
    with pytest.raises(ConfigError, match="xingyaoww/sweb.eval.x86_64.getmoto_s_moto-7365.*not present locally"):
        await rt.prepare()
    await rt.stop()


async def test_docker_limits_and_network_mode(request: pytest.FixtureRequest, tmp_path: Path) -> None:
    request.getfixturevalue("docker_host")
    rt = DockerRuntime(RuntimeSpec(kind="docker", image="polar-test/py:bookworm", memory_mb=256, pids_limit=64))
    await rt.prepare()
    try:
        rt._container.reload()
        host = rt._container.attrs["HostConfig"]
        assert host["NetworkMode"] == "none"
        assert host["Memory"] == 256 << 20 and host["MemorySwap"] == 256 << 20
        assert host["PidsLimit"] == 64 and host["Init"] is True
        assert host["CapDrop"] == ["ALL"] and host["CapAdd"] == ["DAC_OVERRIDE"], host
        assert host["SecurityOpt"] == ["no-new-privileges"], host
        assert rt._container.attrs["Config"]["Image"].startswith("polar-agent:")  # the derived, agent-owned image
        res = await rt.exec("cat /proc/net/dev | tail -n +3 | cut -d: -f1 | tr -d ' '")
        assert res.output.split() == ["lo"]
    finally:
        await rt.stop()


async def test_host_paths_refuse_escapes(tmp_path: Path) -> None:
    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap is not installed: apt-get install -y bubblewrap")
    outside = tmp_path / "outside"
    outside.mkdir()
    rt = SandboxRuntime(RuntimeSpec(), root_dir=tmp_path / "roots")
    await rt.prepare()
    try:
        assert rt.host_path("/testbed/a/../b") == rt.workspace / "b"
        assert rt.host_path("/tmp/x") == rt.tmp_dir / "x" and rt.host_path("/root/.codex/c") == rt.home_dir / ".codex/c"
        with pytest.raises(ConfigError, match="not under"):
            await rt.write_file("/etc/passwd", b"x")
        with pytest.raises(ConfigError, match="absolute"):
            await rt.read_file("relative.txt")
        # A symlink planted inside the workspace cannot redirect a host-side write or read.
        await rt.exec(f"ln -s {outside} escape && ln -s /etc/hostname host_hostname")
        with pytest.raises(ConfigError, match="symlink escape"):
            await rt.write_file("/testbed/escape/pwned.txt", b"x")
        with pytest.raises(ConfigError, match="symlink escape"):
            await rt.read_file("/testbed/host_hostname")
        assert not (outside / "pwned.txt").exists()
        assert str(rt.root).startswith(str(tmp_path / "roots"))
    finally:
        await rt.stop()
    assert not any((tmp_path / "roots").iterdir())


async def test_exec_before_prepare_and_after_stop() -> None:
    rt = SandboxRuntime(RuntimeSpec())
    with pytest.raises(ConfigError, match="not prepared"):
        await rt.exec("true")
    await rt.stop()
    await rt.stop()
    assert rt.timings.stop_s == 0.0  # nothing was running


def test_relay_source_ships_with_the_package() -> None:
    assert RELAY_SOURCE.is_file() and os.access(RELAY_SOURCE, os.R_OK)
