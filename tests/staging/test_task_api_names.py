"""``POST /rollout/task/submit`` resolves every name before anything runs (issue 16, finding 1): a
misspelled builder, evaluator or harness, or ill-typed evaluator params, are a 400 whose message is
the one line naming the field, the bad value and the closest valid names; no session starts."""

from __future__ import annotations

import json

import pytest
from aiohttp.test_utils import TestClient, TestServer

from polar_env.staging.server import LocalNode, RolloutServer, build_server_app
from tests.staging.conftest import FakeRuntimeNode
from tests.staging.test_node import loop_task

AUTH = {"Authorization": "Bearer s3cret"}


@pytest.mark.parametrize(("change", "line"), [
    ({"builder": "prefix_merg"}, "builder: unknown builder 'prefix_merg'; did you mean 'prefix_merge'? "
                                 "(known: per_request, prefix_merge, prefix_merge_strict; or a pkg.module:attr import path)"),
    ({"evaluator": {"name": "outptu"}}, "evaluator.name: unknown evaluator 'outptu'; did you mean 'output'?"),
    ({"agent": {"harness": "clade_code"}}, "agent.harness: unknown harness 'clade_code'; did you mean 'claude_code'?"),
    ({"evaluator": {"name": "output", "regex": ["not", "a", "string"]}}, "evaluator: params of evaluator 'output': regex:"),
    ({"runtime": {"kind": "dockr"}}, "runtime.kind: unknown runtime 'dockr'; did you mean 'docker'?"),
])
async def test_submit_refuses_a_wrong_name_with_one_line(change: dict, line: str, node_config) -> None:  # type: ignore[no-untyped-def]
    node = FakeRuntimeNode(node_config())
    await node.start()
    server = RolloutServer([LocalNode(node)])
    try:
        async with TestClient(TestServer(build_server_app(server, "s3cret"), host="127.0.0.1")) as client:
            body = {**json.loads(loop_task(2).model_dump_json()), **change}
            resp = await client.post("/rollout/task/submit", data=json.dumps(body), headers=AUTH)
            message = (await resp.json())["error"]["message"]
            assert resp.status == 400 and "\n" not in message
            assert message.startswith(f"invalid TaskRequest: {line}"), message
            status = await (await client.get("/rollout/status", headers=AUTH)).json()
            assert status["tasks"] == [] and node.runner.runs == {}  # nothing was queued, nothing ran
    finally:
        await server.aclose()
