"""Checks live with their kinds (issue 47, item 2): every engine, harness, runtime and evaluator
entry carries its own preflight check, the preflight runs the checks of the kinds a job names by
iterating the registries, and a kind that brings no check cannot register. Before, a new runtime
kind was skipped by the preflight without a word (``check_runtime`` knew three kinds by name)."""

from __future__ import annotations

import importlib
import json
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from polar_env import preflight
from polar_env.cli import main
from polar_env.engines.config import ENGINES
from polar_env.env import PolarEnvConfig
from polar_env.errors import ConfigError
from polar_env.evaluators import EVALUATORS
from polar_env.harnesses import HARNESSES
from polar_env.registry import Registry
from polar_env.runtimes import RUNTIMES, RuntimeNeeds, RuntimeSpec

ROOT = Path(__file__).resolve().parents[1]

# The whole of a new runtime kind's own module (a test double: its sessions are never started);
# the kind is then one RUNTIMES.register line away from being usable, preflight included.
THROWAWAY_MODULE = '''
from polar_env.errors import ConfigError
from polar_env.runtimes import RuntimeNeeds, RuntimeSpec

SEEN: list[RuntimeNeeds] = []


class ThrowawayRuntime:
    """A runtime kind that exists only in this test."""

    def __init__(self, spec: RuntimeSpec) -> None:
        self.spec = spec


def check_throwaway(needs: RuntimeNeeds) -> None:
    SEEN.append(needs)
    if needs.image == "refuse-me":
        raise ConfigError("the throwaway runtime cannot run refuse-me here, runtime throwaway; use another image")
'''


@pytest.fixture
def throwaway(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[object]:
    """The throwaway kind's module, importable; RUNTIMES put back afterwards."""
    (tmp_path / "throwaway_runtime.py").write_text(THROWAWAY_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    saved = RUNTIMES.snapshot()
    try:
        yield importlib.import_module("throwaway_runtime")
    finally:
        RUNTIMES.restore(saved)
        sys.modules.pop("throwaway_runtime", None)


def test_a_runtime_kind_without_a_check_cannot_register(throwaway: object) -> None:
    with pytest.raises(ConfigError) as refused:
        RUNTIMES.register("throwaway", throwaway.ThrowawayRuntime, params=RuntimeSpec)  # type: ignore[attr-defined]
    line = str(refused.value)
    assert line == ("runtime 'throwaway' has no preflight check; register it with preflight=<a function that raises "
                    "ConfigError when this host cannot run the runtime>")
    assert "throwaway" not in RUNTIMES  # nothing half-registered


def test_a_registered_runtime_kinds_check_runs_in_the_preflight(throwaway: object, tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    """Its module plus one register line (2 files, as docs/architecture.md says): the preflight runs
    its check with what the sessions ask, and its refusal is the CLI's one line and exit 2."""
    module = throwaway
    RUNTIMES.register("throwaway", module.ThrowawayRuntime, params=RuntimeSpec,  # type: ignore[attr-defined]
                      preflight=module.check_throwaway)  # type: ignore[attr-defined]
    env = PolarEnvConfig.model_validate({"engine": {"kind": "simulated"}, "harness": "loop",
                                         "runtime": {"kind": "throwaway", "image": "img:1", "agent_root": "require"}})
    preflight.check_env(env, [], "rollout")
    assert module.SEEN == [RuntimeNeeds(image="img:1", agent_root="require", images=("img:1",))]  # type: ignore[attr-defined]

    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(json.dumps({"task_id": "echo", "instruction": "run echo hi"}) + "\n")
    out = tmp_path / "out"
    config = tmp_path / "env.yaml"
    config.write_text("runtime:\n  kind: throwaway\n  image: refuse-me\n")
    rc = main(["rollout", "--engine", "simulated", "--harness", "loop", "--no-progress", "--tasks", str(tasks),
               "--config", str(config), "--out", str(out)])
    err = capsys.readouterr().err
    assert rc == 2 and err.strip() == ("polar-env rollout: error: the throwaway runtime cannot run refuse-me here, "
                                       "runtime throwaway; use another image"), err
    assert not out.exists()  # refused before the run folder
    # what adding it took: the module, and the one line that registers it (kinds.py, for a built-in kind)
    registering = [p for p in (ROOT / "polar_env").rglob("*.py") if "RUNTIMES.register(" in p.read_text()]
    assert [p.relative_to(ROOT).as_posix() for p in registering] == ["polar_env/runtimes/kinds.py"]


def test_every_kind_of_the_four_tables_carries_a_check() -> None:
    for table in (ENGINES, HARNESSES, RUNTIMES, EVALUATORS):
        for name in table.names():
            assert callable(table.preflight(name)), (table.kind, name)
    # a kind loaded by import path gets its table's default check
    assert callable(EVALUATORS.preflight("polar_env.evaluators.output:OutputEvaluator"))


def test_an_engine_kind_without_a_check_cannot_register() -> None:
    saved = ENGINES.snapshot()
    try:
        with pytest.raises(ConfigError, match=r"^engine 'throwaway' has no preflight check; register it with preflight="):
            ENGINES.register("throwaway", type(ENGINES.get("simulated")))
    finally:
        ENGINES.restore(saved)


def test_a_table_without_checks_refuses_one_and_the_default_check_applies() -> None:
    plain: Registry[int] = Registry("widget")
    with pytest.raises(ConfigError, match="widgets have no preflight checks"):
        plain.register("w", 1, preflight=lambda: None)
    seen: list[str] = []
    defaulted: Registry[int] = Registry("gadget", preflight=seen.append)
    defaulted.register("g", 1)
    defaulted.preflight("g")("called")
    assert seen == ["called"]


# -- capabilities are declared (Protocols), not probed by name ------------------------------------

CAPABILITIES = ("set_weight_version", "wants_fresh_runtime", "prewarm", "limit_hit", "limits_report")


def test_no_capability_is_found_by_getattr() -> None:
    """Before: ``getattr(engine, "set_weight_version", None)`` and the like in 8 places."""
    import ast

    probes = []
    for path in sorted((ROOT / "polar_env").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr")
                    and len(node.args) > 1 and isinstance(node.args[1], ast.Constant) and node.args[1].value in CAPABILITIES):
                probes.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.args[1].value}")
    assert probes == []


def test_every_kind_declares_its_capabilities() -> None:
    from polar_env.engines.base import WeightVersioned
    from polar_env.engines.embedded.engine import EmbeddedEngine
    from polar_env.evaluators import FreshRuntimeEvaluator, PrewarmingEvaluator, get_evaluator
    from polar_env.runtimes.base import Limited, ReportsLimits, limit_hit_of, limits_report_of

    for kind in RUNTIMES.names():
        runtime = RUNTIMES.get(kind)(RuntimeSpec(kind=kind))
        assert isinstance(runtime, Limited) and isinstance(runtime, ReportsLimits), kind
        assert limit_hit_of(runtime) is None  # a fresh runtime has hit nothing
    assert issubclass(EmbeddedEngine, WeightVersioned)
    assert isinstance(get_evaluator("swebench"), PrewarmingEvaluator)
    assert all(isinstance(get_evaluator(n), FreshRuntimeEvaluator) for n in ("output", "session_completion", "harbor"))
    assert not isinstance(get_evaluator("output"), PrewarmingEvaluator)

    class Bare:  # a test double that declares neither: nothing hit, nothing reported
        pass

    assert limit_hit_of(Bare()) is None and limits_report_of(Bare()) == {}
