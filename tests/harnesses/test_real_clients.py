"""The real pi and Qwen Code CLIs, unmodified, against the real gateway (what CI runs).

Each case runs ``python -m polar_env.testing.harness_check --only <spec>`` in a subprocess: the CLI runs
headless in a loopback-only network namespace against the gateway and the embedded scripted engine,
and the session's journal must show a complete tool round trip with token-faithful records.
pi covers all four provider wire formats; qwen adds a second OpenAI-chat client, and mini-swe-agent
a Python one (litellm) that ends by a command rather than a text answer. The same pi and mini
cases run again on SmolLM2's real weights (template ``smollm2``: the generic hf: family) in token-in
continuation mode, where the calls must merge into one trace with 0 drift and exact masks.

The CLIs come from ``scripts/install_harnesses.sh`` (pi and qwen by default) and
``python -m polar_env.harnesses install mini_swe_agent``. Without them the cases skip locally and
fail under ``CI``, which must install them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from polar_env.harnesses.clients import get
from polar_env.harnesses.pi import MODES as PI_MODES
from polar_env.records import ProviderAPI
from polar_env.testing.harness_check import (
    CheckResult,
    binary_path,
    describe_failure,
    install_hint,
    isolation_problem,
)

pytestmark = pytest.mark.slow

CASES = [("pi", api) for api, *_ in PI_MODES] + [("qwen", ProviderAPI.OPENAI_CHAT), ("mini", ProviderAPI.OPENAI_CHAT)]
CLI_TIMEOUT_S = 120


def _unavailable(reason: str) -> None:
    if os.environ.get("CI"):
        pytest.fail(f"{reason} (CI must provide it)")
    pytest.skip(reason)


@pytest.fixture(scope="module")
def isolation() -> None:
    problem = isolation_problem()
    if problem:
        _unavailable(f"no loopback-only network namespace: {problem}; needs unshare (apt-get install -y util-linux) "
                     "and unprivileged user namespaces (sysctl -w kernel.unprivileged_userns_clone=1) or root")


def _check(name: str, api: ProviderAPI, tmp_path: Path, timeout_s: int, *flags: str) -> CheckResult:
    """The harness check's verdict on one spec, asserted to be a complete tool round trip."""
    spec = get(name, api)
    if not binary_path(spec).exists():
        _unavailable(f"{spec.binary} CLI not installed at {binary_path(spec)}; run {install_hint(spec)}")
    out = tmp_path / "result.json"
    proc = subprocess.run(
        [sys.executable, "-m", "polar_env.testing.harness_check", "--only", spec.id, "--json", str(out),
         "--timeout-s", str(timeout_s), "--workdir", str(tmp_path / "work"), *flags],
        check=False, capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=timeout_s + 300,
    )
    assert out.exists(), f"check wrote no result (rc {proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    data = json.loads(out.read_text())[0]
    data.pop("ok")
    result = CheckResult(**data)
    why = describe_failure(result)
    assert result.exit_code == 0, why
    assert result.turns >= 2, why
    assert result.tool_round_trip, why
    assert result.aligned, why
    assert result.answer_in_stdout, why
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}"
    return result


@pytest.mark.parametrize(("name", "api"), CASES, ids=[f"{n}-{a.value}" for n, a in CASES])
def test_real_client(name: str, api: ProviderAPI, tmp_path: Path, isolation: None) -> None:
    _check(name, api, tmp_path, CLI_TIMEOUT_S)


# Qwen Code's prompt (~15.7k tokens) does not fit SmolLM2's 8,192-token context: pi and mini-swe-agent.
SMOL_CASES = [("pi", api) for api, *_ in PI_MODES] + [("mini", ProviderAPI.OPENAI_CHAT)]
SMOL_TIMEOUT_S = 300  # a real 135 M model's first prefill (pi: 1.5k tokens) is ~20 CPU-s


@pytest.mark.parametrize(("name", "api"), SMOL_CASES, ids=[f"{n}-{a.value}" for n, a in SMOL_CASES])
def test_real_client_on_smollm2_token_in(name: str, api: ProviderAPI, tmp_path: Path, isolation: None,
                                         smollm2: object) -> None:
    """The generic hf: family (SmolLM2's own template, Hermes tool calls) under a real CLI, token-in:
    every turn extends the last, so the calls merge into one trace with 0 drift and exact masks."""
    result = _check(name, api, tmp_path, SMOL_TIMEOUT_S, "--continuation", "--template", "smollm2")
    why = describe_failure(result)
    assert (result.template, result.continuation) == ("smollm2", True), why
    assert (result.merged_traces, result.drift, result.masks_exact) == (1, 0, True), why
