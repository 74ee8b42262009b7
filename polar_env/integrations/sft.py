"""Offline SFT data: the sessions an evaluator accepted, as chat messages + token ids + loss masks.

``polar-env sft`` rolls tasks out (the same staged job as ``polar-env rollout``), then
``export_sft`` keeps the accepted sessions only — for SWE tasks, swebench's ``resolved``: every
FAIL_TO_PASS test passes and PASS_TO_PASS stay green; for other evaluators, reward ≥ ``min_reward``
— and writes one row per trace to ``sft.jsonl`` and ``sft.parquet``:

- ``input_ids``: the exact engine ids, prompt then response; ``loss_mask`` of the same length, 1
  only on tokens the model sampled (0 on the prompt and on tool output the harness inserted);
- ``messages``: the conversation as the harness sent it on the trace's last call, plus the
  assistant's final message (OpenAI chat shape, content flattened to text) — for trainers that
  re-template; the ids are what the model actually saw;
- ``session_id``, ``trace_index``, ``loss_weight`` (session-normalised, ``credit``), ``reward``.

The Parquet file has a fixed schema, so ``datasets.load_dataset("parquet", data_files=...)`` and
pyarrow load it as is.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from polar_env.chat.content import content_text
from polar_env.errors import ConfigError
from polar_env.integrations.credit import CreditScheme, trace_weights
from polar_env.journal.protocols import JournalOpener, JournalSource
from polar_env.records import AssistantMessage, CompletionRecord, FailureKind, Status, Trajectory
from polar_env.trajectory.outcome import failure_kind_of

SFT_JSONL = "sft.jsonl"
SFT_PARQUET = "sft.parquet"


def accepted(failure_kind: FailureKind | None, reward: float, evaluation: Mapping[str, Any], min_reward: float = 1.0) -> bool:
    """Did the evaluator accept this session? A session that completed (no ``failure_kind``) and whose
    evaluation says ``resolved`` (swebench), or, for evaluators without that verdict, whose reward ≥
    ``min_reward``."""
    if failure_kind is not None or evaluation.get("status", "completed") != "completed":
        return False
    if "resolved" in evaluation:
        return evaluation["resolved"] is True
    return reward >= min_reward


def _tool_calls(calls: Any) -> list[dict[str, Any]]:
    out = []
    for c in calls or []:
        fn = c.get("function") or {}
        args = fn.get("arguments", "")
        out.append({"id": str(c.get("id", "")), "type": "function", "function": {
            "name": str(fn.get("name", "")), "arguments": args if isinstance(args, str) else orjson.dumps(args).decode()}})
    return out


def message(m: Mapping[str, Any]) -> dict[str, Any]:
    """One chat message in the fixed SFT shape (every field present, content as text)."""
    reasoning = m.get("reasoning_content", m.get("reasoning"))
    return {"role": str(m.get("role", "")), "content": content_text(m.get("content")),
            "reasoning_content": reasoning if isinstance(reasoning, str) else None,
            "tool_calls": _tool_calls(m.get("tool_calls")),
            "tool_call_id": m.get("tool_call_id") if isinstance(m.get("tool_call_id"), str) else None,
            "name": m.get("name") if isinstance(m.get("name"), str) else None}


def assistant_message(msg: AssistantMessage) -> dict[str, Any]:
    calls = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
             for c in msg.tool_calls]
    return message({"role": "assistant", "content": msg.content or "", "reasoning_content": msg.reasoning,
                    "tool_calls": calls})


def trace_messages(seqs: Sequence[int], records: Mapping[int, CompletionRecord]) -> list[dict[str, Any]]:
    """The conversation of a trace: its last call's request messages plus that call's reply."""
    present = [s for s in seqs if s in records]
    if not present:
        return []
    last = records[max(present)]
    return [message(m) for m in last.chat_request.messages] + [assistant_message(last.message)]


def sft_rows(trajectory: Trajectory, records: Iterable[CompletionRecord] = (), *, repo: str = "",
             credit: CreditScheme = CreditScheme.SESSION) -> list[dict[str, Any]]:
    """One row per trainable trace with sampled tokens (see the module docstring); side requests
    and calls the harness did not continue are not the session's accepted work."""
    by_seq = {r.seq: r for r in records}
    traces = [t for t in trajectory.traces if t.response_ids and t.trainable]
    rows = []
    for index, (trace, weight) in enumerate(zip(traces, trace_weights(traces, credit), strict=True)):
        msgs = trace_messages(trace.metadata.get("seqs", []), by_seq)
        rows.append({
            "session_id": trajectory.session_id,
            "task_id": str(trajectory.metadata.get("task_id") or ""),
            "repo": repo,
            "trace_index": index,
            "reward": float(trajectory.reward or 0.0),
            "loss_weight": weight,
            "messages": msgs,
            "input_ids": [*trace.prompt_ids, *trace.response_ids],
            "loss_mask": [0] * len(trace.prompt_ids) + list(trace.loss_mask),
            "prompt_length": len(trace.prompt_ids),
            "num_messages": len(msgs),
            "assistant_turns": sum(1 for m in msgs if m["role"] == "assistant"),
        })
    return rows


def write_jsonl(rows: Iterable[dict[str, Any]], path: Path) -> int:
    n = 0
    with open(path, "wb") as f:
        for row in rows:
            f.write(orjson.dumps(row) + b"\n")
            n += 1
    return n


def write_parquet(rows: list[dict[str, Any]], path: Path) -> int:
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise ConfigError("writing Parquet needs pyarrow: pip install -e '.[parquet]'") from None
    call = pa.struct([("id", pa.string()), ("type", pa.string()),
                      ("function", pa.struct([("name", pa.string()), ("arguments", pa.string())]))])
    msg = pa.struct([("role", pa.string()), ("content", pa.string()), ("reasoning_content", pa.string()),
                     ("tool_calls", pa.list_(call)), ("tool_call_id", pa.string()), ("name", pa.string())])
    schema = pa.schema([
        ("session_id", pa.string()), ("task_id", pa.string()), ("repo", pa.string()), ("trace_index", pa.int32()),
        ("reward", pa.float64()), ("loss_weight", pa.float64()), ("messages", pa.list_(msg)),
        ("input_ids", pa.list_(pa.int64())), ("loss_mask", pa.list_(pa.int8())), ("prompt_length", pa.int32()),
        ("num_messages", pa.int32()), ("assistant_turns", pa.int32()),
    ])
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), path)
    return len(rows)


@dataclass
class SftSummary:
    """Attempts and acceptances per repo, and the shape of what was kept."""

    per_repo: dict[str, list[int]] = field(default_factory=dict)  # repo -> [attempts, accepted]
    messages: list[int] = field(default_factory=list)  # per accepted session (its longest trace)
    assistant_turns: list[int] = field(default_factory=list)
    rows: int = 0
    files: list[str] = field(default_factory=list)

    def attempt(self, repo: str, ok: bool) -> None:
        entry = self.per_repo.setdefault(repo, [0, 0])
        entry[0] += 1
        entry[1] += int(ok)

    def table(self) -> str:
        width = max([4, *(len(r) for r in self.per_repo)])
        lines = [f"{'repo':<{width}}  attempts  accepted   rate"]
        total = [0, 0]
        for repo, (n, ok) in sorted(self.per_repo.items()):
            lines.append(f"{repo:<{width}}  {n:>8}  {ok:>8}  {ok / n if n else 0:>5.0%}")
            total[0] += n
            total[1] += ok
        lines.append(f"{'all':<{width}}  {total[0]:>8}  {total[1]:>8}  {total[1] / total[0] if total[0] else 0:>5.0%}")
        if self.messages:
            lines.append(f"per accepted trajectory: {sum(self.messages) / len(self.messages):.1f} messages, "
                         f"{sum(self.assistant_turns) / len(self.assistant_turns):.1f} assistant turns; "
                         f"{self.rows} rows")
        else:
            lines.append("no accepted trajectories")
        return "\n".join(lines)


def export(results: Iterable[tuple[FailureKind | None, float, Mapping[str, Any], Trajectory | None, str]],
           records_of: Any, out_dir: Path, *, min_reward: float = 1.0,
           credit: CreditScheme = CreditScheme.SESSION) -> SftSummary:
    """Filter and write. ``results``: (failure kind, reward, evaluation, trajectory, repo) per session;
    a masked trajectory is never accepted. ``records_of(trajectory)`` returns its captured records
    (for the messages)."""
    summary = SftSummary()
    rows: list[dict[str, Any]] = []
    for kind, reward, evaluation, traj, repo in results:
        ok = traj is not None and not traj.mask and accepted(kind, reward, evaluation, min_reward)
        summary.attempt(repo, ok)
        if not ok or traj is None:
            continue
        kept = sft_rows(traj, records_of(traj), repo=repo, credit=credit)
        if not kept:
            continue
        main = max(kept, key=lambda r: sum(r["loss_mask"]))
        summary.messages.append(main["num_messages"])
        summary.assistant_turns.append(main["assistant_turns"])
        rows += kept
    out_dir.mkdir(parents=True, exist_ok=True)
    summary.rows = write_jsonl(rows, out_dir / SFT_JSONL)
    summary.files.append(SFT_JSONL)
    write_parquet(rows, out_dir / SFT_PARQUET)
    summary.files.append(SFT_PARQUET)
    return summary


def export_job(out_dir: Path, repo_of: Mapping[str, str], *, open_journal: JournalOpener, min_reward: float = 1.0,
               credit: CreditScheme = CreditScheme.SESSION) -> SftSummary:
    """``export`` over what ``polar-env rollout``'s job wrote to ``out_dir``: ``sessions.jsonl``
    (every attempt), ``trajectories.jsonl`` and the capture journals under ``capture/<node>/``
    (each opened with ``open_journal``, which the caller names)."""
    from polar_env.trajectory.export import read_jsonl

    sessions = [orjson.loads(line) for line in (out_dir / "sessions.jsonl").read_bytes().splitlines() if line.strip()]
    trajs = {t.session_id: t for t in read_jsonl(out_dir / "trajectories.jsonl")}
    stores: dict[str, JournalSource] = {}

    def records_of(traj: Trajectory) -> list[CompletionRecord]:
        node = str(traj.metadata.get("node_id") or "")
        if node not in stores:
            stores[node] = open_journal(out_dir / "capture" / node)
        return stores[node].read(traj.session_id)

    rows = ((failure_kind_of(s, Status(s["status"])), float(s.get("reward", 0.0)), s.get("evaluation") or {},
             trajs.get(s["session_id"]), repo_of.get(s["task_id"], s["task_id"])) for s in sessions)
    return export(rows, records_of, out_dir, min_reward=min_reward, credit=credit)
