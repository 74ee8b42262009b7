"""Golden inputs: the request bodies the real CLIs sent (tests/fixtures/providers/captured, one folder
per harness/API pair, recorded against a fake provider). Every body must normalize and render
through the Qwen3.5 template, and the second turn's normalized messages must start with the first
turn's — the JSON-level append-only property the token-level merge relies on."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from polar_env.chat import chat_format
from polar_env.chat.qwen35.template import render
from polar_env.proxy.providers import PROVIDERS
from polar_env.proxy.quirks import apply_quirks
from polar_env.records import ProviderAPI

CAPTURED = Path(__file__).parents[1] / "fixtures" / "providers" / "captured"
FOLDERS = sorted(p for p in CAPTURED.iterdir() if p.is_dir())


def requests(folder: Path) -> list[tuple[dict, dict]]:
    out = []
    for line in (folder / "requests.jsonl").read_text().splitlines():
        meta = json.loads(line)
        if meta.get("file"):
            out.append((meta, json.loads((folder / meta["file"]).read_text())))
    return out


def normalize(api: ProviderAPI, meta: dict, body: dict):  # type: ignore[no-untyped-def]
    params: dict[str, str] = {}
    if api == ProviderAPI.GEMINI:
        model, _, method = meta["path"].rsplit("/", 1)[1].partition(":")
        params = {"model": model, "method": method}
    inbound = PROVIDERS[api].to_chat(body, params)
    notes: list[str] = []
    return inbound, apply_quirks(inbound.chat, notes, chat_format("qwen3.5"))


@pytest.mark.parametrize("folder", FOLDERS, ids=lambda p: p.name)
def test_real_bodies_normalize_render_and_append(folder: Path) -> None:
    api = ProviderAPI(folder.name.split("-", 1)[1])
    turns = []
    for meta, body in requests(folder):
        inbound, chat = normalize(api, meta, body)
        thinking = chat.chat_template_kwargs.get("enable_thinking", True) is not False
        assert render(chat.messages, chat.tools, enable_thinking=thinking)  # the engine template accepts it
        if chat.tools:  # main turns (side requests such as opencode's title carry no tools)
            turns.append(chat)
    assert len(turns) >= 2, f"{folder.name}: expected a tool round trip"
    first, second = turns[0], turns[1]
    assert second.messages[: len(first.messages)] == first.messages, folder.name
    assert second.messages[len(first.messages)]["role"] == "assistant"
    assert any(m["role"] == "tool" for m in second.messages[len(first.messages) :])
    assert second.tools == first.tools
