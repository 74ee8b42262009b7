"""Trajectories to files: JSON lines (one Trajectory per line, lossless) and Parquet (one row per
trace, the columns a trainer loads: ids, loss mask, logprobs, reward, status, failure kind, mask,
whether the trace may be trained with the task's reward (``trainable``, ``role``) and provenance). A
trajectory with no traces (a session that ended before any model call) still has one Parquet row, with
``trace_index`` -1, empty token lists, ``trainable`` false and ``mask`` true, so every GRPO group keeps
its size in both files.

Parquet needs the ``parquet`` extra (pyarrow). Token ids stay int64 lists and logprobs float64.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import orjson

from polar_env.errors import ConfigError
from polar_env.records import Trace, Trajectory


def write_jsonl(trajectories: Iterable[Trajectory], path: Path) -> int:
    n = 0
    with open(path, "wb") as out:
        for traj in trajectories:
            out.write(traj.to_json() + b"\n")
            n += 1
    return n


def read_jsonl(path: Path) -> list[Trajectory]:
    return [Trajectory.from_json(line) for line in Path(path).read_bytes().splitlines() if line.strip()]


def trace_rows(trajectories: Sequence[Trajectory]) -> list[dict[str, Any]]:
    rows = []
    for traj in trajectories:
        meta = traj.metadata
        group_id = traj.group_id if traj.group_id is not None else meta.get("group_id")
        sample_index = traj.sample_index if traj.sample_index is not None else meta.get("sample_index")
        traces: list[tuple[int, Trace | None]] = [*enumerate(traj.traces)] or [(-1, None)]  # no traces: still a row
        for index, trace in traces:
            rows.append({
                "session_id": traj.session_id, "trace_index": index,
                "task_id": meta.get("task_id"), "group_id": group_id,
                "sample_index": sample_index, "harness": meta.get("harness"),
                "reward": traj.reward if trace is not None and trace.trainable else None,
                "status": traj.status.value,
                "trace_status": trace.status.value if trace is not None else traj.status.value,
                "failure_kind": traj.failure_kind.value if traj.failure_kind is not None else None,
                "failure_detail": traj.failure_detail, "mask": traj.mask,
                "trainable": trace.trainable if trace is not None else False,
                "role": trace.role if trace is not None else None,
                "prompt_ids": trace.prompt_ids if trace is not None else [],
                "response_ids": trace.response_ids if trace is not None else [],
                "loss_mask": trace.loss_mask if trace is not None else [],
                "response_logprobs": trace.response_logprobs if trace is not None else [],
                "weight_versions": [str(v) for v in meta.get("weight_versions", [])],
                "metadata": orjson.dumps({**meta, "trace": trace.metadata if trace is not None else {}}, default=str).decode(),
            })
    return rows


def write_parquet(trajectories: Sequence[Trajectory], path: Path) -> int:
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise ConfigError("writing Parquet needs pyarrow: pip install -e '.[parquet]'") from None
    rows = trace_rows(trajectories)
    schema = pa.schema([
        ("session_id", pa.string()), ("trace_index", pa.int32()), ("task_id", pa.string()),
        ("group_id", pa.string()), ("sample_index", pa.int32()), ("harness", pa.string()),
        ("reward", pa.float64()), ("status", pa.string()), ("trace_status", pa.string()),
        ("failure_kind", pa.string()), ("failure_detail", pa.string()), ("mask", pa.bool_()),
        ("trainable", pa.bool_()), ("role", pa.string()),
        ("prompt_ids", pa.list_(pa.int64())), ("response_ids", pa.list_(pa.int64())),
        ("loss_mask", pa.list_(pa.int8())), ("response_logprobs", pa.list_(pa.float64())),
        ("weight_versions", pa.list_(pa.string())), ("metadata", pa.string()),
    ])
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), path)
    return len(rows)
