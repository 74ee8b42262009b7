"""PROVIDERS: the one table of provider wire formats (see ``base`` for a provider's contract), keyed
by the provider's name (its module's ``API``). The gateway's provider routes, the ``--api`` choices
and the check of every ``api`` a config, task or harness file names come from it; a record carries
the name. To add a provider: its module plus one ``PROVIDERS.register`` line here."""

from __future__ import annotations

from types import ModuleType

from polar_env.errors import ConfigError
from polar_env.proxy.providers import anthropic, gemini, openai_chat, openai_responses
from polar_env.proxy.providers.base import Provider
from polar_env.records import ProviderAPI
from polar_env.registry import Registry

_CONTRACT = ("API", "ROUTES", "to_chat", "from_chat", "stream_events", "error_body")


def as_provider(module: ModuleType | Provider, name: str) -> Provider:
    """``module`` when it keeps the ``Provider`` contract under ``name`` (a one-line ConfigError
    otherwise: a provider registered under another name than its records would carry is a bug)."""
    missing = [attr for attr in _CONTRACT if not hasattr(module, attr)]
    if missing:
        raise ConfigError(f"provider API {name!r} lacks {', '.join(missing)} (see polar_env/proxy/providers/base.py)")
    api = module.API
    if not isinstance(api, ProviderAPI) or api != name:
        raise ConfigError(f"provider API {name!r}: its API is {api!r}; register it as ProviderAPI({name!r})")
    return module  # checked above (mypy takes a module for any Protocol)


PROVIDERS: Registry[Provider] = Registry("provider API", coerce=as_provider)
PROVIDERS.register(anthropic.API, anthropic)
PROVIDERS.register(gemini.API, gemini)
PROVIDERS.register(openai_chat.API, openai_chat)
PROVIDERS.register(openai_responses.API, openai_responses)
