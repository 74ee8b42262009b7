"""What ``polar-env submit`` sends, and what ``polar-env serve`` fills in: a row's settings win, then
what the submitting user chose (flags, ``--config``), then the server's configured defaults. Submit
never sends its own defaults as if they were chosen: a server started with ``--harness loop`` runs
``loop`` for every row that names no harness (it used to run pi, submit's default, silently).
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from polar_env.env import PolarEnvConfig
    from polar_env.staging.models import TaskRequest

# PolarEnvConfig setting -> where it lands in a TaskRequest
SETTING_PATHS: dict[str, tuple[str, ...]] = {
    "harness": ("agent", "harness"), "api": ("agent", "api"), "agent_env": ("agent", "env"),
    "agent_settings": ("agent", "settings"), "builder": ("builder",), "evaluator": ("evaluator",),
    "continuation": ("continuation",), "timeout_s": ("timeout_s",), "init_timeout_s": ("init_timeout_s",),
    "runtime": ("runtime",),
}
# flag dest -> setting, for the environment options submit shares with rollout
FLAG_SETTINGS = {"harness": "harness", "api": "api", "builder": "builder", "evaluator": "evaluator",
                 "timeout_s": "timeout_s", "runtime": "runtime"}


def chosen_settings(args: argparse.Namespace) -> set[str]:
    """The settings the user gave on the command line or in ``--config``."""
    chosen = {setting for flag, setting in FLAG_SETTINGS.items() if getattr(args, flag, None) is not None}
    if getattr(args, "canonical", False):
        chosen.add("continuation")
    if getattr(args, "config", None):
        from polar_env.env import PolarEnvConfig

        chosen |= PolarEnvConfig.from_yaml(args.config).model_fields_set & set(SETTING_PATHS)
    return chosen


def submission_body(req: TaskRequest, row: Any, chosen: set[str]) -> dict[str, Any]:
    """``req`` as JSON without the settings that came only from submit's defaults. A SWE row's
    runtime (its repo or image) and swebench evaluator come from the row itself and are kept."""
    body = req.model_dump(mode="json")
    keys = set(row) if isinstance(row, Mapping) else set()
    swe = "instance_id" in keys
    own_agent = row.get("agent") if isinstance(row, Mapping) and isinstance(row.get("agent"), Mapping) else None
    for setting, path in SETTING_PATHS.items():
        top = path[0]
        if top == "agent" and own_agent is not None:  # only the keys the row's agent spec names
            if path[1] in own_agent or setting in chosen:
                continue
        elif setting in chosen or top in keys or (swe and top in ("runtime", "evaluator")):
            continue
        if len(path) == 2:
            body[top].pop(path[1], None)
        else:
            body.pop(top, None)
    if body.get("agent") == {}:
        del body["agent"]
    return body


def server_defaults(config: PolarEnvConfig) -> dict[str, Any]:
    """The TaskRequest fields ``polar-env serve`` fills in for a submitted row that lacks them."""
    defaults: dict[str, Any] = {
        "agent": {"harness": config.harness, "api": config.api, "env": config.agent_env,
                  "settings": config.agent_settings},
        "builder": config.builder, "continuation": config.continuation, "timeout_s": config.timeout_s,
        "init_timeout_s": config.init_timeout_s, "runtime": config.runtime.model_dump(mode="json"),
    }
    if config.evaluator is not None:
        defaults["evaluator"] = config.evaluator.model_dump(mode="json")
    return defaults


def with_defaults(body: Any, defaults: Mapping[str, Any] | None) -> Any:
    """``body`` (a submitted TaskRequest as JSON) with the server's defaults under it; the agent
    spec merges key by key, so a row that sets only ``agent.settings`` keeps the server's harness."""
    if not defaults or not isinstance(body, dict):
        return body
    merged = {**defaults, **body}
    if isinstance(body.get("agent"), dict) and isinstance(defaults.get("agent"), dict):
        merged["agent"] = {**defaults["agent"], **body["agent"]}
    return merged
