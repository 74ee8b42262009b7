"""A gateway node: one gateway (its own engine client, capture store and sessions), the runtimes
and harness runs of its sessions, and the stage pools that schedule them.

Sessions are sharded by node: each node serves only the sessions dispatched to it, on its own unix
socket (bridged into its sandboxes) and an optional loopback TCP port, so several nodes are also how
the gateway scales past one Python process. ``GatewayNode`` runs in-process (local runs, tests);
``node_actor()`` wraps the same object as a Ray actor, exchanging JSON so nothing but plain data
crosses the process line.
"""

from __future__ import annotations

import asyncio
import functools
import os
import shutil
import socket
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field

from polar_env.engines.base import EngineClient, WeightVersioned
from polar_env.engines.config import EmbeddedEngineConfig, EngineConfig
from polar_env.errors import ConfigError
from polar_env.harnesses import HarnessSpec, get_harness, loop
from polar_env.journal.protocols import JournalSource
from polar_env.journal.store import JournalStore
from polar_env.proxy.admin import METRICS_TOKEN_FILE, load_or_create_admin_token
from polar_env.proxy.config import GatewayConfig, Sampling
from polar_env.proxy.gate import EngineGate
from polar_env.proxy.sessions import Session
from polar_env.records import ChatRequest, Generation
from polar_env.registry import NAMES_CHECKED
from polar_env.runtimes import Runtime, make_runtime
from polar_env.runtimes.base import prepared
from polar_env.runtimes.reach import default_base
from polar_env.staging.deadline import POSTRUN_SHARE, current
from polar_env.staging.eval_worker import EvalWorkers
from polar_env.staging.lifecycle import SessionRunner
from polar_env.staging.models import SessionResult, SessionSpec, Stage, TaskRequest
from polar_env.staging.pools import PoolLimits, StagePools
from polar_env.staging.postrun_pool import PostrunPool
from polar_env.staging.shipping import Chunk, read_shard, sees_probe
from polar_env.staging.topology import engine_members, session_stages

if TYPE_CHECKING:
    from polar_env.proxy.gateway import Gateway


class NodeConfig(BaseModel):
    """One node, as data: the engine (its template is the gateway's too), the pools, the journal
    folder and the trainer-owned sampling; ``gateway_config`` derives the gateway's settings."""

    model_config = ConfigDict(extra="forbid")

    node_id: str = "node-0"
    engine: EngineConfig = Field(default_factory=EmbeddedEngineConfig)
    limits: PoolLimits = Field(default_factory=PoolLimits)
    store: Path = Path("polar_rollouts/capture")
    sampling: Sampling = Sampling()  # trainer-owned: overrides what harnesses send
    tcp_port: int | None = 0  # loopback listener (0: any free port; None: unix socket only)
    harness_cache: Path | None = None  # default: polar_env's shared harness cache
    install_harnesses: bool = True  # install a missing harness preset during INIT
    runtime_root: Path | None = None  # where sandboxes keep their writable trees
    fsync: bool = False
    spool: bool = False  # journal to a spool in this node's runtime folder, which the head pulls (staging/shipping.py)

    def gateway_config(self, engine_model: str, *, own_engine: bool = True) -> GatewayConfig:
        """The gateway's settings for this node. ``own_engine``: the node built its engine from
        ``engine``, so that config's default per-call cap applies (the embedded engine's 256)."""
        sampling = self.sampling
        if sampling.max_tokens is None and own_engine:
            sampling = sampling.model_copy(update={"max_tokens": self.engine.default_max_tokens()})
        return GatewayConfig(engine_model=engine_model, sampling=sampling, template=self.engine.resolved_template())


@dataclass(slots=True)
class EngineClock:
    """One session's engine time: seconds done, and the calls in flight since ``since``."""

    done_s: float = 0.0
    in_flight: int = 0
    since: float = 0.0


class MeteredEngine:
    """Wraps the node's engine client to measure how busy it is: seconds with at least one call in
    flight (the engine-busy fraction in the report), calls and sampled tokens; and, per tracked
    session, the seconds its calls spent in the engine (``engine_seconds``), which RUNNING does not
    charge to the agent's budget (lifecycle.py). The gateway names the session in ``extra_body``."""

    def __init__(self, inner: EngineClient) -> None:
        self.inner = inner
        self.name = inner.name
        self.in_flight = 0
        self.calls = 0
        self.errors = 0
        self.sampled_tokens = 0
        self.busy_s = 0.0
        self.in_flight_area = 0.0  # ∫ in-flight calls dt: divided by capacity × time, the slot utilization
        self._busy_since = 0.0
        self._last = time.monotonic()
        self._sessions: dict[str, EngineClock] = {}  # tracked sessions' engine time

    def _integrate(self) -> None:
        now = time.monotonic()
        self.in_flight_area += self.in_flight * (now - self._last)
        self._last = now

    async def generate(self, request: ChatRequest) -> Generation:
        self._integrate()
        if self.in_flight == 0:
            self._busy_since = time.monotonic()
        self.in_flight += 1
        clock = self._sessions.get(str(request.extra_body.get("session_id")))
        if clock is not None:
            if clock.in_flight == 0:
                clock.since = time.monotonic()
            clock.in_flight += 1
        try:
            generation = await self.inner.generate(request)
        except BaseException:
            self.errors += 1
            raise
        finally:
            self._integrate()
            self.in_flight -= 1
            if self.in_flight == 0:
                self.busy_s += time.monotonic() - self._busy_since
            if clock is not None:
                clock.in_flight -= 1
                if clock.in_flight == 0:  # concurrent calls of one session count once
                    clock.done_s += time.monotonic() - clock.since
        self.calls += 1
        self.sampled_tokens += len(generation.response_ids)
        return generation

    def track(self, session_id: str) -> None:
        """Start the engine clock of ``session_id`` (only tracked sessions are clocked: bounded memory)."""
        self._sessions.setdefault(session_id, EngineClock())

    def forget(self, session_id: str) -> None:
        self._sessions.pop(session_id, None)

    def engine_seconds(self, session_id: str) -> float:
        """Wall seconds with at least one of the session's calls inside the engine (queued, prefilled,
        decoded), up to now; 0.0 for a session not tracked."""
        clock = self._sessions.get(session_id)
        if clock is None:
            return 0.0
        return clock.done_s + (time.monotonic() - clock.since if clock.in_flight else 0.0)

    def slot_seconds(self) -> float:
        self._integrate()
        return self.in_flight_area

    def busy_seconds(self) -> float:
        extra = time.monotonic() - self._busy_since if self.in_flight else 0.0
        return self.busy_s + extra

    async def aclose(self) -> None:
        await self.inner.aclose()


def runtime_base(config: NodeConfig) -> Path:
    """Where this node's runtime folders live: ``<runtime_root or $TMPDIR/polar-runtimes>/<node_id>/<pid-…>``."""
    return Path(config.runtime_root) if config.runtime_root is not None else default_base()


class GatewayNode:
    def __init__(self, config: NodeConfig, engine: EngineClient | None = None) -> None:
        """``engine``: an already-built client to use instead of ``config.engine`` (an in-process
        embedded engine a trainer also updates, or a test double)."""
        self.config = config
        self.node_id = config.node_id
        self.engine: EngineClient | None = engine
        self.meter: MeteredEngine | None = None
        self.model = config.engine.model
        self.pools = StagePools(config.limits)
        self.postrun = PostrunPool(config.limits.max_postrun)  # read + build off this process
        self.evaluations = EvalWorkers(config.limits.max_postrun)  # fresh-runtime grading off this process
        self.runner = SessionRunner(self)  # the sessions in flight, each through its stages
        self.harness_cache = config.harness_cache
        self.socket: Path | None = None
        self.port: int | None = None
        self.gateway: Gateway | None = None
        self._journal: JournalStore | None = None  # built at start: the gateway's sink, POSTRUN's source
        self._sock_dir: Path | None = None
        self._harnesses: dict[str, HarnessSpec] = {}
        self._install_locks: dict[str, asyncio.Lock] = {}
        self._incarnation: Any = None  # this process's locked runtime folder (runtimes/leftovers.py)
        self._metrics_token_file: Path | None = None  # the read-only scrape credential (proxy/admin.py)
        self.started_at = time.monotonic()
        self.completed = 0
        self.stopping = False  # stop() cancels what runs: those sessions end interrupted, not cancelled
        self.stopped = False

    # -- lifetime -----------------------------------------------------------------------------
    async def start(self) -> None:
        from polar_env.journal.store import JournalStore
        from polar_env.proxy.gateway import Gateway
        from polar_env.runtimes import docker_leftovers, leftovers

        base = runtime_base(self.config)
        await asyncio.to_thread(leftovers.sweep, base)  # what dead node processes left (repo copies, cgroups)
        await asyncio.to_thread(docker_leftovers.sweep)  # and their containers, where a Docker daemon answers
        self._incarnation = await asyncio.to_thread(leftovers.claim, base, self.node_id)
        own_engine = self.engine is None
        if self.engine is None:
            cap = self.config.sampling.max_tokens
            self.engine = await asyncio.to_thread(self.config.engine.build, cap)
        model = getattr(self.engine, "model_name", None)
        if isinstance(model, str) and model:
            self.model = model
        self.meter = MeteredEngine(self.engine)
        store = self._journal = JournalStore(self.shard_root(), fsync=self.config.fsync)
        metrics_token, self._metrics_token_file = await asyncio.to_thread(
            load_or_create_admin_token, store.root, None, METRICS_TOKEN_FILE, "metrics")
        config = self.config.gateway_config(self.model, own_engine=own_engine)
        self.gateway = Gateway(self.meter, store, config.model_copy(update={"metrics_token": metrics_token}))
        # The unix socket is what sandboxes reach (through their relay): it serves the provider
        # routes only, never the control plane (Gateway.provider_app). Unix socket paths are
        # limited to ~107 bytes: keep it short, under the system temp dir. TCP is host loopback
        # only, and only when asked for; the control plane needs the admin token.
        self._sock_dir = Path(tempfile.mkdtemp(prefix="polar-node-"))
        self.socket = self._sock_dir / "gw.sock"
        await self.gateway.start("127.0.0.1", self.config.tcp_port, self.socket)
        self.port = self.gateway.port
        self.started_at = time.monotonic()

    async def stop(self) -> None:
        """Cancel running sessions (each still goes through POSTRUN) and abort their engine calls
        (nobody will use them, and a generation left running would hold the engine for minutes),
        then close the gateway. A second call does nothing (the serve actor stops its nodes, then
        the cluster does)."""
        if self.stopped:
            return
        self.stopped = True
        self.stopping = True
        deadline = current()  # one shutdown deadline for every step below (deadline.py)
        for session_id, work in list(self.runner.work.items()):
            if self.gateway is not None:
                self.gateway.abort_session(session_id, "interrupted")
            work.cancel()
        sessions = deadline.before(POSTRUN_SHARE)  # their POSTRUN; then the rest closes what they left
        while self.runner.runs and not sessions.expired:
            await asyncio.sleep(0.05)
        if self.gateway is not None:  # drains in-flight captures, then closes the engine client and the store
            await deadline.before(0.5).wait(self.gateway.aclose())
        await asyncio.gather(asyncio.to_thread(self.postrun.close, deadline),
                             asyncio.to_thread(self.evaluations.close, deadline))
        if self._sock_dir is not None:
            shutil.rmtree(self._sock_dir, ignore_errors=True)
        if self._incarnation is not None:
            await asyncio.to_thread(self._incarnation.release)
            self._incarnation = None

    # -- sessions -----------------------------------------------------------------------------
    async def run(self, spec: SessionSpec) -> SessionResult:
        self._gateway()  # refuses a node that is not started
        result = await self.runner.run(spec)
        self.completed += 1
        return result

    def cancel(self, session_id: str) -> bool:
        """Cancel a session at any stage; it still reaches POSTRUN and reports CANCELLED."""
        work = self.runner.work.get(session_id)
        if work is None or work.done():
            return False
        if self.gateway is not None:  # its in-flight generations stop now, not when they finish
            self.gateway.abort_session(session_id, "cancelled")
        work.cancel()
        return True

    def load(self) -> int:
        return len(self.runner.runs)

    def shard_root(self) -> Path:
        """Where this node journals: its shard of the store, or (``spool``) a folder of its own
        runtime folder that the head copies into its shard and that goes when the node does."""
        if not self.config.spool:
            return Path(self.config.store) / self.node_id
        if self._incarnation is None:
            raise ConfigError("the node is not started (await node.start() first)")
        return Path(self._incarnation.path) / "journal-spool"

    def shard_since(self, cursors: dict[str, int]) -> tuple[list[Chunk], bool]:
        """What the head's copy of this node's shard lacks (``shipping.read_shard``)."""
        return read_shard(self.store.root, cursors)

    @property
    def store(self) -> JournalStore:
        """The journal this node built at start (node start is where a node's store is named)."""
        if self._journal is None:
            raise ConfigError("the node is not started (await node.start() first)")
        return self._journal

    @property
    def journal_opener(self) -> Callable[[], JournalSource]:
        """Opens this node's journal again, in any process: POSTRUN workers read it (it pickles)."""
        return functools.partial(JournalStore, self.store.root)

    def _gateway(self) -> Gateway:
        if self.gateway is None:
            raise ConfigError("the node is not started (await node.start() first)")
        return self.gateway

    async def open_session(self, spec: SessionSpec, metadata: dict[str, Any]) -> None:
        from polar_env.proxy.continuation import Continuation

        continuation = None
        if spec.request.continuation:
            chat = self.config.engine.chat()
            await asyncio.to_thread(lambda: chat.tokenizer)  # its first load takes seconds: off the loop
            continuation = Continuation(chat)
        gateway = self._gateway()
        gateway.open_session(spec.session_id, metadata, continuation or False,
                                     self.session_sampling(spec.request, gateway.config.sampling))

    def session_sampling(self, request: TaskRequest, gateway: Sampling) -> Sampling | None:
        """The task's own sampling over the gateway's (None: the gateway's applies). A task whose
        sampling contradicts this node's configured one is refused (ConfigError): it was checked
        against the environment's when it was submitted, but a TaskRequest may come from elsewhere."""
        own = request.sampling
        if own is None:
            return None
        conflicts = self.config.sampling.conflicts(own)
        if conflicts:
            raise ConfigError(f"task {request.task_id!r}: its sampling contradicts the node's: {', '.join(conflicts)}")
        return own.over(gateway)

    def open_external(self, session_ids: list[str], metadata: dict[str, Any] | None = None) -> list[dict[str, Any]]:
        """Sessions for harnesses this node does not run (your own agents, load generators): the
        keys to send and where the gateway listens. Their journals land in this node's store."""
        out = []
        for sid in session_ids:
            session = self._gateway().open_session(sid, dict(metadata or {}), False)
            out.append({"session_id": sid, "key": session.key, "port": self.port, "socket": str(self.socket)})
        return out

    def session(self, session_id: str) -> Session:
        return self._gateway().sessions.get(session_id)

    def close_session(self, session_id: str) -> None:
        if self.meter is not None:
            self.meter.forget(session_id)
        try:
            self._gateway().close_session(session_id)
        except Exception:  # noqa: BLE001 - never opened (INIT failed early) or already closed
            pass

    def engine_clock(self, session_id: str) -> Callable[[], float]:
        """The session's engine seconds so far (``MeteredEngine.engine_seconds``), from now on clocked."""
        meter = self.meter
        if meter is None:
            return lambda: 0.0
        meter.track(session_id)
        return lambda: meter.engine_seconds(session_id)

    def harness(self, name: str) -> HarnessSpec:
        if name not in self._harnesses:
            self._harnesses[name] = get_harness(name)
        return self._harnesses[name]

    async def prepare_runtime(self, session: SessionSpec) -> Runtime:
        """INIT's work: the harness installed and bound in, the gateway socket bridged, prepared."""
        req = session.request
        spec = req.runtime.model_copy(update={"gateway_socket": self.socket})
        if req.agent.harness != loop.NAME:
            from polar_env.harnesses.launch import with_harness

            harness = self.harness(req.agent.harness)
            lock = self._install_locks.setdefault(harness.name, asyncio.Lock())
            async with lock:
                spec = await asyncio.to_thread(with_harness, spec, harness, self.harness_cache,
                                               install=self.config.install_harnesses)
        options: dict[str, Any] = {}
        if self._incarnation is not None and spec.kind in ("sandbox", "apptainer", "docker"):
            options["root_dir"] = self._incarnation.path
        return await prepared(self.make_runtime(spec, session.session_id, **options))

    def make_runtime(self, spec: Any, session_id: str, **options: Any) -> Runtime:
        """The one place a node builds runtimes (tests substitute a test double here)."""
        return make_runtime(spec, **options)

    # -- weights --------------------------------------------------------------------------------
    def gate(self) -> EngineGate:
        return self._gateway().gate

    async def pause(self, timeout_s: float = 600.0) -> bool:
        return await self._gateway().pause(timeout_s)

    async def resume(self, weight_version: str | None = None) -> None:
        if weight_version is not None and isinstance(self.engine, WeightVersioned):
            self.engine.set_weight_version(weight_version)  # the gateway holds the meter; the engine itself stamps records
        await self._gateway().resume(weight_version)

    async def update_weights(self, source: Any, version: str | None = None, timeout_s: float = 600.0) -> str:
        """Pause the gateway (in-flight calls drain), load new weights into the engine, resume under
        the new version; every record sampled afterwards carries it."""
        reload = getattr(self.engine, "reload_weights", None)
        if reload is None:
            raise ConfigError(f"engine {getattr(self.engine, 'name', '?')} cannot load weights from the node; "
                              "update the inference server directly, then resume with the version")
        if not await self.pause(timeout_s):
            await self.resume()
            raise ConfigError(f"in-flight engine calls did not drain within {timeout_s} s; weights not updated")
        try:
            loaded = await asyncio.to_thread(reload, Path(source) if isinstance(source, str) else source)
        except BaseException:
            await self.resume()
            raise
        new_version = version if version is not None else str(loaded)
        await self.resume(new_version)
        return new_version

    # -- metrics --------------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        occ = self.pools.occupancy
        elapsed = max(time.monotonic() - self.started_at, 1e-9)
        meter = self.meter
        return {
            "node_id": self.node_id,
            "active": self.load(),
            "completed": self.completed,
            **self.pools.stats(),
            "running_occupancy": occ.mean(Stage.RUNNING, self.started_at) / self.config.limits.max_running,
            "engine_busy_s": meter.busy_seconds() if meter else 0.0,
            "engine_busy_fraction": (meter.busy_seconds() / elapsed) if meter else 0.0,
            "engine_slot_utilization": (meter.slot_seconds() / (elapsed * self.config.limits.max_running)) if meter else 0.0,
            "engine_calls": meter.calls if meter else 0,
            "engine_errors": meter.errors if meter else 0,
            "engine_in_flight": meter.in_flight if meter else 0,
            "engine": engine_members(meter.inner) if meter else None,
            "session_stages": session_stages(self.runner.runs),
            "sampled_tokens": meter.sampled_tokens if meter else 0,
            "elapsed_s": elapsed,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "spool": self.config.spool,
            "port": self.port,
            "socket": str(self.socket) if self.socket else None,
            # what an operator's Prometheus scrapes, with the token in that file (on the node's host)
            "metrics_url": f"http://127.0.0.1:{self.port}/metrics" if self.port else None,
            "metrics_token_file": str(self._metrics_token_file) if self._metrics_token_file else None,
        }


def node_actor() -> Any:
    """The Ray actor class wrapping a GatewayNode (imported lazily: Ray is an optional extra)."""
    try:
        import ray
    except ImportError:
        raise ConfigError("Ray is not installed; install the extra: pip install 'polar-env[ray]'") from None

    @ray.remote
    class NodeActor:
        def __init__(self, config_json: str) -> None:
            self.node = GatewayNode(NodeConfig.model_validate_json(config_json))

        async def start(self, spool: bool = False) -> dict[str, Any]:
            """``spool``: the head does not see this host's copy of the store (cluster.start_cluster)."""
            self.node.config = self.node.config.model_copy(update={"spool": spool})
            await self.node.start()
            return await self.stats()

        async def run(self, spec_json: str) -> str:
            # names were checked where the task was submitted (a custom evaluator may be registered there only)
            result = await self.node.run(SessionSpec.model_validate_json(spec_json, context=NAMES_CHECKED))
            return result.model_dump_json()

        async def cancel(self, session_id: str) -> bool:
            return self.node.cancel(session_id)

        async def open_external(self, session_ids: list[str], metadata: dict[str, Any] | None = None) -> list[dict[str, Any]]:
            return self.node.open_external(session_ids, metadata)

        async def stats(self) -> dict[str, Any]:
            import ray

            ip: str = ray.util.get_node_ip_address()  # type: ignore[no-untyped-call]
            return {**self.node.stats(), "ip": ip}

        def sees(self, path: str, token: str) -> bool:
            """Whether this process sees the head's probe file: the store is shared with it."""
            return sees_probe(path, token)

        async def shard_since(self, cursors: dict[str, int]) -> tuple[list[Chunk], bool]:
            return await asyncio.to_thread(self.node.shard_since, cursors)

        async def update_weights(self, source: str, version: str | None) -> str:
            return await self.node.update_weights(source, version)

        async def stop(self) -> None:
            await self.node.stop()

        def pid(self) -> int:
            import os

            return os.getpid()

    return NodeActor
