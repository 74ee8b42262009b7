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

Abort and partial rollouts: slime's ``abort()`` (end of every rollout, leftover over-sampled
groups, dynamic filtering) sets ``GenerateState.aborted`` and aborts every request on the
workers. ``generate`` watches that flag while its session runs and cancels the session at once
(its engine calls are aborted, the session ends CANCELLED and trains nothing), so slime never
waits for a harness run it will throw away. What comes back depends on ``--partial-rollout``:

- off: ``list[Sample]`` as always (fan-out); an aborted session is the masked placeholder.

Outcomes map from the session's typed fields, never from text: ``mask`` (``polar_env.records.masked``)
decides between trained samples and the ``remove_sample`` placeholder, and ``failure_kind`` decides
the placeholder's ``Sample.Status`` (ABORTED for cancelled/interrupted, FAILED otherwise); every
sample's ``metadata["polar"]`` names the kind.
- on: one ``Sample`` per session, because slime's partial-rollout path iterates each group as
  samples and puts aborted groups back in its buffer to run again. A completed session delivers
  one trace (``polar_env.integrations.delivery``: the most trainable tokens; the dropped share is
  in ``metadata["polar"]``); an aborted one returns the prompt sample reset (status ABORTED, no
  response), so slime re-runs it from its prompt later. A harness session cannot resume
  mid-episode, so "partial" here means "re-run", never half a trajectory.

Sampling: each call's ``sampling_params`` (``forced_sampling``) ride on its TaskRequest and become
the session's trainer sampling, so an evaluation call at ``--eval-temperature`` samples at it; a
value that contradicts the PolarEnv config's own ``sampling`` is refused (ConfigError), never
silently replaced by either side.

Failures: an exception inside ``generate`` becomes the placeholder (slime's rollout must go on), but
it is logged with its traceback and named in the placeholder's ``metadata["polar"]["generate_error"]``;
``--custom-rollout-log-function-path polar_env.integrations.slime.log_rollout`` (``polar-env slime-args``
sets it) counts them in the rollout's metrics (``polar/generate_errors``), so a bug on that path
shows on the dashboard instead of hiding as masked samples.

``--group-rm`` is refused at the first call (``check_slime_args``): the Polar evaluator already set
every sample's reward, and slime's group RM would call the RM on polar's sample lists.

slime is never imported here: new samples are deep copies of the sample slime passed in, so the
real ``slime.utils.types.Sample`` and a duck-typed stand-in (same field names, a nested ``Status``
enum) behave the same. Token ids, masks and logprobs are the engine's, never re-tokenized.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import math
import sys
import uuid
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from polar_env.errors import ConfigError
from polar_env.integrations.credit import CreditScheme, trace_weights
from polar_env.integrations.delivery import choose_delivered
from polar_env.integrations.lazy_env import LazyEnv
from polar_env.proxy.config import Sampling
from polar_env.records import FailureKind, Trace, Trajectory

log = logging.getLogger(__name__)

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
    return int(rid if rid is not None else sample.index)


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


RERUN_KINDS = frozenset({FailureKind.CANCELLED, FailureKind.INTERRUPTED})
"""Failures slime sees as ``Sample.Status.ABORTED`` (its fully-async rollout re-queues the group);
every other masked failure is ``FAILED``."""


def failure_status(kind: FailureKind | None) -> str:
    """slime's status name for a masked session of failure ``kind``."""
    return "ABORTED" if kind in RERUN_KINDS else "FAILED"


def failure_sample(base: Any, reason: str, *, aborted: bool = False, kind: FailureKind | None = None) -> Any:
    """The one-element placeholder for a rollout that produced nothing trainable (a masked session:
    ``polar_env.records.masked``). It keeps the group's shape (slime asserts ``n_samples_per_prompt``
    entries), trains nothing (``remove_sample``) and carries the failure kind in ``metadata``."""
    out = _sibling(base)
    out.tokens = list(FAILURE_TOKENS)
    out.response_length = 1
    out.loss_mask = [0]
    out.rollout_log_probs = [0.0]
    out.response = ""
    out.reward = 0.0
    out.remove_sample = True
    out.status = out.Status.ABORTED if aborted else getattr(out.Status, failure_status(kind))
    out.metadata[POLAR_METADATA_KEY] = {"failed": reason, "failure_kind": kind.value if kind is not None else None}
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
    longer traces at the end and marks them TRUNCATED. A masked trajectory (``mask``: see
    ``polar_env.records.masked``) becomes the placeholder, ABORTED when it was cancelled or
    interrupted and FAILED otherwise; ``failure`` forces the placeholder. A trajectory that is not
    masked trains with its reward even when its session failed (agent timeout, harness error,
    limit hit): its traces keep their finish status and ``metadata["polar"]`` names the kind.
    """
    kind = trajectory.failure_kind if trajectory is not None else None
    if failure is None:
        if trajectory is None:
            failure = "no trajectory"
        elif trajectory.mask or not any(t.response_ids for t in trajectory.traces):
            failure = (f"{kind.value}: {trajectory.failure_detail or ''}" if kind is not None
                       else str(trajectory.metadata.get("error") or "session produced no sampled tokens"))
        elif not any(t.response_ids and t.trainable for t in trajectory.traces):
            failure = "no chain the harness continued (only side requests or abandoned calls)"
    if failure is not None:
        return [failure_sample(base, failure, kind=kind)]
    assert trajectory is not None
    chosen = reward if reward is not None else trajectory.reward
    value = 0.0 if chosen is None else float(chosen)
    if not math.isfinite(value):
        raise ValueError(f"session {trajectory.session_id}: reward {value} is not finite")
    traces = [t for t in trajectory.traces if t.response_ids and t.trainable]  # never train a side chain
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
            "failure_kind": kind.value if kind is not None else None,
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
    raw = getattr(sample, "metadata", None) or {}
    if isinstance(raw, str):  # --metadata-key naming a JSON-text column (re-uploaded SkyRL sets)
        import json

        try:
            raw = json.loads(raw)
        except ValueError:
            raise ConfigError(f"slime sample {sample.index}: its metadata is text but not JSON") from None
    if not isinstance(raw, Mapping):
        raise ConfigError(f"slime sample {sample.index}: metadata is a {type(raw).__name__}; point --metadata-key "
                          "at the task row (SkyRL-v0-293-data: instance)")
    meta = {k: v for k, v in dict(raw).items()
            if k not in (POLAR_METADATA_KEY, "start_rollout_id")}  # ours and slime's bookkeeping
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
    """slime's sampling parameters as the session's trainer sampling. The trainer divides logits
    by ``--rollout-temperature``, so every harness request of the session is forced to these values."""
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


def polar_config(args: Any) -> dict[str, Any]:
    """The PolarEnv config for a slime run: the file named by ``polar_config`` (set through
    ``--custom-config-path``), engine = slime's SGLang router. Its ``sampling`` stays the file's:
    slime's own comes with each call (``forced_sampling``) and must agree with it."""
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
    from polar_env.engines.config import ENGINES, SGLangEngineConfig

    # the engine is slime's router: another backend's own options go; a typo stays, to be refused
    others = {f for kind in ENGINES.names() for f in ENGINES.get(kind).model_fields} - set(SGLangEngineConfig.model_fields)
    given = {k: v for k, v in dict(config.get("engine") or {}).items() if k not in others}
    engine = {**given, "kind": "sglang", "url": f"router:{router_url(args)}"}
    return {**config, "engine": engine}


def check_slime_args(args: Any) -> None:
    """Refuse, with one line, the slime flags polar's generate cannot honour."""
    if getattr(args, "group_rm", False):
        raise ConfigError(
            "--group-rm: polar's generate already sets each sample's reward from the Polar evaluator, and "
            "slime's group RM would re-score polar's per-session sample lists; drop --group-rm (put group "
            "logic in a Polar evaluator or in --custom-reward-post-process-path)")


def slime_abort_flag() -> Callable[[], bool]:
    """slime's abort state as a callable: ``GenerateState.aborted`` of slime's rollout module when
    it is loaded (the state is a process singleton; it is looked up on every call because slime
    resets it between rollouts), else always False."""
    def aborted() -> bool:
        module = sys.modules.get("slime.rollout.sglang_rollout")
        state_cls = getattr(module, "GenerateState", None)
        instances = getattr(state_cls, "_instances", None) if state_cls is not None else None
        state = instances.get(state_cls) if isinstance(instances, dict) else None
        return bool(getattr(state, "aborted", False))

    return aborted


GENERATE_ERROR_KEY = "generate_error"
"""``metadata["polar"]`` key of a placeholder that ``generate`` made from an exception (its repr)."""
GENERATE_ERRORS_METRIC = "polar/generate_errors"


def generate_errors(samples: Sequence[Any]) -> int:
    """How many of a rollout's samples are placeholders for an exception in ``generate``."""
    metas = ((getattr(s, "metadata", None) or {}).get(POLAR_METADATA_KEY) for s in samples)
    return sum(1 for meta in metas if isinstance(meta, Mapping) and GENERATE_ERROR_KEY in meta)


def log_rollout(rollout_id: int, args: Any, samples: Sequence[Any], rollout_extra_metrics: dict[str, Any] | None,
                rollout_time: float) -> bool:
    """``--custom-rollout-log-function-path``: adds ``polar/generate_errors`` to the rollout's
    metrics and returns False, so slime's own logging then reports them with everything else
    (``log_rollout_data`` copies ``rollout_extra_metrics`` after this hook). With no metrics dict
    to add to (a custom rollout function that returns none) the count goes to this log."""
    errors = generate_errors(samples)
    if rollout_extra_metrics is not None:
        rollout_extra_metrics[GENERATE_ERRORS_METRIC] = errors
    if errors:
        log.warning("rollout %s: %d of %d samples are placeholders for exceptions in polar's generate (logged above)",
                    rollout_id, errors, len(samples))
    return False


def reset_for_rerun(base: Any, reason: str) -> Any:
    """The prompt sample as slime's buffer wants an aborted one: no response, status ABORTED."""
    out = copy.deepcopy(base)
    out.tokens = []
    out.response = ""
    out.response_length = 0
    out.loss_mask = None
    out.rollout_log_probs = None
    out.reward = None
    out.remove_sample = False
    out.status = out.Status.ABORTED
    out.metadata = {k: v for k, v in dict(getattr(base, "metadata", None) or {}).items() if k != POLAR_METADATA_KEY}
    out.metadata[POLAR_METADATA_KEY] = {"aborted": reason}
    return out


class SlimeRollout:
    """Runs Polar sessions for slime prompt samples through one started ``PolarEnv``.

    ``env`` is anything with PolarEnv's ``rollout(task, n=..., group_id=...)`` coroutine, async
    context and ``cluster.server.cancel(group_id)``; ``generate`` starts it on first use (under a
    lock: slime calls concurrently). ``aborted`` reads slime's abort flag (polled every
    ``poll_s`` while a session runs)."""

    def __init__(self, env: Any, *, aborted: Callable[[], bool] | None = None, poll_s: float = 0.2) -> None:
        self.env = env
        self.aborted = aborted or slime_abort_flag()
        self.poll_s = poll_s
        self.generate_errors = 0  # exceptions turned into placeholders (each one logged)
        self._lazy = LazyEnv(env)

    async def _ensure_started(self) -> None:
        await self._lazy.start()

    async def close(self) -> None:
        await self._lazy.close()

    async def _run(self, sample: Any, sampling: Mapping[str, Any]) -> tuple[Any, bool]:
        """The session's RolloutGroup (sampled with ``sampling``), and whether slime aborted while it
        ran (then the session was cancelled: the node aborts its engine calls and ends it CANCELLED)."""
        group_id = f"slime-{sample.index}-{uuid.uuid4().hex[:8]}"
        run = asyncio.ensure_future(self.env.rollout(task_row(sample), n=1, metadata=slime_ids(sample),
                                                     group_id=group_id, sampling=sampling))
        aborted = False
        try:
            while not run.done():
                await asyncio.wait({run}, timeout=self.poll_s)
                if not run.done() and self.aborted():
                    aborted = True
                    await self.env.cluster.server.cancel(group_id)
                    break
            return await run, aborted or self.aborted()
        finally:
            if not run.done():
                run.cancel()

    async def generate(self, args: Any, sample: Any, sampling_params: Mapping[str, Any], evaluation: bool = False) -> Any:
        check_slime_args(args)
        sampling = forced_sampling(sampling_params)  # ConfigError for what the gateway cannot force
        check = getattr(getattr(self.env, "config", None), "check_sampling", None)  # PolarEnvConfig's
        if callable(check):  # a contradiction fails the run, not one masked sample
            check(Sampling.model_validate(sampling), f"slime-{sample.index}")
        single = bool(getattr(args, "partial_rollout", False)) and not evaluation
        await self._ensure_started()
        max_context = getattr(args, "rollout_max_context_len", None)
        try:
            group, aborted = await self._run(sample, sampling)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - a failed session must not kill slime's rollout
            # never silent: a bug here would otherwise look like a run of masked samples
            self.generate_errors += 1
            log.exception("polar generate failed for slime sample %s; it becomes a masked placeholder", sample.index)
            failed = failure_sample(sample, f"{type(exc).__name__}: {exc}")
            failed.metadata[POLAR_METADATA_KEY][GENERATE_ERROR_KEY] = repr(exc)
            return failed if single else [failed]
        result = group.results[0] if group.results else None
        if result is None:
            failed = failure_sample(sample, "PolarEnv returned no session")
            return failed if single else [failed]
        status = str(result.status)
        kind = FailureKind(result.failure_kind) if result.failure_kind else None
        if aborted or kind in RERUN_KINDS:
            reason = "slime aborted the rollout" if aborted else f"session {kind}"
            return reset_for_rerun(sample, reason) if single else [failure_sample(sample, reason, aborted=True, kind=kind)]
        # The session's mask is the rule (polar_env.records.masked): an environment failure (INIT,
        # engine, evaluator, build, a lost node) or nothing sampled trains nothing; an agent timeout,
        # a harness error or a limit hit is the policy's doing and keeps its tokens and reward.
        trajectory = result.trajectory
        failure = f"{kind or 'no tokens'}: {result.failure_detail or 'session produced no sampled tokens'}" if result.mask else None
        delivery = choose_delivered(trajectory)
        if single and failure is None and delivery.index is not None:
            trajectory = trajectory.model_copy(update={"traces": [trajectory.traces[delivery.index]]})
        samples = (trajectory_to_samples(trajectory, sample, reward=result.reward, max_tokens=max_context)
                   if failure is None else [failure_sample(sample, failure, kind=kind)])
        for s in samples:
            s.metadata[POLAR_METADATA_KEY].update({
                "session_status": status, "failure_kind": kind.value if kind is not None else None,
                "evaluation": dict(result.evaluation or {}), "evaluation_mode": evaluation})
            if single:
                s.metadata[POLAR_METADATA_KEY].update({"dropped_traces": delivery.dropped_traces,
                                                       "dropped_tokens": delivery.dropped_tokens})
        return samples[0] if single else samples


_DEFAULT: SlimeRollout | None = None


async def generate(args: Any, sample: Any, sampling_params: dict[str, Any], evaluation: bool = False) -> Any:
    """``--custom-generate-function-path polar_env.integrations.slime.generate``. The first call
    checks the flags, builds the PolarEnv (from ``args.polar_config``) and starts it; every call's
    sampling params are its session's. Returns ``list[Sample]``, or one ``Sample`` under ``--partial-rollout``."""
    global _DEFAULT
    if _DEFAULT is None:
        check_slime_args(args)
        from polar_env.env import PolarEnv

        _DEFAULT = SlimeRollout(PolarEnv(polar_config(args)))
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
