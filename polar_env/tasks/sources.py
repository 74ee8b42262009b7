"""Read SWE task rows from files users bring (.jsonl, .json, .parquet) or, on a machine that can
reach the hub, a dataset name; normalise each to ``SweTask``.

Covers SWE-Gym (flat rows, list test ids, no image field) and SkyRL-v0-293-data (rows nested under
``instance``, chat ``prompt`` beside it). Parquet needs pyarrow; a dataset name needs ``datasets``.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from polar_env.errors import ConfigError
from polar_env.tasks.images import ImageStyle
from polar_env.tasks.swe import SweTask

SUFFIXES = (".jsonl", ".json", ".parquet")
# Columns a row must carry to be rolled out and graded (SWE-Gym, SWE-bench Verified, and the
# `instance` struct of SkyRL-v0-293-data all have them); the rest have defaults.
REQUIRED = ("instance_id", "repo", "base_commit", "problem_statement", "test_patch", "FAIL_TO_PASS")


def unknown_ids_message(unknown: Iterable[str], known: Iterable[str], where: str, what: str = "task id") -> str:
    """One line for task ids a user asked for that do not exist: each with its closest known ids."""
    import difflib

    names = sorted(set(known))
    parts = []
    for task_id in unknown:
        close = difflib.get_close_matches(task_id, names, n=3, cutoff=0.7)
        parts.append(f"{task_id!r}" + (f" (closest: {', '.join(close)})" if close else ""))
    listed = ", ".join(names[:8]) + (f", ... ({len(names)} in all)" if len(names) > 8 else "")
    return (f"unknown {what} {'; '.join(parts)}, in {where}; pass one of: {listed}"
            if names else f"unknown {what} {', '.join(map(repr, unknown))}: {where} has no tasks")


def missing_columns(row: Mapping[str, object]) -> list[str]:
    """The required columns ``row`` lacks (looking inside SkyRL's ``instance`` struct)."""
    inner = row.get("instance")
    if isinstance(inner, str):
        try:
            inner = json.loads(inner)
        except ValueError:
            inner = None
    fields = {**row, **inner} if isinstance(inner, Mapping) else dict(row)
    return [c for c in REQUIRED if fields.get(c) is None]


def load_swe_tasks(
    source: str | Path,
    *,
    split: str = "train",
    image_style: ImageStyle = "swegym",
    limit: int | None = None,
) -> list[SweTask]:
    """Every row of ``source`` as a ``SweTask``. ``image_style`` names the image scheme for rows
    without an image of their own (SWE-Gym and SkyRL rows: ``swegym``). Duplicate ids are an error."""
    tasks: list[SweTask] = []
    seen: set[str] = set()
    for index, row in enumerate(read_rows(source, split=split)):
        if limit is not None and len(tasks) >= limit:
            break
        if not isinstance(row, Mapping):
            raise ConfigError(f"{source}: row {index} is a {type(row).__name__}, not an object")
        missing = missing_columns(row)
        if missing:
            inner = row.get("instance")
            ident = row.get("instance_id") or (inner.get("instance_id") if isinstance(inner, Mapping) else None) or "?"
            shape = "SkyRL rows nest them in an `instance` struct" if "prompt" in row or "instance" in row else \
                "SWE-Gym / SWE-bench rows carry them flat"
            raise ConfigError(f"{source}: row {index} ({ident}) has no {', '.join(repr(c) for c in missing)} column "
                              f"({shape}); a SWE task row needs {', '.join(REQUIRED)}")
        try:
            task = SweTask.from_row(row, image_style=image_style)
        except ValidationError as exc:
            ident = row.get("instance_id") or (row.get("instance") or {}).get("instance_id", "?")
            raise ConfigError(f"{source}: row {index} ({ident}) is not a SWE task: {exc}") from exc
        if task.instance_id in seen:
            raise ConfigError(f"{source}: instance_id {task.instance_id} appears twice")
        seen.add(task.instance_id)
        tasks.append(task)
    return tasks


def read_rows(source: str | Path, *, split: str = "train") -> Iterator[Any]:
    path = Path(source)
    suffix = path.suffix.lower()
    if suffix in SUFFIXES:
        if not path.is_file():
            raise ConfigError(f"task file {path} does not exist")
        if suffix == ".jsonl":
            return _jsonl_rows(path)
        if suffix == ".json":
            return _json_rows(path)
        return _parquet_rows(path)
    if path.exists():
        raise ConfigError(f"{path}: expected a {', '.join(SUFFIXES)} file")
    return _hub_rows(str(source), split)


def _jsonl_rows(path: Path) -> Iterator[Any]:
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield json.loads(line)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"{path}:{lineno}: not JSON: {exc}") from exc


def _json_rows(path: Path) -> Iterator[Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}: not JSON: {exc}") from exc
    if isinstance(data, Mapping):
        # one row, or {instance_id: row, ...}
        data = [data] if "instance_id" in data or "instance" in data else list(data.values())
    if not isinstance(data, list):
        raise ConfigError(f"{path}: expected a list of rows, got {type(data).__name__}")
    yield from data


def _parquet_rows(path: Path) -> Iterator[Any]:
    try:
        import pyarrow.parquet as pq
    except ImportError as exc:
        raise ConfigError(f"reading {path} needs pyarrow: pip install pyarrow") from exc
    table = pq.read_table(path)
    for batch in table.to_batches():
        yield from batch.to_pylist()  # struct columns (SkyRL's `instance`) come back as dicts


def _hub_rows(name: str, split: str) -> Iterator[Any]:
    if name.count("/") != 1:
        raise ConfigError(f"{name!r} is neither a {', '.join(SUFFIXES)} file nor an owner/name dataset")
    try:
        import datasets
    except ImportError as exc:
        raise ConfigError(f"{name!r} is not a local file; loading it from the hub needs: pip install datasets") from exc
    yield from datasets.load_dataset(name, split=split)
