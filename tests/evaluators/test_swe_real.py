"""Rewards that are right on real work: for real SWE-bench-style instances (``../shared/swe-real``),
each in its own environment built from its recipe, the gold patch scores 1.0, an empty patch 0.0 and
a wrong patch 0.0, all completed and unmasked, through the real ``polar-env rollout`` in the
bubblewrap sandbox and in Docker (``scripts/swe_real_rollouts.py`` does the work; its docstring says
how the environment reaches the runtime and what the wrong patch is).

Sandbox: three instances, ~20-35 s each on 2 cores: the two fastest on pytest 7 and attrs-887 on
pytest 6.2.5 (the grader's plugin must work there too). Docker (the tests' own dockerd and imported
rootfs): the fastest one, ~60 s. Environments are built, or reused when up to date, by the set's
``build_env.sh`` in the script's cache (``POLAR_SWE_REAL_ENVS`` names another); ``.ci/run`` builds
these three before pytest. Without the set, bwrap or a daemon this skips locally and fails under CI."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from scripts import swe_real_rollouts as swe
from tests.conftest import DOCKER_IMAGE, require_swebench, unavailable
from tests.machine import machine_lock

pytestmark = pytest.mark.slow
# Keep in step with the environments .ci/run builds.
IDS = ("pallets__click-2223", "marshmallow-code__marshmallow-1989", "python-attrs__attrs-887")
ENVS = Path(os.environ.get("POLAR_SWE_REAL_ENVS") or swe.ENVS).expanduser()


@pytest.mark.parametrize("instance", IDS)
def test_sandbox_gold_one_empty_and_wrong_zero(instance: str, tmp_path: Path) -> None:
    if shutil.which("bwrap") is None:
        unavailable("bubblewrap is not installed (apt-get install -y bubblewrap)")
    _check(instance, tmp_path, "sandbox")


def test_docker_gold_one_empty_and_wrong_zero(docker_host: str, tmp_path: Path) -> None:
    _check(IDS[0], tmp_path, "docker", DOCKER_IMAGE)


def _check(instance: str, work: Path, runtime: str, image: str | None = None) -> None:
    if not (swe.SHARED / "instances.jsonl").is_file():
        unavailable(f"the swe-real set is not at {swe.SHARED} (the shared folder beside the checkout)")
    require_swebench()
    row = swe.load_instances(swe.SHARED)[instance]
    with machine_lock("swe-real-build"):  # build_env.sh installs uv once into a shared folder
        swe.build_env(swe.SHARED, row, ENVS)
    results = swe.run([instance], envs=ENVS, work=work, runtime=runtime, image=image, echo=False)
    assert [r.case for r in results] == list(swe.CASES)
    assert all(r.ok for r in results), f"run folders under {work}\n{swe.table(results)}"
