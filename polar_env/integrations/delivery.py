"""Which trace a one-chain consumer gets, and how much of the session that leaves out.

NeMo Gym / NeMo RL take one token chain per rollout (as does slime with ``--partial-rollout``,
where polar returns one Sample per session). A Polar session can yield several traces: a
sub-agent or a side request (opencode's title generator) is its own chain, a compaction starts a
new one, a harness that rewrites history forks one. The rule, the same everywhere:

    deliver the trainable trace (``Trace.trainable``: a chain the harness continued) with the
    most loss-mask-1 tokens; on a tie, the earliest (lowest index: traces are ordered by their
    first call, so the chain that started first). A chain not trained with the task's reward (a
    side request, a call whose client went away) is never delivered; its tokens are counted apart.

It depends only on the trajectory, so a rerun of the build delivers the same trace. Everything
else is dropped, and the drop is counted, never silent: per rollout (``Delivery``: traces and
trainable tokens delivered and dropped) and per run (``DeliveryTally``).
"""

from __future__ import annotations

from dataclasses import dataclass

from polar_env.records import Trajectory


@dataclass(frozen=True, slots=True)
class Delivery:
    """One rollout's delivery: the chosen trace (None when nothing was sampled) and what the
    other traces held."""

    index: int | None
    traces: int
    trainable_tokens: int
    delivered_tokens: int
    untrained_tokens: int = 0  # mask-1 tokens of traces that are not trainable for the task's reward

    @property
    def dropped_traces(self) -> int:
        return self.traces - (self.index is not None)

    @property
    def dropped_tokens(self) -> int:
        return self.trainable_tokens - self.delivered_tokens

    @property
    def dropped_token_share(self) -> float:
        return self.dropped_tokens / self.trainable_tokens if self.trainable_tokens else 0.0

    def fields(self) -> dict[str, float | int]:
        """Flat numeric fields (Gym's aggregate metrics average top-level numbers per run)."""
        return {"polar_traces": self.traces, "polar_dropped_traces": self.dropped_traces,
                "polar_trainable_tokens": self.trainable_tokens, "polar_dropped_tokens": self.dropped_tokens,
                "polar_dropped_token_share": self.dropped_token_share, "polar_untrained_tokens": self.untrained_tokens}


def choose_delivered(trajectory: Trajectory | None) -> Delivery:
    """The delivered trace of ``trajectory`` under the rule above."""
    if trajectory is None:
        return Delivery(None, 0, 0, 0)
    counts = [sum(t.loss_mask) if t.trainable else 0 for t in trajectory.traces]
    untrained = sum(sum(t.loss_mask) for t in trajectory.traces if not t.trainable)
    best: int | None = None
    for i, n in enumerate(counts):
        if n > 0 and (best is None or n > counts[best]):
            best = i
    return Delivery(best, len(counts), sum(counts), counts[best] if best is not None else 0, untrained)


@dataclass
class DeliveryTally:
    """Running totals over a run's rollouts."""

    rollouts: int = 0
    rollouts_with_drops: int = 0
    traces: int = 0
    dropped_traces: int = 0
    trainable_tokens: int = 0
    dropped_tokens: int = 0
    untrained_tokens: int = 0

    def add(self, d: Delivery) -> None:
        self.rollouts += 1
        self.rollouts_with_drops += d.dropped_traces > 0
        self.traces += d.traces
        self.dropped_traces += d.dropped_traces
        self.trainable_tokens += d.trainable_tokens
        self.dropped_tokens += d.dropped_tokens
        self.untrained_tokens += d.untrained_tokens

    def report(self) -> dict[str, float | int]:
        share = self.dropped_tokens / self.trainable_tokens if self.trainable_tokens else 0.0
        return {"rollouts": self.rollouts, "rollouts_with_drops": self.rollouts_with_drops, "traces": self.traces,
                "dropped_traces": self.dropped_traces, "trainable_tokens": self.trainable_tokens,
                "dropped_tokens": self.dropped_tokens, "dropped_token_share": share,
                "untrained_tokens": self.untrained_tokens}

    def line(self) -> str:
        r = self.report()
        return (f"delivered one trace per rollout: {r['dropped_traces']} of {r['traces']} traces and "
                f"{r['dropped_tokens']} of {r['trainable_tokens']} trainable tokens dropped "
                f"({float(r['dropped_token_share']):.1%}) over {r['rollouts']} rollouts; "
                f"{r['untrained_tokens']} tokens of side requests and abandoned calls not trainable")
