"""``--tracker tensorboard|wandb`` on ``polar-env train`` and ``polar-env eval``: the event files
they write are read back with each tool's own reader (TensorBoard's EventAccumulator; W&B's
offline run log through its DataStore scanner) and hold the per-step figures and the config."""

from __future__ import annotations

import json
import struct
import zlib
from pathlib import Path

import pytest
import yaml

from polar_env.cli import main
from tests.conftest import require_bwrap

pytestmark = pytest.mark.slow  # real tracker libraries

TINY = {
    "name": "tiny", "steps": 2, "rollouts_per_task": 3, "source": "local",
    "tasks": [{"task_id": "k", "instruction": "Say a word with a k."}],
    "evaluator": {"name": "output", "regex": "k", "ignore_case": True},
    "sampling": {"temperature": 0.1, "max_tokens": 3},
    "trainer": {"lr": 0.01},
}


def tensorboard_scalars(folder: Path) -> tuple[dict[str, list[tuple[int, float]]], list[str]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (events,) = list(folder.glob("events.out.tfevents.*"))
    acc = EventAccumulator(str(events))
    acc.Reload()
    tags = acc.Tags()
    scalars = {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in tags["scalars"]}
    return scalars, tags["tensors"]


def wandb_log_records(path: Path) -> list[bytes]:
    """The records of a W&B run log (``run-*.wandb``): LevelDB log framing (32 KiB blocks; a 7-byte
    header per fragment: crc32, length, type FULL/FIRST/MIDDLE/LAST) after a 7-byte file header
    (``:W&B``, magic 0xBEE1, version). W&B 0.2x+ ships no Python reader for it (wandb-core, in
    Go, writes it), so this test reads the framing and lets W&B's own protobuf parse each record."""
    data = path.read_bytes()
    assert data[:4] == b":W&B" and struct.unpack("<H", data[4:6])[0] == 0xBEE1
    records, parts, pos, block = [], b"", 7, 32768
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is zero padding
            pos += block - pos % block
            continue
        checksum, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if length == 0 and kind == 0:
            break
        payload = data[pos + 7:pos + 7 + length]
        assert zlib.crc32(bytes([kind]) + payload) & 0xFFFFFFFF == checksum, f"bad crc at {pos}"
        parts += payload
        if kind in (1, 4):  # FULL or LAST
            records.append(parts)
            parts = b""
        pos += 7 + length
    return records


def wandb_records(folder: Path) -> tuple[list[dict[str, object]], dict[str, object]]:
    """(history rows, config) of the one offline run under ``folder/wandb``."""
    from wandb.proto import wandb_internal_pb2

    (log,) = list(folder.glob("wandb/offline-run-*/run-*.wandb"))
    history, config = [], {}
    for data in wandb_log_records(log):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(data)
        kind = record.WhichOneof("record_type")
        if kind == "history":
            history.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                            for item in record.history.item})
        elif kind == "run":
            config.update({u.key: json.loads(u.value_json) for u in record.run.config.update})
        elif kind == "config":
            config.update({u.key: json.loads(u.value_json) for u in record.config.update})
    return history, config


def test_train_tracker_tensorboard_event_files(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    recipe = tmp_path / "tiny.yaml"
    recipe.write_text(yaml.safe_dump(TINY))
    out = tmp_path / "run"
    assert main(["train", str(recipe), "--out-dir", str(out), "--tracker", "tensorboard"]) == 0
    scalars, tensors = tensorboard_scalars(out / "tensorboard")
    summary = json.loads((out / "summary.json").read_text())
    rewards = [value for _, value in scalars["train/reward_mean"]]
    assert [step for step, _ in scalars["train/reward_mean"]] == [0, 1]
    assert rewards == pytest.approx(summary["rewards"], abs=1e-4)
    assert max(v for _, v in scalars["train/step0_max_abs_delta"]) <= 1e-4
    for tag in ("train/ratio_min", "train/ratio_max", "train/sampled_tokens_per_s", "time/rollout_s",
                "time/train_s", "time/sync_s", "summary/improvement"):
        assert tag in scalars, tag
    assert "config" in tensors and "summary" in tensors  # the recipe and the run summary, as text


def test_train_tracker_wandb_offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    recipe = tmp_path / "tiny.yaml"
    recipe.write_text(yaml.safe_dump(TINY))
    out = tmp_path / "run"
    assert main(["train", str(recipe), "--out-dir", str(out), "--tracker", "wandb"]) == 0
    history, config = wandb_records(out)
    steps = [row for row in history if "train/reward_mean" in row]
    summary = json.loads((out / "summary.json").read_text())
    assert [row["_step"] for row in steps] == [0, 1]
    assert [row["train/reward_mean"] for row in steps] == pytest.approx(summary["rewards"], abs=1e-4)
    assert all("train/ratio_max" in row and "time/train_s" in row for row in steps)
    assert config["name"] == "tiny" and config["steps"] == 2  # the recipe is the run's config


def test_eval_tracker_tensorboard_logs_progress_and_pass_at_k(tmp_path: Path) -> None:
    """``polar-env eval`` (simulated engine test double, loop harness in real bwrap sandboxes)."""
    pytest.importorskip("tensorboard")
    require_bwrap()
    rows = [{"task_id": "alpha__one", "instruction": "run echo hi", "repo": "alpha",
             "evaluator": {"name": "output", "regex": "printed"}},
            {"task_id": "beta__two", "instruction": "run echo hi", "repo": "beta",
             "evaluator": {"name": "output", "regex": "never"}}]
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out"
    assert main(["eval", "--tasks", str(tasks), "--samples", "2", "-k", "1", "--engine", "simulated",
                 "--harness", "loop", "--out", str(out), "--no-progress", "--tracker", "tensorboard"]) == 0
    scalars, _ = tensorboard_scalars(out / "latest" / "tensorboard")
    assert scalars["summary/eval/overall/pass@1"] == [(0, 0.5)]
    assert scalars["summary/eval/per_repo/alpha/pass@1"] == [(0, 1.0)]
    assert scalars["summary/mean_reward"] == [(0, 0.5)] and "summary/stage_seconds_mean/running" in scalars
    assert scalars["rollout/sessions_done"][0][1] <= scalars["rollout/sessions_done"][-1][1]
    assert "stages/running" in scalars
