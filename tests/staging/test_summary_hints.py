"""The summary's hints (issue 44, item 11): sessions that time out on a loaded machine are told
apart from a policy that ran out of time (what the engine was doing, the flag that helps), and the
"random weights" hint is not given when real weights were loaded."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from polar_env.staging.summary import next_steps, real_weights, timeout_hint


def report(*, timeout: int = 2, busy: float | None = 0.97, kind: str = "embedded",
           engine: dict[str, str] | None = None) -> dict[str, Any]:
    return {
        "statuses": {"timeout": timeout, "completed": 1}, "failure_kinds": {"agent_timeout": timeout},
        "engine_busy_fraction": busy, "wall_s": 640.0, "sampled_tokens": 1920, "engine_calls": 6, "mean_reward": 0.0,
        "config": {"env": {"engine": {"kind": kind, **(engine or {})}, "timeout_s": 600.0, "limits": {"max_running": 4}}},
    }


def test_timeouts_behind_a_busy_engine_name_the_engine_and_the_flags() -> None:
    lines = timeout_hint(report())
    assert lines == [
        "2 session(s) timed out; meanwhile the engine was busy 97.0% of the 640 s run and sampled 1920 tokens in 6 "
        "call(s) (3.0 tokens/s): the engine, not the policy, was the limit (the embedded CPU engine decodes one "
        "request at a time); lower --max-running (now 4) or raise --timeout-s (now 600), or give the engine more capacity"]
    steps = next_steps(report(), Path("runs/x"))
    assert steps[0].startswith("next: 2 session(s) timed out; meanwhile the engine was busy 97.0%")


def test_timeouts_beside_an_idle_engine_blame_the_machine() -> None:
    (line,) = timeout_hint(report(busy=0.05, kind="vllm"))
    assert "busy 5.0%" in line and "the harnesses themselves were slow (a loaded machine?)" in line
    assert line.endswith("lower --max-running (now 4) or raise --timeout-s (now 600)")
    assert "decodes one request" not in line
    alone = report()
    alone["config"]["env"]["limits"]["max_running"] = 1
    assert "--max-running" not in timeout_hint(alone)[0]  # one session at a time already: only the budget helps


def test_engine_bound_timeouts_are_counted_and_no_timeouts_say_nothing() -> None:
    bound = report(timeout=3)
    bound["failure_kinds"] = {"engine_bound_timeout": 2, "agent_timeout": 1}
    assert "3 session(s) timed out (2 session(s) ran out of wall time waiting on the engine, masked)" in timeout_hint(bound)[0]
    assert timeout_hint(report(timeout=0)) == []
    assert not any("timed out" in s for s in next_steps(report(timeout=0), Path("r")))


def test_the_random_weights_hint_only_for_random_weights() -> None:
    seeded = " ".join(next_steps(report(timeout=0, engine={"template": "qwen3.5"}), Path("r")))
    assert "random weights" in seeded
    for engine in ({"template": "smollm2"}, {"template": "hf:/m/SmolLM2.gguf"},
                   {"template": "auto", "model_dir": "/m/SmolLM2.gguf"}):
        assert real_weights(engine)
        assert "random weights" not in " ".join(next_steps(report(timeout=0, engine=engine), Path("r"))), engine
