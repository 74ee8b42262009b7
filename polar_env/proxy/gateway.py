"""The ``Gateway``: the gateway's core (``core.py``) served over HTTP.

``app`` is the full API (providers, sessions, admin) and ``provider_app`` what a sandbox is served
(the provider routes only); both are route tables built from this gateway (``app.py``). Nodes, the
CLI, the demo, the harness check and the trainer hold a ``Gateway`` and call its methods.

Lifetime: ``await gateway.start(...)`` binds the sockets; ``await gateway.aclose()`` stops
accepting, waits for every in-flight capture (a record being written when the harness already
left) and only then closes the engine client and the journal. Serving ``gateway.app`` through any
aiohttp runner (a test server) runs the same shutdown from the app's cleanup context.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from aiohttp import web

from polar_env.engines.base import EngineClient
from polar_env.journal.protocols import JournalSink
from polar_env.proxy.app import build_app, build_provider_app, gateway_of
from polar_env.proxy.config import GatewayConfig
from polar_env.proxy.core import GatewayCore

# The sandboxes' socket's accept queue: a node's sessions may all connect at once (256 at the
# production shape, more while earlier connections wait). A connect past a full queue fails with
# EAGAIN, which asyncio's client (our relay, Python harnesses) takes for "in progress": the socket
# polls writable, SO_ERROR reads 0, and the first write fails ENOTCONN — a lost call. aiohttp's
# default of 128 lost 7 of 256 sessions at full size once the node's loop accepted a little later
# (uvloop). The kernel caps it at net.core.somaxconn (4096 since Linux 5.4).
UNIX_BACKLOG = 4096


class Gateway(GatewayCore):
    """A ``GatewayCore`` with its two route tables and the sockets that serve them."""

    def __init__(self, engine: EngineClient, store: JournalSink, config: GatewayConfig) -> None:
        super().__init__(engine, store, config)
        self._app: web.Application | None = None
        self._provider_app: web.Application | None = None
        self._runners: list[web.AppRunner] = []
        self._port: int | None = None
        self._host = "127.0.0.1"
        self.socket: Path | None = None  # the unix socket sandboxes reach (provider routes only)

    @staticmethod
    def of(app: web.Application) -> GatewayCore:
        """The gateway behind one of its aiohttp apps (for tests holding an app)."""
        return gateway_of(app)

    # -- the route tables ---------------------------------------------------------------------
    @property
    def app(self) -> web.Application:
        """The full API (providers, sessions, admin); its cleanup context owns the lifetime."""
        if self._app is None:
            self._app = build_app(self)
        return self._app

    @property
    def provider_app(self) -> web.Application:
        """What a sandbox is served: provider routes only, over this gateway's state."""
        if self._provider_app is None:
            self._provider_app = build_provider_app(self, self.app)
        return self._provider_app

    # -- lifetime -----------------------------------------------------------------------------
    async def start(self, host: str = "127.0.0.1", port: int | None = 0, unix_socket: str | Path | None = None,
                    *, access_log: logging.Logger | None = None, access_log_class: Any = None) -> Gateway:
        """Serve the full API on ``host:port`` (``port=None``: no TCP listener) and the provider
        routes on ``unix_socket`` when given. Raises OSError when a socket cannot be bound."""
        kwargs: dict[str, Any] = {"access_log": access_log}
        if access_log_class is not None:
            kwargs["access_log_class"] = access_log_class
        runner = web.AppRunner(self.app, **kwargs)
        await runner.setup()
        self._runners.append(runner)
        try:
            if port is not None:
                site = web.TCPSite(runner, host, port)
                await site.start()
                self._host = host
                self._port = int(runner.addresses[-1][1])
            if unix_socket is not None:
                sandbox = web.AppRunner(self.provider_app, access_log=None)
                await sandbox.setup()
                self._runners.insert(0, sandbox)
                await web.UnixSite(sandbox, str(unix_socket), backlog=UNIX_BACKLOG).start()
                self.socket = Path(unix_socket)
        except BaseException:
            await self.aclose()
            raise
        return self

    @property
    def port(self) -> int | None:
        return self._port

    @property
    def url(self) -> str | None:
        """``http://host:port`` of the full API, or None when no TCP listener was started."""
        return None if self._port is None else f"http://{self._host}:{self._port}"

    async def aclose(self) -> None:
        """Stop listening, drain in-flight captures, then close the engine client and journal."""
        runners, self._runners = self._runners, []
        for runner in runners:  # the sandbox runner first: it does not own the state
            await runner.cleanup()
        await self.shutdown()  # already done by the app's cleanup context when it was served

    async def __aenter__(self) -> Gateway:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
