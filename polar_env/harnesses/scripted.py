"""Scripted-engine policies that fit a harness (for checks, demos and end-to-end tests).

Most harnesses end a run when the model answers without a tool call. Some never do:
mini-swe-agent treats a reply without a tool call as a format error and finishes only when a command
prints ``COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT`` (its ``finish_command``). :func:`policy_for` wraps a
:class:`ScriptedPolicy` so that, for such a harness, every text answer also calls the shell tool with
the finish command; for every other harness the policy is returned unchanged.
"""

from __future__ import annotations

import json

from polar_env.engines.embedded.policy import FinishingPolicy, ScriptedPolicy
from polar_env.harnesses.spec import ClientSpec, HarnessSpec


def policy_for(harness: HarnessSpec | ClientSpec, policy: ScriptedPolicy | None = None) -> ScriptedPolicy:
    """``policy`` (default: the stock echo-hi script) adapted to how ``harness`` ends a run."""
    base = policy if policy is not None else ScriptedPolicy()
    if harness.finish_command is None:
        return base
    return FinishingPolicy(steps=base.steps, shell_tools=base.shell_tools, command_params=base.command_params,
                           finish_command=harness.finish_command)


def is_finish_call(arguments: str, finish_command: str | None) -> bool:
    """Whether a tool call's JSON arguments run exactly the harness's finish command."""
    if finish_command is None:
        return False
    try:
        args = json.loads(arguments)
    except ValueError:
        return False
    if not isinstance(args, dict):
        return False
    return any(v == finish_command or v == ["bash", "-lc", finish_command] for v in args.values())
