"""Model families behind one seam: ``chat_format(template)`` gives the ``ChatFormat`` (see
``base.py``) an engine's ``template`` names. Only this package knows a family.

Templates: ``qwen3.5`` (the default; what vLLM serving Qwen3.5 renders), ``append_only`` (Qwen3.5
without its prefix-breaking behaviours), ``qwen3`` (Qwen3-0.6B ... 32B; see ``qwen3.py``), and
``hf:PATH``: any model's own Hugging Face chat template and tokenizer, from a model folder or a
``.gguf`` file, with Hermes-style ``<tool_call>`` JSON for tools. ``smollm2`` is ``hf:`` on the SmolLM2-135M-Instruct GGUF that the
``smollm2`` extra installs. ``auto`` reads the family off the served model (``detect.py``): engine
configs resolve it (``resolved_template``) before asking for the format.
"""

from __future__ import annotations

import functools

from polar_env.chat.base import ChatFormat, NotContinuable, RequestRules, Tokenizer

__all__ = ["ChatFormat", "NotContinuable", "RequestRules", "Tokenizer", "chat_format", "check_template", "TEMPLATES"]

TEMPLATES = ("qwen3.5", "append_only", "qwen3", "smollm2", "hf:PATH", "auto")  # for help texts and errors
HF_PREFIX = "hf:"


def check_template(value: str) -> str:
    """``value`` if it names a template (an ``hf:`` path must exist); else ValueError in one line."""
    from pathlib import Path

    if value.startswith(HF_PREFIX):
        path = Path(value[len(HF_PREFIX):]).expanduser()
        if not path.exists():
            raise ValueError(f"template {value!r}: {path} does not exist (give a HF model folder or a .gguf file)")
        return value
    if value not in TEMPLATES:
        raise ValueError(f"unknown template {value!r}; known: {', '.join(TEMPLATES)}")
    if value == "smollm2":
        from polar_env.chat.hf import smollm2_gguf
        from polar_env.errors import ConfigError

        try:
            smollm2_gguf()
        except ConfigError as exc:
            raise ValueError(str(exc)) from None
    return value


@functools.cache
def chat_format(template: str) -> ChatFormat:
    """The family's format for ``template`` (one object per template per process; tokenizers
    load on first use)."""
    check_template(template)
    if template == "auto":
        raise ValueError("template 'auto' names no format until it is resolved against the served model "
                         "(EngineConfig.resolved_template)")
    if template in ("qwen3.5", "append_only"):
        from polar_env.chat.qwen35.format import FORMATS

        return FORMATS[template]
    if template == "qwen3":
        from polar_env.chat.qwen3 import FORMAT

        return FORMAT
    from polar_env.chat.hf import HFChatFormat, smollm2_gguf

    if template == "smollm2":
        return HFChatFormat(smollm2_gguf(), name=template)
    return HFChatFormat(template[len(HF_PREFIX):], name=template)
