"""Starting gateway nodes and the rollout server: in this process, or as Ray actors.

``start_cluster(config)`` gives a ``Cluster`` whose ``server`` (a RolloutServer) dispatches to
``config.nodes`` nodes. With ``ray=False`` the nodes are GatewayNodes on this event loop (small
local runs, tests, a trainer holding the embedded engine in-process); with ``ray=True`` each node
is a Ray actor in its own process with its own engine client and gateway (``ray.init()`` locally,
or an existing cluster by ``ray_address``). The code path per session is the same either way.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from polar_env.engines.base import EngineClient
from polar_env.errors import ConfigError
from polar_env.staging.deadline import CLOSE_BUDGET_S, CLOSE_GRACE_S, scope
from polar_env.staging.interrupt import until_signal
from polar_env.staging.node import GatewayNode, NodeConfig, node_actor, runtime_base
from polar_env.staging.server import LocalNode, NodeHandle, RayNode, RolloutServer
from polar_env.staging.shipping import write_probe


class ClusterConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    nodes: int = Field(default=1, ge=1, le=256)
    ray: bool = False
    ray_address: str | None = None  # an existing cluster ("auto", "ray://host:port"); None: start one here
    # Ray nodes: True: every host mounts the store (refused at start when one does not); False: the
    # head pulls every node's journals; None: pull from the nodes that do not see it (shipping.py)
    shared_store: bool | None = None
    node_resource: str | None = None  # Ray custom resource a node actor takes one unit of (pins nodes to hosts)
    ray_wait_s: float = Field(default=300.0, gt=0, allow_inf_nan=False)  # hosts joining late (a loaded site)
    node: NodeConfig = Field(default_factory=NodeConfig)


@dataclass
class Cluster:
    server: RolloutServer
    handles: list[NodeHandle]
    local_nodes: list[GatewayNode] = field(default_factory=list)
    actors: list[Any] = field(default_factory=list)
    runtime_base: Path | None = None  # swept at the end for what dead node processes left

    async def aclose(self) -> None:
        """Stop the nodes by one shutdown deadline (a signal's, or ``CLOSE_BUDGET_S`` from now:
        deadline.py); what they still run past it is killed."""
        with scope(CLOSE_BUDGET_S) as deadline, contextlib.suppress(TimeoutError):
            # a node's own steps kill what overruns; this bounds the wait on Ray actors' stop too
            await asyncio.wait_for(self.server.aclose(), deadline.remaining() + CLOSE_GRACE_S)
        if self.actors:
            import ray

            for actor in self.actors:
                try:
                    ray.kill(actor)
                except Exception:  # noqa: BLE001 - already gone
                    pass
        if self.runtime_base is not None:
            from polar_env.runtimes import docker_leftovers, leftovers

            await asyncio.sleep(0.5)  # a killed actor's process releases its lock as it exits
            await asyncio.to_thread(leftovers.sweep, self.runtime_base)
            await asyncio.to_thread(docker_leftovers.sweep)


def init_ray(address: str | None) -> None:
    try:
        import ray
    except ImportError:
        raise ConfigError("Ray is not installed; install the extra: pip install -e '.[ray]'") from None
    if not ray.is_initialized():
        ray.init(address=address, include_dashboard=False, log_to_driver=False,
                 configure_logging=False, ignore_reinit_error=True)


async def start_cluster(config: ClusterConfig, engine: EngineClient | None = None) -> Cluster:
    """Start the nodes (and their engines) and a RolloutServer over them. ``engine``: an in-process
    client every local node shares (not possible with Ray nodes, which build their own)."""
    configs = [config.node.model_copy(update={"node_id": f"node-{i}"}) for i in range(config.nodes)]
    if not config.ray:
        nodes = [GatewayNode(c, engine=engine) for c in configs]
        try:
            await asyncio.gather(*(n.start() for n in nodes))
        except BaseException:  # a failed or cancelled start-up (a signal): stop what it had started
            with scope(CLOSE_BUDGET_S):
                await asyncio.gather(*(n.stop() for n in nodes), return_exceptions=True)
            raise
        handles: list[NodeHandle] = [LocalNode(n) for n in nodes]
        return Cluster(RolloutServer(handles), handles, local_nodes=nodes)
    if engine is not None:
        raise ConfigError("Ray nodes build their own engine clients; pass an engine config, not a client")
    init_ray(config.ray_address)
    store = Path(config.node.store).absolute()  # the same path on every host, whatever its cwd
    configs = [c.model_copy(update={"store": store}) for c in configs]
    actor_cls = node_actor()
    # num_cpus=0: nodes are mostly I/O (HTTP, subprocesses); do not let Ray's CPU count cap them
    options: dict[str, Any] = {"num_cpus": 0, "max_concurrency": 10_000}
    if config.node_resource:
        await wait_for_resource(config.node_resource, config.nodes, config.ray_wait_s)
        options["resources"] = {config.node_resource: 1}
    actors = [actor_cls.options(**options).remote(c.model_dump_json()) for c in configs]
    try:
        spools = await _spools(config, store, configs, actors)
        ray_handles: list[NodeHandle] = [RayNode(c.node_id, a, store=store / c.node_id, pull=spool)
                                         for c, a, spool in zip(configs, actors, spools, strict=True)]
        await asyncio.gather(*(a.start.remote(spool) for a, spool in zip(actors, spools, strict=True)))
    except BaseException:
        import ray

        for actor in actors:
            ray.kill(actor)
        raise
    return Cluster(RolloutServer(ray_handles), ray_handles, actors=actors, runtime_base=runtime_base(config.node))


async def wait_for_resource(name: str, nodes: int, wait_s: float, *, first_poll_s: float = 0.5) -> None:
    """Wait until the cluster's live hosts offer a unit of ``name`` for every node (hosts that are
    still starting, slowly on a loaded site), with a progress line per poll, polls backing off to
    5 s; after ``wait_s`` the run is refused in one line (a node actor would wait forever)."""
    import ray

    began, poll = time.monotonic(), first_poll_s
    while True:
        units = ray.cluster_resources().get(name, 0)  # type: ignore[no-untyped-call]
        waited = time.monotonic() - began
        if units >= nodes:
            if waited > 0.05:
                print(f"polar-env: Ray hosts ready: {units:g} unit(s) of {name} after {waited:.0f} s", file=sys.stderr,
                      flush=True)
            return
        if waited >= wait_s:
            raise ConfigError(f"--ray-node-resource {name}: after {wait_s:g} s the cluster's live hosts offer {units:g} "
                              f"unit(s), {nodes} node(s) need {nodes}; pass --nodes {int(units)}, start more hosts with "
                              f"ray start --resources '{{\"{name}\": K}}', or wait longer with --ray-wait-s")
        print(f"polar-env: waiting for Ray hosts: {units:g} of {nodes} unit(s) of {name} ({waited:.0f} s of "
              f"{wait_s:g} s, --ray-wait-s)", file=sys.stderr, flush=True)
        await asyncio.sleep(min(poll, max(0.0, wait_s - waited)))
        poll = min(poll * 2, 5.0)


async def _spools(config: ClusterConfig, store: Path, configs: list[NodeConfig], actors: list[Any]) -> list[bool]:
    """Which nodes journal to a spool the head pulls: those that do not see the head's store (a
    probe file written here and read there), all of them with ``shared_store=False``. A store
    said to be shared that a node does not see is refused, in one line, before any session."""
    if config.shared_store is False:
        return [True] * len(actors)
    probe, token = await asyncio.to_thread(write_probe, store)
    try:
        seen = await asyncio.gather(*(a.sees.remote(str(probe), token) for a in actors))
    finally:
        probe.unlink(missing_ok=True)
    blind = [c.node_id for c, s in zip(configs, seen, strict=True) if not s]
    if blind and config.shared_store:
        raise ConfigError(f"the store {store} is not shared: {', '.join(blind)} cannot see it from its host; mount it "
                          "on every host at that path, or drop --shared-store (shared_store) and the head pulls "
                          "each node's journals over Ray")
    return [not s for s in seen]


def server_actor() -> Any:
    """The rollout server as a Ray actor: it dispatches to node actors and serves the task API."""
    import ray

    @ray.remote
    class ServerActor:
        def __init__(self, nodes: list[tuple[str, Any, str | None, bool]], host: str, port: int, token: str,
                     defaults: dict[str, Any] | None = None) -> None:
            """``nodes``: (node id, actor, the head's copy of its shard, whether to pull it)."""
            self.args = (nodes, host, port, token, defaults)
            self.runner: Any = None
            self.nodes: list[RayNode] = []

        async def start(self) -> str:
            from aiohttp import web

            from polar_env.staging.server import build_server_app

            nodes, host, port, token, defaults = self.args
            self.nodes = [RayNode(i, a, Path(store) if store else None, pull=pull) for i, a, store, pull in nodes]
            server = RolloutServer(self.nodes)
            self.runner = web.AppRunner(build_server_app(server, token, defaults), access_log=None)
            await self.runner.setup()
            await web.TCPSite(self.runner, host, port).start()
            return f"http://{host}:{port}"

        async def stop(self) -> None:
            """Stop serving, then the nodes, each after its last pull (this actor owns the pulls)."""
            if self.runner is not None:
                await self.runner.cleanup()
            await asyncio.gather(*(node.stop() for node in self.nodes), return_exceptions=True)

    return ServerActor


async def _server_on_head(cluster: Cluster, host: str, port: int, token: str, defaults: dict[str, Any]) -> Any:
    """The server actor, on this host (the head: its store is the one the run folder names); it
    takes over pulling the nodes' journals from this process's handles, so each shard has one writer,
    and stops the nodes after their last pull (``Cluster.aclose`` then finds them stopped)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    nodes = []
    for handle in cluster.handles:
        assert isinstance(handle, RayNode)
        pull = handle.puller is not None
        await handle.halt()
        handle.puller = None  # one writer per shard: the server actor from now on (it stops the nodes too)
        nodes.append((handle.node_id, handle.actor, str(handle.store) if handle.store else None, pull))
    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    return server_actor().options(num_cpus=0, scheduling_strategy=here).remote(nodes, host, port, token, defaults)


def write_token(path: Any, token: str | None) -> tuple[str, Any]:
    """The server's bearer token: the given one, else the one in ``path``, else a new one written
    there readable by this user only. A new one starts with letters: a bare urlsafe token starts
    with ``-`` one time in 64, and ``--token $(cat rollout_token)`` then fails as a missing value."""
    import os
    import secrets
    from pathlib import Path

    path = Path(path)
    if token:
        return token, None
    if path.exists():
        return path.read_text().strip(), path
    path.parent.mkdir(parents=True, exist_ok=True)
    new = f"polar-rollout-{secrets.token_urlsafe(32)}"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(new + "\n")
    return new, path


async def serve(env: Any, host: str, port: int, store: Any, token: str | None) -> int:
    """``polar-env serve``: the nodes, the rollout server and its task API, until SIGINT/SIGTERM."""
    import time
    from pathlib import Path

    from aiohttp import web

    from polar_env.observe.liveness import Heartbeat, current_exception
    from polar_env.staging.server import build_server_app
    from polar_env.staging.submission import server_defaults

    started = time.perf_counter()
    defaults = server_defaults(env)  # what a submitted row that names no harness (etc.) runs with
    token, token_path = write_token(Path(store) / "rollout_token", token)
    beat = Heartbeat(Path(store), kind="serve").start()  # the dashboard's word on whether the server runs
    cluster = await start_cluster(env.cluster())
    runner = None
    actor = None
    try:
        if env.ray:
            actor = await _server_on_head(cluster, host, port, token, defaults)
            url = await actor.start.remote()
        else:
            runner = web.AppRunner(build_server_app(cluster.server, token, defaults), access_log=None)
            await runner.setup()
            try:
                await web.TCPSite(runner, host, port).start()
            except OSError as exc:  # taken since preflight looked
                raise ConfigError(f"cannot listen on {host}:{port} ({exc.strerror or exc}), the task API; pick another "
                                  "--port, or stop the process that holds it") from None
            url = f"http://{host}:{port}"
        where = f"token in {token_path}" if token_path else "token as given"
        print(f"polar-env serve ready in {time.perf_counter() - started:.1f}s on {url} "
              f"({len(cluster.handles)} node(s){' on Ray' if env.ray else ''}; {where})", flush=True)
        await until_signal()
    finally:
        if actor is not None:
            await actor.stop.remote()
        if runner is not None:
            await runner.cleanup()
        await cluster.aclose()
        beat.stop_for(current_exception())
    return 0
