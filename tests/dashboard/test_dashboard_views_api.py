"""Issue 44's dashboard views through the API, without a browser (``test_dashboard_views_browser.py``
runs them in chromium over real ``polar-env`` runs): a ``polar-env train`` run recognised as one
(its per-step curves, held-out before/after, pass@k per policy version), histograms that follow
the Sessions filters, Compare's per-repo shared-task rows and paged per-task rows, the Tasks
table paged server-side over a 5,000-session store, the Live counts from a job's first look, and
what an in-flight session has reached. Stores are written through JournalStore and the outcome
writer, train folders through ``train.report.write_run``, ``live.json`` through ``JobObserver``."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from polar_env.dashboard.runs import FINISHED, Run, pass_table
from polar_env.dashboard.server import Dashboard, build_dashboard
from polar_env.journal.store import JournalStore, SessionMeta
from polar_env.observe.live import JobObserver
from polar_env.train.loop import RunResult, StepRecord
from polar_env.train.report import write_run as write_train_run
from tests.dashboard.test_dashboard_api import record
from tests.dashboard.test_dashboard_live_api import live_run
from tests.dashboard.test_dashboard_research_api import session, write_run


def big_store(root: Path, sessions: int, *, samples: int = 4, fail_every: int = 7,
              keep: Callable[[int], bool] | None = None) -> Path:
    """A capture store of ``sessions`` finished sessions over ``sessions // samples`` tasks in five
    repos (``repoN__taskNNNN``), one call each; every ``fail_every``-th an engine error, a third
    rewarded; only the tasks whose number ``keep`` keeps; written as the gateway and the node write them."""
    tasks = sessions // samples
    store = JournalStore(root / "capture" / "node-0")
    for i in range(sessions):
        task = f"repo{i % 5}__task{i % tasks:04d}"
        if keep is not None and not keep(i % tasks):
            continue
        sid = f"{task}-g-{i // tasks}"
        meta = {"task_id": task, "harness": "loop", "sample_index": i // tasks, "group_id": f"{task}-g"}
        store.write_session_meta(SessionMeta(session_id=sid, key_sha256="0" * 64, created_at=0.0, closed=True, metadata=meta))
        store.append(record(sid, 0, [1, 2, 3], [10, 11, 12]))
        failed = i % fail_every == 0
        store.write_outcome(sid, {"session_id": sid, "task_id": task, "sample_index": i // tasks, "group_id": f"{task}-g",
                                  "status": "error" if failed else "completed", "reward": float(i % 3 == 0 and not failed),
                                  "records": 1, "failure_kind": "engine_error" if failed else None,
                                  "stage_times": {"queued": 0.0, "running": 1.0, "done": 1.0 + i / 100},
                                  "evaluation": {"reason": f"reason {i % 20}"}, "metadata": meta})
    store.close()
    return root


def train_folder(run: Path) -> Path:
    """A ``polar-env train`` run (``source: polar_env``) as its writers leave it: ``summary.json``
    and ``steps.jsonl`` (``write_run``), and a store whose outcomes carry the weight version each
    session sampled under: task ``k`` three rollouts a step under versions 0, 1, 2 (0, 1, then 3
    rewarded), held-out ``h`` twice under 0 (before) and 3 (after)."""
    steps = [StepRecord(step=i, reward_mean=[0.0, 1 / 3, 1.0][i], rollouts=3, traces=3, sampled_tokens=9 + i,
                        rollout_s=4.5, train_s=0.5, sync_s=0.1, weight_versions=[str(i)], new_version=str(i + 1),
                        step0_max_abs_delta=1e-6, ratio_min=1.0, ratio_max=1.0, loss=0.3, grad_norm=1.0) for i in range(3)]
    recipe = {"name": "tiny", "seed": 0, "control": False, "builder": "prefix_merge_strict"}
    result = RunResult(recipe=recipe, steps=steps, wall_s=20.0, held_out_before={"h": 0.5}, held_out_after={"h": 1.0})
    write_train_run(result, run)
    store = JournalStore(run / "capture" / "node-0")
    plan = [("k", str(v), v, [float(j < v + (v == 2)) for j in range(3)]) for v in range(3)]
    plan += [("h", "0", 0, [1.0, 0.0]), ("h", "3", 1, [1.0, 1.0])]
    for task, version, round_, rewards in plan:
        for j, reward in enumerate(rewards):
            sid = f"{task}-abc-{round_}-{j}"
            meta = {"task_id": task, "group_id": f"{task}-abc-{round_}", "sample_index": j, "harness": "loop"}
            store.write_session_meta(SessionMeta(session_id=sid, key_sha256="0" * 64, created_at=0.0, closed=True, metadata=meta))
            store.append(record(sid, 0, [1, 2, 3], [10, 11, 12]))
            store.write_outcome(sid, {"session_id": sid, "metadata": meta, "status": "completed", "reward": reward,
                                      "weight_versions": [version], "evaluation": {"reason": "regex"},
                                      "stage_times": {"queued": 100.0 + round_, "done": 101.0 + round_}})
    store.close()
    return run


async def test_a_train_run_is_recognised_with_its_curves_and_held_out(tmp_path: Path) -> None:
    run = train_folder(tmp_path / "runs" / "train")
    async with TestClient(TestServer(build_dashboard(Dashboard([tmp_path / "runs"])))) as client:
        (row,) = (await (await client.get("/api/runs")).json())["runs"]
        assert (row["kind"], row["state"]) == ("train", "done")  # was a bare "store"
        train = await (await client.get("/api/runs/train/train")).json()
        # sampled tokens / rollout s, unrounded: the page rounds once (9.952 rounded to 9.95, then
        # to one decimal by the page, showed 9.9)
        assert [s["tokens_per_s"] for s in train["steps"]] == [9 / 4.5, 10 / 4.5, 11 / 4.5]
        assert [s["reward_mean"] for s in train["steps"]] == pytest.approx([0.0, 1 / 3, 1.0])
        assert train["held_out"]["before"] == 0.5 and train["held_out"]["after"] == 1.0
        assert train["held_out"]["per_task"] == [{"task_id": "h", "before": 0.5, "after": 1.0}]
        assert train["summary"]["sampled_tokens_per_s"] == round(30 / 13.5, 1)
        curves = await (await client.get("/api/runs/train/curves")).json()
        # no session records its sampled tokens: no rate over time, not a flat 0 beside the steps' 2 tokens/s
        assert curves["points"] and {p["tokens_per_s"] for p in curves["points"]} == {None}
    assert json.loads((run / "summary.json").read_text())["steps"] == 3


async def test_pass_at_k_is_per_policy_version(tmp_path: Path) -> None:
    run = Run(train_folder(tmp_path / "train"), "train", JournalStore)
    done = [r for r in run.rows() if r["status"] in FINISHED]
    table = pass_table(done)
    # three rollouts of k per version: pass@3, never pass@9 over three policies pooled
    assert table["ks"] == [1, 2]  # the smallest group: h's two held-out rollouts per version
    versions = {v: (t["tasks"], t["sessions"], t["pass@1"]) for v, t in table["per_version"].items()}
    assert versions == {"0": (2, 5, 0.25), "1": (1, 3, 0.3333), "2": (1, 3, 1.0), "3": (1, 2, 1.0)}
    assert list(table["per_version"]) == ["0", "1", "2", "3"]
    k_only = pass_table([r for r in done if r["task_id"] == "k"])
    assert k_only["ks"] == [1, 3] and k_only["overall"]["sessions"] == 9
    assert k_only["per_version"]["0"]["pass@3"] == 0.0 and k_only["per_version"]["2"]["pass@3"] == 1.0
    # one policy, one of whose sessions failed before its first call (no version): one group, not two
    one_policy = [{**r, "weight_version": None if r["sample_index"] == 0 else "0"} for r in done if r["task_id"] == "k"][:3]
    assert pass_table(one_policy)["per_version"] == {} and pass_table(one_policy)["ks"] == [1, 3]
    async with TestClient(TestServer(build_dashboard(Dashboard([run.path])))) as client:
        train = await (await client.get("/api/runs/train/train")).json()
        assert [(v["version"], v["pass@1"]) for v in train["per_version"]] == [("0", 0.25), ("1", 0.3333), ("2", 1.0), ("3", 1.0)]
        (row,) = (await (await client.get("/api/runs")).json())["runs"]
        assert row["pass_version"] == "3" and row["pass"]["sessions"] == 2  # the last policy's figure, not a pool


async def test_histograms_follow_the_task_and_session_filters(tmp_path: Path) -> None:
    run = tmp_path / "runs" / "r1"
    rows = [session("alpha", 0, 1.0), session("alpha", 1, 0.0, reason="unresolved"),
            session("beta", 0, 0.0, status="timeout", kind="agent_timeout", reason="unresolved"),
            session("beta", 1, 0.0, status="error", kind="engine_error", reason="-")]
    write_run(run, rows, {"alpha": 2, "beta": 2})
    async with TestClient(TestServer(build_dashboard(Dashboard([run])))) as client:
        alpha = await (await client.get("/api/runs/r1/sessions?task=alpha")).json()
        assert alpha["reasons"]["bars"] == [["resolved", 1], ["unresolved", 1]]
        assert alpha["failure_kinds"]["bars"] == [["-", 2]]
        timeouts = await (await client.get("/api/runs/r1/sessions?status=timeout")).json()
        assert timeouts["reasons"]["bars"] == [["unresolved", 1]]
        # a histogram keeps its own bars when one is picked (to switch), and follows the other filter
        picked = await (await client.get("/api/runs/r1/sessions?reason=unresolved")).json()
        assert picked["reasons"]["bars"] == [["unresolved", 2], ["-", 1], ["resolved", 1]]
        assert picked["failure_kinds"]["bars"] == [["-", 1], ["agent_timeout", 1]]


async def test_compare_has_shared_task_rows_per_repo_and_pages_its_tasks(tmp_path: Path) -> None:
    base = big_store(tmp_path / "runs" / "base", 400)  # 100 tasks, 20 per repo
    trained = tmp_path / "runs" / "trained"
    store = JournalStore(trained / "capture" / "node-0")
    src = JournalStore(base / "capture" / "node-0")
    for sid in src.outcome_ids():  # the trained run: half of repo4's tasks missing, every session rewarded
        outcome = src.read_outcome(sid) or {}
        if int(outcome["task_id"][-4:]) % 10 == 4:
            continue
        store.write_outcome(sid, {**outcome, "reward": 1.0, "status": "completed", "failure_kind": None})
    store.close()
    async with TestClient(TestServer(build_dashboard(Dashboard([tmp_path / "runs"])))) as client:
        data = await (await client.get("/api/compare?a=base&b=trained")).json()
        per_repo = {r["name"]: r for r in next(s for s in data["sections"] if s["section"] == "per_repo")["rows"]}
        assert (per_repo["repo4"]["a"]["tasks"], per_repo["repo4"]["b"]["tasks"]) == (20, 10)
        shared = per_repo["repo4 · shared tasks"]  # like for like: the 10 tasks of repo4 both ran
        assert shared["a"]["tasks"] == 10 == shared["b"]["tasks"] and shared["b"]["pass@1"] == 1.0
        assert "repo0 · shared tasks" not in per_repo  # the same tasks in both: no second row
        assert data["per_task_total"] == 100 and len(data["per_task"]) == 50  # one page, not every task
        every = [t["task_id"] for t in (await (await client.get("/api/compare?a=base&b=trained&limit=500")).json())["per_task"]]
        page2 = await (await client.get("/api/compare?a=base&b=trained&offset=50&limit=50")).json()
        assert [t["task_id"] for t in page2["per_task"]] == every[50:100] and page2["per_task_offset"] == 50
        only = await (await client.get("/api/compare?a=base&b=trained&q=task0004")).json()
        assert [t["task_id"] for t in only["per_task"]] == ["repo4__task0004"] and only["per_task_total"] == 1


async def test_tasks_are_paged_server_side_over_5000_sessions(tmp_path: Path) -> None:
    big_store(tmp_path / "runs" / "big", 5000)
    async with TestClient(TestServer(build_dashboard(Dashboard([tmp_path / "runs"])))) as client:
        first = await (await client.get("/api/runs/big/tasks")).json()
        assert first["total"] == 1250 and len(first["tasks"]) == 50 and first["offset"] == 0
        later = await (await client.get("/api/runs/big/tasks?offset=1200&limit=100")).json()
        assert len(later["tasks"]) == 50 and later["tasks"][-1]["task_id"] == "repo4__task1249"
        worst = await (await client.get("/api/runs/big/tasks?sort=mean_reward&limit=3")).json()
        assert [t["mean_reward"] for t in worst["tasks"]] == sorted(t["mean_reward"] for t in worst["tasks"])
        assert worst["tasks"][0]["mean_reward"] == 0.0
        repo3 = await (await client.get("/api/runs/big/tasks?q=repo3__&limit=500")).json()
        assert repo3["total"] == 250 and {t["task_id"][:5] for t in repo3["tasks"]} == {"repo3"}
        assert first["states"] == {"done": 1250}


async def test_live_counts_are_right_from_the_first_look(tmp_path: Path) -> None:
    run = tmp_path / "runs" / "r1"
    write_run(run, [], {"alpha": 4, "beta": 2})  # plan.json only: no session has reached a node
    (run / "sessions.jsonl").unlink()
    observer = JobObserver(run, None, {"mode": "rollout"})
    observer.live.started = time.time() - 70.0  # the job began 70 s ago; its nodes are still starting
    observer.phase("starting 1 node(s): embedded, gateway, runtime folders", 0.0)
    try:
        async with TestClient(TestServer(build_dashboard(Dashboard([tmp_path / "runs"])))) as client:
            live = await (await client.get("/api/runs/r1/live")).json()
    finally:
        observer.close()
    assert live["state"] == "starting" and live["total"] == 6
    assert live["stages"]["queued"] == 6  # every planned session waits (QUEUED showed 0)
    assert live["elapsed_s"] >= 69.0  # from the run's start, not the last write's 0.0


async def test_an_in_flight_session_says_what_it_has_reached(tmp_path: Path) -> None:
    live_run(tmp_path)
    async with TestClient(TestServer(build_dashboard(Dashboard([tmp_path / "runs"])))) as client:
        d = await (await client.get("/api/runs/r1/sessions/alpha-g-1")).json()
        assert d["in_flight"] is True and d["evaluation"] == {} and d["stage_seconds"] == {}
        assert d["grading"] == "not yet run"
        assert d["stages_reached"] == ["queued", "init", "ready", "running"]
        done: dict[str, Any] = await (await client.get("/api/runs/r1/sessions/alpha-g-0")).json()
        assert done["grading"] is None and done["stages_reached"] == []
