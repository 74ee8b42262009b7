"""Assembly: the aiohttp route tables built from a gateway's core.

``build_app`` is the full API (provider routes, sessions, admin); ``build_provider_app`` is what a
sandbox is served (the provider routes only: session and admin routes do not exist there, 404,
whatever credential is sent). Handlers are methods of the request pipeline and the control plane,
each built over the one ``GatewayCore`` it is given; the full app's cleanup context runs the
core's public ``startup`` / ``shutdown`` hooks. Use ``Gateway(...).app`` / ``.provider_app``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from aiohttp import web

from polar_env.observe.metrics import install_gateway_metrics, share_gateway_metrics
from polar_env.proxy.control import ControlPlane
from polar_env.proxy.core import GatewayCore
from polar_env.proxy.pipeline import CallPipeline, last_resort, not_found, refuse_websocket, root
from polar_env.proxy.providers import PROVIDERS

__all__ = ["build_app", "build_provider_app", "gateway_of"]

_CORE = web.AppKey("gateway", GatewayCore)  # only for gateway_of: handlers are bound to their core


def gateway_of(app: web.Application) -> GatewayCore:
    """The gateway core behind one of its apps (tests holding only an app use this)."""
    return app[_CORE]


def provider_paths() -> dict[str, str]:
    """Route pattern → provider name, for both the plain and the ``/s/{session_id}`` prefix (metrics labels)."""
    out: dict[str, str] = {}
    for provider in PROVIDERS.values():
        for route in provider.ROUTES:
            out[route.path] = out["/s/{session_id}" + route.path] = provider.API.value
    return out


def _add_provider_routes(router: web.UrlDispatcher, calls: CallPipeline) -> None:
    for prefix in ("", "/s/{session_id}"):
        for provider in PROVIDERS.values():
            for route in provider.ROUTES:
                router.add_route(route.method, prefix + route.path, calls.provider_handler(provider))
        router.add_post(prefix + "/v1/messages/count_tokens", calls.count_tokens)
        router.add_get(prefix + "/v1/models", calls.models)
        router.add_get(prefix + "/models", calls.models)
        router.add_get(prefix + "/v1beta/models", calls.gemini_models)
        router.add_get(prefix + "/v1/responses", refuse_websocket)
        router.add_get(prefix + "/responses", refuse_websocket)
    router.add_get("/", root)  # also answers HEAD
    router.add_get("/health", root)


def build_app(core: GatewayCore) -> web.Application:
    calls, control = CallPipeline(core), ControlPlane(core)
    app = web.Application(client_max_size=core.config.max_body_bytes, middlewares=[last_resort(core)])
    app[_CORE] = core

    async def lifetime(app: web.Application) -> AsyncIterator[None]:
        await core.startup()
        yield
        await core.shutdown()

    app.cleanup_ctx.append(lifetime)
    router = app.router
    _add_provider_routes(router, calls)
    router.add_post("/sessions", control.create_session)
    router.add_get("/sessions", control.list_sessions)
    router.add_get("/sessions/{session_id}", control.get_session)
    router.add_get("/sessions/{session_id}/completions", control.session_completions)
    router.add_delete("/sessions/{session_id}", control.delete_session)
    router.add_post("/admin/pause", control.admin_pause)
    router.add_post("/admin/resume", control.admin_resume)
    router.add_get("/admin/status", control.admin_status)
    install_gateway_metrics(app, core, control.reads_metrics, provider_paths())
    router.add_route("*", "/{tail:.*}", not_found)
    return app


def build_provider_app(core: GatewayCore, full: web.Application) -> web.Application:
    """The provider routes only, over ``core``; ``full`` (its full app) owns the lifetime and
    the metrics registry this app counts into."""
    sandbox = web.Application(client_max_size=core.config.max_body_bytes, middlewares=[last_resort(core)])
    sandbox[_CORE] = core
    share_gateway_metrics(sandbox, full)
    _add_provider_routes(sandbox.router, CallPipeline(core))
    sandbox.router.add_route("*", "/{tail:.*}", not_found)
    return sandbox
