"""Offline SFT export: only evaluator-accepted sessions are kept; rows carry the exact ids, a loss
mask that is 1 only on sampled tokens, and the conversation; JSONL and Parquet load back (pyarrow,
and ``datasets`` when installed). The real path runs ``polar-env sft`` on two toy tasks."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import orjson
import pytest
from integration_doubles import multi_turn_trace, trace, trajectory

from polar_env.integrations.sft import SFT_JSONL, SFT_PARQUET, accepted, export, export_job, sft_rows
from polar_env.journal.store import JournalStore
from polar_env.records import (
    AssistantMessage,
    ChatRequest,
    CompletionRecord,
    FailureKind,
    ProviderAPI,
    Timings,
    ToolCall,
)

pytestmark = pytest.mark.slow  # CLI runs

TOOL_CALL = {"id": "c1", "type": "function", "function": {"name": "bash", "arguments": {"command": "ls"}}}


def record(seq: int, messages: list[dict[str, Any]], reply: AssistantMessage, session: str = "s-1") -> CompletionRecord:
    return CompletionRecord(
        session_id=session, seq=seq, provider_api=ProviderAPI.OPENAI_CHAT, provider_request={},
        chat_request=ChatRequest(messages=messages), timings=Timings(received_at=0.0), message=reply,
        prompt_ids=[1], response_ids=[2], response_logprobs=[-0.1], finish_reason="stop")


def conversation() -> list[CompletionRecord]:
    first = [{"role": "system", "content": "sys"}, {"role": "user", "content": [{"type": "text", "text": "fix it"}]}]
    call = AssistantMessage(content=None, reasoning="look first", tool_calls=[ToolCall(id="c1", name="bash", arguments='{"command":"ls"}')])
    second = [*first, {"role": "assistant", "content": None, "tool_calls": [TOOL_CALL]},
              {"role": "tool", "tool_call_id": "c1", "content": "a.py"}]
    return [record(0, first, call), record(1, second, AssistantMessage(content="Done."))]


def test_rows_hold_exact_ids_masks_and_messages() -> None:
    t = multi_turn_trace().model_copy(update={"metadata": {"seqs": [0, 1]}})
    traj = trajectory([t], reward=1.0, task_id="toy__calc-1")
    (row,) = sft_rows(traj, conversation(), repo="toy/calc")
    assert row["input_ids"] == t.prompt_ids + t.response_ids
    assert row["loss_mask"] == [0, 0, 0] + t.loss_mask and len(row["loss_mask"]) == len(row["input_ids"])
    assert row["prompt_length"] == 3 and row["task_id"] == "toy__calc-1" and row["repo"] == "toy/calc"
    msgs = row["messages"]
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "tool", "assistant"]
    assert msgs[1]["content"] == "fix it"  # content parts flattened to text
    assert msgs[2]["tool_calls"] == [{"id": "c1", "type": "function",
                                      "function": {"name": "bash", "arguments": '{"command":"ls"}'}}]
    assert msgs[3]["tool_call_id"] == "c1" and msgs[-1]["content"] == "Done."
    assert (row["num_messages"], row["assistant_turns"], row["loss_weight"]) == (5, 2, 1.0)


@pytest.mark.parametrize("kind, reward, evaluation, ok", [
    (None, 1.0, {"status": "completed", "resolved": True}, True),
    (None, 1.0, {"status": "completed", "resolved": False}, False),  # swebench's verdict wins
    (FailureKind.AGENT_TIMEOUT, 0.0, {"status": "skipped"}, False),
    (FailureKind.EVALUATOR_ERROR, 0.0, {"status": "error"}, False),
    (FailureKind.LIMIT_EXCEEDED, 1.0, {"status": "completed"}, False),  # any failure: never SFT data
    (None, 0.5, {"status": "completed"}, False),  # no verdict: reward >= min_reward
    (None, 1.0, {"status": "completed"}, True),
])
def test_acceptance(kind: FailureKind | None, reward: float, evaluation: dict[str, Any], ok: bool) -> None:
    assert accepted(kind, reward, evaluation) is ok


def test_export_filters_by_acceptance_and_loads_back(tmp_path: Path) -> None:
    good = trajectory([multi_turn_trace().model_copy(update={"metadata": {"seqs": [0, 1]}}),
                       trace([1, 4], [([30, 31], [])])], reward=1.0, session_id="s-1")
    bad = trajectory([multi_turn_trace()], reward=0.0, session_id="s-2")
    resolved = {"status": "completed", "resolved": True}
    results = [(None, 1.0, resolved, good, "toy/calc"),
               (None, 0.0, {"status": "completed", "resolved": False}, bad, "toy/calc"),
               (FailureKind.INIT_ERROR, 0.0, {}, None, "toy/textkit")]
    summary = export(results, lambda t: conversation() if t.session_id == "s-1" else [], tmp_path)
    assert summary.per_repo == {"toy/calc": [2, 1], "toy/textkit": [1, 0]}
    assert summary.rows == 2 and summary.messages == [5] and summary.assistant_turns == [2]
    table = summary.table().splitlines()
    assert table[1].split() == ["toy/calc", "2", "1", "50%"] and table[2].split() == ["toy/textkit", "1", "0", "0%"]
    assert table[3].split() == ["all", "3", "1", "33%"]
    assert table[4] == "per accepted trajectory: 5.0 messages, 2.0 assistant turns; 2 rows"
    rows = [orjson.loads(line) for line in (tmp_path / SFT_JSONL).read_bytes().splitlines()]
    assert {r["session_id"] for r in rows} == {"s-1"}
    assert sum(r["loss_weight"] for r in rows) == pytest.approx(1.0)  # session-normalised
    import pyarrow.parquet as pq

    table_pq = pq.read_table(tmp_path / SFT_PARQUET).to_pylist()
    assert [r["input_ids"] for r in table_pq] == [r["input_ids"] for r in rows]
    assert [r["loss_mask"] for r in table_pq] == [r["loss_mask"] for r in rows]
    assert table_pq[0]["messages"] == rows[0]["messages"]
    if importlib.util.find_spec("datasets") is not None:
        import datasets

        ds = datasets.load_dataset("parquet", data_files=str(tmp_path / SFT_PARQUET), split="train",
                                   cache_dir=str(tmp_path / "hf"))
        assert ds.num_rows == 2 and ds[0]["input_ids"] == rows[0]["input_ids"]
        assert ds[0]["messages"][0]["role"] == "system"


def test_cli_sft_keeps_only_the_solved_task(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from integration_env import env_config, require_sandbox

    from polar_env.cli import main
    from polar_env.tasks.toy import toy_tasks

    require_sandbox()
    (calc,) = toy_tasks(ids=["toy__calc-1"])
    script = env_config(tmp_path, calc)["engine"]["script"]  # applies calc's fix; useless on textkit
    out = tmp_path / "sft"
    rc = main(["sft", "--tasks", "toy", "--task-id", "toy__calc-1", "--task-id", "toy__textkit-1",
               "--harness", "loop", "--engine-script", script, "--samples", "1", "--out", str(out), "--no-progress"])
    printed = capsys.readouterr().out
    assert rc == 0, printed
    lines = printed.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("repo"))
    assert lines[header + 1].split() == ["toy/calc", "1", "1", "100%"]
    assert lines[header + 2].split() == ["toy/textkit", "1", "0", "0%"]
    assert lines[header + 4].startswith("per accepted trajectory: 5.0 messages, 2.0 assistant turns")
    rows = [json.loads(line) for line in (out / "latest" / SFT_JSONL).read_text().splitlines()]
    assert rows and {r["task_id"] for r in rows} == {"toy__calc-1"}
    trajs = [json.loads(line) for line in (out / "latest" / "trajectories.jsonl").read_text().splitlines()]
    (solved,) = [t for t in trajs if t["metadata"]["task_id"] == "toy__calc-1"]
    tr = solved["traces"][0]
    assert rows[0]["input_ids"] == tr["prompt_ids"] + tr["response_ids"]  # the engine's ids, untouched
    assert rows[0]["loss_mask"][len(tr["prompt_ids"]):] == tr["loss_mask"]
    assert rows[0]["messages"][-1]["role"] == "assistant" and rows[0]["messages"][-2]["role"] == "tool"


def test_export_job_reads_typed_rows_and_old_ones(tmp_path: Path) -> None:
    """sessions.jsonl rows are accepted by their failure kind and mask; rows written before kinds
    existed (``error`` text) still load, and a failed one is never accepted."""
    from polar_env.trajectory.export import write_jsonl

    good = trajectory([multi_turn_trace()], reward=1.0, session_id="ok")
    timed_out = trajectory([multi_turn_trace()], reward=1.0, session_id="late").model_copy(
        update={"failure_kind": FailureKind.AGENT_TIMEOUT})
    old = trajectory([multi_turn_trace()], reward=1.0, session_id="old")
    write_jsonl([good, timed_out, old], tmp_path / "trajectories.jsonl")
    rows = [{"session_id": "ok", "task_id": "t", "status": "completed", "reward": 1.0, "failure_kind": None,
             "mask": False, "evaluation": {"status": "completed"}},
            {"session_id": "late", "task_id": "t", "status": "timeout", "reward": 1.0, "failure_kind": "agent_timeout",
             "mask": False, "evaluation": {"status": "completed"}},
            {"session_id": "old", "task_id": "t", "status": "error", "reward": 1.0, "error": "INIT failed: boom",
             "evaluation": {"status": "completed"}}]
    (tmp_path / "sessions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    summary = export_job(tmp_path, {}, open_journal=JournalStore)
    assert summary.per_repo == {"t": [3, 1]}
    assert {r["session_id"] for r in map(orjson.loads, (tmp_path / SFT_JSONL).read_bytes().splitlines())} == {"ok"}
