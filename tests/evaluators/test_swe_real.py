"""Real SWE rows as users bring them, end to end: for real SWE-bench-style instances
(``../shared/swe-real``, rows with an ``environment_setup`` recipe and no eval script, no repo folder),
``polar-env images build`` makes each row's image from its recipe, and ``polar-env rollout`` of the
published row scores the gold patch 1.0, an empty patch 0.0 and a wrong patch 0.0, all completed and
unmasked, graded in a fresh runtime from the image (``scripts/swe_real_rollouts.py`` does the work;
its docstring says what the wrong patch is).

Sandbox (``--kind rootfs`` bundles): three instances with the ``loop`` harness, ~15-40 s each on 2
cores (the two fastest on pytest 7 and attrs-887 on pytest 6.2.5), and one with the real ``pi`` CLI.
Docker (the tests' own dockerd; ``--kind docker``, an image of the row's name over the imported
rootfs) and Apptainer (the real binary on the same bundle): the fastest one. Images go to the default store (``$POLAR_IMAGES`` or
``~/.cache/polar_env/images``), rebuilt only when their recipe changed; ``.ci/run`` builds the
sandbox ones before pytest. Without the set, bwrap, pi or a daemon this skips locally and fails
under CI."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from polar_env.harnesses import get_harness, install_hint, is_installed
from polar_env.runtimes.bundle import images_root
from scripts import swe_real_rollouts as swe
from tests.conftest import require_swebench, unavailable
from tests.machine import machine_lock

pytestmark = pytest.mark.slow
# Keep in step with the images .ci/run builds.
IDS = ("pallets__click-2223", "marshmallow-code__marshmallow-1989", "python-attrs__attrs-887")


@pytest.mark.parametrize("instance", IDS)
def test_sandbox_gold_one_empty_and_wrong_zero(instance: str, rootfs: Path, tmp_path: Path) -> None:
    _check(instance, tmp_path, "sandbox", "loop")


def test_sandbox_with_the_pi_cli(rootfs: Path, tmp_path: Path) -> None:
    if not is_installed(get_harness("pi")):
        unavailable(f"the pi CLI is not installed ({install_hint(get_harness('pi'))})")
    _check(IDS[0], tmp_path, "sandbox", "pi")


def test_docker_gold_one_empty_and_wrong_zero(docker_host: str, tmp_path: Path) -> None:
    _check(IDS[0], tmp_path, "docker", "loop")


def test_apptainer_gold_one_empty_and_wrong_zero(apptainer: str, rootfs: Path, tmp_path: Path) -> None:
    _check(IDS[0], tmp_path, "apptainer", "loop")


def _check(instance: str, work: Path, runtime: str, harness: str) -> None:
    if runtime == "sandbox" and shutil.which("bwrap") is None:
        unavailable("bubblewrap is not installed (apt-get install -y bubblewrap)")
    if not (swe.SHARED / "instances.jsonl").is_file():
        unavailable(f"the swe-real set is not at {swe.SHARED} (the shared folder beside the checkout)")
    require_swebench()
    with machine_lock("swe-real-build"):  # one build of an image at a time (uv installed once, one store)
        swe.build_image(swe.SHARED, instance, kind="docker" if runtime == "docker" else "rootfs",
                        store=images_root())
    results = swe.run([instance], work=work, runtime=runtime, harness=harness, echo=False)
    assert [r.case for r in results] == list(swe.CASES)
    assert all(r.ok for r in results), f"run folders under {work}\n{swe.table(results)}"
