"""slime_flags.txt is what the real parsers register (scripts/gen_slime_flags.py), with the
commits it came from; none of the pip/ray/hf options the old scraped list let through. When
checkouts are at hand (POLAR_SLIME_SRC, POLAR_MEGATRON_SRC: a Megatron-LM clone holding slime's
pinned commit, POLAR_SGLANG_SITE: unpacked sglang + sglang-router wheels), the list is rebuilt and
must equal the committed one."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from polar_env.errors import ConfigError
from polar_env.integrations.slime_recipe import FLAGS_FILE, check_flag, known_flags

REPO = Path(__file__).resolve().parents[2]
NOT_FLAGS = ("port", "tp", "no-deps", "index-url", "extra-index-url", "force-reinstall", "no-cache-dir", "host",
             "num-gpus", "runtime-env-json", "address", "temp-dir", "repo-type", "local-dir", "model-path")


def test_list_holds_real_flags_only() -> None:
    header = [line for line in FLAGS_FILE.read_text().splitlines() if line.startswith("#")]
    assert "Megatron-LM 1dcf0dafa884" in header[1] and "slime 624b824a898a" in header[1] and "sglang 0.5.23" in header[1]
    names = known_flags()
    assert not [n for n in NOT_FLAGS if n in names]
    for real in ("rollout-batch-size", "custom-generate-function-path", "tensor-model-parallel-size",
                 "use-gated-attention", "debug-rollout-only", "sglang-mem-fraction-static", "router-policy",
                 "partial-rollout", "group-rm", "over-sampling-batch-size"):
        assert real in names, real
    with pytest.raises(ConfigError, match="did you mean sglang-mem-fraction-static"):
        check_flag("sglang-mem-fraction-statc", "sglang")  # SGLang typos are caught too, not passed by prefix


@pytest.mark.skipif(not all(os.environ.get(k) for k in ("POLAR_SLIME_SRC", "POLAR_MEGATRON_SRC", "POLAR_SGLANG_SITE")),
                    reason="set POLAR_SLIME_SRC, POLAR_MEGATRON_SRC and POLAR_SGLANG_SITE to rebuild the list")
def test_list_regenerates_from_the_checkouts(tmp_path: Path) -> None:
    out = tmp_path / "flags.txt"
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "gen_slime_flags.py"),
                           "--slime", os.environ["POLAR_SLIME_SRC"], "--megatron", os.environ["POLAR_MEGATRON_SRC"],
                           "--sglang", os.environ["POLAR_SGLANG_SITE"], "--out", str(out)],
                          capture_output=True, text=True, timeout=600, check=False, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert out.read_text() == FLAGS_FILE.read_text()
