"""What persists between tool calls, one rule on every runtime (docs/runtimes.md): files in the
workspace, /tmp and HOME, and the processes a call leaves running (``server &``) until the session
stops; a call returns when its command exits even if what it left holds the call's output; a
timeout kills the command's process group. Sandbox: one bwrap instance per session
(``runtimes/bwrap_instance.py``), checked here for the isolation each exec keeps too."""

from __future__ import annotations

import asyncio
import os
import secrets
from pathlib import Path
from typing import Any

import pytest

from polar_env.runtimes import RuntimeSpec, SandboxRuntime
from tests.conftest import require_bwrap
from tests.runtimes.test_runtimes import host_pids_matching


def marker() -> str:
    return f"31{secrets.randbelow(10**6):06d}"  # a sleep argument no other test uses


async def gone(needle: str) -> bool:
    for _ in range(100):
        if not host_pids_matching(needle):
            return True
        await asyncio.sleep(0.05)
    return False


async def test_background_processes_live_until_stop(runtimes: Any, task_repo: Path) -> None:
    rt = await runtimes(source_dir=task_repo)
    mark = marker()
    first = await rt.exec(f"sleep {mark} >/dev/null 2>&1 & echo $!")
    pid = first.output.strip()
    assert first.exit_code == 0 and pid.isdigit(), first.output
    again = await rt.exec(f"kill -0 {pid} && echo alive")
    assert again.output == "alive\n", again.output
    assert host_pids_matching(mark)
    await rt.stop()
    assert await gone(mark), f"sleep {mark} outlived the session"


async def test_a_call_returns_when_its_command_exits(runtimes: Any, task_repo: Path) -> None:
    """``sleep &`` keeps the call's stdout open; the call still ends with its command (the output
    it left is read for a grace period, then dropped), and the sleep lives on."""
    rt = await runtimes(source_dir=task_repo)
    mark = marker()
    res = await rt.exec(f"sleep {mark} & echo $!", timeout_s=120)
    assert not res.timed_out and res.exit_code == 0, res
    pid = res.output.strip()
    assert (await rt.exec(f"kill -0 {pid} && echo alive")).output == "alive\n"
    await rt.stop()
    assert await gone(mark)


async def test_a_timeout_kills_the_group_and_spares_what_earlier_calls_left(runtimes: Any, task_repo: Path) -> None:
    rt = await runtimes(source_dir=task_repo)
    kept, killed = marker(), marker()
    assert (await rt.exec(f"sleep {kept} >/dev/null 2>&1 &")).exit_code == 0
    res = await rt.exec(f"sleep {killed} & sleep {killed}", timeout_s=3)
    assert res.timed_out and res.exit_code == 124
    assert await gone(killed)
    assert host_pids_matching(kept)


# ----- sandbox: the instance ------------------------------------------------------------------------
@pytest.fixture
async def sandbox(task_repo: Path) -> Any:
    require_bwrap()
    rt = SandboxRuntime(RuntimeSpec(source_dir=task_repo, network="none"))
    await rt.prepare()
    yield rt
    await rt.stop()


async def test_each_exec_keeps_the_isolation(sandbox: SandboxRuntime) -> None:
    """Joined per exec, the sandbox is still the sandbox: no capability, no new privileges, its
    own /proc (the session's processes only), hostname and loopback-only network."""
    res = await sandbox.exec("grep -E '^(CapEff|CapPrm|NoNewPrivs)' /proc/self/status; hostname; "
                             f"test -e /proc/{os.getpid()}/cmdline && echo host-visible; "
                             "ls /proc | grep -c '^[0-9]*$'; cat /proc/net/dev | grep -c ':'; id -u")
    lines = res.output.splitlines()
    assert lines[:3] == ["CapPrm:\t0000000000000000", "CapEff:\t0000000000000000", "NoNewPrivs:\t1"], lines
    assert lines[3] == "sandbox" and "host-visible" not in lines, lines
    assert int(lines[4]) < 10  # init, holder, this shell and its pipeline
    assert lines[5:] == ["1", "0"], lines  # lo only; uid 0 inside


async def test_sessions_do_not_see_each_other(sandbox: SandboxRuntime, task_repo: Path) -> None:
    other = SandboxRuntime(RuntimeSpec(source_dir=task_repo, network="none"))
    await other.prepare()
    try:
        mark = marker()
        assert (await other.exec(f"sleep {mark} >/dev/null 2>&1 &")).exit_code == 0
        seen = await sandbox.exec("for p in /proc/[0-9]*; do [ \"$(tr '\\0' ' ' < $p/cmdline 2>/dev/null)\" = "
                                  f"'sleep {mark} ' ] && echo $p; done; echo end")
        mine = await other.exec("for p in /proc/[0-9]*; do [ \"$(tr '\\0' ' ' < $p/cmdline 2>/dev/null)\" = "
                                f"'sleep {mark} ' ] && echo $p; done; echo end")
        assert seen.output == "end\n" and mine.output != "end\n", (seen.output, mine.output)
    finally:
        await other.stop()


async def test_an_ended_instance_is_started_again(sandbox: SandboxRuntime) -> None:
    """The agent can end its own instance (kill the holder); the next call gets a new one."""
    res = await sandbox.exec("for p in /proc/[0-9]*; do [ \"$(tr '\\0' ' ' < $p/cmdline 2>/dev/null)\" = "
                             "'/bin/sh -c echo polar-ready; read -r _ || : ' ] && kill -9 ${p#/proc/} && echo killed; done")
    assert res.output == "killed\n", res.output
    for _ in range(100):
        if sandbox._instance is not None and not sandbox._instance.alive:
            break
        await asyncio.sleep(0.05)
    again = await sandbox.exec("echo back")
    assert again.output == "back\n" and sandbox.restarts == 1
