"""End to end: the real pi CLI auto-compacts its context, and the builder starts a new chain there.

pi (``@mariozechner/pi-coding-agent``) compacts when the last answer's usage (the gateway's real
token counts) exceeds ``contextWindow - compaction.reserveTokens`` (its models.json and
settings.json); it checks when a prompt's agent loop ends and again before the next prompt. It sends
a summarization request (no tools, its ``SUMMARIZATION_SYSTEM_PROMPT``, the history serialized
inside ``<conversation>``) and continues from ``[system, summary, kept messages]``. Here the
preset's files get a small ``contextWindow`` and a settings.json (``keepRecentTokens`` 1: only the
last answer is kept, the rest of its turn is summarized). The first prompt runs three scripted
shell calls whose output is large only the first time, then answers: usage over the threshold,
input still under the window (pi's "threshold" compaction, not its overflow recovery, which print
mode abandons). pi compacts; the second prompt continues on the summary, where the same commands
print nothing, so pi does not compact again. The scripted policy answers the summarization
request (it declares no tool) with ``SUMMARY``.

Two ways to get there: one ``pi -p FIRST SECOND`` run, where print mode does not wait for the
compaction started when the first loop ends, so the second prompt's own check starts another
(two identical summaries: no builder can tell which pi kept, both quarantined as
``ambiguous_sibling``); and a saved session resumed with ``--continue``, compacted once before the
second prompt (the summary's answer is quoted next: a trainable branch).

Prerequisites as for ``test_sandbox_rollout.py`` (bubblewrap, node, pi, python3 in /usr/bin).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

from polar_env.chat.content import content_text
from polar_env.engines.embedded.policy import ScriptedPolicy, ScriptStep
from polar_env.harnesses.launch import run_harness, with_harness
from polar_env.harnesses.pi import SPEC as PI
from polar_env.harnesses.spec import HarnessSpec, as_json
from polar_env.records import CompletionRecord, ProviderAPI
from polar_env.runtimes import ExecResult, RuntimeSpec, make_runtime
from tests.e2e.test_sandbox_rollout import GATEWAY_PORT, HARNESS_TIMEOUT_S, _harness, _unavailable, gateway
from tests.trajectory.test_rewrites import Chains, check

pytestmark = pytest.mark.slow

SUMMARY = "## Goal\nRun the listings.\n\n## Progress\n- [x] three listings printed 001-400"
FINAL = "Checkpoint: ran the three listings."
# Large output the first time a command runs in the sandbox, nothing after.
BIG = "test -e /tmp/{tag} || seq -w 1 400; touch /tmp/{tag}"
FIRST = "Run the listings."
SECOND = "Run them again."
CONTEXT_WINDOW = 7000  # the first prompt's last call: ~6500 prompt tokens, under the window
RESERVE_TOKENS = 1000  # compacts over 6000 tokens; the summary's max_tokens is half of it
KEEP_RECENT_TOKENS = 1
COMPACTED = "The conversation history before this point was compacted into the following summary:"
SUMMARIZER = "You are a context summarization assistant."
TURN_PREFIX = "This is the PREFIX of a turn that was too large to keep."


@dataclasses.dataclass(frozen=True, slots=True)
class SummarizingPolicy(ScriptedPolicy):
    """The scripted steps, and ``SUMMARY`` for a request that declares no tool (pi's
    summarization request)."""

    def next_turn(self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        if not tools:
            return {"role": "assistant", "content": SUMMARY, "reasoning_content": "Summarize."}
        return ScriptedPolicy.next_turn(self, messages, tools)


POLICY = SummarizingPolicy(steps=(
    ScriptStep(command=BIG.format(tag="one"), reasoning="List."),
    ScriptStep(command=BIG.format(tag="two"), reasoning="More."),
    ScriptStep(command=BIG.format(tag="three"), reasoning="Last."),
    ScriptStep(text=FINAL, reasoning="Done."),
))


def compacting_pi(argv: tuple[str, ...], *, enabled: bool = True) -> HarnessSpec:
    """pi's preset with a small context window, compaction settings and ``argv``."""
    conf = PI.apis[ProviderAPI.OPENAI_CHAT]
    models = json.loads(conf.files[".pi/agent/models.json"])
    for model in models["providers"]["polar"]["models"]:
        model["contextWindow"] = CONTEXT_WINDOW
        model["maxTokens"] = 2048
    settings = {"compaction": {"enabled": enabled, "reserveTokens": RESERVE_TOKENS,
                               "keepRecentTokens": KEEP_RECENT_TOKENS}}
    files = {**conf.files, ".pi/agent/models.json": as_json(models), ".pi/agent/settings.json": as_json(settings)}
    return dataclasses.replace(PI, apis={ProviderAPI.OPENAI_CHAT: dataclasses.replace(conf, files=files)}, argv=argv)


def two_prompts() -> tuple[str, ...]:
    """One run, two prompts: print mode sends the second once the first's loop ends."""
    argv = list(PI.argv)
    argv.insert(argv.index("{prompt}") + 1, SECOND)
    return tuple(argv)


def saved_session(*, resume: bool) -> tuple[str, ...]:
    """The session saved under ``$HOME`` (no ``--no-session``); ``resume``: ``--continue`` it."""
    return (*(a for a in PI.argv if a != "--no-session"), *(("--continue",) if resume else ()))


async def run_pi(runs: Sequence[tuple[HarnessSpec, str]], tmp: Path) -> tuple[ExecResult, list[CompletionRecord]]:
    """Each (preset, prompt) in turn, in one sandbox, through one gateway session; the last run."""
    harness = runs[0][0]
    async with gateway(POLICY, tmp / "capture") as gw:
        spec = with_harness(RuntimeSpec(kind="sandbox", gateway_socket=gw.socket, gateway_port=GATEWAY_PORT), harness)
        runtime = make_runtime(spec)
        await runtime.prepare()
        try:
            for harness, prompt in runs:
                run = await run_harness(runtime, harness, api=ProviderAPI.OPENAI_CHAT, key=gw.key, model=gw.model,
                                        prompt=prompt, timeout_s=HARNESS_TIMEOUT_S)
                assert run.exit_code == 0, f"exit {run.exit_code}\n{describe(gw.records())}\n{run.output[-2000:]}"
        finally:
            await runtime.stop()
        return run, gw.records()


def texts(record: CompletionRecord) -> list[str]:
    return [content_text(m.get("content")) for m in record.chat_request.messages]


def describe(records: list[CompletionRecord]) -> str:
    lines = []
    for r in records:
        roles = ",".join(str(m.get("role"))[0] for m in r.chat_request.messages)
        lines.append(f"seq {r.seq}: {len(r.prompt_ids)}+{len(r.response_ids)} tokens, {len(r.chat_request.tools or [])} "
                     f"tools, roles {roles}, calls {[c.name for c in r.message.tool_calls]}, "
                     f"text {(r.message.content or '')[:40]!r}")
    return "\n".join(lines)


def sandbox_and_pi() -> None:
    if shutil.which("bwrap") is None:
        _unavailable("bubblewrap is not installed (apt-get install -y bubblewrap)")
    if not os.access("/usr/bin/python3", os.X_OK):
        _unavailable("/usr/bin/python3 is missing (the sandbox's gateway relay runs on it)")
    _harness("pi")


def assert_compacted(run: ExecResult, records: list[CompletionRecord], summaries_allowed: Sequence[int]) -> None:
    """pi ran the first prompt, summarized it, went on from the summary; the chains say so."""
    why = f"{describe(records)}\noutput:\n{run.output[-2000:]}"
    assert run.output.strip() == FINAL, why

    # pi really summarized: requests with its summarization system prompt, no tools, the first
    # prompt's turn (all but its kept last answer) serialized as text
    summaries = [r for r in records if SUMMARIZER in texts(r)[0]]
    assert len(summaries) in summaries_allowed, why
    for r in summaries:
        assert not r.chat_request.tools and r.message.content == SUMMARY, why
        asked = texts(r)[-1]
        assert asked.startswith(f"<conversation>\n[User]: {FIRST}") and TURN_PREFIX in asked, why
        assert r.chat_request.max_tokens == RESERVE_TOKENS // 2, why
    first, last = summaries[0].seq, summaries[-1].seq
    assert [r.seq for r in summaries] == list(range(first, last + 1)), why
    pre = [r for r in records if r.seq < first]
    post = [r for r in records if r.seq > last]
    # before: three tool calls and the answer, each prompt extending the last
    assert [len(r.message.tool_calls) for r in pre] == [1, 1, 1, 0] and pre[-1].message.content == FINAL, why
    # after: the summary replaced the history; the kept last answer, then the second prompt
    rewritten = post[0].chat_request.messages
    assert [m["role"] for m in rewritten] == ["system", "user", "assistant", "user"], why
    assert texts(post[0])[1].startswith(COMPACTED) and SUMMARY in texts(post[0])[1], why
    assert content_text(rewritten[2].get("content")) == FINAL and texts(post[0])[3] == SECOND, why
    assert not any("001\n002" in t for r in post for t in texts(r)), why  # the old tool outputs are gone
    assert [len(r.message.tool_calls) for r in post] == [1, 1, 1, 0], why  # and no second compaction

    # a lone summary's answer is quoted in the next prompt: a trainable branch; two identical
    # ones cannot be told apart: both quarantined
    summary_role = "branch" if len(summaries) == 1 else "ambiguous_sibling"
    expected: Chains = [([r.seq for r in pre], True, "main", None),
                        *[([r.seq], summary_role == "branch", summary_role, None) for r in summaries],
                        ([r.seq for r in post], True, "branch", "history_rewritten")]
    traj = check(records, expected)  # both merging builders, no drift, faithful traces, per_request roles
    stats = traj.metadata["stats"]
    assert stats["chain_starts"] == [{"seq": post[0].seq, "parent": pre[-1].seq, "reason": "history_rewritten"}]
    assert stats["drift_boundaries"] == 0 and stats["drift_tokens"] == 0
    assert "uncontinued" not in stats["untrained"]
    print(f"\n{describe(records)}\nchains {[(t.metadata['seqs'], t.role, t.metadata.get('start')) for t in traj.traces]}"
          f"\nchain_starts {stats['chain_starts']}")


async def test_pi_auto_compaction_between_prompts_starts_a_new_chain(tmp_path: Path) -> None:
    """One ``pi -p FIRST SECOND`` run: pi compacts when the first prompt's loop ends, and (print
    mode not waiting for that) again in the second prompt's check: one or two summaries."""
    sandbox_and_pi()
    started = time.monotonic()
    run, records = await run_pi([(compacting_pi(two_prompts()), FIRST)], tmp_path)
    assert_compacted(run, records, summaries_allowed=(1, 2))
    print(f"pi ran {time.monotonic() - started:.1f}s")


async def test_pi_compacts_a_resumed_session_once(tmp_path: Path) -> None:
    """``pi -p FIRST`` (compaction off, the session saved), then ``pi -p SECOND --continue``
    (compaction on): the resumed session is over the threshold, pi compacts once before sending
    the second prompt and waits for it."""
    sandbox_and_pi()
    started = time.monotonic()
    runs = [(compacting_pi(saved_session(resume=False), enabled=False), FIRST),
            (compacting_pi(saved_session(resume=True)), SECOND)]
    run, records = await run_pi(runs, tmp_path)
    assert_compacted(run, records, summaries_allowed=(1,))
    print(f"pi ran {time.monotonic() - started:.1f}s")
