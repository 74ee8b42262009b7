"""Prometheus metrics for the gateway and the rollout server (``GET /metrics``, Prometheus text format).

Each application gets its own ``CollectorRegistry`` (several gateways live in one test process, and
a library must not write into the global default). The gateway is hooked with one middleware and
one route (``install_gateway_metrics``), the sandbox-facing provider app shares the same registry
without the route (``share_gateway_metrics``), and the request pipeline makes one observation per
captured call (``observe_call``). The rollout server owns a ``RolloutMetrics`` it feeds one finished
session at a time; per-stage gauges are refreshed from the nodes' stats when scraped. Names and
labels are listed in docs/observability.md ("Prometheus"); a label is never a session id (unbounded cardinality).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any, Protocol

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from polar_env.observe.events import GatewayEvent, GatewayEvents

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
# Added latency is the gateway's own cost (parse, translate, journal): sub-millisecond to tens of ms.
ADDED_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
# Engine latency is a whole generation: tens of ms to minutes for a 100k-token context.
ENGINE_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 900.0)
STAGE_BUCKETS_S = (0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0)
STAGES = ("queued", "init", "ready", "running", "postrun")


class _Gate(Protocol):
    paused: bool

    @property
    def in_flight(self) -> int: ...


class _Result(Protocol):
    """What the metrics read of a finished session (``polar_env.staging.models.SessionResult``)."""

    @property
    def status(self) -> object: ...

    @property
    def failure_kind(self) -> object: ...

    @property
    def evaluation(self) -> Mapping[str, object]: ...

    @property
    def reward(self) -> float: ...

    def stage_seconds(self) -> dict[str, float]: ...


class _Gateway(Protocol):
    """What the metrics read of a gateway: its gate and its events."""

    @property
    def gate(self) -> _Gate: ...

    @property
    def events(self) -> GatewayEvents: ...


class GatewayMetrics:
    """The gateway's series. ``provider`` is the wire format (``anthropic``, ``openai_chat``,
    ``openai_responses``, ``gemini``; ``none`` for control-plane and unmatched routes)."""

    def __init__(self, gate: _Gate, provider_paths: Mapping[str, str]) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter("polar_gateway_requests", "HTTP requests answered, by provider and status code",
                                ["provider", "status"], registry=r)
        self.added_latency = Histogram("polar_gateway_added_latency_seconds",
                                       "Gateway time per captured call outside the engine (parse, translate, journal)",
                                       ["provider"], buckets=ADDED_BUCKETS_S, registry=r)
        self.engine_latency = Histogram("polar_gateway_engine_latency_seconds", "Engine time per captured call",
                                        ["provider"], buckets=ENGINE_BUCKETS_S, registry=r)
        self.prompt_tokens = Counter("polar_gateway_prompt_tokens", "Prompt tokens sent to the engine",
                                     ["provider"], registry=r)
        self.sampled_tokens = Counter("polar_gateway_sampled_tokens", "Tokens the engine sampled",
                                      ["provider"], registry=r)
        self.records = Counter("polar_gateway_records", "Completions journaled", ["provider", "finish_reason"],
                               registry=r)
        self.journal_bytes = Counter("polar_gateway_journal_bytes", "Bytes appended to session journals", registry=r)
        Gauge("polar_gateway_engine_in_flight", "Engine calls running now", registry=r).set_function(
            lambda: float(gate.in_flight))
        Gauge("polar_gateway_paused", "1 while engine calls are paused for a weight sync", registry=r).set_function(
            lambda: float(gate.paused))
        self._paths = dict(provider_paths)  # route pattern → provider name
        self.unsubscribe: Callable[[], None] = lambda: None  # set when subscribed to a gateway's events

    def provider_of(self, request: web.Request) -> str:
        resource = request.match_info.route.resource
        return self._paths.get(resource.canonical, "none") if resource is not None else "none"

    def on_event(self, event: GatewayEvent) -> None:
        """A ``Gateway`` event subscriber: each recorded call moves the call series."""
        if event.kind != "call_recorded":
            return
        data = event.data
        provider = data["provider"]
        engine_s = data["engine_ms"] / 1000
        self.engine_latency.labels(provider).observe(engine_s)
        self.added_latency.labels(provider).observe(max(0.0, data["total_ms"] / 1000 - engine_s))
        self.prompt_tokens.labels(provider).inc(data["prompt_tokens"])
        self.sampled_tokens.labels(provider).inc(data["response_tokens"])
        self.records.labels(provider, data["finish_reason"]).inc()
        self.journal_bytes.inc(data.get("journal_bytes", 0))


METRICS = web.AppKey("polar_metrics", GatewayMetrics)


def _middleware(metrics: GatewayMetrics) -> Any:
    @web.middleware
    async def count(request: web.Request, handler: Handler) -> web.StreamResponse:
        status = 500
        try:
            response = await handler(request)
            status = response.status
            return response
        except web.HTTPException as exc:
            status = exc.status
            raise
        finally:
            metrics.requests.labels(metrics.provider_of(request), str(status)).inc()

    return count


def metrics_response(registry: CollectorRegistry) -> web.Response:
    response = web.Response(body=generate_latest(registry))
    response.headers["Content-Type"] = CONTENT_TYPE_LATEST
    return response


def install_gateway_metrics(app: web.Application, gateway: _Gateway,
                            authorized: Callable[[web.Request], bool], provider_paths: Mapping[str, str]) -> GatewayMetrics:
    """Count every request of ``app``, subscribe to ``gateway``'s events for the call series, and
    serve ``GET /metrics`` to callers ``authorized`` admits (the gateway's admin or read-only
    metrics token: Prometheus sends it as ``authorization: {credentials: ...}``). ``provider_paths``: route pattern →
    provider label. Call before the catch-all route is added."""
    metrics = GatewayMetrics(gateway.gate, provider_paths)
    metrics.unsubscribe = gateway.events.subscribe(metrics.on_event)
    app[METRICS] = metrics
    app.middlewares.append(_middleware(metrics))

    async def scrape(request: web.Request) -> web.Response:
        if not authorized(request):
            return web.json_response({"error": {"message": "metrics or admin token required (Authorization: "
                                                "Bearer <token>)", "type": "authentication_error", "code": 401}},
                                     status=401)
        return metrics_response(metrics.registry)

    app.router.add_get("/metrics", scrape)
    return metrics


def share_gateway_metrics(sandbox: web.Application, app: web.Application) -> None:
    """The sandbox-facing app counts into ``app``'s registry; it has no ``/metrics`` route."""
    if METRICS in app:
        sandbox[METRICS] = app[METRICS]
        sandbox.middlewares.append(_middleware(app[METRICS]))


class RolloutMetrics:
    """The rollout server's series: sessions by stage (now) and by final status, failure kinds,
    evaluator time, seconds per stage, reward, and the nodes' engine figures."""

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.sessions = Counter("polar_rollout_sessions_finished", "Sessions finished, by status", ["status"],
                                registry=r)
        self.failures = Counter("polar_rollout_failures", "Sessions that did not complete cleanly, by failure kind",
                                ["kind"], registry=r)
        self.evaluator_s = Histogram("polar_rollout_evaluator_seconds", "Evaluator time per session", ["evaluator"],
                                     buckets=STAGE_BUCKETS_S, registry=r)
        self.stage_s = Histogram("polar_rollout_stage_seconds", "Seconds a session spent in each stage", ["stage"],
                                 buckets=STAGE_BUCKETS_S, registry=r)
        self.reward = Histogram("polar_rollout_reward", "Reward per finished session",
                                buckets=(0.0, 0.25, 0.5, 0.75, 1.0), registry=r)
        self.stage_now = Gauge("polar_rollout_sessions", "Sessions in each stage now (all live nodes)", ["stage"],
                               registry=r)
        self.tasks = Gauge("polar_rollout_tasks", "Submitted task groups, by state", ["state"], registry=r)
        self.nodes = Gauge("polar_rollout_nodes", "Gateway nodes, by liveness", ["state"], registry=r)
        self.busy = Gauge("polar_rollout_engine_busy_fraction", "Share of wall time the node's engine was busy",
                          ["node"], registry=r)
        self.engine_calls = Gauge("polar_rollout_engine_calls", "Engine calls made by the node (cumulative)",
                                  ["node"], registry=r)
        self.node_tokens = Gauge("polar_rollout_sampled_tokens", "Tokens sampled for the node (cumulative)",
                                 ["node"], registry=r)
        self.prefix_hit = Gauge("polar_rollout_prefix_cache_hit_rate",
                                "Share of prompt tokens the engine server took from its prefix cache "
                                "(usage.prompt_tokens_details.cached_tokens), per node and server", ["node", "server"],
                                registry=r)
        self.prefix_spills = Gauge("polar_rollout_prefix_cache_spills",
                                   "Session calls sent off their prefix's server because it was overloaded "
                                   "(cumulative)", ["node"], registry=r)

    def observe_result(self, result: _Result) -> None:
        """One finished ``SessionResult``. ``failure_kind`` is read when the result carries one."""
        status = str(getattr(result.status, "value", result.status))
        self.sessions.labels(status).inc()
        kind = getattr(result, "failure_kind", None)
        if kind is not None or status != "completed":
            self.failures.labels(str(getattr(kind, "value", kind) or status)).inc()
        evaluation = result.evaluation or {}
        seconds = evaluation.get("evaluate_s")
        if isinstance(seconds, int | float):
            self.evaluator_s.labels(str(evaluation.get("evaluator", "unknown"))).observe(float(seconds))
        for stage, seconds in result.stage_seconds().items():
            if stage in STAGES:
                self.stage_s.labels(stage).observe(max(0.0, seconds))
        self.reward.observe(float(result.reward))

    def refresh(self, node_stats: Iterable[dict[str, Any]], task_states: Iterable[str]) -> None:
        totals = dict.fromkeys(STAGES, 0)
        alive = dead = 0
        for s in node_stats:
            if "dead" in s:
                dead += 1
                continue
            alive += 1
            for stage, n in s.get("counts", {}).items():
                if stage in totals:
                    totals[stage] += int(n)
            node = str(s.get("node_id", ""))
            self.busy.labels(node).set(float(s.get("engine_busy_fraction", 0.0)))
            self.engine_calls.labels(node).set(float(s.get("engine_calls", 0)))
            self.node_tokens.labels(node).set(float(s.get("sampled_tokens", 0)))
            cache = (s.get("engine") or {}).get("prefix_cache")
            if cache:
                self.prefix_spills.labels(node).set(float(cache["spills"]))
                for server, figures in cache["servers"].items():
                    if figures["hit_rate"] is not None:
                        self.prefix_hit.labels(node, server).set(float(figures["hit_rate"]))
        for stage, n in totals.items():
            self.stage_now.labels(stage).set(n)
        self.nodes.labels("alive").set(alive)
        self.nodes.labels("dead").set(dead)
        states: dict[str, int] = {}
        for state in task_states:
            states[state] = states.get(state, 0) + 1
        for state in ("pending", "running", "done", "cancelled"):
            self.tasks.labels(state).set(states.get(state, 0))


def install_server_metrics(app: web.Application, metrics: RolloutMetrics,
                           node_stats: Callable[[], Awaitable[Iterable[dict[str, Any]]]],
                           task_states: Callable[[], Iterable[str]]) -> None:
    """``GET /metrics`` on the rollout server (behind its bearer-token middleware); the per-stage
    gauges are refreshed from ``node_stats()`` and ``task_states()`` when scraped."""

    async def scrape(request: web.Request) -> web.Response:
        metrics.refresh(await node_stats(), task_states())
        return metrics_response(metrics.registry)

    app.router.add_get("/metrics", scrape)
