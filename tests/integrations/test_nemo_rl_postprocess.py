"""NeMo RL's own post-processing (``NemoGym._postprocess_nemo_gym_to_nemo_rl_result``, from a
NeMo RL checkout: set POLAR_NEMO_RL_SRC) over a ``polar_swegym`` /run result built from a real
capture (opencode's recorded bodies through the gateway, tests/integrations/test_gym_delivery.py).
NeMo RL's package imports its vLLM worker and a transformers<5.12 patch; the test loads
``nemo_rl.environments.nemo_gym`` with those two package ``__init__``s bypassed (the function and
every helper it calls are NeMo RL's own), in a subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from test_gym_delivery import opencode_capture

from polar_env.integrations.delivery import choose_delivered
from polar_env.integrations.nemo_gym.agent import build_result
from polar_env.integrations.nemo_gym.convert import check_contiguous
from polar_env.trajectory.prefix_merge import build_prefix_merged

REPO = Path(__file__).resolve().parents[2]
NEMO_RL = os.environ.get("POLAR_NEMO_RL_SRC")
pytestmark = pytest.mark.skipif(not (NEMO_RL and (Path(NEMO_RL) / "nemo_rl" / "environments" / "nemo_gym.py").is_file()),
                                reason="set POLAR_NEMO_RL_SRC to a NVIDIA-NeMo/RL checkout")

RUNNER = r"""
import json, sys, types
from pathlib import Path
from types import SimpleNamespace
root = Path(sys.argv[1]); sys.path.insert(0, str(root))
def package(name, path):
    m = types.ModuleType(name); m.__path__ = [str(path)]; sys.modules[name] = m
import nemo_rl
package("nemo_rl.models", root / "nemo_rl/models")
package("nemo_rl.models.generation", root / "nemo_rl/models/generation")
policy = types.ModuleType("nemo_rl.models.policy"); policy.PolicyConfig = dict; policy.TokenizerConfig = dict
sys.modules["nemo_rl.models.policy"] = policy
from nemo_rl.environments.nemo_gym import NemoGym
cls = getattr(NemoGym, "__ray_actor_class__", None) or NemoGym.__ray_metadata__.modified_class
from polar_env.chat.qwen35.tokenizer import load_tokenizer
tok = load_tokenizer()
tokenizer = SimpleNamespace(batch_decode=lambda seqs: [tok.decode(list(s)) for s in seqs])
row, result = json.loads(Path(sys.argv[2]).read_text())
out = cls._postprocess_nemo_gym_to_nemo_rl_result(SimpleNamespace(cfg={}), row, result, tokenizer)
log = [{"role": m["role"], "token_ids": m["token_ids"].tolist(),
        "logprobs": m["generation_logprobs"].tolist() if "generation_logprobs" in m else None,
        "invalid_tool_call": m.get("is_invalid_tool_call"), "malformed_thinking": m.get("has_malformed_thinking")}
       for m in out["message_log"]]
print(json.dumps({"log": log, "keys": sorted(out)}))
"""


async def test_nemo_rl_postprocesses_a_real_polar_result(tmp_path: Path) -> None:
    records = await opencode_capture(tmp_path)
    traj = build_prefix_merged(records)
    row = {"responses_create_params": {"input": [{"role": "user", "content": "echo hi"}]}}
    result = SimpleNamespace(session_id="oc", status="completed", reward=1.0, evaluation={}, failure_kind=None,
                             failure_detail=None, mask=False, trajectory=traj)
    out = build_result(row, result, model="m", records=records)
    out["responses_create_params"] = row["responses_create_params"]
    payload = tmp_path / "run.json"
    payload.write_text(json.dumps([row, out]))
    proc = subprocess.run([sys.executable, "-c", RUNNER, str(NEMO_RL), str(payload)], capture_output=True, text=True,
                          timeout=300, check=False, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    log = got["log"]
    assert "message_log" in got["keys"]
    main = traj.traces[choose_delivered(traj).index]
    assert [t for m in log for t in m["token_ids"]] == check_contiguous(out["response"]["output"])
    trained = [t for m in log if m["role"] == "assistant" for t in m["token_ids"]]
    assert trained == [t for t, k in zip(main.response_ids, main.loss_mask, strict=True) if k]
    lps = [lp for m in log if m["role"] == "assistant" for lp in m["logprobs"]]
    assert lps == pytest.approx([lp for lp, k in zip(main.response_logprobs, main.loss_mask, strict=True) if k])
    assert [m["invalid_tool_call"] for m in log if m["role"] == "assistant"] == [False, False]
    assert [m["malformed_thinking"] for m in log if m["role"] == "assistant"] == [False, False]
