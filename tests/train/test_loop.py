"""The loop end to end on the real path (embedded engine, gateway, capture, merge, evaluator):
weight versions on records advance with the steps, the engine ends up with the trainer's weights,
and ``polar-env train`` writes its report."""

from __future__ import annotations

import asyncio
import copy
from pathlib import Path

import orjson
import pytest
import torch
import yaml

from polar_env.cli import main
from polar_env.engines.embedded.engine import EmbeddedEngine
from polar_env.train.loop import run_recipe
from polar_env.train.recipe import Recipe
from polar_env.train.rollout import LocalGateway, ToyTask
from polar_env.train.trainer import GRPOTrainer, TrainerConfig
from tests.conftest import require_bwrap

pytestmark = pytest.mark.slow  # CPU GRPO steps

TINY = {
    "name": "tiny", "steps": 3, "rollouts_per_task": 3, "source": "local",
    "tasks": [{"task_id": "k", "instruction": "Say a word with a k.", "follow_ups": ["Again."]}],
    "evaluator": {"name": "output", "regex": "k", "ignore_case": True},
    "sampling": {"temperature": 0.1, "max_tokens": 3},
    "trainer": {"lr": 0.01},
}


def test_records_carry_the_weight_version_of_each_step(tmp_path: Path) -> None:
    """Local source: multi-call sessions (instruction + follow-up), merged into one trace each."""
    recipe = Recipe.model_validate({**TINY, "out_dir": str(tmp_path / "run")})
    result = asyncio.run(run_recipe(recipe))
    assert [s.weight_versions for s in result.steps] == [["0"], ["1"], ["2"]]
    assert [s.new_version for s in result.steps] == ["1", "2", "3"]
    # and in the capture journal itself, every record of step k was sampled under version k
    journals = sorted((tmp_path / "run" / "capture").glob("*.jsonl"))
    versions = {orjson.loads(line)["weight_version"] for j in journals for line in j.read_bytes().splitlines()}
    assert versions == {"0", "1", "2"}
    assert all(s.step0_max_abs_delta <= 1e-4 for s in result.steps)  # every batch, not just the first
    assert result.per_request_traces == 2 * result.merged_traces == 2 * 3 * 3  # two calls per session, one trace
    assert result.per_request_tokens > result.merged_tokens


def test_steps_keep_no_tensors_and_report_resident_memory(tmp_path: Path) -> None:
    """The loop holds nothing from one step to the next (no graphs, batches or weight copies): the
    live tensors after the last step are those after the first plus Adam's state (3 per parameter,
    made at the first update), give or take one transient state dict."""
    import gc

    live: list[int] = []

    def count(_record: object) -> None:
        gc.collect()
        live.append(sum(1 for o in gc.get_objects() if type(o) in (torch.Tensor, torch.nn.Parameter)))

    recipe = Recipe.model_validate({**TINY, "steps": 4, "out_dir": str(tmp_path / "run")})
    result = asyncio.run(run_recipe(recipe, count))
    params = sum(1 for _ in EmbeddedEngine().model.state_dict())
    assert live[-1] <= live[0] + 4 * params, live  # a state dict kept per step would add 4 * params more
    assert all(s.rss_gb > 0.0 for s in result.steps)


def test_polar_env_source_trains_and_advances_versions(tmp_path: Path) -> None:
    """The staged pipeline: PolarEnv, one bwrap sandbox per session, the loop harness."""
    require_bwrap()
    tasks = [{"task_id": "k", "instruction": "Say a word with a k."}]
    recipe = Recipe.model_validate({**TINY, "source": "polar_env", "tasks": tasks, "out_dir": str(tmp_path / "run")})
    result = asyncio.run(run_recipe(recipe))
    assert [s.weight_versions for s in result.steps] == [["0"], ["1"], ["2"]]
    assert [s.rollouts for s in result.steps] == [3, 3, 3]
    assert all(s.step0_max_abs_delta <= 1e-4 and s.sampled_tokens == 3 * 3 for s in result.steps)
    assert result.per_request_traces == result.merged_traces == 9  # one call per session


def test_follow_ups_need_the_local_source() -> None:
    with pytest.raises(ValueError, match="follow_ups need source: local"):
        Recipe.model_validate({**TINY, "source": "polar_env"})


def test_update_weights_pauses_reloads_and_resumes(task: ToyTask) -> None:
    engine = EmbeddedEngine(max_tokens=3)
    trainer = GRPOTrainer(copy.deepcopy(engine.model), TrainerConfig(lr=0.05))
    seen: dict[str, object] = {}

    async def run() -> None:
        async with LocalGateway(engine, temperature=0.1, max_tokens=3) as gateway:
            assert gateway.gateway is not None
            gate = gateway.gateway.gate
            reload = engine.reload_weights

            def watched_reload(state):  # type: ignore[no-untyped-def]
                seen.update(paused=gate.paused, in_flight=gate.in_flight)
                return reload(state)

            engine.reload_weights = watched_reload  # type: ignore[method-assign]
            batch = await gateway.rollout(task, 3)
            batch[0] = batch[0].model_copy(update={"reward": 1.0})  # make sure the step moves weights
            await asyncio.to_thread(trainer.step, batch)
            assert await gateway.update_weights(trainer.state_dict()) == "1"
            assert seen == {"paused": True, "in_flight": 0}  # reloaded only behind a drained gate
            assert not gate.paused and await gateway.weight_version() == "1"
            after = await gateway.rollout(task, 2)
            assert all(t.metadata["weight_versions"] == ["1"] for t in after)

    asyncio.run(run())
    for name, value in trainer.model.state_dict().items():
        assert torch.equal(engine.model.state_dict()[name], value), name


def test_cli_train_writes_the_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    recipe = tmp_path / "tiny.yaml"
    recipe.write_text(yaml.safe_dump({**TINY, "steps": 2}))
    out = tmp_path / "report"
    assert main(["train", str(recipe), "--out-dir", str(out), "--seed", "3"]) == 0
    printed = capsys.readouterr().out
    assert "step   1:" in printed and "updates per-request 12 vs merged 6" in printed
    summary = orjson.loads((out / "summary.json").read_bytes())
    assert summary["seed"] == 3 and summary["steps"] == 2 and summary["step0_max_abs_delta"] <= 1e-4
    pytest.importorskip("matplotlib", reason="pip install -e '.[report]'")
    assert (out / "reward.png").stat().st_size > 0 and (out / "ratio_delta.png").stat().st_size > 0


def test_a_bad_recipe_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    recipe = tmp_path / "bad.yaml"
    recipe.write_text(yaml.safe_dump({**TINY, "rollouts_per_task": "many"}))
    assert main(["train", str(recipe)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "rollouts_per_task" in err and str(recipe) in err


def test_sigterm_stops_a_train_run_as_interrupted(tmp_path: Path) -> None:
    """A scheduler's stop (SIGTERM) ends `polar-env train` with 143 and the run reads interrupted,
    its steps so far kept; without a handler the process died and the run read crashed."""
    import os
    import signal
    import subprocess
    import sys

    from polar_env.observe.liveness import run_state
    from tests.waits import until_sync

    recipe = tmp_path / "tiny.yaml"
    recipe.write_text(yaml.safe_dump({**TINY, "steps": 200}))
    out = tmp_path / "report"
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.Popen([sys.executable, "-m", "polar_env.cli", "train", str(recipe), "--out-dir", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONPATH": str(root)})
    try:
        until_sync(lambda: run_state(out).state == "running", timeout_s=120, what="the train run beating")
        proc.send_signal(signal.SIGTERM)
        printed, _ = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 143, printed[-2000:]
    assert "SIGTERM: stopped" in printed
    assert run_state(out).state == "interrupted"
