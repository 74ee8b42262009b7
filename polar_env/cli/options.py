"""The one table of command-line options that set configuration: each flag names the field it sets,
as a path into ``RolloutJob`` (``env.…`` is the ``PolarEnvConfig`` under it) or, for ``gateway``,
into ``GatewayConfig`` (``gateway.…``). ``rollout``, ``eval`` and ``sft`` take the job's and the
environment's flags; ``serve`` and ``submit`` the ``env.…`` ones; the servers ``engine`` and
``gateway`` the engine's and sampling's (``Flag.servers``), and ``gateway`` its own. The table is
the only place a flag meets the config: the parser is generated from it (type, default in ``--help``
and choices read from the models and the registries), ``env_config``/``job_values``/``settings``
apply it, ``submit`` reads from it what the user chose, and ``tests/test_cli_options.py`` and
``tests/test_cli_defaults.py`` check it against the models (every field has a flag or is in
``NOT_EXPOSED`` with a reason; every flag's default is its field's).

The engine kind has one inference rule, ``engine_kind``, shared with ``polar-env gateway``.
"""

from __future__ import annotations

import argparse
import json
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from pydantic import BaseModel
from pydantic.fields import FieldInfo

from polar_env.errors import ConfigError

if TYPE_CHECKING:
    from pydantic import ValidationError

    from polar_env.staging.config import PolarEnvConfig
    from polar_env.staging.job import RolloutJob


M = TypeVar("M")


@dataclass(frozen=True)
class Flag:
    """One option: ``--name`` sets the field at ``path``. ``const``: a switch setting that value;
    ``shown``: the default as ``--help`` words it where the model's own is None or depends on
    something else; ``choices``: the registry (or template table) its names come from."""

    name: str
    path: str
    help: str
    shown: str | None = None
    choices: str | None = None
    const: Any = None
    repeat: bool = False
    commands: tuple[str, ...] = ()  # only these commands (default: every command of its kind)
    servers: tuple[str, ...] = ()  # the server commands (engine, gateway) that take it too
    aliases: tuple[str, ...] = ()  # older names that still work (documented in docs/configuration.md)

    @property
    def dest(self) -> str:
        return self.name.lstrip("-").replace("-", "_")

    @property
    def env(self) -> bool:
        return self.path.startswith("env.")


SERVERS = ("engine", "gateway")  # both run an engine: they take its flags (Flag.servers)
GATEWAY = ("gateway",)  # the gateway only: a served engine's flags, sampling, its own settings


TEMPLATE_HELP = ("the model family's chat format (qwen3.5: what vLLM serving Qwen3.5 renders; append_only: Qwen3.5 "
                 "without its prefix-breaking quirks; qwen3; smollm2; hf:PATH: a model folder's or .gguf's own template; "
                 "auto: read off the served model's own chat template)")
ENGINE_URL_HELP = ("a served engine's base URL (a /v1 suffix is fine); several, comma-separated: a session-sticky "
                   "vLLM pool (SGLang workers with --engine sglang); router:URL: an SGLang router")
ENGINE_KIND_HELP = ("the engine; when not given: sglang for --engine-url router:URL, vllm for any other --engine-url "
                    "(one URL or a comma-separated pool), else the one in --config, else embedded (the CPU engine, "
                    "in-process). simulated: a test double")

FLAGS: tuple[Flag, ...] = (
    # -- the job (RolloutJob): rollout, eval, sft ------------------------------------------------------
    Flag("--tasks", "tasks", "'toy' (the offline toy SWE set), a .jsonl/.json/.parquet file, or a folder of Harbor tasks"),
    Flag("--task-id", "task_ids", "only this task (repeatable)", shown="every task", repeat=True),
    Flag("--limit", "limit", "at most this many tasks", shown="no limit"),
    Flag("--samples", "samples", "sessions per task (the GRPO group size)"),
    Flag("--out", "out", "folder of runs: each run writes OUT/<run id>/ (journals, trajectories, report) and "
         "OUT/latest points at the newest"),
    Flag("--run-id", "run_id", "name of the run folder", shown="UTC time, command and a random tail"),
    Flag("--early-stop", "early_stop_min_usable", "finish a group after this many usable sessions",
         shown="off: every sample runs"),
    Flag("-k", "pass_k", "report pass@k (repeatable)", shown="1", repeat=True, commands=("eval",)),
    Flag("--tracker", "tracker", "also log the figures there (W&B offline by default)", shown="none"),
    # -- the environment (PolarEnvConfig): also serve and submit ------------------------------------
    Flag("--harness", "env.harness", "harness: a preset, a harness file, or 'loop' (the built-in agent loop)",
         choices="harnesses"),
    Flag("--api", "env.api", "wire format the harness speaks", shown="the harness's own", choices="apis"),
    Flag("--engine", "env.engine.kind", ENGINE_KIND_HELP, shown="inferred", choices="engines", servers=GATEWAY),
    Flag("--engine-url", "env.engine.url", ENGINE_URL_HELP, shown="none: the engine runs in-process",
         servers=GATEWAY),
    Flag("--served-model-name", "env.engine.model", "the engine's model name (the gateway, given none, sends the "
         "one model a served engine lists)", shown="polar-tiny-qwen3, or --model-dir's file or folder name",
         servers=SERVERS),
    Flag("--template", "env.engine.template", TEMPLATE_HELP, choices="templates", shown="qwen3.5; auto with --model-dir",
         servers=SERVERS),
    Flag("--logprobs-mode", "env.engine.logprobs_mode", "embedded/vllm: logprobs of the sampled distribution "
         "(processed) or of the raw logits", servers=SERVERS),
    Flag("--model-dir", "env.engine.model_dir", "embedded: a HF model folder or a .gguf file",
         shown="the hf:/smollm2 template's own model, else seeded random tiny weights", servers=SERVERS),
    Flag("--seed", "env.engine.seed", "embedded/simulated: seed of the random weights", servers=SERVERS),
    Flag("--engine-script", "env.engine.script", "embedded/simulated: scripted policy JSON forcing the tokens "
         "(a test double)", shown="none", servers=SERVERS, aliases=("--script",)),
    Flag("--max-tokens", "env.sampling.max_tokens", "cap on the tokens sampled per call, any engine",
         shown="none; embedded 256, scripted 4096", servers=SERVERS),
    Flag("--temperature", "env.sampling.temperature", "trainer-owned temperature (overrides harnesses)",
         shown="the harness's own", servers=GATEWAY),
    Flag("--top-p", "env.sampling.top_p", "trainer-owned top_p (overrides harnesses)", shown="the harness's own",
         servers=GATEWAY),
    Flag("--runtime", "env.runtime.kind", "the sandbox each session runs in", choices="runtimes"),
    Flag("--pull", "env.runtime.pull", "docker: pull a missing image at prepare, once per image (else preflight "
         "lists the missing ones with their docker pull)", const=True, shown="off"),
    Flag("--allow-unbounded", "env.runtime.allow_unbounded", "apptainer as a non-root user on a host that delegates "
         "no cgroup: run with memory and pids unbounded (the limits report says so) instead of refusing",
         const=True, shown="off: refused"),
    Flag("--builder", "env.builder", "trajectory builder", choices="builders"),
    Flag("--evaluator", "env.evaluator", "evaluator name or JSON spec, e.g. '{\"name\": \"output\", \"regex\": \"ok\"}'",
         shown="swebench for SWE tasks, none otherwise", choices="evaluators"),
    Flag("--canonical", "env.continuation", "canonical templating instead of token-in continuation", const=False,
         shown="token-in continuation"),
    Flag("--timeout-s", "env.timeout_s", "agent budget per session in seconds"),
    Flag("--init-timeout-s", "env.init_timeout_s", "budget in seconds to prepare a session's runtime (INIT)"),
    Flag("--nodes", "env.nodes", "gateway nodes"),
    Flag("--ray", "env.ray", "run nodes as Ray actors (ray.init() locally)", const=True, shown="off"),
    Flag("--ray-address", "env.ray_address", "join an existing Ray cluster (implies --ray)", shown="none"),
    Flag("--ray-node-resource", "env.ray_node_resource", "Ray nodes: each takes one unit of this custom resource "
         "(ray start --resources '{\"NAME\": K}' on the hosts that may run them)", shown="none: anywhere"),
    Flag("--ray-wait-s", "env.ray_wait_s", "Ray nodes: how long the hosts may take to offer --ray-node-resource "
         "(a progress line per poll) before the run is refused"),
    Flag("--shared-store", "env.shared_store", "Ray nodes: every host mounts the run folder at the same path "
         "(refused at start when one does not)", const=True,
         shown="per node: the head pulls the journals of nodes that do not see it"),
    Flag("--max-running", "env.limits.max_running", "RUNNING slots per node (match the engine's capacity)"),
    Flag("--max-init", "env.limits.max_init", "INIT workers per node"),
    Flag("--max-postrun", "env.limits.max_postrun", "POSTRUN workers per node"),
    Flag("--ready-buffer", "env.limits.ready_buffer", "prepared runtimes per node (INIT + READY)",
         shown="--max-running + --max-init"),
    # -- the gateway (GatewayConfig): gateway only ----------------------------------------------------
    Flag("--public-url", "gateway.public_url", "base URL handed to harnesses", shown="the request's Host",
         commands=GATEWAY, servers=GATEWAY),
    Flag("--admin-token", "gateway.admin_token", "bearer token for /sessions and /admin/*",
         shown="read or create <store>/admin_token, mode 0600", commands=GATEWAY, servers=GATEWAY),
    Flag("--engine-timeout", "gateway.engine_timeout_s", "seconds one engine call may take before the harness "
         "gets a 504", commands=GATEWAY, servers=GATEWAY),
    Flag("--continuation", "gateway.continuation", "token-in continuation mode for every session (append-only "
         "prompts)", const=True, shown="off", commands=GATEWAY, servers=GATEWAY),
)

# Fields no flag sets, each with the reason; tests/test_cli_options.py fails on a field in neither.
NOT_EXPOSED: dict[str, str] = {
    "mode": "the command: eval runs mode eval, rollout and sft mode rollout",
    "env.store": "each command places it: OUT/<run id>/capture (rollout), STORE/capture (serve)",
    "env.harness_cache": "a host folder of harness installs shared by runs: --config (harness_cache: DIR)",
    "env.agent_settings": "a mapping of harness settings: --config (agent_settings: {...}) or a task row's agent",
    "env.agent_env": "a mapping of environment variables: --config (agent_env: {...}) or a task row's agent",
    "env.engine.script_finish_command": "derived from the harness (mini-swe-agent ends by a command)",
    "env.engine.latency_s": "the simulated engine's test knob: --config (engine: {kind: simulated, latency_s: ...})",
    "env.engine.jitter": "the simulated engine's test knob: --config (engine: {kind: simulated, jitter: ...})",
    "env.runtime": "the sandbox's settings besides --runtime (image, limits, binds, network, user): --config "
                   "(runtime: {...}); a SWE or Harbor task brings its own image and workdir",
    "gateway.engine_model": "the engine's: --served-model-name, or the one model a served engine lists",
    "gateway.sampling": "--temperature, --top-p, --max-tokens (env.sampling's flags: the same Sampling model)",
    "gateway.template": "the engine's: --template (auto resolved before the gateway starts)",
    "gateway.max_body_bytes": "32 MiB, far above what harnesses send (a 100k-token history is 1-2 MB)",
    "gateway.metrics_token": "the gateway command's /metrics is read with the admin token",
    "gateway.session_idle_s": "a served gateway's sessions are closed by whoever opened them (or after a day)",
    "gateway.drain_s": "how long a stopping gateway waits for in-flight captures: the default fits every engine call",
}

# Options of these commands that set no config field (what the command does, not what it runs with).
COMMAND_OPTIONS: dict[str, str] = {
    "--config": "the YAML file the flags apply on top of",
    "--resume": "continue a run folder under its plan",
    "--no-progress": "display only",
    "--min-reward": "sft's export filter, applied after the run",
    "--host": "where the server listens", "--port": "where the server listens",
    "--log-level": "the servers' stderr log (engine, gateway)",
    "--store": "serve's folder (its capture store is STORE/capture); gateway's journal folder",
    "--fsync": "gateway: how its journal writes, not what it serves",
    "--unix-socket": "gateway: a second listener, for sandboxes", "--engine-wait-s": "gateway: start-up patience",
    "--scripted": "engine, gateway: the built-in tool-then-answer script (a demo double; --engine-script: a file)",
    "--script-command": "--scripted's command", "--script-answer": "--scripted's answer",
    "--token": "the task API's bearer token",
    "--local": "serve: nodes in this process (else Ray actors, env.ray)",
    "--samples": "submit: sessions per submitted task (its TaskRequest's num_samples; the job's --samples is a flag)",
    "--wait": "submit: poll until done", "--server": "the task API's URL", "--token-file": "where the token is",
}


# -- the models behind the paths -----------------------------------------------------------------


def _root() -> type[BaseModel]:
    from polar_env.staging.job import RolloutJob

    return RolloutJob


def _gateway_root() -> type[BaseModel]:
    from polar_env.proxy.config import GatewayConfig

    return GatewayConfig


def _models(annotation: Any) -> list[type[BaseModel]]:
    """The pydantic models an annotation stands for (the engine union: every ENGINES member)."""
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) is typing.Annotated:
        return _models(args[0])
    if args and (typing.get_origin(annotation) in (typing.Union, types.UnionType)):
        return [m for a in args for m in _models(a)]
    return [annotation] if isinstance(annotation, type) and issubclass(annotation, BaseModel) else []


def fields_at(path: str) -> list[FieldInfo]:
    """The fields a dotted path names, one per union member that has it, in the union's order (the
    engine's: embedded, the default, first)."""
    parts = path.split(".")
    current: list[type[BaseModel]] = [_root()]
    if parts[0] == "gateway":
        current, parts = [_gateway_root()], parts[1:]
    found: list[FieldInfo] = []
    for part in parts:
        found = [m.model_fields[part] for m in current if part in m.model_fields]
        current = [m for f in found for m in _models(f.annotation)]
    return found


def leaf_paths(model: type[BaseModel] | None = None, prefix: str = "") -> list[str]:
    """Every field under ``model`` (default: RolloutJob) as a dotted path, down to the values one
    flag sets; the members of a union (the engine kinds) share one path per field name."""
    out: list[str] = []
    for name, field in (model or _root()).model_fields.items():
        path = prefix + name
        subs = _models(field.annotation)
        if subs and not _is_leaf_model(subs):
            out += [leaf for sub in subs for leaf in leaf_paths(sub, path + ".") if leaf not in out]
        elif path not in out:
            out.append(path)
    return out


def _is_leaf_model(models: list[type[BaseModel]]) -> bool:
    """Models set as one value from the command line (an evaluator spec: a name or JSON)."""
    from polar_env.evaluators.base import EvaluatorSpec

    return models == [EvaluatorSpec]


def _value_type(flag: Flag) -> Callable[[str], Any] | None:
    """argparse's ``type`` for a flag: int or float when its field is one, else the text."""
    fields = fields_at(flag.path)
    annotation = fields[0].annotation if fields else str
    args = set(typing.get_args(annotation)) or {annotation}
    if flag.repeat and typing.get_origin(annotation) is list:
        args = {a for inner in typing.get_args(annotation) for a in (typing.get_args(inner) or (inner,))}
    return int if int in args else float if float in args else None


def literal_values(path: str) -> list[str]:
    """The values of a ``Literal[...]`` field (``| None`` aside), argparse ``choices``; empty for any other field."""
    fields = fields_at(path)
    args = typing.get_args(fields[0].annotation) if fields else ()
    literals = [a for a in args if typing.get_origin(a) is typing.Literal]
    if fields and typing.get_origin(fields[0].annotation) is typing.Literal:
        literals = [fields[0].annotation]
    return [str(v) for lit in literals for v in typing.get_args(lit)]


def model_default(path: str) -> object:
    fields = fields_at(path)
    return fields[0].get_default(call_default_factory=True) if fields else None


def choices(name: str) -> list[str]:
    """The names a flag's ``choices`` stands for, from its registry (or table) now."""
    if name == "engines":
        from polar_env.engines.config import ENGINES

        return ENGINES.names()
    if name == "runtimes":
        from polar_env.runtimes import RUNTIMES

        return RUNTIMES.names()
    if name == "builders":
        from polar_env.trajectory.builders import BUILDERS

        return BUILDERS.names()
    if name == "evaluators":
        from polar_env.evaluators import EVALUATORS

        return EVALUATORS.names()
    if name == "harnesses":
        from polar_env.harnesses import HARNESSES, LOOP

        return [*HARNESSES.names(), LOOP]
    if name == "apis":
        from polar_env.proxy.providers import PROVIDERS

        return PROVIDERS.names()
    if name == "templates":
        from polar_env.chat import TEMPLATES

        return list(TEMPLATES)
    raise KeyError(name)


def metavar(names: list[str]) -> str:
    """``{a,b,c}``: names listed as a metavar, not argparse ``choices``, so a typo gets the
    registry's one line with the closest name (and import paths, harness files still parse)."""
    return "{" + ",".join(names) + "}"


def help_text(flag: Flag, default: object = None) -> str:
    """The flag's help with its default: ``shown`` when given, else the model's (or ``default``)."""
    if flag.shown is not None:
        shown = flag.shown
    else:
        value = default if default is not None else model_default(flag.path)
        shown = "none" if value is None else str(value)
    return f"{flag.help} (default: {shown})"


def add_flags(p: argparse.ArgumentParser | argparse._ArgumentGroup, flags: tuple[Flag, ...],
              defaults: dict[str, Any] | None = None) -> None:
    """Add ``flags`` to ``p``; ``defaults``: a command's own default for a path (sft's samples)."""
    for flag in flags:
        kwargs: dict[str, Any] = {"help": help_text(flag, (defaults or {}).get(flag.path)), "dest": flag.dest}
        if flag.const is not None:
            kwargs["action"] = "store_true"
        else:
            kwargs["type"] = _value_type(flag)
            if flag.repeat:
                kwargs["action"] = "append"
            if flag.choices is not None:
                kwargs["metavar"] = metavar(choices(flag.choices))
            elif literal := literal_values(flag.path):
                kwargs["choices"] = literal  # a closed set in the model itself (tracker, logprobs mode)
        p.add_argument(flag.name, *flag.aliases, **kwargs)


def numeric_paths(command: str) -> dict[str, str]:
    """dest -> path of ``command``'s numeric flags, for ``checks.check_numbers`` (their bounds are
    the models': a server checks them before it starts anything)."""
    return {f.dest: f.path for f in flags_for(command) if f.const is None and _value_type(f) is not None}


def flags_for(command: str, *, env_only: bool = False) -> tuple[Flag, ...]:
    if command in SERVERS:
        return tuple(f for f in FLAGS if command in f.servers)
    return tuple(f for f in FLAGS if (f.env or not env_only) and (not f.commands or command in f.commands))


def given(args: argparse.Namespace, flags: tuple[Flag, ...] = FLAGS) -> dict[str, Any]:
    """The values the user gave on the command line, by path (a switch: its ``const``)."""
    out: dict[str, Any] = {}
    for flag in flags:
        value = getattr(args, flag.dest, None)
        if flag.const is not None:
            if value:
                out[flag.path] = flag.const
        elif value is not None:
            out[flag.path] = evaluator_option(value) if flag.path == "env.evaluator" else value
    return out


def evaluator_option(text: str) -> str | dict[str, object]:
    """``--evaluator NAME`` or ``--evaluator '{"name": ..., ...}'`` as data for PolarEnvConfig (which
    resolves the name and params); JSON that does not parse names the option."""
    text = text.strip()
    if not text.startswith("{"):
        return text
    try:
        spec = json.loads(text)
    except ValueError as exc:
        raise ConfigError(f"--evaluator {text!r} is not JSON ({exc}); give a name, e.g. --evaluator output, "
                          """or JSON, e.g. --evaluator '{"name": "output", "regex": "ok"}'""") from None
    assert isinstance(spec, dict)  # valid JSON that starts with "{" is an object
    return spec


# -- the engine kind ------------------------------------------------------------------------------


def engine_kind(kind: str | None, url: str | None, base: str | None = None) -> str:
    """The one rule, for every command: ``--engine`` when given; else with ``--engine-url``, sglang
    for ``router:URL`` (only SGLang has a router), the base's kind (``--config``'s) when it takes a
    URL, else vllm, for one URL and for a comma-separated list (a vLLM pool) alike; else the base's
    kind, else embedded."""
    from polar_env.engines.config import DEFAULT_KIND, ENGINES

    if kind:
        return kind
    if url:
        if url.strip().startswith("router:"):
            return "sglang"
        if base is not None and base in ENGINES and "url" in ENGINES.get(base).model_fields:
            return base
        return "vllm"
    return base or DEFAULT_KIND


# -- applying the table ---------------------------------------------------------------------------


def env_config(args: argparse.Namespace) -> PolarEnvConfig:
    """PolarEnvConfig from ``--config`` (YAML) with the flags given on top. Every name is resolved
    here, before anything starts; a mistake is one line, ``<field>: <problem>``. The settings
    ``--config`` or a flag gave are the result's ``model_fields_set`` (what ``submit`` sends)."""
    from pydantic import ValidationError

    from polar_env.registry import validation_line
    from polar_env.staging.config import PolarEnvConfig

    try:
        return PolarEnvConfig.model_validate(_env_data(args))
    except ValidationError as exc:  # a bound a flag's value broke names the flag: "nodes: ... (given as --nodes)"
        flag = _flag_of(exc, args)
        given_as = f" (given as {flag.name})" if flag is not None else ""
        raise ConfigError(validation_line(exc, model=PolarEnvConfig) + given_as) from None


def _flag_of(exc: ValidationError, args: argparse.Namespace, prefix: str = "env.") -> Flag | None:
    """The flag that gave the value of the first problem (None: ``--config``'s, or a default);
    ``prefix``: where the validated model sits in the table's paths."""
    from polar_env.engines.config import ENGINES

    loc = [str(p) for p in exc.errors(include_url=False)[0]["loc"]]
    if len(loc) > 2 and loc[0] == "engine" and loc[1] in ENGINES:
        del loc[1]  # the union's tag
    if prefix == "env.engine." and len(loc) > 1 and loc[0] in ENGINES:
        del loc[0]  # the engine union validated on its own
    path = prefix + ".".join(loc)
    for flag in FLAGS:
        if (path == flag.path or path.startswith(flag.path + ".")) and given(args, (flag,)):
            return flag
    return None


def settings(args: argparse.Namespace, command: str, prefix: str, validate: Callable[[dict[str, object]], M],
             fixed: Mapping[str, object] | None = None) -> M:
    """What a server command's flags under ``prefix`` (``env.engine.``, ``env.sampling.``,
    ``gateway.``) stand for, with ``fixed`` (what the command derived) on top, through ``validate``
    (the model's): unset flags leave the model's defaults; a mistake is one line naming its flag."""
    from pydantic import ValidationError

    from polar_env.registry import validation_line

    values: dict[str, object] = {path.removeprefix(prefix): v for path, v in given(args, flags_for(command)).items()
                                 if path.startswith(prefix)}
    try:
        return validate({**values, **(fixed or {})})
    except ValidationError as exc:
        flag = _flag_of(exc, args, prefix)
        given_as = f" (given as {flag.name})" if flag is not None else ""
        raise ConfigError(validation_line(exc, prefix.rstrip(".").rsplit(".", 1)[-1]) + given_as) from None


def _env_data(args: argparse.Namespace) -> dict[str, Any]:
    from polar_env.engines.config import ENGINES
    from polar_env.staging.config import PolarEnvConfig

    config = PolarEnvConfig.from_yaml(args.config) if getattr(args, "config", None) else PolarEnvConfig()
    data = config.model_dump(exclude_unset=True)
    values = {path.removeprefix("env."): v for path, v in given(args, tuple(f for f in FLAGS if f.env)).items()}
    kind = engine_kind(values.pop("engine.kind", None), values.get("engine.url"), config.engine.kind)
    engine = config.engine.model_dump(exclude_unset=True)
    if kind != config.engine.kind and kind in ENGINES:  # another backend: keep what it also has (model, template)
        engine = {k: v for k, v in engine.items() if k in ENGINES.get(kind).model_fields}
    data["engine"] = {**engine, "kind": kind}
    if {"limits.max_running", "limits.max_init"} & set(values) and "limits.ready_buffer" not in values:
        data.get("limits", {}).pop("ready_buffer", None)  # derived from the old limits: derive it again
    for path, value in values.items():
        *parents, leaf = path.split(".")
        node = data
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    if values.get("ray_address"):
        data["ray"] = True  # --ray-address implies --ray
    return data


def job_values(args: argparse.Namespace) -> dict[str, Any]:
    """The RolloutJob fields (not ``env``) the user gave on the command line."""
    values = given(args, tuple(f for f in FLAGS if not f.env))
    if "pass_k" in values:
        values["pass_k"] = sorted(set(values["pass_k"]))
    return values


def job_from_args(args: argparse.Namespace) -> RolloutJob:
    """The RolloutJob a ``rollout``/``eval``/``sft`` command line stands for."""
    from polar_env.staging.job import RolloutJob

    return RolloutJob.model_validate({"samples": args.default_samples, **job_values(args), "env": env_config(args),
                                      "mode": "eval" if args.command == "eval" else "rollout"})


def chosen_settings(config: PolarEnvConfig) -> set[str]:
    """The per-task settings (``submission.TASK_SETTINGS``) that ``--config`` or a flag gave: what
    ``submit`` sends, so the server's own defaults fill in the rest."""
    from polar_env.staging.submission import TASK_SETTINGS

    return config.model_fields_set & set(TASK_SETTINGS)
