"""The grader's pytest plugin in the environments SWE-bench and SWE-Gym ship: each pytest from 4.6 to
8 installed from the package index into its own venv, on the oldest and the newest Python this machine
has (pyenv's, when there is one; this interpreter otherwise), run on a small real project with the
grader's own reader (``results.py``) on the other side.

Where a combination cannot run here: pytest 4.6 on Python 3.11+ (its assertion rewriter fails on
3.11's AST, before any plugin), pytest 5.x and 6.x on 3.13 are not tried (their last releases predate
it); pytest 3.x is below the plugin's floor and must say so (``unsupported``: the evaluator grades
from the log and says that in ``results_from``).

Each case is a real pytest run of the task's interpreter with the plugin loaded by name, as the
evaluators stage it; the attacks are project code (``pkg/__init__.py``, a file a fix may edit).
"""

from __future__ import annotations

import fcntl
import json
import os
import secrets
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from polar_env.evaluators import results as R
from polar_env.evaluators.integrity import in_test_location
from tests.conftest import unavailable

pytestmark = pytest.mark.slow

CACHE = Path(os.environ.get("POLAR_PYTEST_MATRIX", Path.home() / ".cache" / "polar_env" / "pytest-matrix"))
PYENV = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"


def _pythons() -> tuple[Path, Path]:
    """(oldest, newest) CPython 3 this machine has."""
    found = sorted((tuple(int(x) for x in p.name.split(".")[:2]), p / "bin" / "python")
                   for p in PYENV.glob("3.*") if (p / "bin" / "python").exists() and p.name.replace(".", "").isdigit())
    here = (sys.version_info[:2], Path(sys.executable))
    found = sorted([*found, here])
    return found[0][1], found[-1][1]


OLDEST, NEWEST = _pythons()


def _minor(python: Path) -> tuple[int, int]:
    out = subprocess.run([str(python), "-c", "import sys; print(sys.version_info[0], sys.version_info[1])"],
                         capture_output=True, text=True, check=True).stdout.split()
    return int(out[0]), int(out[1])


def _matrix() -> list[tuple[Path, str]]:
    old, new = _minor(OLDEST), _minor(NEWEST)
    cases = [(OLDEST, v) for v, upto in (("4.6.11", (3, 10)), ("5.4.3", (3, 10)), ("6.2.5", (3, 12)), ("7.0.1", (3, 13)))
             if old <= upto]
    cases += [(NEWEST, v) for v, upto in (("6.2.5", (3, 12)), ("7.4.4", (3, 13)), ("8.3.5", (3, 14))) if new <= upto]
    return cases


def _uv() -> str:
    found = shutil.which("uv")
    if found:
        return found
    target = CACHE / "uv"
    if not (target / "bin" / "uv").exists():
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--target",
                        str(target), "uv==0.13.9"], check=True)
    return str(target / "bin" / "uv")


def venv(python: Path, pytest_version: str) -> Path:
    """A venv of ``python`` with ``pytest==pytest_version`` from the package index, cached."""
    minor = ".".join(map(str, _minor(python)))
    dest = CACHE / f"py{minor}-pytest{pytest_version}"
    exe = dest / "bin" / "python"
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / ".lock", "w") as lock:  # the suite's xdist workers build into one cache
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (dest / ".complete").exists():
            _build(python, pytest_version, dest)
    return exe


def _build(python: Path, pytest_version: str, dest: Path) -> None:
    exe = dest / "bin" / "python"
    shutil.rmtree(dest, ignore_errors=True)
    uv = _uv()
    try:
        subprocess.run([uv, "venv", "-q", "-p", str(python), str(dest)], check=True, capture_output=True, timeout=300)
        subprocess.run([uv, "pip", "install", "-q", "--python", str(exe), f"pytest=={pytest_version}"], check=True,
                       capture_output=True, timeout=600)
    except (subprocess.SubprocessError, OSError) as exc:
        shutil.rmtree(dest, ignore_errors=True)
        unavailable(f"cannot build a venv with pytest {pytest_version} on {python}: {exc}")
    (dest / ".complete").write_text(pytest_version)


PKG = "def add(a, b):\n    return a + b\n\n\ndef check(x):\n    return x\n"
TESTS = '''import pytest
from pkg import add, check


def test_add():
    assert add(2, 3) == 5


@pytest.mark.parametrize("a", [1, 2])
def test_add_param(a):
    assert add(a, 0) == a


class TestCheck:
    def test_check(self):
        assert check(4) == 4


@pytest.mark.xfail(reason="a known bug")
def test_known_bad():
    assert add(1, 1) == 3


def test_target():
    assert check(add(1, 1)) == 3
'''
FIXED_PKG = PKG.replace("return x\n", "return x + 1 if x == 2 else x\n")
# project code (a file a fix may edit) forging its way past the failing test
XFAIL_FROM_PROJECT = PKG.replace("    return x\n", "    import pytest\n    pytest.xfail('flaky')\n    return x\n")
SKIP_FROM_PROJECT = PKG.replace("    return x\n", "    import pytest\n    pytest.skip('later')\n    return x\n")
EXIT_FROM_PROJECT = PKG.replace("    return x\n", "    import os\n    if x == 2:\n        os._exit(0)\n    return x\n")
TRUNCATE_REPORT = PKG + (
    "\n\nimport os\nfor _fd in range(3, 64):\n"
    "    try:\n"
    "        if 'polar-grader' in os.readlink('/proc/self/fd/%d' % _fd):\n"
    "            os.ftruncate(_fd, 0)\n"
    "    except OSError:\n"
    "        pass\n")
PASS_EVERYTHING = PKG + (
    "\n\nimport _pytest.reports as _r\n_orig = _r.TestReport.from_item_and_call\n\n\n"
    "def _made(item, call):\n    rep = _orig(item, call)\n    rep.outcome = 'passed'\n    rep.longrepr = None\n    return rep\n\n\n"
    "_r.TestReport.from_item_and_call = staticmethod(_made)\n")


@dataclass
class Run:
    exit_code: int
    verdict: R.Verdict
    output: str
    work: Path


def run(python: Path, tmp: Path, pkg: str = PKG, canaries: int = 2, tests: str = TESTS) -> Run:
    """pytest in ``python`` on the project, the plugin staged as ``results.stage_reporter`` stages it."""
    work = tmp / f"w-{secrets.token_hex(4)}"
    (work / "pkg").mkdir(parents=True)
    (work / "tests").mkdir()
    (work / "pkg" / "__init__.py").write_text(pkg)
    (work / "tests" / "test_pkg.py").write_text(tests)
    grader = tmp / f"polar-grader-{secrets.token_hex(8)}"
    grader.mkdir()
    key, tag = secrets.token_bytes(32), secrets.token_hex(8)
    report = grader / "report.jsonl"
    report.write_bytes(b"")
    config = {"key": key.hex(), "report": str(report), "tag": tag, "seed": secrets.randbits(64), "canaries": canaries,
              "files": ["tests/test_pkg.py"], "prefer": [], "words": list(R.CANARY_WORDS)}
    (grader / "config.json").write_text(json.dumps(config))
    shutil.copy(R.PLUGIN_SOURCE, grader / f"{R.PLUGIN_MODULE}.py")
    env = {"PATH": f"{python.parent}:/usr/bin:/bin", "HOME": str(tmp), "PYTHONPATH": str(grader),
           "POLAR_GRADER_CONFIG": str(grader / "config.json"), "PYTHONSAFEPATH": "1", "PYTHONDONTWRITEBYTECODE": "1",
           "PYTEST_ADDOPTS": f"-p no:cacheprovider --rootdir={work} -p {R.PLUGIN_MODULE}"}
    proc = subprocess.run([str(python), "-m", "pytest", "-rA", "tests"], cwd=work, env=env, capture_output=True,
                          text=True, timeout=300)
    output = proc.stdout + proc.stderr
    reporter = R.Reporter(str(grader), str(report), key, tag, 2 * canaries, {})
    raw = report.read_bytes() if report.exists() else None
    records, bad = R.read_report(raw, key)
    found = R.verdict(records, bad, reporter, editable=lambda p: not in_test_location(p), beacon=R.beacon_seen(output, reporter),
                      report_missing=raw is None)
    return Run(proc.returncode, found, output, work)


MATRIX = _matrix()
IDS = [f"{p.parent.parent.name}-pytest{v}" for p, v in MATRIX]


@pytest.fixture(scope="module", params=MATRIX, ids=IDS)
def python(request: pytest.FixtureRequest) -> Path:
    return venv(*request.param)


def _where(r: Run) -> str:
    return f"{r.verdict.as_report()}\n{r.output[-3000:]}"


def test_an_honest_run_is_graded_with_its_canaries(python: Path, tmp_path: Path) -> None:
    r = run(python, tmp_path)
    v = r.verdict
    assert v.state == R.FINISHED and not v.problems and not v.faults, _where(r)
    assert v.statuses == {"tests/test_pkg.py::test_add": "PASSED", "tests/test_pkg.py::test_add_param[1]": "PASSED",
                          "tests/test_pkg.py::test_add_param[2]": "PASSED",
                          "tests/test_pkg.py::TestCheck::test_check": "PASSED",
                          "tests/test_pkg.py::test_known_bad": "XFAIL", "tests/test_pkg.py::test_target": "FAILED"}, _where(r)
    assert len(v.canaries) == 4 and all(c["ok"] for c in v.canaries), _where(r)
    assert r.exit_code == 1  # test_target failed
    assert (r.work / "tests" / "test_pkg.py").read_text() == TESTS  # the copies left with the run


def test_unittest_style_classes_are_copied_too(python: Path, tmp_path: Path) -> None:
    tests = ("import unittest\nfrom pkg import add\n\n\nclass AddCase(unittest.TestCase):\n"
             "    def test_add(self):\n        self.assertEqual(add(1, 2), 3)\n")
    r = run(python, tmp_path, tests=tests)
    assert r.verdict.state == R.FINISHED and not r.verdict.problems, _where(r)
    assert len(r.verdict.canaries) == 4 and all(c["ok"] for c in r.verdict.canaries), _where(r)
    assert r.verdict.statuses == {"tests/test_pkg.py::AddCase::test_add": "PASSED"} and r.exit_code == 0, _where(r)


def test_the_failing_copies_leave_the_exit_status_to_the_suite(python: Path, tmp_path: Path) -> None:
    r = run(python, tmp_path, FIXED_PKG)
    assert r.verdict.state == R.FINISHED and not r.verdict.problems, _where(r)
    assert r.verdict.statuses["tests/test_pkg.py::test_target"] == "PASSED"
    assert sum(c["expected"] == "fail" for c in r.verdict.canaries) == 2 and "FAILED" in r.output
    assert r.exit_code == 0, _where(r)


@pytest.mark.parametrize("pkg", [XFAIL_FROM_PROJECT, SKIP_FROM_PROJECT], ids=["xfail", "skip"])
def test_an_xfail_or_skip_raised_from_project_code_is_a_failure(python: Path, tmp_path: Path, pkg: str) -> None:
    r = run(python, tmp_path, pkg)
    assert r.verdict.state == R.FINISHED, _where(r)
    assert r.verdict.statuses["tests/test_pkg.py::test_target"] == "FAILED", _where(r)
    refused = {x["test"]: x["why"] for x in r.verdict.refused}
    assert "pkg/__init__.py" in refused["tests/test_pkg.py::test_target"]
    assert r.verdict.statuses["tests/test_pkg.py::test_known_bad"] == "XFAIL"  # the suite's own mark still counts


def test_a_process_that_leaves_early_is_unfinished(python: Path, tmp_path: Path) -> None:
    r = run(python, tmp_path, EXIT_FROM_PROJECT)
    assert r.exit_code == 0 and r.verdict.state == R.UNFINISHED, _where(r)


def test_an_emptied_report_is_tampering(python: Path, tmp_path: Path) -> None:
    r = run(python, tmp_path, TRUNCATE_REPORT)
    assert r.verdict.state == R.TAMPERED, _where(r)


def test_passing_everything_flips_the_failing_copies(python: Path, tmp_path: Path) -> None:
    r = run(python, tmp_path, PASS_EVERYTHING)
    assert r.verdict.state == R.TAMPERED and any("must fail" in p for p in r.verdict.problems), _where(r)


def test_pytest_below_the_floor_says_unsupported(tmp_path: Path) -> None:
    if _minor(OLDEST) > (3, 9):
        pytest.skip(f"pytest 3.10 needs Python <= 3.9; the oldest here is {OLDEST}")
    r = run(venv(OLDEST, "3.10.1"), tmp_path)
    assert r.verdict.state == R.UNSUPPORTED and r.verdict.loaded and r.verdict.loaded["pytest"] == "3.10.1", _where(r)


def test_the_plugin_parses_as_python_3_6() -> None:
    import ast

    ast.parse(R.PLUGIN_SOURCE.read_text(), feature_version=(3, 6))
