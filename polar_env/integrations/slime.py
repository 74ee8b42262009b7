"""Slime (THUDM/slime) integration: Polar trajectories as slime ``Sample`` lists.

Plug-in points (dotted paths slime loads with ``load_function``):

- ``--custom-generate-function-path polar_env.integrations.slime.generate``: runs one Polar session
  for the prompt sample and returns a non-empty ``list[Sample]``, one per trace. All siblings
  share the sample's ``rollout_id`` (slime's loss is a per-rollout token mean, so K traces of one
  session count as one rollout), and each carries the full session reward.
- ``--custom-reward-post-process-path polar_env.integrations.slime.grpo_normalize``: GRPO
  normalisation per prompt group over distinct rollouts. slime's default reshapes by
  ``n_samples_per_prompt`` and, when a rollout yields several samples, falls back to one group
  over the whole batch (THUDM/slime#1414).

slime is never imported here: new samples are deep copies of the sample slime passed in, so the
real ``slime.utils.types.Sample`` and a duck-typed stand-in (same field names, a nested ``Status``
enum) behave the same. Token ids, masks and logprobs are the engine's, never re-tokenized.
"""

from __future__ import annotations

import asyncio
import copy
import math
from collections import defaultdict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from polar_env.errors import ConfigError
from polar_env.integrations.credit import CreditScheme, trace_weights
from polar_env.integrations.lazy_env import LazyEnv
from polar_env.records import Status, Trace, Trajectory

POLAR_METADATA_KEY = "polar"
"""Key in ``Sample.metadata`` holding the session id, trace index, loss weight and evaluation."""

FAILURE_TOKENS = [0, 0]
"""Placeholder sequence for a failed rollout: slime crashes on an empty list, so a failure is one
sample with one masked response token and ``remove_sample=True``."""

_NORMALIZED_ESTIMATORS = ("grpo", "gspo", "cispo", "reinforce_plus_plus_baseline")
_STD_ESTIMATORS = ("grpo", "gspo", "cispo")
_EPS = 1e-6  # slime's std epsilon


def status_name(finish_reason: str | None) -> str:
    """slime's status for a trace, from the finish reason of its last call (as slime's own
    ``meta_info`` handling maps SGLang's: length → TRUNCATED, abort → ABORTED)."""
    if finish_reason == "length":
        return "TRUNCATED"
    if finish_reason == "abort":
        return "ABORTED"
    return "COMPLETED"


def rollout_id_of(sample: Any) -> int:
    """The id all samples of one rollout share: slime's ``rollout_id``, else its ``index``."""
    rid = getattr(sample, "rollout_id", None)
    return rid if rid is not None else sample.index


def _weight_versions(trace: Trace, trajectory: Trajectory) -> list[str]:
    versions = trace.metadata.get("weight_versions")
    if versions is None:
        versions = trajectory.metadata.get("weight_versions") or []
    return [str(v) for v in versions if v is not None]


def _sibling(base: Any) -> Any:
    out = copy.deepcopy(base)
    out.rollout_id = rollout_id_of(base)
    out.metadata = dict(getattr(base, "metadata", None) or {})
    return out


def failure_sample(base: Any, reason: str, *, aborted: bool = False) -> Any:
    """The one-element placeholder for a rollout that produced nothing trainable. It keeps the
    group's shape (slime asserts ``n_samples_per_prompt`` entries) and trains nothing."""
    out = _sibling(base)
    out.tokens = list(FAILURE_TOKENS)
    out.response_length = 1
    out.loss_mask = [0]
    out.rollout_log_probs = [0.0]
    out.response = ""
    out.reward = 0.0
    out.remove_sample = True
    out.status = out.Status.ABORTED if aborted else out.Status.FAILED
    out.metadata[POLAR_METADATA_KEY] = {"failed": reason}
    return out


def _truncated(trace: Trace, max_tokens: int | None) -> tuple[Trace, bool]:
    if max_tokens is None or len(trace.prompt_ids) + len(trace.response_ids) <= max_tokens:
        return trace, False
    keep = max(0, max_tokens - len(trace.prompt_ids))
    return trace.model_copy(update={
        "response_ids": trace.response_ids[:keep],
        "loss_mask": trace.loss_mask[:keep],
        "response_logprobs": trace.response_logprobs[:keep],
    }), True


def trajectory_to_samples(
    trajectory: Trajectory | None,
    base: Any,
    *,
    reward: float | None = None,
    max_tokens: int | None = None,
    credit: CreditScheme = CreditScheme.SESSION,
    failure: str | None = None,
) -> list[Any]:
    """slime samples for one Polar session, one per trace; never empty.

    ``base`` is the prompt sample slime handed to the generate function: ``index``,
    ``group_index``, ``prompt``, ``label``, ``session_id`` and ``train_metadata`` are copied from it.
    ``reward`` defaults to the trajectory's. ``max_tokens`` (``--rollout-max-context-len``) cuts
    longer traces at the end and marks them TRUNCATED. ``failure`` forces the placeholder.
    """
    if failure is None:
        if trajectory is None:
            failure = "no trajectory"
        elif trajectory.status is Status.ERROR:
            failure = str(trajectory.metadata.get("error") or "trajectory build failed")
        elif not any(t.response_ids for t in trajectory.traces):
            failure = "session produced no sampled tokens"
    if failure is not None:
        aborted = trajectory is not None and trajectory.status is Status.ABORTED
        return [failure_sample(base, failure, aborted=aborted)]
    assert trajectory is not None
    chosen = reward if reward is not None else trajectory.reward
    value = 0.0 if chosen is None else float(chosen)
    if not math.isfinite(value):
        raise ValueError(f"session {trajectory.session_id}: reward {value} is not finite")
    traces = [t for t in trajectory.traces if t.response_ids]
    weights = trace_weights(traces, credit)
    samples: list[Any] = []
    for index, (original, weight) in enumerate(zip(traces, weights, strict=True)):
        trace, cut = _truncated(original, max_tokens)
        if not trace.response_ids:
            continue  # the prompt alone fills the context: nothing to train in this trace
        out = _sibling(base)
        out.tokens = [*trace.prompt_ids, *trace.response_ids]
        out.response_length = len(trace.response_ids)
        out.loss_mask = list(trace.loss_mask)
        out.rollout_log_probs = [lp if m else 0.0 for lp, m in zip(trace.response_logprobs, trace.loss_mask, strict=True)]
        out.response = ""  # display only; slime never re-tokenizes it
        out.reward = value
        out.remove_sample = False
        out.weight_versions = _weight_versions(trace, trajectory)
        name = "TRUNCATED" if cut else status_name(trace.metadata.get("finish_reason"))
        out.status = getattr(out.Status, name)
        out.metadata[POLAR_METADATA_KEY] = {
            "session_id": trajectory.session_id,
            "trace_index": index,
            "traces": len(traces),
            "loss_weight": weight,
            "seqs": trace.metadata.get("seqs", []),
            "drift_boundaries": len(trace.metadata.get("drift") or []),
            "cut_to_context": cut,
        }
        samples.append(out)
    return samples or [failure_sample(base, f"every trace exceeds the {max_tokens}-token context")]


def _reward_value(args: Any, sample: Any) -> float:
    reward = sample.reward
    key = getattr(args, "reward_key", None)
    if isinstance(reward, Mapping):
        if not key:
            raise ConfigError("samples carry dict rewards: set --reward-key to pick one")
        reward = reward[key]
    return 0.0 if reward is None else float(reward)


def grpo_normalize(args: Any, samples: Sequence[Any]) -> tuple[list[float], list[float]]:
    """``--custom-reward-post-process-path``: (raw rewards, normalised rewards), one per sample.

    Samples are grouped by ``group_index``; inside a group each distinct rollout (``rollout_id``,
    else ``index``) counts once, whatever its number of samples, and rollouts whose samples are
    all ``remove_sample`` are left out. The mean and the unbiased std (as slime's default, 0 for
    a single rollout) of those rollout rewards normalise every sample of the group; removed
    samples get 0.0. The estimator and ``--disable-*-normalization`` flags are honoured as in
    slime's default.
    """
    raw = [_reward_value(args, s) for s in samples]
    estimator = getattr(args, "advantage_estimator", "grpo")
    if estimator not in _NORMALIZED_ESTIMATORS or not getattr(args, "rewards_normalization", True):
        return raw, list(raw)
    divide = estimator in _STD_ESTIMATORS and getattr(args, "grpo_std_normalization", True)
    rollouts: dict[Any, dict[Any, float]] = defaultdict(dict)  # group → rollout id → reward
    for sample, reward in zip(samples, raw, strict=True):
        if not sample.remove_sample:
            rollouts[sample.group_index].setdefault(rollout_id_of(sample), reward)
    stats: dict[Any, tuple[float, float]] = {}
    for group, by_rollout in rollouts.items():
        values = list(by_rollout.values())
        mean = sum(values) / len(values)
        std = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1)) if len(values) > 1 else 0.0
        stats[group] = (mean, std)
    normalized: list[float] = []
    for sample, reward in zip(samples, raw, strict=True):
        if sample.remove_sample:
            normalized.append(0.0)
            continue
        mean, std = stats[sample.group_index]
        centred = reward - mean
        normalized.append(centred / (std + _EPS) if divide else centred)
    return raw, normalized


# --- the generate function -------------------------------------------------------------------


def task_row(sample: Any) -> dict[str, Any]:
    """The Polar task for a slime prompt sample: the row in ``metadata`` (``--metadata-key``, or
    its ``task`` entry). A SWE row (with ``instance_id``) goes to PolarEnv as is: its repo or image
    becomes the runtime and swebench grades it. Any other row gets the prompt as its instruction."""
    meta = dict(getattr(sample, "metadata", None) or {})
    row = dict(meta.get("task") or meta)
    if "instance_id" in row:
        return row
    prompt = sample.prompt
    if isinstance(prompt, list):  # messages (--apply-chat-template off): the last user turn
        users = [m.get("content") for m in prompt if isinstance(m, Mapping) and m.get("role") == "user"]
        prompt = users[-1] if users else ""
    instruction = row.pop("instruction", None) or prompt
    task_id = row.pop("task_id", None) or f"slime-{sample.index}"
    return {"task_id": str(task_id), "instruction": instruction if isinstance(instruction, str) else str(instruction),
            "task": row}


def slime_ids(sample: Any) -> dict[str, Any]:
    """Where a session came from, recorded in its TaskRequest metadata."""
    return {"slime_index": sample.index, "slime_group_index": sample.group_index,
            "slime_rollout_id": rollout_id_of(sample), "slime_session_id": getattr(sample, "session_id", None)}


def forced_sampling(sampling_params: Mapping[str, Any]) -> dict[str, Any]:
    """slime's sampling parameters as PolarEnv gateway overrides. The trainer divides logits by
    ``--rollout-temperature``, so every harness request is forced to these values."""
    top_k = sampling_params.get("top_k")
    if top_k not in (None, -1, 0):
        raise ConfigError(
            f"--rollout-top-k {top_k}: the Polar gateway cannot force top_k; keep slime's default (-1)")
    top_p = float(sampling_params.get("top_p", 1.0))
    if top_p != 1.0:
        raise ConfigError(
            f"--rollout-top-p {top_p}: slime then requires top-p token replay on every sample, which "
            "Polar does not capture; use --rollout-top-p 1.0")
    out: dict[str, Any] = {"temperature": float(sampling_params.get("temperature", 1.0)), "top_p": top_p}
    if sampling_params.get("max_new_tokens") is not None:
        out["max_tokens"] = int(sampling_params["max_new_tokens"])
    return out


def router_url(args: Any) -> str:
    return f"http://{args.sglang_router_ip}:{args.sglang_router_port}"


def polar_config(args: Any, sampling_params: Mapping[str, Any]) -> dict[str, Any]:
    """The PolarEnv config for a slime run: the file named by ``polar_config`` (set through
    ``--custom-config-path``), engine = slime's SGLang router, sampling forced to slime's."""
    import yaml

    path = getattr(args, "polar_config", None)
    if not path:
        raise ConfigError(
            "slime args have no polar_config: put `polar_config: /path/to/polar.yaml` in the file "
            "given to --custom-config-path (polar-env slime-args writes it from the recipe)")
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"polar_config {file} does not exist (set by --custom-config-path)")
    config = yaml.safe_load(file.read_text()) or {}
    if not isinstance(config, dict):
        raise ConfigError(f"{file}: a PolarEnv config must be a mapping, got {type(config).__name__}")
    engine = dict(config.get("engine") or {})
    engine.update({"kind": "sglang", "url": f"router:{router_url(args)}"})
    return {**config, "engine": engine, **forced_sampling(sampling_params)}


class SlimeRollout:
    """Runs Polar sessions for slime prompt samples through one started ``PolarEnv``.

    ``env`` is anything with PolarEnv's ``rollout(task, n=...)`` coroutine and async context;
    ``generate`` starts it on first use (under a lock: slime calls concurrently)."""

    def __init__(self, env: Any) -> None:
        self.env = env
        self._lazy = LazyEnv(env)

    async def _ensure_started(self) -> None:
        await self._lazy.start()

    async def close(self) -> None:
        await self._lazy.close()

    async def generate(self, args: Any, sample: Any, sampling_params: Mapping[str, Any], evaluation: bool = False) -> list[Any]:
        await self._ensure_started()
        max_context = getattr(args, "rollout_max_context_len", None)
        try:
            group = await self.env.rollout(task_row(sample), n=1, metadata=slime_ids(sample))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - a failed session must not kill slime's rollout
            return [failure_sample(sample, f"{type(exc).__name__}: {exc}")]
        if not group.results:
            return [failure_sample(sample, "PolarEnv returned no session")]
        result = group.results[0]
        status = str(getattr(result, "status", "completed"))
        if status == "cancelled":
            return [failure_sample(sample, "session cancelled", aborted=True)]
        # An errored session (runtime, harness or evaluator failure) says nothing about the policy:
        # train nothing from it. A timed-out one is the policy's doing and keeps its tokens.
        failure = (result.error or f"session {status}") if status == "error" or result.trajectory is None else None
        samples = trajectory_to_samples(result.trajectory, sample, reward=result.reward,
                                        max_tokens=max_context, failure=failure)
        for s in samples:
            s.metadata[POLAR_METADATA_KEY].update({
                "session_status": status, "evaluation": dict(result.evaluation or {}), "evaluation_mode": evaluation})
        return samples


_DEFAULT: SlimeRollout | None = None


async def generate(args: Any, sample: Any, sampling_params: dict[str, Any], evaluation: bool = False) -> list[Any]:
    """``--custom-generate-function-path polar_env.integrations.slime.generate``. The first call
    builds the PolarEnv (from ``args.polar_config`` and these sampling params) and starts it."""
    global _DEFAULT
    if _DEFAULT is None:
        from polar_env.env import PolarEnv

        _DEFAULT = SlimeRollout(PolarEnv(polar_config(args, sampling_params)))
    return await _DEFAULT.generate(args, sample, sampling_params, evaluation)


async def shutdown() -> None:
    """Stop the PolarEnv ``generate`` started (its nodes, runtimes and engine clients)."""
    global _DEFAULT
    rollout, _DEFAULT = _DEFAULT, None
    if rollout is not None:
        await rollout.close()


def write_toy_prompts(path: str | Path) -> int:
    """slime prompt data for polar_env's offline toy SWE tasks (built on this machine): one JSONL row
    per task, ``prompt`` = the problem statement, ``metadata`` = the SWE row (the smoke recipe)."""
    import orjson

    from polar_env.tasks.toy import toy_tasks

    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tasks = toy_tasks()
    with open(out, "wb") as f:
        for task in tasks:
            f.write(orjson.dumps({"prompt": task.problem_statement, "label": task.instance_id,
                                  "metadata": task.model_dump(mode="json")}) + b"\n")
    return len(tasks)


if __name__ == "__main__":
    import sys

    if len(sys.argv) != 3 or sys.argv[1] != "toy-prompts":
        print("usage: python -m polar_env.integrations.slime toy-prompts OUT.jsonl", file=sys.stderr)
        sys.exit(2)
    print(f"wrote {write_toy_prompts(sys.argv[2])} prompts to {sys.argv[2]}")
