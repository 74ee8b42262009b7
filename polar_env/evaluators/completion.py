"""``session_completion``: reward 1 when the harness exited 0 within its budget, else 0, with the reason.

It judges the harness process only, not the work; use it for smoke runs and as a gate.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from polar_env.evaluators.base import EvalContext, EvalResult


class NoParams(BaseModel):
    """session_completion takes no params: a key given to it is a mistake, refused up front."""

    model_config = ConfigDict(extra="forbid")


class SessionCompletion:
    name = "session_completion"
    params_model = NoParams

    async def evaluate(self, ctx: EvalContext) -> EvalResult:
        if ctx.timed_out:
            reward, reason = 0.0, "harness ran out of its time budget"
        elif ctx.exit_code is None:
            reward, reason = 0.0, "harness exit code unknown (it did not run to an exit)"
        elif ctx.exit_code != 0:
            reward, reason = 0.0, f"harness exited with code {ctx.exit_code}"
        else:
            reward, reason = 1.0, "harness exited 0 within its budget"
        return EvalResult(
            reward=reward, report={"reason": reason, "exit_code": ctx.exit_code, "timed_out": ctx.timed_out}
        )

    def wants_fresh_runtime(self, ctx: EvalContext) -> bool:
        return False
