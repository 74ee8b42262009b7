"""A node's gateway can be scraped by its operator: a read-only metrics token in the node's store
(mode 0600) opens ``GET /metrics`` and nothing else, and the node's stats say where to scrape and
where the token is. The engine is the simulated test double; no sandbox is needed."""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from pathlib import Path

import aiohttp

from polar_env.staging.node import GatewayNode, NodeConfig


async def test_the_metrics_token_opens_metrics_and_nothing_else(node_config: Callable[..., NodeConfig]) -> None:
    node = GatewayNode(node_config().model_copy(update={"tcp_port": 0}))
    await node.start()
    try:
        stats = node.stats()
        token_file = Path(stats["metrics_token_file"])
        assert token_file.parent == node.store.root
        assert stat.S_IMODE(os.stat(token_file).st_mode) == 0o600
        token = token_file.read_text().strip()
        assert token.startswith("polar-metrics-") and token != node.gateway.config.admin_token  # type: ignore[union-attr]
        url = stats["metrics_url"]
        base = url.removesuffix("/metrics")
        bearer = {"Authorization": f"Bearer {token}"}
        async with aiohttp.ClientSession() as http:
            async with http.get(url, headers=bearer) as resp:
                assert resp.status == 200 and "polar_gateway" in await resp.text()
            async with http.get(url) as resp:
                assert resp.status == 401
            async with http.get(url, headers={"Authorization": "Bearer polar-metrics-wrong"}) as resp:
                assert resp.status == 401
            for method, path in (("GET", "/sessions"), ("POST", "/sessions"), ("POST", "/admin/pause"),
                                 ("GET", "/admin/status")):
                async with http.request(method, base + path, headers=bearer, json={}) as resp:
                    assert resp.status == 401, (method, path, resp.status)
    finally:
        await node.stop()
