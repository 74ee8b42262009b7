"""Loading SWE-Gym and SkyRL-v0-293 shaped rows into ``SweTask``; image naming; patch parsing."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from polar_env.errors import ConfigError
from polar_env.tasks import (
    SweTask,
    build_eval_script,
    load_swe_tasks,
    patch_files,
    swebench_image,
    swegym_image,
    task_image,
)

PARQUET_MISSING = "the parquet extra is not installed: pip install -e '.[parquet]'"

# Synthetic rows in the published shapes (values invented; field names as the datasets have them).
SWEGYM_ROW = {
    "instance_id": "getmoto__moto-7365",
    "hints_text": "",
    "patch": "diff --git a/moto/x.py b/moto/x.py\n",
    "test_patch": ("diff --git a/tests/test_x.py b/tests/test_x.py\n--- a/tests/test_x.py\n+++ b/tests/test_x.py\n"
                   "@@ -1 +1,2 @@\n a = 1\n+b = 2\n"),
    "created_at": "2024-02-20T12:00:00Z",
    "problem_statement": "A synthetic issue text.",
    "repo": "getmoto/moto",
    "base_commit": "a" * 40,
    "version": "5.0",
    "PASS_TO_PASS": ["tests/test_x.py::test_old"],
    "FAIL_TO_PASS": ["tests/test_x.py::test_new"],
}
SKYRL_INSTANCE = {
    **SWEGYM_ROW,
    "instance_id": "pydantic__pydantic-8511",
    "repo": "pydantic/pydantic",
    "FAIL_TO_PASS": json.dumps(["tests/test_a.py::test_fixed"]),  # JSON strings, as SWE-bench stores them
    "PASS_TO_PASS": json.dumps(["tests/test_a.py::test_kept", "tests/test_a.py::test_also_kept"]),
}
SKYRL_ROW = {
    "prompt": [{"role": "user", "content": "Fix the issue described below."}],
    "data_source": "swe-gym",
    "ability": "coding",
    "instance": SKYRL_INSTANCE,
}


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_swegym_flat_rows_from_jsonl(tmp_path: Path) -> None:
    second = {
        **SWEGYM_ROW,
        "instance_id": "python__mypy-16000",
        "repo": "python/mypy",
        "hints_text": None,
        "version": 1.5,
    }
    [moto, mypy] = load_swe_tasks(write_jsonl(tmp_path / "swegym.jsonl", [SWEGYM_ROW, second]))
    assert moto.FAIL_TO_PASS == ["tests/test_x.py::test_new"] and moto.PASS_TO_PASS == ["tests/test_x.py::test_old"]
    assert moto.image == "docker.io/xingyaoww/sweb.eval.x86_64.getmoto_s_moto-7365:latest"
    assert moto.eval_script is None and moto.log_parser == "parse_log_pytest" and moto.eval_type == "pass_and_fail"
    assert moto.test_files() == {"tests/test_x.py": "modified"}
    assert (mypy.hints_text, mypy.version) == ("", "1.5")  # null → default, float version → text
    assert mypy.image == "docker.io/xingyaoww/sweb.eval.x86_64.python_s_mypy-16000:latest"


def test_skyrl_nested_rows_from_json(tmp_path: Path) -> None:
    path = tmp_path / "skyrl.json"
    path.write_text(json.dumps([SKYRL_ROW]))
    [task] = load_swe_tasks(path)
    assert task.instance_id == "pydantic__pydantic-8511"
    assert task.FAIL_TO_PASS == ["tests/test_a.py::test_fixed"]
    assert task.PASS_TO_PASS == ["tests/test_a.py::test_kept", "tests/test_a.py::test_also_kept"]
    assert task.prompt == SKYRL_ROW["prompt"] and task.data_source == "swe-gym"
    assert task.extra == {"ability": "coding"}
    assert task.image == swegym_image("pydantic__pydantic-8511")


def test_json_object_forms(tmp_path: Path) -> None:
    one = tmp_path / "one.json"
    one.write_text(json.dumps(SWEGYM_ROW))
    assert [t.instance_id for t in load_swe_tasks(one)] == ["getmoto__moto-7365"]
    keyed = tmp_path / "keyed.json"
    keyed.write_text(json.dumps({"a": SWEGYM_ROW, "b": SKYRL_ROW}))
    assert [t.instance_id for t in load_swe_tasks(keyed)] == ["getmoto__moto-7365", "pydantic__pydantic-8511"]


def test_skyrl_nested_rows_from_parquet(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow", reason=PARQUET_MISSING)
    pq = pytest.importorskip("pyarrow.parquet", reason=PARQUET_MISSING)
    rows = [SKYRL_ROW, {**SKYRL_ROW, "instance": {**SKYRL_INSTANCE, "instance_id": "pydantic__pydantic-9000"}}]
    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    tasks = load_swe_tasks(path)
    assert [t.instance_id for t in tasks] == ["pydantic__pydantic-8511", "pydantic__pydantic-9000"]
    assert tasks[0].FAIL_TO_PASS == ["tests/test_a.py::test_fixed"]
    assert tasks[0].prompt == SKYRL_ROW["prompt"]
    assert load_swe_tasks(path, limit=1)[0].instance_id == "pydantic__pydantic-8511"


def test_flat_parquet_with_list_columns(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow", reason=PARQUET_MISSING)
    pq = pytest.importorskip("pyarrow.parquet", reason=PARQUET_MISSING)
    path = tmp_path / "swegym.parquet"
    pq.write_table(pa.Table.from_pylist([SWEGYM_ROW]), path)
    [task] = load_swe_tasks(path)
    assert task == SweTask.from_row(SWEGYM_ROW, image_style="swegym")


def test_parquet_without_pyarrow_names_the_install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "train.parquet"
    path.write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # import pyarrow → ImportError
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(ConfigError, match="pip install pyarrow"):
        load_swe_tasks(path)


def test_optional_fields_and_image_rules() -> None:
    row = {
        **SWEGYM_ROW,
        "image_name": "registry.local/moto:7365",
        "eval_script": "#!/bin/bash\n",
        "log_parser": "parse_log_pytest_v2",
    }
    task = SweTask.from_row(row)
    assert (task.image, task.eval_script, task.log_parser) == (
        "registry.local/moto:7365",
        "#!/bin/bash\n",
        "parse_log_pytest_v2",
    )
    assert SweTask.from_row({**SWEGYM_ROW, "image": "x/y:1"}).image == "x/y:1"  # swebench 5.x's field name
    legacy = SweTask.from_row(
        {**SWEGYM_ROW, "instance_id": "marshmallow-code__marshmallow-1359", "repo": "marshmallow-code/marshmallow"}
    )
    assert legacy.image == "swebench/sweb.eval.x86_64.marshmallow-code_1776_marshmallow-1359:latest"
    assert SweTask.from_row(SWEGYM_ROW, image_style="swebench").image == swebench_image("getmoto__moto-7365")
    assert swebench_image("django__django-11099") == "swebench/sweb.eval.x86_64.django_1776_django-11099:latest"
    assert task_image("a__b-1", style="local") is None
    assert SweTask.from_row(SWEGYM_ROW).runtime_spec("docker").image == swegym_image("getmoto__moto-7365")


def test_swebench_instance_dict_builds_a_test_spec() -> None:
    utils = pytest.importorskip("swebench.harness.utils", reason="the swebench extra is not installed: pip install -e '.[swebench]'",
                                exc_type=ImportError)
    task = SweTask.from_row(SKYRL_ROW)
    script = build_eval_script(
        base_commit=task.base_commit, test_patch=task.test_patch, test_command="pytest -rA tests/test_a.py"
    )
    spec = utils.make_test_spec(task.to_swebench_instance(script))
    assert spec.FAIL_TO_PASS == task.FAIL_TO_PASS and spec.log_parser == "parse_log_pytest"
    assert "SWEBENCH_TEST_EXIT_CODE=$?" in spec.eval_script  # 5.x records the test command's status


@pytest.mark.parametrize(
    ("content", "match"),
    [
        (json.dumps(SWEGYM_ROW) + "\nnot json\n", r"rows\.jsonl:2: not JSON"),
        (json.dumps(SWEGYM_ROW) + "\n" + json.dumps(SWEGYM_ROW) + "\n", "appears twice"),
        (json.dumps({**SWEGYM_ROW, "instance_id": "a", "FAIL_TO_PASS": "not a list"}) + "\n",
         r"row 0 \(a\) is not a SWE task"),
        ('{"repo": "x/y"}\n', r"row 0 \(\?\) has no 'instance_id', 'base_commit'"),
        ("[1]\n", "row 0 is a list"),
    ],
)
def test_bad_rows_are_config_errors(tmp_path: Path, content: str, match: str) -> None:
    path = tmp_path / "rows.jsonl"
    path.write_text(content)
    with pytest.raises(ConfigError, match=match):
        load_swe_tasks(path)


def test_bad_sources_are_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_swe_tasks(tmp_path / "missing.jsonl")
    (tmp_path / "rows.csv").write_text("a,b\n")
    with pytest.raises(ConfigError, match="expected a .jsonl, .json, .parquet file"):
        load_swe_tasks(tmp_path / "rows.csv")
    with pytest.raises(ConfigError, match="neither a"):
        load_swe_tasks("just-a-name")


def test_patch_files_kinds_and_hunk_bodies() -> None:
    patch = (
        "diff --git a/src/m.py b/src/m.py\nindex 1..2 100644\n--- a/src/m.py\n+++ b/src/m.py\n"
        "@@ -1,3 +1,3 @@\n x = 1\n--- a/not/a/header.sql\n+++ b/not/a/header.sql\n y = 2\n"
        "diff --git a/tests/new.py b/tests/new.py\nnew file mode 100644\n--- /dev/null\n+++ b/tests/new.py\n@@ -0,0 +1 @@\n+z = 3\n"
        "diff --git a/old.py b/old.py\ndeleted file mode 100644\n--- a/old.py\n+++ /dev/null\n@@ -1 +0,0 @@\n-gone\n"
        "diff --git a/data.bin b/data.bin\nnew file mode 100644\nBinary files /dev/null and b/data.bin differ\n"
    )
    assert patch_files(patch) == {
        "src/m.py": "modified",
        "tests/new.py": "added",
        "old.py": "deleted",
        "data.bin": "added",
    }


def test_eval_script_layout() -> None:
    test_patch = SWEGYM_ROW["test_patch"]
    script = build_eval_script(
        base_commit="b" * 40, test_patch=test_patch, test_command="pytest -rA tests/test_x.py", workdir="/testbed"
    )
    lines = script.splitlines()
    assert lines[:5] == [
        "#!/bin/bash",
        "set -uxo pipefail",
        "cd /testbed",
        f"polar_base={'b' * 40}; git cat-file -e \"$polar_base^{{commit}}\" 2>/dev/null || polar_base=HEAD",
        'git checkout "$polar_base" -- tests/test_x.py',
    ]
    assert "git apply -v - <<'EOF_POLAR_TEST_PATCH'" in lines
    start, end = lines.index(": '>>>>> Start Test Output'"), lines.index(": '>>>>> End Test Output'")
    assert lines[start + 1 : end] == ["pytest -rA tests/test_x.py"]
    assert lines[-1] == lines[4]  # reset again at the end
    with pytest.raises(ValueError, match="heredoc delimiter"):
        build_eval_script(base_commit="b", test_patch="EOF_POLAR_TEST_PATCH\n", test_command="true")
