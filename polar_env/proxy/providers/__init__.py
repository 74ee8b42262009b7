"""PROVIDERS: the only place a provider wire format is registered (see ``base`` for the contract);
a ``Registry`` keyed by the ``ProviderAPI`` value. Add one more with a module and one line here."""

from __future__ import annotations

from polar_env.proxy.providers import anthropic, gemini, openai_chat, openai_responses
from polar_env.proxy.providers.base import Provider
from polar_env.registry import Registry

PROVIDERS: Registry[Provider] = Registry("provider API")
for _module in (anthropic, gemini, openai_chat, openai_responses):
    PROVIDERS.register(_module.API.value, _module)
