"""The ``swebench`` evaluator through the real runtimes (``make_runtime``): the bubblewrap sandbox on
the host system, the sandbox on the cached debootstrap rootfs, and Docker. The shared ``rootfs`` and
``docker_host`` fixtures (tests/conftest.py) skip locally when a prerequisite is missing and build or
start it — or fail — under CI."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("swebench.harness.grading", reason="the swebench extra is not installed: pip install -e '.[swebench]'",
                    exc_type=ImportError)

from polar_env.evaluators import EvalContext, run_evaluator
from polar_env.records import Status
from polar_env.runtimes import RuntimeSpec, make_runtime
from polar_env.runtimes.sandbox import DEFAULT_PATH
from polar_env.tasks.swe import SweTask
from tests.conftest import DOCKER_IMAGE, require_bwrap

pytestmark = pytest.mark.slow  # grades in real sandboxes and containers

HANG_TIMEOUT_S = 5.0


@pytest.fixture(params=["sandbox-host", "sandbox-rootfs", "docker"])
def spec_for(request: pytest.FixtureRequest):  # type: ignore[no-untyped-def]
    """``spec_for(task)`` → the RuntimeSpec of this variant holding the task's repo."""
    variant = request.param
    extra: dict = {}
    if variant.startswith("sandbox"):
        require_bwrap()
    if variant == "sandbox-host":
        # the host's /usr python has no pytest here: bind this interpreter's prefix and put it first on PATH
        prefixes = sorted({sys.base_prefix, sys.prefix})
        extra = {
            "binds": [(Path(p), p) for p in prefixes],
            "env": {"PATH": f"{Path(sys.executable).parent}:{DEFAULT_PATH}"},
        }
    elif variant == "sandbox-rootfs":
        extra = {"image": str(request.getfixturevalue("rootfs"))}
    else:
        request.getfixturevalue("docker_host")  # a private dockerd with the test image (CI: required)
        extra = {"image": DOCKER_IMAGE}

    def build(task: SweTask) -> RuntimeSpec:
        kind = "docker" if variant == "docker" else "sandbox"
        return RuntimeSpec(kind=kind, source_dir=task.repo_dir, network="none", **extra)

    return build


async def grade(task: SweTask, spec: RuntimeSpec, patch: str | None, runtime=None, **params):  # type: ignore[no-untyped-def]
    made = []

    def factory():  # type: ignore[no-untyped-def]
        made.append(make_runtime(spec))
        return made[-1]

    ctx = EvalContext(task=task, params=params, patch=patch, runtime=runtime, runtime_factory=factory)
    result = await run_evaluator("swebench", ctx)
    assert len(made) == 1
    return result


@pytest.mark.parametrize("toy_id", ["toy__calc-1", "toy__textkit-1", "toy__bsearch-1"])
async def test_gold_patch_resolves(toys, spec_for, toy_id):  # type: ignore[no-untyped-def]
    task = toys[toy_id]
    result = await grade(task, spec_for(task), task.patch)
    assert (result.status, result.reward) == (Status.COMPLETED, 1.0), result.report.get("log_tail") or result.report


async def test_breaking_pass_to_pass_and_not_applying(toys, spec_for):  # type: ignore[no-untyped-def]
    task = toys["toy__calc-1"]
    broken = await grade(task, spec_for(task), task.extra["variants"]["breaks_pass_to_pass"])
    assert broken.reward == 0.0 and "PASS_TO_PASS failed: tests/test_calc.py::test_add" in broken.report["reason"]
    bogus = "diff --git a/calc.py b/calc.py\n--- a/calc.py\n+++ b/calc.py\n@@ -1 +1 @@\n-no such line\n+x\n"
    refused = await grade(task, spec_for(task), bogus)
    assert refused.reward == 0.0 and refused.report["reason"] == "patch does not apply"
    assert len(refused.report["apply_logs"]) == 4


async def test_hanging_test_is_a_timeout(toys, spec_for):  # type: ignore[no-untyped-def]
    task = toys["toy__bsearch-1"]
    result = await grade(task, spec_for(task), "", skip_empty_patch=False, timeout_s=HANG_TIMEOUT_S)
    assert (result.status, result.reward) == (Status.TIMEOUT, 0.0), result.report
    assert result.report["timings_s"]["eval"] < HANG_TIMEOUT_S + 10


async def test_agent_diff_that_writes_the_new_test_file_does_not_help(toys, spec_for):  # type: ignore[no-untyped-def]
    task = toys["toy__textkit-1"]
    agent = make_runtime(spec_for(task))
    await agent.prepare()
    try:
        fake = ("import pytest\n\n\n@pytest.mark.parametrize('x', [1, 2], ids=['comma', 'dashes'])\n"
                "def test_collapse_runs(x):\n    pass\n\n\ndef test_strip_ends():\n    pass\n")
        await agent.write_file("/testbed/tests/test_slug_edges.py", fake.encode())
        result = await grade(task, spec_for(task), None, runtime=agent)  # the grader takes the change set itself
    finally:
        await agent.stop()
    assert result.reward == 0.0 and result.report["reason"] == "no admitted change", result.report
    assert [d["path"] for d in result.report["dropped_paths"]] == ["tests/test_slug_edges.py"]


@pytest.mark.parametrize("attack_name", ["conftest_root", "conftest_deep", "pytest_ini_plugin", "tests_init_import_hook"])
async def test_reward_hacks_score_zero_in_every_runtime(toys, spec_for, tmp_path, attack_name):  # type: ignore[no-untyped-def]
    """The grading-integrity policy holds in each real runtime (Docker included, graded as the node
    grades there: container root): a diff that only plants runner hooks scores 0, paths reported."""
    import shutil
    import subprocess

    from tests.evaluators.attacks import ATTACKS

    attack = next(a for a in ATTACKS if a.name == attack_name)
    task = toys["toy__calc-1"]
    repo = tmp_path / "repo"
    shutil.copytree(task.repo_dir, repo, symlinks=True)
    for path, text in attack.files.items():
        (repo / path).parent.mkdir(parents=True, exist_ok=True)
        (repo / path).write_text(text)
    git = ["git", "-c", "safe.directory=*", "-C", str(repo)]
    subprocess.run([*git, "add", "-A"], check=True)
    patch = subprocess.run([*git, "diff", "--cached"], check=True, capture_output=True, text=True).stdout
    spec = spec_for(task)
    if spec.kind == "docker":
        spec = spec.model_copy(update={"user": "root"})
    result = await grade(task, spec, patch)
    assert result.status is Status.COMPLETED and result.reward == 0.0, result.report
    dropped = {d["path"] for d in result.report["dropped_paths"]}
    assert set(attack.expect_dropped) <= dropped, result.report["dropped_paths"]
