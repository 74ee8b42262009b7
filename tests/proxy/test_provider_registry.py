"""A provider API is one module plus one registry line (docs/architecture.md, "Where a new thing
goes"): a throwaway wire format, written as one module file here and registered with one
``PROVIDERS.register`` call, is served by the gateway (its route, its reply and error shapes), its
calls are journaled under its name, and that journal still loads once the provider is gone. Nothing
else in ``polar_env/`` is edited for it: files touched = 2 (the module, the registration line)."""

from __future__ import annotations

import importlib.util
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

from polar_env.errors import ConfigError
from polar_env.journal.store import JournalStore
from polar_env.proxy.app import provider_paths
from polar_env.proxy.providers import PROVIDERS
from polar_env.records import CompletionRecord, ProviderAPI
from tests.proxy.conftest import FakeEngine, Gateway, start_gateway

# The whole provider: what a new module under polar_env/proxy/providers/ would hold.
ECHO_LINES = textwrap.dedent('''
    """echo_lines: a toy wire format ({"say": text, "stream": bool}) for the registry test."""
    from __future__ import annotations

    from polar_env.proxy.providers.base import Inbound, Reply, Route, require
    from polar_env.records import ChatRequest, ProviderAPI

    API = ProviderAPI("echo_lines")
    ROUTES = (Route("POST", "/echo/v1/say"),)


    def to_chat(body, path_params, memo=None):
        text = require(body, "say", str, "a string")
        chat = ChatRequest(messages=[{"role": "user", "content": text}])
        return Inbound(chat=chat, stream=bool(body.get("stream")), model=str(body.get("model", "")))


    def from_chat(reply: Reply) -> dict:
        return {"said": reply.generation.message.content, "id": "echo-" + reply.request_id, "model": reply.model}


    def stream_events(reply: Reply):
        yield b"data: " + (reply.generation.message.content or "").encode() + b"\\n\\n"
        yield b"data: [END]\\n\\n"


    def error_body(status: int, message: str) -> dict:
        return {"echo_error": {"status": status, "message": message}}
''')


def load_module(path: Path, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def echo_lines(tmp_path: Path) -> Iterator[ModuleType]:
    """The throwaway provider, registered for this test only (the table is put back after)."""
    path = tmp_path / "echo_lines.py"
    path.write_text(ECHO_LINES)
    module = load_module(path, "echo_lines_provider")
    saved = PROVIDERS.snapshot()
    PROVIDERS.register(module.API, module)  # the one registry line
    try:
        yield module
    finally:
        PROVIDERS.restore(saved)
        sys.modules.pop("echo_lines_provider", None)


async def test_a_provider_is_one_module_and_one_registry_line(echo_lines: ModuleType, tmp_path: Path) -> None:
    client, store = await start_gateway(FakeEngine(), tmp_path)
    try:
        gw = Gateway(client, store)
        session = await gw.session(session_id="echo-1")
        key = {"Authorization": f"Bearer {session['key']}"}
        resp = await gw.post("/echo/v1/say", {"say": "hello", "model": "m"}, key)
        assert resp.status == 200 and await resp.json() == {"said": "ok", "id": (await resp.json())["id"], "model": "m"}
        streamed = await gw.post("/s/echo-1/echo/v1/say", {"say": "again", "stream": True}, key)
        assert streamed.status == 200 and await streamed.text() == "data: ok\n\ndata: [END]\n\n"
        bad = await gw.post("/echo/v1/say", {"said": 1}, key)  # its own error shape, not another provider's
        assert bad.status == 400 and (await bad.json())["echo_error"]["message"].startswith("missing required field 'say'")
    finally:
        await client.close()
    records = store.read("echo-1")
    assert [r.provider_api for r in records] == ["echo_lines", "echo_lines"]
    assert provider_paths()["/s/{session_id}/echo/v1/say"] == "echo_lines"  # its metrics label, from the table too
    assert records[0].provider_api is ProviderAPI("echo_lines") and records[0].chat_request.messages[0]["content"] == "hello"


async def test_a_journal_outlives_its_provider(echo_lines: ModuleType, tmp_path: Path) -> None:
    """Records hold the provider's name; reading them needs no registered provider (a journal
    outlives the code that wrote it), so the name is checked for shape only."""
    client, store = await start_gateway(FakeEngine(), tmp_path)
    try:
        gw = Gateway(client, store)
        session = await gw.session(session_id="echo-2")
        assert (await gw.post("/echo/v1/say", {"say": "x"}, {"Authorization": f"Bearer {session['key']}"})).status == 200
    finally:
        await client.close()
    PROVIDERS.restore({k: v for k, v in PROVIDERS.snapshot().items() if k != "echo_lines"})
    assert "echo_lines" not in PROVIDERS
    (record,) = JournalStore(tmp_path / "capture").read("echo-2")
    assert record.provider_api == "echo_lines"
    assert CompletionRecord.model_validate_json(record.model_dump_json()).provider_api is record.provider_api


def test_the_builtin_names_load_as_the_enum_wrote_them() -> None:
    """Journals written while ProviderAPI was a closed enum hold its string values."""
    for name in ("anthropic", "openai_chat", "openai_responses", "gemini"):
        assert name in PROVIDERS and ProviderAPI(name) is getattr(ProviderAPI, name.upper())
        assert PROVIDERS[name].API is ProviderAPI(name)
    with pytest.raises(ValueError, match="provider API name"):
        ProviderAPI("Open AI")


def test_a_registration_must_keep_the_contract(echo_lines: ModuleType) -> None:
    with pytest.raises(ConfigError, match="its API is 'echo_lines'"):
        PROVIDERS.register("echo_words", echo_lines)
    with pytest.raises(ConfigError, match="lacks API, ROUTES, to_chat"):
        PROVIDERS.register("half_done", ModuleType("half_done"))


def test_a_config_naming_an_unregistered_api_is_one_line(tmp_path: Path) -> None:
    """``api`` is checked against PROVIDERS where it is chosen: a config, a task, a harness file."""
    from polar_env.staging.config import PolarEnvConfig

    with pytest.raises(ValueError, match="harness 'pi' does not speak smoke_signals"):
        PolarEnvConfig(harness="pi", api="smoke_signals")
    harness = tmp_path / "h.yaml"
    harness.write_text("name: yagent\ncommand: [yagent, '{prompt}']\napi: anthropc\n")
    with pytest.raises(ValueError, match="unknown provider API 'anthropc'; did you mean 'anthropic'"):
        PolarEnvConfig(harness=str(harness))
