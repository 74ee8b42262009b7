from __future__ import annotations

import pytest

from polar_env.chat.qwen35.tokenizer import IM_END_ID, load_tokenizer

SAMPLES = [
    "OK",
    "Hello, world! 123 4567",
    "<|im_start|>user\nhi<|im_end|>\n<think>\n\n</think>\n\n",
    "déjà vu — naïve café; e\u0301 (combining) 你好，世界 🙂🚀",
    "def f(x):\n\treturn x  # tabs\r\n\n\n   spaces   ",
    "<tool_call>\n<function=bash>\n<parameter=command>\nls -la\n</parameter>\n</function>\n</tool_call>",
]


def test_known_ids() -> None:
    tok = load_tokenizer()
    assert tok.encode("OK") == [3793]
    assert tok.encode("<think>") == [248068]
    assert tok.encode("<|im_end|>") == [IM_END_ID]


@pytest.mark.parametrize("text", SAMPLES)
def test_roundtrip(text: str) -> None:
    import unicodedata

    tok = load_tokenizer()
    assert tok.decode(tok.encode(text)) == unicodedata.normalize("NFC", text)


@pytest.mark.slow
def test_hf_export_encodes_identically(tmp_path) -> None:
    """The exported tokenizer.json (what vLLM loads) must agree with ours id for id."""
    from tokenizers import Tokenizer

    from polar_env.chat.qwen35.tokenizer import export_hf_tokenizer

    export_hf_tokenizer(tmp_path)
    hf = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    tok = load_tokenizer()
    for text in SAMPLES:
        assert hf.encode(text, add_special_tokens=False).ids == tok.encode(text), text
