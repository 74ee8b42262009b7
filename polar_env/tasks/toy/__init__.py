"""The offline toy SWE task set: three tiny repos generated from Python data at run time.

Each has a real bug, a failing test added by its test patch, a gold patch, FAIL_TO_PASS /
PASS_TO_PASS and a swebench-layout eval script; ``toy__bsearch-1`` hangs while its bug is present.
The repos are built into a cache directory (``~/.cache/polar_env/toy`` unless given) with a
deterministic commit, so ``base_commit`` is stable. ``task.repo_dir`` is the checkout to copy.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from polar_env.errors import ConfigError
from polar_env.tasks.sources import unknown_ids_message
from polar_env.tasks.swe import SweTask
from polar_env.tasks.toy import bsearch, calc, textkit
from polar_env.tasks.toy.build import ToySource, build_toy_task

TOY_SOURCES: dict[str, ToySource] = {s.instance_id: s for s in (calc.SOURCE, textkit.SOURCE, bsearch.SOURCE)}


def default_cache_dir() -> Path:
    return Path.home() / ".cache" / "polar_env" / "toy"


def toy_tasks(cache_dir: Path | None = None, ids: Iterable[str] | None = None) -> list[SweTask]:
    """The toy tasks (all, or those in ``ids``), building repos that are not cached yet."""
    root = cache_dir if cache_dir is not None else default_cache_dir()
    wanted = list(TOY_SOURCES) if ids is None else list(ids)
    unknown = [i for i in wanted if i not in TOY_SOURCES]
    if unknown:
        raise ConfigError(unknown_ids_message(unknown, TOY_SOURCES, "the toy task set"))
    return [build_toy_task(TOY_SOURCES[i], root) for i in wanted]


__all__ = ["TOY_SOURCES", "ToySource", "build_toy_task", "default_cache_dir", "toy_tasks"]
