"""Rootless Apptainer bounds what it promises or refuses: a non-root caller gets memory and pids
bounded through a delegated cgroup v2 subtree, or a one-line refusal naming why, or — with
``allow_unbounded`` — a run whose limits report says "unbounded" (never rlimits passed off as a
bound: RLIMIT_DATA turned a memory hit into the agent's own MemoryError, a session "completed").

This host has cgroups v1, where a non-root user gets no delegation: the real rootless runs (a forked
child switched to an unprivileged user made here with ``useradd``) show the refusal and the
unbounded run. The delegated-v2 path is only unit-tested, against a fake cgroup tree."""

from __future__ import annotations

import asyncio
import ctypes
import multiprocessing
import os
import pwd
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import pytest

from polar_env.errors import ConfigError
from polar_env.runtimes import ApptainerRuntime, RuntimeSpec, limits
from polar_env.runtimes import apptainer as apptainer_mod
from polar_env.runtimes.limits import SessionLimits, rootless_bound

ROOTLESS_USER = "polar-rootless"
CLONE_NEWNS = 0x00020000


def _fake_v2(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *, delegated: bool) -> Path:
    root = tmp_path / "cgroup"
    root.mkdir()
    (root / "cgroup.controllers").write_text("memory pids\n")
    own = root / "user.slice" / "user-1000.slice" / "session.scope"
    if delegated:
        own.mkdir(parents=True)
    monkeypatch.setattr(limits, "_own_v2_cgroup", lambda _root: own)
    return root


def test_rootless_bound_delegated_v2(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A delegated v2 subtree: the probe group is made with memory.max and pids.max, and removed."""
    root = _fake_v2(tmp_path, monkeypatch, delegated=True)
    made: list[Path] = []
    real_v2 = limits.Cgroup._v2.__func__  # type: ignore[attr-defined]

    def recording(cls: type[limits.Cgroup], name: str, memory_mb: int | None, pids_limit: int | None,
                  root: Path) -> limits.Cgroup:
        group: limits.Cgroup = real_v2(cls, name, memory_mb, pids_limit, root)
        made.append(group.dirs[0])
        assert (group.dirs[0] / "memory.max").read_text() == str(64 * limits.MIB)
        assert (group.dirs[0] / "pids.max").read_text() == "16"
        return group

    removed: list[Path] = []
    monkeypatch.setattr(limits.Cgroup, "_v2", classmethod(recording))
    monkeypatch.setattr(limits.Cgroup, "remove", lambda self: removed.extend(self.dirs))
    assert rootless_bound(root=root) is None
    assert made and removed == made


def test_rootless_bound_names_why(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = _fake_v2(tmp_path, monkeypatch, delegated=False)
    why = rootless_bound(root=root)
    assert why is not None and why.startswith("cgroup v2 but") and "Delegate=yes" in why
    v1 = tmp_path / "v1"
    (v1 / "memory").mkdir(parents=True)  # no pids hierarchy: not the writable pair root gets
    assert rootless_bound(root=v1) == "cgroups v1 (no delegation to unprivileged users)"
    assert rootless_bound(root=tmp_path / "none") == f"no cgroup filesystem at {tmp_path / 'none'}"


def _rootless_runtime(monkeypatch: pytest.MonkeyPatch, rootfs: Path, apptainer: str, **kw: Any) -> ApptainerRuntime:
    monkeypatch.setattr(apptainer_mod, "drops_privileges", lambda: False)
    monkeypatch.setattr(limits, "rootless_bound", lambda root=None: "cgroups v1 (no delegation to unprivileged users)")
    return ApptainerRuntime(RuntimeSpec(kind="apptainer", image=str(rootfs), network="none", **kw), binary=apptainer)


def test_rootless_refusal_is_one_line(monkeypatch: pytest.MonkeyPatch, rootfs: Path, apptainer: str) -> None:
    rt = _rootless_runtime(monkeypatch, rootfs, apptainer, memory_mb=512)
    with pytest.raises(ConfigError) as info:
        rt._check()
    assert str(info.value) == apptainer_mod.unbounded_refusal("cgroups v1 (no delegation to unprivileged users)")
    assert "\n" not in str(info.value) and "--allow-unbounded" in str(info.value)
    # no memory or pids limit asked: nothing to refuse
    _rootless_runtime(monkeypatch, rootfs, apptainer, memory_mb=None, pids_limit=None)._check()


async def test_allow_unbounded_reports_unbounded_and_sets_no_rlimits(
        monkeypatch: pytest.MonkeyPatch, rootfs: Path, apptainer: str) -> None:
    rt = _rootless_runtime(monkeypatch, rootfs, apptainer, memory_mb=512, pids_limit=64, allow_unbounded=True)
    rt._check()
    assert rt.unbounded == "cgroups v1 (no delegation to unprivileged users)"
    lim = SessionLimits(rt.spec, "t", trees=[], uid=None, unbounded=rt.unbounded)
    lim.start(lambda: None)
    try:
        mech = lim.report()["mechanisms"]
        assert mech["memory_mb"].startswith("unbounded (cgroups v1") and mech["pids_limit"].startswith("unbounded (")
        assert lim.cgroup is None and not any(a.startswith(("--data", "--nproc")) for a in lim.prefix())
    finally:
        await lim.aclose()


# -- real rootless runs, as an unprivileged user -------------------------------------------------------


def _user() -> pwd.struct_passwd:
    if os.geteuid() != 0 or shutil.which("useradd") is None:
        pytest.skip("a real rootless run needs root here, to make the unprivileged user it runs as")
    try:
        return pwd.getpwnam(ROOTLESS_USER)
    except KeyError:
        subprocess.run(["useradd", "-M", "-s", "/usr/sbin/nologin", ROOTLESS_USER], check=True, capture_output=True)
        return pwd.getpwnam(ROOTLESS_USER)


def _as_user(user: pwd.struct_passwd, rootfs: Path, scenario: Callable[[str], Any]) -> Any:
    """Run ``scenario(image)`` in a forked child switched to ``user``, the image bound into a private
    mount namespace where the user can reach it (the cached rootfs sits under 0700 /root)."""
    work = Path(tempfile.mkdtemp(prefix="polar-rootless-", dir="/tmp"))
    os.chown(work, user.pw_uid, user.pw_gid)
    ctx = multiprocessing.get_context("fork")
    parent, child = ctx.Pipe()

    def run(conn: Connection) -> None:
        try:
            if ctypes.CDLL(None, use_errno=True).unshare(CLONE_NEWNS) != 0:
                raise OSError(ctypes.get_errno(), "unshare")
            image = work / "image"
            image.mkdir()
            subprocess.run(["mount", "--make-rprivate", "/"], check=True)
            subprocess.run(["mount", "--bind", "-o", "ro", str(rootfs), str(image)], check=True)
            os.setgroups([])
            os.setresgid(user.pw_gid, user.pw_gid, user.pw_gid)
            os.setresuid(user.pw_uid, user.pw_uid, user.pw_uid)
            os.environ.update(HOME=str(work), USER=user.pw_name, TMPDIR=str(work), POLAR_RUNTIME_DIR=str(work / "rt"))
            os.environ.pop("POLAR_APPTAINER", None)
            conn.send(("ok", scenario(str(image))))
        except BaseException as exc:  # noqa: BLE001 - reported to the parent
            conn.send(("error", f"{type(exc).__name__}: {exc}"))

    proc = ctx.Process(target=run, args=(child,))
    proc.start()
    try:
        if not parent.poll(240):
            raise TimeoutError("the rootless child did not answer")
        return parent.recv()
    finally:
        proc.join(10)
        if proc.is_alive():
            proc.kill()
        shutil.rmtree(work, ignore_errors=True)


def _refused(apptainer: str) -> Callable[[str], Any]:
    def scenario(image: str) -> Any:
        rt = ApptainerRuntime(RuntimeSpec(kind="apptainer", image=image, network="none", memory_mb=512), binary=apptainer)

        async def go() -> str:
            try:
                await rt.prepare()
            except ConfigError as exc:
                return str(exc)
            finally:
                await rt.stop()
            return "prepared"

        return asyncio.run(go())

    return scenario


def _unbounded(apptainer: str) -> Callable[[str], Any]:
    def scenario(image: str) -> Any:
        spec = RuntimeSpec(kind="apptainer", image=image, network="none", memory_mb=128, pids_limit=64,
                           allow_unbounded=True)
        rt = ApptainerRuntime(spec, binary=apptainer)

        async def go() -> dict[str, Any]:
            await rt.prepare()
            try:
                res = await rt.exec("id -u; python3 -c 'b = bytearray(256 << 20); print(len(b) >> 20)'", timeout_s=120)
                return {"output": res.output, "code": res.exit_code, "limit": res.limit, "report": rt.limits_report()}
            finally:
                await rt.stop()

        return asyncio.run(go())

    return scenario


@pytest.mark.slow
def test_real_rootless_refuses_without_delegation(rootfs: Path, apptainer: str) -> None:
    if limits.cgroup_version() == "v2":
        pytest.skip("a cgroup v2 host: whether it delegates is the host's (the unit tests cover both)")
    user = _user()
    status, message = _as_user(user, rootfs, _refused(str(Path(apptainer).resolve())))
    assert status == "ok", message
    assert message == apptainer_mod.unbounded_refusal("cgroups v1 (no delegation to unprivileged users)"), message


@pytest.mark.slow
def test_real_rootless_allow_unbounded_says_so(rootfs: Path, apptainer: str) -> None:
    """Unbounded, and the report says it: the 256 MB allocation over memory_mb=128 is not stopped
    (nor does Apptainer fail to start, as it did under RLIMIT_DATA=128 MB)."""
    if limits.cgroup_version() == "v2":
        pytest.skip("a cgroup v2 host: whether it delegates is the host's (the unit tests cover both)")
    user = _user()
    status, got = _as_user(user, rootfs, _unbounded(str(Path(apptainer).resolve())))
    assert status == "ok", got
    assert got["code"] == 0 and got["output"].split() == [str(user.pw_uid), "256"], got
    mech = got["report"]["mechanisms"]
    assert mech["memory_mb"].startswith("unbounded (cgroups v1") and mech["pids_limit"].startswith("unbounded ("), mech
    assert got["report"]["uid"] is None and got["limit"] is None


def test_preflight_refuses_rootless_without_delegation_in_one_line(
        monkeypatch: pytest.MonkeyPatch, apptainer: str, capsys: pytest.CaptureFixture[str]) -> None:
    """The site's Apptainer in one line (version, user namespaces, cgroup mode, what bounds limits),
    then the refusal — unless no session needs memory/pids bounded (``unbounded_ok``)."""
    from polar_env import preflight
    from polar_env.runtimes import hostworkspace

    monkeypatch.setenv("POLAR_APPTAINER", apptainer)
    monkeypatch.setattr(hostworkspace, "drops_privileges", lambda: False)
    monkeypatch.setattr(apptainer_mod, "drops_privileges", lambda: False)
    monkeypatch.setattr(limits, "rootless_bound", lambda root=None: "cgroups v1 (no delegation to unprivileged users)")
    with pytest.raises(ConfigError, match=r"^this host cannot bound memory/pids for rootless Apptainer: cgroups v1"):
        preflight.check_runtime("apptainer", None)
    assert capsys.readouterr().err == ""  # a refusal is its one line alone
    preflight.check_runtime("apptainer", None, unbounded_ok=True)
    line = capsys.readouterr().err.strip()
    assert line.startswith("polar-env: runtime apptainer: apptainer version ") and "\n" not in line, line
    assert "user namespaces" in line and "cgroup" in line and "limits (uid" in line and "SIF " in line, line
