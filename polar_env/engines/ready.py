"""The engines' preflight checks (each ``ENGINES`` entry's ``preflight``, called with the engine's
config and how long a served engine gets to answer): a local engine's files and script load and its
template fits its weights; a served one answers ``GET /v1/models`` in time and serves the model
(vLLM: exactly; SGLang ignores the name). Each typed by what it reads, so this module needs no
config class (``config.py`` registers them)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Protocol

from polar_env.engines import probe  # its served_models read at each call (tests record the probes)
from polar_env.engines.base import EngineClient
from polar_env.errors import ConfigError, EngineError, EngineHTTPError, EngineProtocolError


class LocalEngine(Protocol):
    def policy(self) -> object: ...

    def resolved_template(self) -> str: ...


class EmbeddedWeights(LocalEngine, Protocol):
    def weights(self) -> Path | None: ...

    def check_fits(self) -> None: ...


class ServedEngine(Protocol):
    kind: str
    model: str

    def build(self, max_tokens: int | None = None) -> EngineClient: ...

    def resolved_template(self) -> str: ...


def check_local(config: LocalEngine, wait_s: float) -> None:
    """The script loads (one line naming --engine-script and what in the file is wrong), and
    template auto is read off the model's own files, or one line."""
    config.policy()
    config.resolved_template()


def check_embedded(config: EmbeddedWeights, wait_s: float) -> None:
    """Also: a folder with config.json or a .gguf file, and a tokenizer with no ids past the
    weights' embedding (one line naming --template)."""
    config.weights()
    check_local(config, wait_s)
    config.check_fits()


def check_served(config: ServedEngine, wait_s: float) -> None:
    asyncio.run(_served(config, wait_s))


async def _served(config: ServedEngine, wait_s: float) -> None:
    client = config.build()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait_s
    where = getattr(client, "router_url", None) or getattr(client, "base_url", None) or str(getattr(config, "url", ""))
    try:
        while True:
            try:
                served: dict[str, list[str]] = {}
                for where in await probe.engine_urls(client):
                    served[where] = await probe.served_models(where, engine=client.name, timeout_s=max(0.5, wait_s))
                break
            except (EngineHTTPError, EngineProtocolError) as exc:
                raise ConfigError(f"{where} does not answer like a {client.name} server ({exc.message}), --engine-url; "
                                  "give the server's base URL, e.g. http://127.0.0.1:8000") from None
            except EngineError as exc:
                if loop.time() >= deadline:
                    raise ConfigError(f"no {client.name} engine answers at {where} after {wait_s:g}s ({exc.message}), "
                                      "--engine-url; start the engine first, or fix the URL") from None
                await asyncio.sleep(0.25)
    finally:
        await client.aclose()
    for url, models in served.items():
        probe.choose_model(config.model, models, url, strict=config.kind == "vllm")
    await asyncio.to_thread(config.resolved_template)  # template auto: read off what the engine serves, or one line
