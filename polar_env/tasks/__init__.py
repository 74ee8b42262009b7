"""SWE task rows: the ``SweTask`` shape, loaders for user-supplied files, image naming, and the
offline toy task set (``polar_env.tasks.toy``)."""

from __future__ import annotations

from polar_env.tasks.images import swebench_image, swegym_image, task_image
from polar_env.tasks.sources import load_swe_tasks, read_rows
from polar_env.tasks.swe import SweTask, build_eval_script, patch_files

__all__ = [
    "SweTask",
    "build_eval_script",
    "load_swe_tasks",
    "patch_files",
    "read_rows",
    "swebench_image",
    "swegym_image",
    "task_image",
]
