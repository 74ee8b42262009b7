"""Assembly: the aiohttp route tables over a ``Gateway``.

``build_app`` is the full API (provider routes, sessions, admin); ``build_provider_app`` is what a
sandbox is served (the provider routes only: session and admin routes do not exist there, 404,
whatever credential is sent). Both read and write only the ``Gateway`` they are given; the full
app's cleanup context runs the gateway's startup and shutdown (drain in-flight captures, close
the engine and the journal). Use ``Gateway(...).app`` / ``.provider_app`` rather than these.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from aiohttp import web

from polar_env.observe.metrics import install_gateway_metrics, share_gateway_metrics
from polar_env.proxy import control, pipeline
from polar_env.proxy.gateway import GATEWAY, Gateway, GatewayConfig
from polar_env.proxy.providers import PROVIDERS

__all__ = ["Gateway", "GatewayConfig", "build_app", "build_provider_app"]


def _add_provider_routes(router: web.UrlDispatcher) -> None:
    for prefix in ("", "/s/{session_id}"):
        for provider in PROVIDERS.values():
            for route in provider.ROUTES:
                router.add_route(route.method, prefix + route.path, pipeline.provider_handler(provider))
        router.add_post(prefix + "/v1/messages/count_tokens", pipeline.count_tokens)
        router.add_get(prefix + "/v1/models", pipeline.models)
        router.add_get(prefix + "/models", pipeline.models)
        router.add_get(prefix + "/v1beta/models", pipeline.gemini_models)
        router.add_get(prefix + "/v1/responses", pipeline.refuse_websocket)
        router.add_get(prefix + "/responses", pipeline.refuse_websocket)
    router.add_get("/", pipeline.root)  # also answers HEAD
    router.add_get("/health", pipeline.root)


def build_app(gateway: Gateway) -> web.Application:
    app = web.Application(client_max_size=gateway.config.max_body_bytes, middlewares=[pipeline.last_resort])
    app[GATEWAY] = gateway

    async def lifetime(app: web.Application) -> AsyncIterator[None]:
        await gateway._startup()
        yield
        await gateway._shutdown()

    app.cleanup_ctx.append(lifetime)
    router = app.router
    _add_provider_routes(router)
    router.add_post("/sessions", control.create_session)
    router.add_get("/sessions", control.list_sessions)
    router.add_get("/sessions/{session_id}", control.get_session)
    router.add_get("/sessions/{session_id}/completions", control.session_completions)
    router.add_delete("/sessions/{session_id}", control.delete_session)
    router.add_post("/admin/pause", control.admin_pause)
    router.add_post("/admin/resume", control.admin_resume)
    router.add_get("/admin/status", control.admin_status)
    install_gateway_metrics(app, gateway, control.is_admin)
    router.add_route("*", "/{tail:.*}", pipeline.not_found)
    return app


def build_provider_app(gateway: Gateway) -> web.Application:
    """The provider routes only, over ``gateway``'s state; ``gateway.app`` owns the lifetime."""
    sandbox = web.Application(client_max_size=gateway.config.max_body_bytes, middlewares=[pipeline.last_resort])
    sandbox[GATEWAY] = gateway
    share_gateway_metrics(sandbox, gateway.app)
    _add_provider_routes(sandbox.router)
    sandbox.router.add_route("*", "/{tail:.*}", pipeline.not_found)
    return sandbox
