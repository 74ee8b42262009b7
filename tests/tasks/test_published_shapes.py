"""Task rows in the published shapes of SWE-Gym (``SWE-Gym/SWE-Gym``, split train), SWE-bench
Verified (``princeton-nlp/SWE-bench_Verified``, split test) and SkyRL-v0-293-data
(``NovaSky-AI/SkyRL-v0-293-data``, train.parquet): small fixtures in tests/fixtures/tasks written
from the datasets' documented columns (values invented), read by the loader, by PolarEnv's task
builder, and by the slime recipe's path (``--metadata-key instance``); a missing column is one line."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from polar_env.env import PolarEnvConfig, task_request
from polar_env.errors import ConfigError
from polar_env.integrations.slime import task_row
from polar_env.tasks import load_swe_tasks

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "tasks"
SWE_GYM = FIXTURES / "swe_gym_train.jsonl"
VERIFIED = FIXTURES / "swe_bench_verified_test.jsonl"
SKYRL = FIXTURES / "skyrl_v0_293_train.jsonl"


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_swe_gym_rows() -> None:
    assert set(_rows(SWE_GYM)[0]) == {"instance_id", "hints_text", "patch", "test_patch", "created_at",
                                      "problem_statement", "repo", "base_commit", "version", "PASS_TO_PASS",
                                      "FAIL_TO_PASS"}
    tasks = load_swe_tasks(SWE_GYM)
    assert [t.instance_id for t in tasks] == ["getmoto__moto-7365", "pandas-dev__pandas-53123"]
    assert tasks[0].FAIL_TO_PASS == ["tests/test_mod.py::test_x"]
    assert tasks[0].image == "docker.io/xingyaoww/sweb.eval.x86_64.getmoto_s_moto-7365:latest"
    req = task_request(tasks[0], PolarEnvConfig())
    assert req.evaluator is not None and req.evaluator.name == "swebench"
    assert req.instruction == "Synthetic issue 0: x should be 2."


def test_swe_bench_verified_rows() -> None:
    tasks = load_swe_tasks(VERIFIED, image_style="swebench")
    first, second = tasks
    assert first.FAIL_TO_PASS == ["tests/test_mod.py::test_x"] and len(first.PASS_TO_PASS) == 2  # JSON text parsed
    assert first.environment_setup_commit == "e" * 40 and first.extra["difficulty"] == "15 min - 1 hour"
    assert first.image == "swebench/sweb.eval.x86_64.astropy_1776_astropy-12907:latest"
    assert second.PASS_TO_PASS == []


def test_skyrl_rows_jsonl_and_parquet(tmp_path: Path) -> None:
    rows = _rows(SKYRL)
    assert set(rows[0]) == {"prompt", "data_source", "ability", "instance"}
    (task, _) = load_swe_tasks(SKYRL)
    assert task.instance_id == "getmoto__moto-7365" and task.data_source == "swe-gym"
    assert task.prompt == rows[0]["prompt"]
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)  # `instance` becomes a struct column, as published
    assert pa.types.is_struct(pq.read_schema(path).field("instance").type)
    assert [t.instance_id for t in load_swe_tasks(path)] == [r["instance"]["instance_id"] for r in rows]
    as_text = tmp_path / "text.jsonl"  # re-uploads store `instance` as JSON text and `prompt` as a string
    as_text.write_text("".join(json.dumps({**r, "instance": json.dumps(r["instance"]), "prompt": "p"}) + "\n"
                               for r in rows))
    assert load_swe_tasks(as_text)[1].instance_id == "pandas-dev__pandas-53123"


def test_slime_recipe_reads_the_instance_column() -> None:
    """recipes/slime_grpo_qwen3.5_4b_swegym.yaml: --input-key prompt --metadata-key instance, so a
    sample's metadata is the row's `instance`: a SWE row PolarEnv grades with swebench."""
    row = _rows(SKYRL)[0]
    for metadata in (row["instance"], json.dumps(row["instance"])):
        sample = SimpleNamespace(index=0, prompt=row["prompt"], metadata=metadata)
        task = task_row(sample)
        assert task["instance_id"] == "getmoto__moto-7365"
        req = task_request(task, PolarEnvConfig())
        assert req.evaluator is not None and req.evaluator.name == "swebench" and req.task["base_commit"] == "1" * 40
    with pytest.raises(ConfigError, match="metadata is a list"):
        task_row(SimpleNamespace(index=3, prompt="p", metadata=[1]))


@pytest.mark.parametrize("path, drop, nested", [(SWE_GYM, "base_commit", False), (VERIFIED, "test_patch", False),
                                                 (SKYRL, "FAIL_TO_PASS", True)])
def test_a_missing_column_is_one_line(tmp_path: Path, path: Path, drop: str, nested: bool) -> None:
    rows = _rows(path)
    target = rows[1]["instance"] if nested else rows[1]
    del target[drop]
    bad = tmp_path / path.name
    bad.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(ConfigError) as err:
        load_swe_tasks(bad)
    message = str(err.value)
    assert "\n" not in message and "row 1 " in message and f"has no '{drop}' column" in message
    assert ("instance` struct" in message) is nested


def test_a_row_sets_its_own_runtime_budgets_and_evaluator() -> None:
    """Per-row settings win over the config's: the row's image, env (merged), binds (added), limits,
    budgets and evaluator settings (over the default swebench spec)."""
    row = _rows(SWE_GYM)[0]
    config = PolarEnvConfig.model_validate({"runtime": {"kind": "docker", "env": {"A": "1", "B": "1"}, "memory_mb": 2048,
                                                        "binds": [["/usr/share", "/opt/share"]]}})
    plain = task_request(row, config)
    assert plain.runtime.image == "docker.io/xingyaoww/sweb.eval.x86_64.getmoto_s_moto-7365:latest"
    assert plain.runtime.memory_mb == 2048 and plain.timeout_s == 600.0 and plain.evaluator is not None
    own = {**row, "timeout_s": 1200, "init_timeout_s": 900,
           "runtime": {"image": "moto:local", "env": {"B": "2"}, "memory_mb": 8192, "binds": [["/usr/lib", "/opt/lib"]]},
           "evaluator": {"timeout_s": 3600, "test_command": "pytest -rA tests/test_mod.py"}}
    req = task_request(own, config)
    assert req.runtime.kind == "docker" and req.runtime.image == "moto:local" and req.runtime.memory_mb == 8192
    assert req.runtime.env == {"A": "1", "B": "2"}
    assert [dst for _src, dst in req.runtime.binds] == ["/opt/share", "/opt/lib"]
    assert (req.timeout_s, req.init_timeout_s) == (1200, 900)
    assert req.evaluator is not None and req.evaluator.name == "swebench" and req.evaluator.timeout_s == 3600
    assert req.evaluator.params["test_command"] == "pytest -rA tests/test_mod.py"


def test_a_bad_row_runtime_is_one_line() -> None:
    row = {**_rows(SWE_GYM)[0], "runtime": {"memory_mb": 1}}
    with pytest.raises(ConfigError, match="getmoto__moto-7365") as err:
        task_request(row, PolarEnvConfig())
    assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="'runtime' must be a mapping"):
        task_request({**row, "runtime": "docker"}, PolarEnvConfig())
