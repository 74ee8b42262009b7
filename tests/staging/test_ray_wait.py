"""Ray hosts that join late (a loaded site, a SLURM allocation still starting its workers): the node
actors wait for their resource with a progress line per poll, then start; past ``--ray-wait-s`` the
run is refused in one line. Ray's own ``cluster_resources`` is replaced by a test double that
reports hosts joining over time (a real late-joining cluster: tests/e2e/test_slurm.py)."""

from __future__ import annotations

import asyncio

import pytest

from polar_env.errors import ConfigError
from polar_env.staging.cluster import wait_for_resource
from tests.conftest import require_extras


def joining(monkeypatch: pytest.MonkeyPatch, units: list[float]) -> list[float]:
    require_extras("ray")
    import ray

    seen: list[float] = []

    def cluster_resources() -> dict[str, float]:
        seen.append(units[min(len(seen), len(units) - 1)])
        return {"polar_host": seen[-1]}

    monkeypatch.setattr(ray, "cluster_resources", cluster_resources)
    return seen


def test_late_hosts_are_waited_for_with_progress(monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    seen = joining(monkeypatch, [0, 1, 1, 2])
    asyncio.run(wait_for_resource("polar_host", 2, wait_s=30, first_poll_s=0.01))
    assert seen == [0, 1, 1, 2]
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("polar-env: waiting for Ray hosts: 0 of 2 unit(s) of polar_host")
    assert "--ray-wait-s" in err[0] and err[-1].startswith("polar-env: Ray hosts ready: 2 unit(s) of polar_host")


def test_hosts_already_there_print_nothing(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    joining(monkeypatch, [3])
    asyncio.run(wait_for_resource("polar_host", 2, wait_s=30))
    assert capsys.readouterr().err == ""


def test_past_the_wait_the_run_is_refused_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    joining(monkeypatch, [1])
    with pytest.raises(ConfigError) as err:
        asyncio.run(wait_for_resource("polar_host", 2, wait_s=0.05, first_poll_s=0.01))
    text = str(err.value)
    assert "\n" not in text and "after 0.05 s" in text and "--nodes 1" in text and "--ray-wait-s" in text
