"""PROVIDERS: the only place a provider wire format is registered (see ``base`` for the contract)."""

from __future__ import annotations

from polar_env.proxy.providers import openai_chat
from polar_env.proxy.providers.base import Provider
from polar_env.records import ProviderAPI

PROVIDERS: dict[ProviderAPI, Provider] = {
    openai_chat.API: openai_chat,  # type: ignore[dict-item]
}
