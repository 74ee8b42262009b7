"""The researcher's API without a browser: per-task rows, one GRPO group with its advantages,
the reason / failure-kind histogram and filters, a session's tests, integrity verdict, graded
patch and trainer view, and the Runs list's cached summaries. The run folder is written through
JournalStore and the outcome writer, plus the ``plan.json`` / ``sessions.jsonl`` a rollout writes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from polar_env.dashboard import runs as runs_module
from polar_env.dashboard.server import Dashboard, build_dashboard
from polar_env.journal.store import JournalStore, SessionMeta
from tests.dashboard.test_dashboard_api import record

SWEBENCH = {"tests_status": {"FAIL_TO_PASS": {"success": [], "failure": ["t.py::test_new"]},
                             "PASS_TO_PASS": {"success": ["t.py::test_old"], "failure": []}}}
PATCH = "diff --git a/a.py b/a.py\n--- a/a.py\n+++ b/a.py\n@@ -1 +1 @@\n-x = 1\n+x = 2\n"


def session(task: str, i: int, reward: float, *, status: str = "completed", kind: str | None = None,
            mask: bool = False, reason: str = "resolved", evaluation: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"session_id": f"{task}-g-{i}", "task_id": task, "group_id": f"{task}-g", "sample_index": i, "node_id": "node-0",
            "status": status, "reward": reward, "records": 1, "failure_kind": kind, "mask": mask,
            "evaluation": {"reason": reason, **(evaluation or {})}, "stage_times": {"queued": 0.0, "done": 1.0},
            "metadata": {"harness": "loop", "task_id": task, "group_id": f"{task}-g"}}


def write_run(run: Path, rows: list[dict[str, Any]], planned: dict[str, int]) -> None:
    store = JournalStore(run / "capture" / "node-0")
    for r in rows:
        store.write_session_meta(SessionMeta(session_id=r["session_id"], key_sha256="0" * 64, created_at=0.0, closed=True,
                                             metadata=r["metadata"]))
        store.append(record(r["session_id"], 0, [1, 2, 3], [10, 11, 12]))
        store.write_outcome(r["session_id"], r)
    store.close()
    (run / "sessions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    groups = [{"task_id": t, "group_id": f"{t}-g", "session_ids": [f"{t}-g-{i}" for i in range(n)]} for t, n in planned.items()]
    (run / "plan.json").write_text(json.dumps({"groups": groups, "job": {"env": {"engine": {"model": "tiny"}}}}))


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    run = tmp_path / "runs" / "r1"
    evaluated = {"swebench": SWEBENCH, "graded_patch": PATCH, "graded_paths": ["a.py"],
                 "dropped_paths": [{"path": "tests/t.py", "rule": "test location"}, "old.py"],  # older runs: bare paths
                 "tampered": True, "tamper_evidence": ["rewrote conftest.py"]}
    rows = [session("alpha", 0, 1.0), session("alpha", 1, 0.0, reason="unresolved", evaluation=evaluated),
            session("alpha", 2, 1.0), session("alpha", 3, 0.0, status="error", kind="engine_error", mask=True, reason="-"),
            session("beta", 0, 0.0, status="timeout", kind="agent_timeout", reason="unresolved")]
    write_run(run, rows, {"alpha": 4, "beta": 2, "gamma": 1})  # beta's second sample and gamma never ran
    return run


async def test_tasks_groups_and_why(run_dir: Path) -> None:
    async with TestClient(TestServer(build_dashboard(Dashboard([run_dir])))) as client:
        tasks = {t["task_id"]: t for t in (await (await client.get("/api/runs/r1/tasks")).json())["tasks"]}
        assert tasks["alpha"] == {"task_id": "alpha", "state": "done", "harness": "loop", "model": "tiny", "samples": 4,
                                  "finished": 4, "completed": 3, "errored": 1, "mean_reward": 0.5, "mean_traces": None,
                                  "mean_calls": 1.0, "masked": 1, "groups": ["alpha-g"]}
        assert (tasks["beta"]["state"], tasks["beta"]["samples"], tasks["beta"]["errored"]) == ("running", 2, 1)
        assert (tasks["gamma"]["state"], tasks["gamma"]["samples"], tasks["gamma"]["finished"]) == ("pending", 1, 0)

        group = await (await client.get("/api/runs/r1/groups/alpha-g")).json()
        # the mean is over the three unmasked samples (1, 0, 1); the masked one gets no advantage
        assert [s["advantage"] for s in group["samples"]] == [0.3333, -0.6667, 0.3333, None]
        assert group["mean_reward"] == 0.6667 and group["counted"] == 3 and "unmasked" in group["advantage_rule"]
        assert (group["prev"], group["next"]) == (None, "beta-g")
        assert (await (await client.get("/api/runs/r1/groups/beta-g")).json())["prev"] == "alpha-g"
        assert (await client.get("/api/runs/r1/groups/nope")).status == 404

        page = await (await client.get("/api/runs/r1/sessions")).json()
        assert page["reasons"] == {"bars": [["resolved", 2], ["unresolved", 2], ["-", 1]], "other_values": 0, "other_sessions": 0}
        assert page["failure_kinds"]["bars"] == [["-", 3], ["agent_timeout", 1], ["engine_error", 1]]
        by_reason = await (await client.get("/api/runs/r1/sessions?reason=unresolved")).json()
        assert sorted(r["session_id"] for r in by_reason["rows"]) == ["alpha-g-1", "beta-g-0"]
        completed = await (await client.get("/api/runs/r1/sessions?failure_kind=-&task=alpha")).json()
        assert [r["session_id"] for r in completed["rows"]] == ["alpha-g-0", "alpha-g-1", "alpha-g-2"]
        masked = await (await client.get("/api/runs/r1/sessions?sort=mask&desc=1&limit=1")).json()
        assert masked["rows"][0]["session_id"] == "alpha-g-3" and masked["rows"][0]["mask"] is True


async def test_session_tests_integrity_patch_and_trainer(run_dir: Path) -> None:
    async with TestClient(TestServer(build_dashboard(Dashboard([run_dir])))) as client:
        d = await (await client.get("/api/runs/r1/sessions/alpha-g-1")).json()
        assert d["tests"] == [{"group": "FAIL_TO_PASS", "result": "failure", "test": "t.py::test_new"},
                              {"group": "PASS_TO_PASS", "result": "success", "test": "t.py::test_old"}]
        assert d["integrity"]["dropped_paths"] == [{"path": "tests/t.py", "rule": "test location"}, {"path": "old.py", "rule": None}]
        assert d["integrity"]["tampered"] is True
        assert d["integrity"]["tamper_evidence"] == ["rewrote conftest.py"]
        assert d["graded_patch"] == PATCH
        assert d["trainer"]["mask"] is False and d["trainer"]["trained_tokens"] == 3
        assert d["trainer"]["traces"] == [{"index": 0, "role": "main", "trainable": True, "sampled_tokens": 3}]
        assert [s["session_id"] for s in d["siblings"]] == [f"alpha-g-{i}" for i in range(4)]
        masked = await (await client.get("/api/runs/r1/sessions/alpha-g-3")).json()
        assert masked["trainer"]["mask"] is True and masked["trainer"]["trained_tokens"] == 0  # dropped: nothing trained
        clean = await (await client.get("/api/runs/r1/sessions/alpha-g-0")).json()
        assert clean["tests"] == [] and clean["integrity"] is None and clean["graded_patch"] is None  # no workspace graded


async def test_runs_list_summaries_are_cached_until_files_change(run_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    computed: list[int] = []
    real = runs_module.pass_table

    def counting(rows: Any, ks: Any = None) -> dict[str, Any]:
        computed.append(len(rows))
        return real(rows, ks)

    monkeypatch.setattr(runs_module, "pass_table", counting)
    async with TestClient(TestServer(build_dashboard(Dashboard([run_dir.parent])))) as client:
        for _ in range(3):
            (run,) = (await (await client.get("/api/runs")).json())["runs"]
            assert run["sessions"] == 7 and run["statuses"]["not started"] == 2  # plan.json's too (the job is not running)
        assert computed == [5]  # finished, unchanged: computed once for three visits
        (run_dir / "report.json").write_text(json.dumps({"wall_s": 12.5}))
        (run,) = (await (await client.get("/api/runs")).json())["runs"]
        assert run["wall_s"] == 12.5 and run["state"] == "done" and computed == [5, 5]
        extra = session("gamma", 0, 1.0)
        store = JournalStore(run_dir / "capture" / "node-0")
        store.write_outcome(extra["session_id"], extra)
        store.close()
        (run,) = (await (await client.get("/api/runs")).json())["runs"]
        assert run["sessions"] == 7 and run["statuses"]["not started"] == 1 and computed == [5, 5, 6]
