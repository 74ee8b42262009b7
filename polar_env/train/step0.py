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

STEP0_TOLERANCE = 1e-4  # fp32 forward vs the engine's KV-cached decode differ by ~1e-6


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
    """Compare ``recomputed[i]`` with ``traces[i][1].response_logprobs`` on mask-1 tokens.

    ``traces`` pairs each trace with the label the error names it by (``session/trace-index``).
    Raises ``Step0Mismatch`` naming the first trace and response position over ``tolerance``,
    with how many tokens failed in all."""
    report = Step0Report()
    first: str | None = None
    failed = 0
    for (label, trace), mine in zip(traces, recomputed, strict=True):
        if len(mine) != len(trace.response_ids):
            raise Step0Mismatch(f"trace {label}: {len(mine)} recomputed logprobs for {len(trace.response_ids)} response ids")
        for pos, (mask, captured, value) in enumerate(zip(trace.loss_mask, trace.response_logprobs, mine, strict=True)):
            if not mask:
                continue
            delta = abs(captured - value)
            report.deltas.append(delta)
            if not delta <= tolerance:  # also catches NaN
                failed += 1
                if first is None:
                    first = (f"trace {label} response position {pos} (token id {trace.response_ids[pos]}): "
                             f"rollout logprob {captured:.6f}, recomputed {value:.6f}, |Δ| {delta:.3g} > {tolerance:g}")
    report.tokens = len(report.deltas)
    report.max_abs_delta = max(report.deltas, default=0.0)
    report.mean_abs_delta = sum(report.deltas) / report.tokens if report.tokens else 0.0
    if first is not None:
        raise Step0Mismatch(
            f"step-0 check failed on {failed} of {report.tokens} mask-1 tokens; first: {first}. The batch's "
            f"token data is misaligned (loss mask, dropped/inserted tokens, logprob order, or sampling temperature)."
        )
    return report
