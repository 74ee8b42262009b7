"""Model weights on disk: a Hugging Face folder or a GGUF file, checked in one line before work
starts; GGUF files are converted once to HF folders, cached.

transformers reads a ``.gguf`` by converting it: SmolLM2-135M's tokenizer takes ~15 CPU-s and its
Q4_1 weights ~40 CPU-s to de-quantize, every time. The first reader writes the converted tokenizer
(``tokenizer/``) and fp32 weights (``model/``) under ``~/.cache/polar_env/gguf/<name>-<size>-<mtime>``
(``POLAR_GGUF_CACHE`` overrides the root); later readers load those folders, which hold exactly
what the conversion produced (fp32 safetensors, the same tokenizer and chat template).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from polar_env.errors import ConfigError

INSTALL_HINT = "pip install gguf accelerate (the polar-env[smollm2] extra)"


def check_weights(path: Path, where: str) -> Path:
    """``path`` if it holds a model (a folder with ``config.json``, or a ``.gguf`` file); else
    ConfigError naming ``where`` (the flag or field that gave it). Never a hub id: nothing downloads."""
    path = Path(path).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ConfigError(f"{where} {path}: no such GGUF file; give a .gguf file or a HF model folder")
        return path
    if not path.exists():
        raise ConfigError(f"{where} {path}: no such folder or .gguf file; give a HF model folder (polar-env "
                          "export-model DIR writes one) or a .gguf file")
    if not path.is_dir():
        raise ConfigError(f"{where} {path} is a file, not a HF model folder or a .gguf file")
    if not (path / "config.json").is_file():
        raise ConfigError(f"{where} {path} has no config.json; give a HF model folder (polar-env export-model DIR "
                          "writes one) or a .gguf file")
    return path


def cache_root() -> Path:
    return Path(os.environ.get("POLAR_GGUF_CACHE") or Path.home() / ".cache" / "polar_env" / "gguf")


def _key(gguf: Path) -> str:
    stat = gguf.stat()
    return f"{gguf.stem}-{stat.st_size}-{stat.st_mtime_ns}"


def converted(gguf: Path, part: str, write: Callable[[Path, Path], None]) -> Path:
    """The cached folder ``part`` ("tokenizer" or "model") of ``gguf``; made by ``write(gguf,
    folder)`` when absent. Written into a temporary folder and renamed, so a reader never sees a
    half-written one and two first readers race harmlessly."""
    if not gguf.is_file():
        raise ConfigError(f"{gguf} is not a file (give a .gguf file or a HF model folder)")
    final = cache_root() / _key(gguf) / part
    if (final / ".complete").is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{part}-", dir=final.parent))
    try:
        try:
            write(gguf, scratch)
        except ImportError as exc:
            raise ConfigError(f"reading {gguf} needs more packages: {INSTALL_HINT} ({exc})") from None
        (scratch / ".complete").write_text("")
        try:
            scratch.rename(final)
        except OSError:  # another reader finished first: its folder is as good
            if not (final / ".complete").is_file():
                raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return final


def write_tokenizer(gguf: Path, folder: Path) -> None:
    from transformers import AutoTokenizer

    AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(str(folder))


def write_model(gguf: Path, folder: Path) -> None:
    import torch
    from safetensors.torch import save_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    # save_pretrained refuses a model read from GGUF ("quantized with gguf"): its weights are plain
    # fp32 now, so the config (without the GGUF marker) and the tensors are written directly.
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.save_pretrained(str(folder))
    if model.generation_config is not None:
        model.generation_config.save_pretrained(str(folder))
    save_model(model, str(folder / "model.safetensors"))  # tied embeddings are stored once


def tokenizer_folder(gguf: Path) -> Path:
    return converted(gguf, "tokenizer", write_tokenizer)


def model_folder(gguf: Path) -> Path:
    return converted(gguf, "model", write_model)
