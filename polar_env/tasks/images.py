"""Container image names for SWE task rows: the SWE-Gym and SWE-bench naming schemes, pure functions.

An explicit ``image_name`` on the row always wins; otherwise the dataset's scheme decides. Apptainer
uses the same names behind ``docker://``.
"""

from __future__ import annotations

from typing import Literal

ImageStyle = Literal["swegym", "swebench", "local"]

# Repos whose SWE-Gym-era rows point at the SWE-bench images (the converters of the SkyRL-v0-293
# set send these six there), matched on the repo's name without its owner.
SWEBENCH_IMAGE_REPOS = frozenset({"marshmallow", "pydicom", "astroid", "pvlib-python", "pyvista", "sqlfluff"})


def swegym_image(instance_id: str) -> str:
    """``getmoto__moto-7365`` → ``docker.io/xingyaoww/sweb.eval.x86_64.getmoto_s_moto-7365:latest``."""
    return f"docker.io/xingyaoww/sweb.eval.x86_64.{instance_id.replace('__', '_s_').lower()}:latest"


def swebench_image(instance_id: str) -> str:
    """``django__django-11099`` → ``swebench/sweb.eval.x86_64.django_1776_django-11099:latest``.
    Lower-cased because Docker refuses upper-case repository names."""
    return f"swebench/sweb.eval.x86_64.{instance_id.replace('__', '_1776_').lower()}:latest"


def task_image(
    instance_id: str, repo: str = "", *, image_name: str | None = None, style: ImageStyle = "swegym"
) -> str | None:
    """The image a task's grading runs in; None for ``local`` tasks (a repo directory, no image)."""
    if image_name:
        return image_name
    if style == "local":
        return None
    if style == "swebench" or repo.rpartition("/")[2].lower() in SWEBENCH_IMAGE_REPOS:
        return swebench_image(instance_id)
    return swegym_image(instance_id)
