"""The rollout server: dispatch, early stop, callbacks with retries, the authenticated HTTP task API."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from polar_env.records import FailureKind
from polar_env.staging.models import SessionStatus, TaskRequest, TaskState, TaskStatus
from polar_env.staging.server import LocalNode, RolloutServer, build_server_app
from tests.staging.conftest import FakeRuntimeNode
from tests.staging.test_node import loop_task
from tests.waits import WAIT_S, until


async def two_nodes(node_config, **runtime: Any) -> list[FakeRuntimeNode]:  # type: ignore[no-untyped-def]
    nodes = [FakeRuntimeNode(node_config(max_running=2).model_copy(update={"node_id": f"n{i}"}), **runtime)
             for i in range(2)]
    await asyncio.gather(*(n.start() for n in nodes))
    return nodes


async def test_least_loaded_dispatch_spreads_a_group_over_nodes(node_config) -> None:  # type: ignore[no-untyped-def]
    nodes = await two_nodes(node_config)
    server = RolloutServer([LocalNode(n) for n in nodes])
    try:
        status = await server.run(loop_task(8))
    finally:
        await server.aclose()
    per_node = {n.node_id: sum(1 for r in status.results if r.node_id == n.node_id) for n in nodes}
    assert per_node == {"n0": 4, "n1": 4}
    assert status.state is TaskState.DONE and status.finished_at is not None
    # each node journaled only its own sessions
    assert set(nodes[0].store.session_ids()).isdisjoint(nodes[1].store.session_ids())


async def test_early_stop_cancels_the_stragglers(node_config) -> None:  # type: ignore[no-untyped-def]
    slow = {"t-x-3", "t-x-4", "t-x-5"}  # stragglers: their tool calls never come back in time
    node = FakeRuntimeNode(node_config(max_running=6), per_session={s: {"exec_s": 30.0} for s in slow})
    await node.start()
    server = RolloutServer([LocalNode(node)])
    try:
        status = await asyncio.wait_for(server.run(loop_task(6, group_id="t-x", early_stop_min_usable=3)), 20)
    finally:
        await server.aclose()
    by_status = {r.session_id: r.status for r in status.results}
    assert status.early_stopped is True
    assert sum(s is SessionStatus.COMPLETED for s in by_status.values()) >= 3
    assert {sid for sid, s in by_status.items() if s is SessionStatus.CANCELLED} == slow
    assert len(status.results) == 6  # stragglers still report
    assert {r.session_id for r in status.results if r.failure_kind is FailureKind.CANCELLED and r.mask} == slow


async def test_a_group_can_run_only_some_of_its_samples(node_config) -> None:  # type: ignore[no-untyped-def]
    """What ``--resume`` submits: the unfinished sample indices of a planned group, under their ids."""
    node = FakeRuntimeNode(node_config(max_running=2))
    await node.start()
    server = RolloutServer([LocalNode(node)])
    try:
        status = server.submit(loop_task(5, group_id="t-plan"), samples=[4, 1, 4])
        await server.tasks[status.group_id].runner
    finally:
        await server.aclose()
    assert [(r.session_id, r.sample_index) for r in status.results] == [("t-plan-1", 1), ("t-plan-4", 4)]
    assert status.num_samples == 5 and status.state is TaskState.DONE
    assert sorted(node.store.session_ids()) == ["t-plan-1", "t-plan-4"]


async def test_callback_is_retried_until_it_is_accepted(node_config) -> None:  # type: ignore[no-untyped-def]
    received: list[dict[str, Any]] = []

    async def callback(request: web.Request) -> web.Response:
        received.append(await request.json())
        return web.Response(status=503 if len(received) < 3 else 200)

    app = web.Application()
    app.router.add_post("/done", callback)
    async with TestServer(app, host="127.0.0.1") as sink:
        node = FakeRuntimeNode(node_config())
        await node.start()
        server = RolloutServer([LocalNode(node)], callback_backoff_s=0.01)
        try:
            await server.run(loop_task(2, callback_url=str(sink.make_url("/done"))))
        finally:
            await server.aclose()
    assert len(received) == 3  # two refusals, then accepted
    status = TaskStatus.model_validate(received[-1])
    assert status.state is TaskState.DONE and len(status.results) == 2
    assert all(r.trajectory is not None and r.reward == 1.0 for r in status.results)


async def test_callback_gives_up_after_its_retries_and_status_stays_pollable(node_config) -> None:  # type: ignore[no-untyped-def]
    node = FakeRuntimeNode(node_config())
    await node.start()
    server = RolloutServer([LocalNode(node)], callback_retries=2, callback_backoff_s=0.01)
    try:
        # nothing listens on port 9 of loopback: every attempt is refused at once
        status = await server.run(loop_task(1, group_id="g", callback_url="http://127.0.0.1:9/done"))
        assert server.tasks["g"].callback_attempts == 2 and server.tasks["g"].callback_error
        assert server.get("g") is status and server.get("echo") is status
    finally:
        await server.aclose()


async def test_http_task_api_requires_the_token(node_config) -> None:  # type: ignore[no-untyped-def]
    node = FakeRuntimeNode(node_config())
    await node.start()
    server = RolloutServer([LocalNode(node)])
    app = build_server_app(server, "s3cret")
    async with TestClient(TestServer(app, host="127.0.0.1")) as client:
        body = loop_task(2).model_dump_json()
        for method, path in (("POST", "/rollout/task/submit"), ("GET", "/rollout/status"), ("GET", "/rollout/task/x"),
                             ("DELETE", "/rollout/task/x")):
            resp = await client.request(method, path, data=body, headers={"Authorization": "Bearer wrong"})
            assert resp.status == 401, path
        for raw in ("Bearer s3cr\u00e9t".encode(), b"Bearer \xff\xfe\x80", "Bearer \u20ac".encode()):  # non-ASCII
            reader, writer = await asyncio.open_connection("127.0.0.1", client.port)
            writer.write(b"GET /rollout/status HTTP/1.1\r\nHost: x\r\nAuthorization: " + raw + b"\r\nConnection: close\r\n\r\n")
            answer = await reader.read()
            writer.close()
            head, _, payload = answer.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 401"), answer[:200]
            assert b'"error"' in payload and b"application/json" in head
        assert (await client.get("/health")).status == 200
        auth = {"Authorization": "Bearer s3cret"}
        resp = await client.post("/rollout/task/submit", data=body, headers=auth)
        assert resp.status == 202
        group = (await resp.json())["group_id"]
        bad = await client.post("/rollout/task/submit", data=b'{"task_id": 5}', headers=auth)
        assert bad.status == 400 and "invalid TaskRequest" in (await bad.json())["error"]["message"]
        await asyncio.wait_for(server.tasks[group].done.wait(), WAIT_S)
        summary = await (await client.get(f"/rollout/task/{group}?results=0", headers=auth)).json()
        assert summary["state"] == "done", summary
        assert summary["done"] == 2 and summary["statuses"] == {"completed": 2} and summary["mean_reward"] == 1.0
        assert summary["failure_kinds"] == {} and summary["masked"] == 0
        full = TaskStatus.model_validate(await (await client.get(f"/rollout/task/{group}", headers=auth)).json())
        assert all(r.trajectory is not None for r in full.results)
        overview = await (await client.get("/rollout/status", headers=auth)).json()
        assert overview["nodes"][0]["completed"] == 2 and overview["tasks"][0]["group_id"] == group
    await server.aclose()


async def test_cancel_a_running_task_over_http(node_config) -> None:  # type: ignore[no-untyped-def]
    node = FakeRuntimeNode(node_config(), exec_s=30.0)
    await node.start()
    server = RolloutServer([LocalNode(node)])
    async with TestClient(TestServer(build_server_app(server, "t"), host="127.0.0.1")) as client:
        auth = {"Authorization": "Bearer t"}
        group = (await (await client.post("/rollout/task/submit", data=loop_task(2).model_dump_json(),
                                          headers=auth)).json())["group_id"]
        await until(lambda: len(node.made) == 2 and all(rt.commands for rt in node.made), "both tool calls to start")
        assert (await client.delete(f"/rollout/task/{group}", headers=auth)).status == 200
        await asyncio.wait_for(server.tasks[group].done.wait(), 10)
    status = server.get(group)
    assert status is not None and status.state is TaskState.CANCELLED
    assert [r.status for r in status.results] == [SessionStatus.CANCELLED] * 2
    assert all(r.failure_kind is FailureKind.CANCELLED and r.mask and r.trajectory.traces for r in status.results)
    assert status.summary()["failure_kinds"] == {"cancelled": 2} and status.summary()["masked"] == 2
    await server.aclose()


def test_task_request_json_round_trip() -> None:
    req = loop_task(3, priority=90, metadata={"policy_version": 2})
    assert TaskRequest.model_validate_json(req.model_dump_json()) == req


def test_a_generated_token_can_be_given_as_an_argument(tmp_path: Path) -> None:
    """``--token $(cat rollout_token)``: a new token never starts with "-" (argparse would read it
    as an option; a bare urlsafe token does one time in 64)."""
    from polar_env.staging.cluster import write_token

    for i in range(200):
        token, path = write_token(tmp_path / f"t{i}" / "rollout_token", None)
        assert token[0].isalpha() and path is not None and path.read_text().strip() == token
        assert write_token(path, None)[0] == token  # read back, not replaced


class DyingNode(LocalNode):
    """A test double of a node handle: answers stats from host ``h7`` once, then is gone (NodeDied)."""

    def __init__(self) -> None:
        self.node_id, self.calls = "node-7", 0

    async def stats(self) -> dict[str, Any]:
        from polar_env.staging.server import NodeDied

        self.calls += 1
        if self.calls > 1:
            raise NodeDied("node node-7 died: the actor's process is gone")
        return {"node_id": "node-7", "host": "h7", "pid": 1}


async def test_a_dead_nodes_entry_names_the_host_it_last_reported_from() -> None:
    server = RolloutServer([DyingNode()])
    assert (await server.node_stats())[0]["host"] == "h7"
    for _ in range(2):  # when it dies, and every look after
        (entry,) = await server.node_stats()
        assert entry == {"node_id": "node-7", "dead": "node node-7 died: the actor's process is gone", "host": "h7"}
