"""OpenAI Chat inbound: vLLM's ``chat_template_kwargs`` extension reaches the template."""

from __future__ import annotations

import pytest

from polar_env.errors import RequestError
from polar_env.proxy.providers.openai_chat import to_chat


def test_chat_template_kwargs_pass_through() -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"enable_thinking": False}}
    assert to_chat(body, {}).chat.chat_template_kwargs == {"enable_thinking": False}
    assert to_chat({"messages": body["messages"]}, {}).chat.chat_template_kwargs == {}


def test_chat_template_kwargs_must_be_an_object() -> None:
    with pytest.raises(RequestError, match="chat_template_kwargs"):
        to_chat({"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": "no"}, {})
