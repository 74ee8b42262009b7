"""What ``polar-env submit`` sends, and what ``polar-env serve`` fills in: a row's settings win, then
what the submitting user chose (flags, ``--config``), then the server's configured defaults. Submit
never sends its own defaults as if they were chosen: a server started with ``--harness loop`` runs
``loop`` for every row that names no harness (it used to run pi, submit's default, silently).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel

if TYPE_CHECKING:
    from polar_env.staging.models import TaskRequest

# The PolarEnvConfig settings a TaskRequest can override per task, and where each lands in it: the
# one table behind ``config.task_request`` (rows the job and submit build), ``submission_body`` (what
# submit leaves out) and ``server_defaults`` (what serve fills in). The CLI's flags name these
# settings through ``polar_env.cli.options.FLAGS``.
TASK_SETTINGS: dict[str, tuple[str, ...]] = {
    "harness": ("agent", "harness"), "api": ("agent", "api"), "agent_env": ("agent", "env"),
    "agent_settings": ("agent", "settings"), "builder": ("builder",), "evaluator": ("evaluator",),
    "continuation": ("continuation",), "timeout_s": ("timeout_s",), "init_timeout_s": ("init_timeout_s",),
    "runtime": ("runtime",),
}


def task_settings(config: BaseModel, *, dump: bool) -> dict[str, Any]:
    """``config``'s per-task settings (``TASK_SETTINGS``) shaped as TaskRequest fields; ``dump``:
    nested models as JSON data (to send), else as they are (to build a TaskRequest from)."""
    out: dict[str, Any] = {}
    for setting, path in TASK_SETTINGS.items():
        value = getattr(config, setting)
        if dump and isinstance(value, BaseModel):
            value = value.model_dump(mode="json")
        node = out
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = value
    return out


def submission_body(req: TaskRequest, row: Any, chosen: set[str]) -> dict[str, Any]:
    """``req`` as JSON without the settings that came only from submit's defaults. A SWE row's
    runtime (its repo or image) and swebench evaluator come from the row itself and are kept."""
    body = req.model_dump(mode="json")
    keys = set(row) if isinstance(row, Mapping) else set()
    swe = "instance_id" in keys
    own_agent = row.get("agent") if isinstance(row, Mapping) and isinstance(row.get("agent"), Mapping) else None
    for setting, path in TASK_SETTINGS.items():
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


def server_defaults(config: BaseModel) -> dict[str, Any]:
    """The TaskRequest fields ``polar-env serve`` fills in for a submitted row that lacks them
    (``config``: the server's PolarEnvConfig)."""
    defaults = task_settings(config, dump=True)
    if defaults["evaluator"] is None:  # none configured: the row's kind decides (swebench for SWE rows)
        del defaults["evaluator"]
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
