"""A session whose harness ends without one captured model call is a typed, masked, ungraded
``no_model_calls`` row, never a silent completion (the peer project's failure: a preset whose config
missed the gateway URL ran to completion capturing nothing). Through the real lifecycle: the loop
harness told never to call, given a key the gateway never issued, or pointed at an address that
never answers. Runtimes are the FakeRuntime test double, the engine the simulated one (conftest)."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

from polar_env.proxy.sessions import Session
from polar_env.records import FailureKind
from polar_env.staging.models import AgentSpec, SessionSpec, SessionStatus
from polar_env.staging.report import build_report
from tests.staging.conftest import FakeRuntimeNode
from tests.staging.test_node import loop_task, started
from tests.staging.test_outcomes import check_row, rebuilt, run_one
from tests.waits import until


async def test_a_harness_that_never_calls_is_masked_and_not_graded(node_config) -> None:  # type: ignore[no-untyped-def]
    node = await started(FakeRuntimeNode(node_config()))
    r = await run_one(node, agent=AgentSpec(harness="loop", settings={"max_turns": 0}))  # exits 2, called nothing
    assert r.status is SessionStatus.ERROR and r.records == 0 and r.harness_exit_code == 2
    check_row(r, FailureKind.NO_MODEL_CALLS, masked=True, traces=False)
    detail = r.failure_detail or ""
    assert "never reached the gateway" in detail and "base URL / API key" in detail and "exit code 2" in detail
    assert r.evaluation["status"] == "skipped" and r.reward == 0.0  # not graded: nothing of the policy's to grade
    assert rebuilt(node)[r.session_id].failure_kind is FailureKind.NO_MODEL_CALLS  # polar-env build agrees
    report = build_report([r], [], 1.0)
    assert report["failure_kinds"] == {"no_model_calls": 1} and report["masked"] == 1


class WrongKeyNode(FakeRuntimeNode):
    """Test double: hands the harness a key the gateway never issued (a preset's key config gone wrong)."""

    def session(self, session_id: str) -> Session:
        return dataclasses.replace(super().session(session_id), key="sk-polar-not-issued")


async def test_a_harness_with_a_wrong_key_carries_its_exit_code_and_output(node_config) -> None:  # type: ignore[no-untyped-def]
    node = await started(WrongKeyNode(node_config()))
    r = await run_one(node)
    assert r.status is SessionStatus.ERROR and r.records == 0
    check_row(r, FailureKind.NO_MODEL_CALLS, masked=True, traces=False)  # was a harness_error before
    detail = r.failure_detail or ""
    assert "exit code 1" in detail and "gateway answered 401" in detail and "invalid API key" in detail, detail


async def test_a_harness_hanging_on_an_address_that_never_answers_times_out_as_no_model_calls(  # type: ignore[no-untyped-def]
        node_config, tmp_path: Path) -> None:
    async def hold(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()  # accept, never answer: until the client gives up
        writer.close()

    server = await asyncio.start_unix_server(hold, path=str(tmp_path / "nobody.sock"))
    node = await started(FakeRuntimeNode(node_config()))
    node.socket = tmp_path / "nobody.sock"  # the harness's gateway address, wrong
    try:
        r = await run_one(node, timeout_s=0.5)
    finally:
        server.close()
    assert r.status is SessionStatus.TIMEOUT and r.records == 0
    check_row(r, FailureKind.NO_MODEL_CALLS, masked=True, traces=False)  # was a (masked) agent_timeout before
    detail = r.failure_detail or ""
    assert "never reached the gateway" in detail and "agent exceeded 0.5 s" in detail, detail


async def test_an_init_failure_and_a_cancellation_keep_their_kinds(node_config) -> None:  # type: ignore[no-untyped-def]
    failing = await started(FakeRuntimeNode(node_config(), fail_prepare=True))
    r = await run_one(failing, agent=AgentSpec(harness="loop", settings={"max_turns": 0}))
    check_row(r, FailureKind.INIT_ERROR, masked=True, traces=False)
    node = await started(FakeRuntimeNode(node_config(latency_s=5.0)))  # cancelled while its first call is in the engine
    spec = SessionSpec(session_id="c-0", sample_index=0, group_id="c", request=loop_task(1))
    task = asyncio.create_task(node.run(spec))
    await until(lambda: node.meter is not None and node.meter.in_flight == 1, "the first call in the engine")
    assert node.cancel("c-0")
    c = await asyncio.wait_for(task, 10)
    await node.stop()
    assert c.records == 0
    check_row(c, FailureKind.CANCELLED, masked=True, traces=False)
