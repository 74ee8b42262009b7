"""Teacher-forced fidelity check: recompute each trace's logprobs with the model that sampled it.

One forward pass over prompt + merged response per trace; on every loss-mask-1 token the
recomputed logprob (at the trace's sampling temperature) is compared with the captured one. A
merged trace that is exactly a context the model saw reproduces its logprobs to float precision;
drift shows up as large deltas right after the boundary where it happened.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from polar_env.engines.embedded.model import teacher_forced_logprobs
from polar_env.records import Trace, Trajectory


def scoring_temperature(trace: Trace) -> float:
    """The temperature a recomputation must divide logits by to reproduce the captured logprobs:
    the sampling temperature for ``processed`` logprobs (greedy reports the temperature-1
    distribution), 1 for ``raw`` ones (log-softmax of the unscaled logits)."""
    temperature = trace.metadata.get("temperature")
    if trace.metadata.get("logprobs_mode") == "raw" or temperature is None or temperature <= 0:
        return 1.0
    return float(temperature)


@dataclass(slots=True)
class FidelityReport:
    traces: int = 0
    tokens_checked: int = 0
    max_abs_delta: float = 0.0
    mean_abs_delta: float = 0.0
    worst: list[dict[str, float | int]] = field(default_factory=list)  # largest deltas, with positions

    def line(self) -> str:
        return (f"{self.traces} traces, {self.tokens_checked} sampled tokens: "
                f"max |Δlogprob| {self.max_abs_delta:.3g}, mean {self.mean_abs_delta:.3g}")


def verify(trajectories: Sequence[Trajectory], model: torch.nn.Module, *, top: int = 5) -> FidelityReport:
    report = FidelityReport()
    total = 0.0
    deltas: list[dict[str, float | int]] = []
    for t_index, traj in enumerate(trajectories):
        for tr_index, trace in enumerate(traj.traces):
            if not trace.response_ids:
                continue
            recomputed = teacher_forced_logprobs(model, trace.prompt_ids, trace.response_ids, scoring_temperature(trace))
            report.traces += 1
            for pos, (mask, captured, mine) in enumerate(zip(trace.loss_mask, trace.response_logprobs, recomputed, strict=True)):
                if not mask:
                    continue
                delta = abs(captured - mine)
                total += delta
                report.tokens_checked += 1
                report.max_abs_delta = max(report.max_abs_delta, delta)
                deltas.append({"trajectory": t_index, "trace": tr_index, "position": pos, "delta": delta})
    report.mean_abs_delta = total / report.tokens_checked if report.tokens_checked else 0.0
    report.worst = sorted(deltas, key=lambda d: -d["delta"])[:top]
    return report
