"""``SweTask``: one SWE task row (SWE-bench, SWE-Gym, SkyRL-v0-293, the toy set) in one shape.

``SweTask.from_row`` normalises the shapes users bring: flat rows or rows nested under
``instance``; FAIL_TO_PASS/PASS_TO_PASS as lists or JSON strings; optional ``image_name``
(or swebench 5.x's ``image``), ``eval_script``, ``log_parser``, ``eval_type``. Unknown keys are
kept in ``extra``. Reading files is ``polar_env.tasks.sources``; grading is the ``swebench`` evaluator.
"""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from polar_env.runtimes.base import RuntimeSpec
from polar_env.tasks.images import ImageStyle, task_image

START_TEST_OUTPUT = ">>>>> Start Test Output"
END_TEST_OUTPUT = ">>>>> End Test Output"
TEST_PATCH_DELIMITER = "EOF_POLAR_TEST_PATCH"

_ALIASES = {"image": "image_name"}  # swebench 5.x rows name the image field "image"
_HUNK = re.compile(r"^@@ -\d+(?:,(\d+))? \+\d+(?:,(\d+))? @@")
_NESTED_KEY = "instance"  # SkyRL-v0-293: {"prompt": [...], "data_source": ..., "instance": {...}}


class SweTask(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    instance_id: str
    repo: str = ""
    base_commit: str = ""
    patch: str = ""  # the gold patch
    test_patch: str = ""
    problem_statement: str = ""
    hints_text: str = ""
    created_at: str = ""
    version: str = ""
    environment_setup_commit: str | None = None
    FAIL_TO_PASS: list[str] = Field(default_factory=list)
    PASS_TO_PASS: list[str] = Field(default_factory=list)
    image_name: str | None = None  # explicit image; wins over the derived name
    image_style: ImageStyle = "swegym"
    eval_script: str | None = None  # swebench layout: applies test_patch, prints the markers
    log_parser: str = "parse_log_pytest"
    eval_type: Literal["pass_and_fail", "fail_only"] = "pass_and_fail"
    repo_dir: Path | None = None  # a local checkout at base_commit (the toy set); runtimes copy it in
    data_source: str | None = None
    prompt: list[dict[str, Any]] | None = None  # SkyRL's chat prompt, kept as given
    extra: dict[str, Any] = Field(default_factory=dict)

    @field_validator("FAIL_TO_PASS", "PASS_TO_PASS", mode="before")
    @classmethod
    def _test_list(cls, value: Any) -> Any:
        if value is None:
            return []
        if isinstance(value, str):
            text = value.strip()
            if not text:
                return []
            try:
                value = json.loads(text)  # SWE-bench stores these as JSON strings
            except json.JSONDecodeError as exc:
                raise ValueError(f"not a JSON list of test ids: {text[:80]!r}") from exc
        if hasattr(value, "tolist"):
            value = value.tolist()  # numpy arrays, when rows come from a dataframe
        if isinstance(value, tuple):
            value = list(value)
        return value

    @field_validator("version", "created_at", mode="before")
    @classmethod
    def _as_text(cls, value: Any) -> Any:
        # parquet may hand back versions as floats ("0.1" → 0.1) and dates as timestamps
        return "" if value is None else value if isinstance(value, str) else str(value)

    @classmethod
    def from_row(cls, row: Mapping[str, Any] | SweTask, *, image_style: ImageStyle | None = None) -> SweTask:
        """Normalise one dataset row. ``image_style`` applies when the row does not set its own."""
        if isinstance(row, SweTask):
            return row
        data = dict(row)
        nested = data.pop(_NESTED_KEY, None)
        if isinstance(nested, str):  # re-uploads of the SkyRL sets store the struct as JSON text
            try:
                nested = json.loads(nested)
            except ValueError:
                raise ValueError(f"the {_NESTED_KEY!r} column is text but not JSON") from None
        if isinstance(data.get("prompt"), str):  # ... and the chat prompt as one string
            data["prompt"] = [{"role": "user", "content": data["prompt"]}]
        if isinstance(nested, Mapping):
            data = {**data, **nested}  # the instance's own fields win over the wrapper's
        for alias, name in _ALIASES.items():
            if alias in data and name not in data:
                data[name] = data.pop(alias)
        fields = cls.model_fields
        known: dict[str, Any] = {}
        extra: dict[str, Any] = dict(data.pop("extra", None) or {})
        for key, value in data.items():
            if key not in fields:
                extra[key] = value
            elif value is not None or fields[key].default is None:
                known[key] = value  # nulls (parquet) fall back to the field default
        if image_style is not None:
            known.setdefault("image_style", image_style)
        return cls.model_validate({**known, "extra": extra})

    @property
    def image(self) -> str | None:
        return task_image(self.instance_id, self.repo, image_name=self.image_name, style=self.image_style)

    def runtime_spec(
        self, kind: str = "sandbox", **overrides: Any  # a RUNTIMES name
    ) -> RuntimeSpec:
        """How to start a runtime holding this task's repo at base_commit: the local checkout for
        toy tasks, the instance image otherwise."""
        fields: dict[str, Any] = {"kind": kind, "source_dir": self.repo_dir}
        if self.repo_dir is None or kind != "sandbox":
            fields["image"] = self.image
        return RuntimeSpec(**{**fields, **overrides})

    def test_files(self) -> dict[str, str]:
        """Paths the test patch touches → ``modified`` / ``added`` / ``deleted``."""
        return patch_files(self.test_patch)

    def to_swebench_instance(self, eval_script: str | None = None) -> dict[str, Any]:
        """The dict ``swebench.harness.utils.make_test_spec`` (5.x) takes."""
        return {
            "instance_id": self.instance_id,
            "repo": self.repo,
            "version": self.version,
            "base_commit": self.base_commit,
            "image": self.image or "local",
            "FAIL_TO_PASS": list(self.FAIL_TO_PASS),
            "PASS_TO_PASS": list(self.PASS_TO_PASS),
            "log_parser": self.log_parser,
            "eval_type": self.eval_type,
            "eval_script": eval_script if eval_script is not None else self.eval_script,
        }


def hunk_body_step(tag: str, old_left: int, new_left: int) -> tuple[int, int]:
    """One hunk body line (its first character ``tag``): the old and new line counts still to
    come. Diff readers skip hunk bodies this way, so a body line that looks like a header is not."""
    if tag in (" ", ""):
        return old_left - 1, new_left - 1
    if tag == "-":
        return old_left - 1, new_left
    if tag == "+":
        return old_left, new_left - 1
    return old_left, new_left  # "\ No newline at end of file"


def patch_files(patch: str) -> dict[str, str]:
    """Paths a unified diff touches → ``modified`` / ``added`` / ``deleted``, in patch order.
    Hunk bodies are skipped by their line counts, so a removed ``-- comment`` line is not a header."""
    files: dict[str, str] = {}
    old: str | None = None
    section: str | None = None  # path from the ``diff --git`` line, for headers without ---/+++
    old_left = new_left = 0
    for line in patch.splitlines():
        if old_left > 0 or new_left > 0:
            old_left, new_left = hunk_body_step(line[:1], old_left, new_left)
            continue
        if line.startswith("diff --git "):
            old, section = None, _git_header_path(line)
            if section is not None:
                files.setdefault(section, "modified")
        elif line.startswith("new file mode") and section is not None:
            files[section] = "added"
        elif line.startswith("deleted file mode") and section is not None:
            files[section] = "deleted"
        elif line.startswith("--- "):
            old = _diff_path(line[4:], "a/") or ""
        elif line.startswith("+++ ") and old is not None:
            new = _diff_path(line[4:], "b/")
            if new is None:
                files[old] = "deleted"
            else:
                files[new] = "modified" if old else "added"
            old = None
        elif match := _HUNK.match(line):
            old_left = int(match.group(1)) if match.group(1) is not None else 1
            new_left = int(match.group(2)) if match.group(2) is not None else 1
    return files


def _git_header_path(line: str) -> str | None:
    rest = line[len("diff --git ") :]
    if rest.startswith("a/") and len(rest) % 2 == 1:
        half = (len(rest) - 1) // 2  # "a/P b/P": both halves equal when there is no rename
        a, b = rest[:half], rest[half + 1 :]
        if a[2:] == b[2:] and b.startswith("b/"):
            return a[2:]
    return None


def _diff_path(text: str, prefix: str) -> str | None:
    path = text.split("\t", 1)[0].rstrip()
    if path == "/dev/null":
        return None
    if path.startswith('"') and path.endswith('"'):
        path = path[1:-1].encode("latin-1", "backslashreplace").decode("unicode_escape").encode("latin-1").decode()
    return path.removeprefix(prefix)


def build_eval_script(
    *,
    base_commit: str,
    test_patch: str,
    test_command: str,
    workdir: str | None = None,
    preamble: Sequence[str] = (),
) -> str:
    """An eval script in the swebench layout: reset the test files, apply ``test_patch`` through a
    heredoc, run ``test_command`` between the Start/End markers (they reach the log through xtrace,
    on stderr), reset again. Files the test patch adds are not in base_commit and are left alone.
    The reset uses ``base_commit`` when the repo holds it, else ``HEAD``: an image built from a
    ``git archive`` tarball has one local commit, and the grading runtime is fresh from the image."""
    if any(line == TEST_PATCH_DELIMITER for line in test_patch.splitlines()):
        raise ValueError(f"the test patch contains the heredoc delimiter line {TEST_PATCH_DELIMITER}")
    existing = [path for path, kind in patch_files(test_patch).items() if kind != "added"]
    reset = f"git checkout \"$polar_base\" -- {' '.join(shlex.quote(p) for p in existing)}" if existing else ":"
    base = shlex.quote(base_commit or "HEAD")
    pick_base = f"polar_base={base}; git cat-file -e \"$polar_base^{{commit}}\" 2>/dev/null || polar_base=HEAD"
    body = test_patch if test_patch.endswith("\n") else test_patch + "\n"
    lines = [
        "#!/bin/bash",
        "set -uxo pipefail",
        *preamble,
        *([f"cd {shlex.quote(workdir)}"] if workdir else []),
        *([pick_base] if existing else []),
        reset,
        f"git apply -v - <<'{TEST_PATCH_DELIMITER}'",
        body + TEST_PATCH_DELIMITER,
        f": '{START_TEST_OUTPUT}'",
        test_command,
        f": '{END_TEST_OUTPUT}'",
        reset,
    ]
    return "\n".join(lines) + "\n"
