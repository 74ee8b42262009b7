"""The step-0 check: before a batch updates the weights, the trainer's own logprobs must equal the
logprobs the engine reported when it sampled, on every mask-1 token.

While trainer and engine hold the same weights, any difference means the data is wrong, not the
model: a loss mask shifted by one, a template or tool token dropped between turns, logprobs that no
longer line up with their tokens, or a temperature / logprobs-mode mismatch. Those poison training
silently, so the check raises and names the first offending trace and position.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from polar_env.errors import PolarError
from polar_env.records import Trace
from polar_env.trajectory.fidelity import scoring_temperature

STEP0_TOLERANCE = 1e-4
"""At temperature 1. The trainer's fp32 forward and the engine's KV-cached, batched decode sum in
other orders: their logits differ by float noise (~1e-6 on the tiny model, ~1e-5 on SmolLM2's
30 layers), and a logprob at temperature T divides the logits by T, so a trace sampled below 1 is
held to ``tolerance / T`` (SmolLM2 at 0.4: measured up to 1.6e-4). A misaligned batch is off by
~0.1 and more at any temperature."""


class Step0Mismatch(PolarError):
    """Recomputed and rollout logprobs disagree: the batch's token data is misaligned."""


@dataclass(slots=True)
class Step0Report:
    tokens: int = 0
    max_abs_delta: float = 0.0
    mean_abs_delta: float = 0.0
    deltas: list[float] = field(default_factory=list)  # |Δ| per mask-1 token, for the histogram

    def line(self) -> str:
        return f"step-0 check: {self.tokens} mask-1 tokens, max |Δ| {self.max_abs_delta:.2e}, mean {self.mean_abs_delta:.2e}"


def check_step0(
    traces: Sequence[tuple[str, Trace]],
    recomputed: Sequence[Sequence[float]],
    *,
    tolerance: float = STEP0_TOLERANCE,
) -> Step0Report:
    """Compare ``recomputed[i]`` with ``traces[i][1].response_logprobs`` on mask-1 tokens, to
    ``tolerance`` divided by the trace's scoring temperature when that is below 1.

    ``traces`` pairs each trace with the label the error names it by (``session/trace-index``).
    Raises ``Step0Mismatch`` naming the first trace and response position over ``tolerance``,
    with how many tokens failed in all."""
    report = Step0Report()
    first: str | None = None
    failed = 0
    for (label, trace), mine in zip(traces, recomputed, strict=True):
        if len(mine) != len(trace.response_ids):
            raise Step0Mismatch(f"trace {label}: {len(mine)} recomputed logprobs for {len(trace.response_ids)} response ids")
        temperature = scoring_temperature(trace)
        allowed = tolerance / temperature if temperature < 1.0 else tolerance
        for pos, (mask, captured, value) in enumerate(zip(trace.loss_mask, trace.response_logprobs, mine, strict=True)):
            if not mask:
                continue
            delta = abs(captured - value)
            report.deltas.append(delta)
            if not delta <= allowed:  # also catches NaN
                failed += 1
                if first is None:
                    first = (f"trace {label} response position {pos} (token id {trace.response_ids[pos]}): "
                             f"rollout logprob {captured:.6f}, recomputed {value:.6f}, |Δ| {delta:.3g} > {allowed:g}"
                             + (f" ({tolerance:g} at temperature {temperature:g})" if allowed != tolerance else ""))
    report.tokens = len(report.deltas)
    report.max_abs_delta = max(report.deltas, default=0.0)
    report.mean_abs_delta = sum(report.deltas) / report.tokens if report.tokens else 0.0
    if first is not None:
        raise Step0Mismatch(
            f"step-0 check failed on {failed} of {report.tokens} mask-1 tokens; first: {first}. The batch's "
            f"token data is misaligned (loss mask, dropped/inserted tokens, logprob order, or sampling temperature)."
        )
    return report
