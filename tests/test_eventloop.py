"""The server loop choice (polar_env/eventloop.py): uvloop where installed, asyncio's default loop
without it or when POLAR_ENV_LOOP=asyncio, and one clear line for a value that is neither."""

from __future__ import annotations

import asyncio
import importlib.util
import sys

import pytest

from polar_env import eventloop
from polar_env.errors import ConfigError

HAS_UVLOOP = importlib.util.find_spec("uvloop") is not None


async def _loop_module() -> str:
    return type(asyncio.get_running_loop()).__module__


def test_uvloop_where_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(eventloop.LOOP_ENV, raising=False)
    module = eventloop.run(_loop_module())
    assert module.startswith("uvloop") is HAS_UVLOOP
    assert eventloop.loop_name() == ("uvloop" if HAS_UVLOOP else "asyncio")


def test_default_loop_without_uvloop(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(eventloop.LOOP_ENV, raising=False)
    monkeypatch.setitem(sys.modules, "uvloop", None)  # as if not installed: importing it raises ImportError
    assert eventloop.loop_factory() is None and eventloop.loop_name() == "asyncio"
    assert eventloop.run(_loop_module()).startswith("asyncio")


def test_env_turns_uvloop_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(eventloop.LOOP_ENV, "asyncio")
    assert eventloop.loop_factory() is None
    assert eventloop.run(_loop_module()).startswith("asyncio")


def test_env_typo_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(eventloop.LOOP_ENV, "uvlop")
    with pytest.raises(ConfigError, match="POLAR_ENV_LOOP='uvlop': use 'uvloop' or 'asyncio'"):
        eventloop.loop_factory()


def test_new_loop_is_the_kind_run_uses(monkeypatch: pytest.MonkeyPatch) -> None:
    """PolarEnv keeps its nodes on a loop in a thread: the same kind ``run`` picks."""
    monkeypatch.delenv(eventloop.LOOP_ENV, raising=False)
    loop = eventloop.new_loop()
    try:
        assert type(loop).__module__.startswith("uvloop") is HAS_UVLOOP
    finally:
        loop.close()
    monkeypatch.setenv(eventloop.LOOP_ENV, "asyncio")
    loop = eventloop.new_loop()
    try:
        assert type(loop).__module__.startswith("asyncio")
    finally:
        loop.close()


def test_rollout_runs_its_nodes_on_the_chosen_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    """``polar_env.rollout`` (and the rollout, eval and sft commands, through the same ``eventloop.run``)
    runs the job on uvloop where installed: a node's CPU per call is mostly its sockets' work."""
    from polar_env.staging import job as job_module

    async def loop_of_job(job: object, progress: object = None) -> dict[str, str]:
        return {"loop": await _loop_module()}

    monkeypatch.delenv(eventloop.LOOP_ENV, raising=False)
    monkeypatch.setattr(job_module, "run_job", loop_of_job)
    assert job_module.rollout({})["loop"].startswith("uvloop") is HAS_UVLOOP
    monkeypatch.setenv(eventloop.LOOP_ENV, "asyncio")
    assert job_module.rollout({})["loop"].startswith("asyncio")
