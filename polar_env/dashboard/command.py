"""``polar-env dashboard PATH... [--server URL]``: serve the dashboard until interrupted.

Loopback needs no token; any other bind address gets one (``--token``, or a generated one printed
once), because the page shows prompts, code and rewards.
"""

from __future__ import annotations

import asyncio
import ipaddress
import os
import secrets
from pathlib import Path

from aiohttp import web

from polar_env.dashboard.server import Dashboard, build_dashboard
from polar_env.dashboard.session import warm_tokenizer
from polar_env.errors import ConfigError


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def run_dashboard(paths: list[str], host: str, port: int, token: str | None, server: str | None,
                  server_token: str | None) -> int:
    folders = [Path(p) for p in paths]
    missing = [str(p) for p in folders if not p.exists()]
    if missing:
        raise ConfigError(f"dashboard: {', '.join(missing)} does not exist (give run folders or capture stores)")
    if not folders and not server:
        raise ConfigError("dashboard: give a run folder, a capture store or a folder of runs (or --server URL)")
    if not is_loopback(host) and not token:
        token = f"polar-dashboard-{secrets.token_urlsafe(24)}"  # never "-...": it is typed as an argument
    dashboard = Dashboard(folders, server_url=server, server_token=server_token)
    warm_tokenizer()  # while the user opens the page: the first trace then decodes at once
    return asyncio.run(_serve(build_dashboard(dashboard, token if not is_loopback(host) or token else None),
                              host, port, token))


async def _serve(app: web.Application, host: str, port: int, token: str | None) -> int:
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    try:
        await site.start()
    except OSError as exc:
        await runner.cleanup()
        why = os.strerror(exc.errno).lower() if exc.errno else str(exc)
        raise ConfigError(f"cannot listen on {host}:{port} ({why}); pick another --port (0: any free port) or --host, "
                          "or stop the process that holds it") from None
    bound = runner.addresses[0][1] if runner.addresses else port  # the real port when --port 0
    shown = f"[{host}]" if ":" in host else host
    print(f"dashboard: http://{shown}:{bound}/" + (f"?token={token}" if token else ""), flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()
    return 0
