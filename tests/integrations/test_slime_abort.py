"""slime's own rollout loop over polar's generate, with over-sampling, so every rollout ends in
slime's real ``abort()``: ``generate_rollout_async`` submits two prompt groups, keeps the first
that finishes (the toy calc task, fixed by the scripted policy) and aborts the other, whose
sessions sit in a long tool call. polar's generate sees slime's abort flag and cancels those
sessions at once (no waiting for the two-minute command); with ``--partial-rollout`` slime collects the
aborted group into its buffer and the next rollout re-runs it through polar's generate again.

Everything on the polar side is real (PolarEnv, gateway, loop harness, bubblewrap runtime,
swebench grading, the SGLang client); the engine is the embedded CPU engine behind the SGLang
router/worker doubles of tests/fake_engines.py. slime comes from a checkout: set
``POLAR_SLIME_SRC=/path/to/slime`` (``.ci/run`` unpacks the vendored source) or install it (it is not on PyPI).
"""

from __future__ import annotations

import asyncio
import json
from argparse import Namespace
from pathlib import Path
from typing import Any

import pytest
import yaml

pytestmark = pytest.mark.usefixtures("slime_src")  # POLAR_SLIME_SRC (conftest.py): under CI, missing fails

TIMEOUT_S = 300  # polar's session timeout in this test
SLOW = 3600  # seconds the aborted sessions' command would sleep: longer than TIMEOUT_S, so such a session
# ends CANCELLED only if polar cancels it on slime's abort; waited out it would end TIMEOUT (or never)
ROLLOUT_WAIT_S = 900  # a rollout that has not returned by then fails the test (generous: a loaded machine)


def _script(tmp: Path) -> Path:
    from polar_env.tasks.toy import toy_tasks

    (calc,) = toy_tasks(ids=["toy__calc-1"])
    fix = f"cat > /tmp/fix.diff <<'POLAR_EOF'\n{calc.patch}POLAR_EOF\ngit apply /tmp/fix.diff && echo applied"
    command = f"if [ -f calc.py ]; then {fix}; else sleep {SLOW}; fi"
    path = tmp / "script.json"
    path.write_text(json.dumps({"steps": [{"command": command, "reasoning": "Work."},
                                          {"text": "Done: {tool_output}", "reasoning": "Ok."}]}))
    return path


def _args(router: Any, polar_file: Path, *, partial: bool) -> Namespace:
    host, port = router.url.removeprefix("http://").split(":")
    return Namespace(
        rollout_global_dataset=True, dynamic_sampling_filter_path=None, rollout_batch_size=1,
        over_sampling_batch_size=2, n_samples_per_prompt=2, partial_rollout=partial,
        mask_offpolicy_in_partial_rollout=partial, group_rm=False, rollout_sample_filter_path=None,
        rollout_all_samples_process_path=None, rollout_sample_hook_path=None,
        custom_generate_function_path="polar_env.integrations.slime.generate", sglang_router_ip=host,
        sglang_router_port=int(port), polar_config=str(polar_file), rollout_max_context_len=None,
        advantage_estimator="grpo", ci_test=False, reward_key=None, use_rollout_routing_replay=False,
        rollout_num_engines=1, sglang_server_concurrency=8, use_distributed_post=False, custom_rm_path=None)


def _install_state(args: Namespace) -> Any:
    """slime's GenerateState singleton without loading an HF tokenizer (its __init__ does; polar's
    generate never uses it): the same attributes, set on slime's own class."""
    from slime.rollout.sglang_rollout import GenerateState

    GenerateState.clear_instances()
    state = object.__new__(GenerateState)
    state.args = args
    state.semaphore = asyncio.Semaphore(8)
    state.sampling_params = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_new_tokens": 256,
                             "stop": None, "stop_token_ids": None, "skip_special_tokens": False,
                             "no_stop_trim": True, "spaces_between_special_tokens": False}
    state.dp_counts, state.dp_rank = [0], 0
    state.reset()
    GenerateState._instances[GenerateState] = state
    return state


def _groups(task_rows: list[dict[str, Any]], start: int) -> list[list[Any]]:
    from slime.utils.types import Sample

    groups = []
    for g, row in enumerate(task_rows):
        groups.append([Sample(index=start + 2 * g + k, group_index=start // 2 + g, prompt=row["problem_statement"],
                              metadata=dict(row)) for k in range(2)])
    return groups


@pytest.mark.parametrize("partial", [True, False], ids=["partial-rollout", "plain"])
async def test_slime_abort_cancels_polar_sessions(tmp_path: Path, partial: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    from fake_engines import FakeSGLangRouter
    from integration_env import require_sandbox
    from slime.rollout.sglang_rollout import generate_rollout_async
    from slime.utils.types import Sample

    from polar_env.engines.config import EmbeddedEngineConfig, build_engine
    from polar_env.integrations import slime as polar_slime
    from polar_env.records import FailureKind
    from polar_env.tasks.toy import toy_tasks

    ended: dict[int, tuple[bool, FailureKind | None]] = {}  # sample index: (slime aborted it, polar's failure kind)
    real_run = polar_slime.SlimeRollout._run

    async def recorded_run(self: Any, sample: Any, sampling: Any) -> tuple[Any, bool]:
        group, aborted = await real_run(self, sample, sampling)
        kind = group.results[0].failure_kind if group.results else None
        ended[sample.index] = (aborted, FailureKind(kind) if kind else None)
        return group, aborted

    monkeypatch.setattr(polar_slime.SlimeRollout, "_run", recorded_run)

    require_sandbox()
    calc, bsearch = (t.model_dump(mode="json") for t in toy_tasks(ids=["toy__calc-1", "toy__bsearch-1"]))
    router = await FakeSGLangRouter(build_engine(EmbeddedEngineConfig(script=_script(tmp_path)))).start()
    polar_file = tmp_path / "polar.yaml"
    polar_file.write_text(yaml.safe_dump({"harness": "loop", "store": str(tmp_path / "store"),
                                          "engine": {"model": "qwen3.5-4b"}, "timeout_s": TIMEOUT_S}))
    args = _args(router, polar_file, partial=partial)
    state = _install_state(args)
    from slime.utils import http_utils

    http_utils.init_http_client(args)  # what slime's RolloutManager does at start
    queue = _groups([calc, bsearch], 0)
    try:
        output, aborted = await asyncio.wait_for(
            generate_rollout_async(args, 0, lambda n: [queue.pop(0) for _ in range(n)]), ROLLOUT_WAIT_S)
        assert polar_slime._DEFAULT is not None and polar_slime._DEFAULT.generate_errors == 0  # none hidden as placeholders
        # the kept group ran to completion; the other's sessions were cancelled on slime's abort, not
        # waited out (their command outlasts polar's timeout: waited out, they would end TIMEOUT)
        assert {i: ended.get(i) for i in (2, 3)} == {2: (True, FailureKind.CANCELLED), 3: (True, FailureKind.CANCELLED)}, ended
        assert not state.aborted  # slime reset its state after the rollout
        (kept,) = output.samples
        assert [s.metadata["instance_id"] for s in _leaves(kept)] == ["toy__calc-1"] * len(_leaves(kept))
        assert all(s.reward == 1.0 and s.status == Sample.Status.COMPLETED for s in _leaves(kept))
        if not partial:
            assert all(isinstance(x, list) for x in kept) and aborted == []  # fan-out lists; nothing kept
            return
        assert all(isinstance(x, Sample) for x in kept)  # one Sample per session under --partial-rollout
        (requeued,) = aborted
        assert [s.status for s in requeued] == [Sample.Status.ABORTED] * 2
        assert all(s.response == "" and s.response_length == 0 and s.tokens == [] for s in requeued)
        assert all(s.metadata["instance_id"] == "toy__bsearch-1" for s in requeued)
        # The next rollout takes the buffered group back first (as slime's data buffer does) and a
        # fresh calc group; polar's generate re-runs the aborted prompts from scratch.
        queue = [requeued, *_groups([calc], 10)]
        ended.clear()
        output2, aborted2 = await asyncio.wait_for(
            generate_rollout_async(args, 1, lambda n: [queue.pop(0) for _ in range(n)]), ROLLOUT_WAIT_S)
        assert all(ended.get(s.index) == (True, FailureKind.CANCELLED) for s in requeued), ended  # cancelled again
        (kept2,) = output2.samples
        assert all(s.reward == 1.0 for s in kept2) and [s.index for s in kept2] == [10, 11]
        (requeued2,) = aborted2
        assert [s.index for s in requeued2] == [s.index for s in requeued]
        assert all(s.status == Sample.Status.ABORTED for s in requeued2)
        sessions = json.dumps([s.metadata.get("polar", {}) for s in requeued2])
        assert "slime aborted the rollout" in sessions
    finally:
        type(state).clear_instances()
        client, http_utils._http_client = http_utils._http_client, None
        if client is not None:
            await client.aclose()
        await polar_slime.shutdown()
        await router.stop()


def _leaves(group: list[Any]) -> list[Any]:
    return [s for x in group for s in (x if isinstance(x, list) else [x])]
