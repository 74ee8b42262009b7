"""Model weights on disk (polar_env/weights.py): what a model_dir may be, said in one line, and the
GGUF conversion cache (written once, atomically, reused)."""

from __future__ import annotations

from pathlib import Path

import pytest

from polar_env.engines.config import EmbeddedEngineConfig
from polar_env.errors import ConfigError
from polar_env.weights import check_weights, converted


def _one_line(exc: pytest.ExceptionInfo[ConfigError], *parts: str) -> None:
    assert "\n" not in str(exc.value) and all(p in str(exc.value) for p in parts), str(exc.value)


def test_a_model_is_a_folder_with_config_or_a_gguf_file(tmp_path: Path) -> None:
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    (tmp_path / "w.gguf").write_bytes(b"GGUF")
    assert check_weights(tmp_path / "m", "--model-dir") == tmp_path / "m"
    assert check_weights(tmp_path / "w.gguf", "--model-dir") == tmp_path / "w.gguf"
    (tmp_path / "empty").mkdir()
    (tmp_path / "notes.txt").write_text("x")
    for path, says in ((tmp_path / "nope", "no such folder or .gguf file"), (tmp_path / "nope.gguf", "no such GGUF file"),
                       (tmp_path / "empty", "has no config.json"), (tmp_path / "notes.txt", "is a file, not a HF model")):
        with pytest.raises(ConfigError) as caught:
            check_weights(path, "--model-dir")
        _one_line(caught, "--model-dir", str(path), says)


def test_the_engine_config_checks_its_weights_before_work(tmp_path: Path) -> None:
    missing = EmbeddedEngineConfig(model_dir=tmp_path / "m.gguf")
    with pytest.raises(ConfigError) as caught:
        missing.build()
    _one_line(caught, "engine model_dir", "no such GGUF file")
    assert EmbeddedEngineConfig().weights() is None  # qwen3.5 names no model: seeded random weights


def test_a_conversion_is_written_once_and_reused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("POLAR_GGUF_CACHE", str(tmp_path / "cache"))
    gguf = tmp_path / "w.gguf"
    gguf.write_bytes(b"GGUF")
    calls: list[Path] = []

    def write(source: Path, folder: Path) -> None:
        calls.append(folder)
        (folder / "out.txt").write_text(source.read_text())

    first = converted(gguf, "model", write)
    assert converted(gguf, "model", write) == first and len(calls) == 1
    assert (first / "out.txt").read_text() == "GGUF" and first.parent.parent == tmp_path / "cache"
    assert [p.name for p in first.parent.iterdir()] == ["model"]  # no scratch folder left behind


def test_a_failed_conversion_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("POLAR_GGUF_CACHE", str(tmp_path / "cache"))
    gguf = tmp_path / "w.gguf"
    gguf.write_bytes(b"GGUF")

    def missing_package(source: Path, folder: Path) -> None:
        (folder / "half").write_text("x")
        raise ImportError("No module named 'gguf'")

    with pytest.raises(ConfigError) as caught:
        converted(gguf, "tokenizer", missing_package)
    _one_line(caught, "needs more packages", "pip install gguf accelerate")
    assert list((tmp_path / "cache").rglob("*")) == [next((tmp_path / "cache").iterdir())]  # the key folder only
