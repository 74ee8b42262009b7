"""Preflight: what a pydantic validator cannot see, checked before any session or runtime starts.

``rollout``, ``eval``, ``sft``, ``train`` and ``serve`` call one of the ``check_*`` functions first.
Each problem is one ``ConfigError`` line, ``<what>, <where>; <how to fix>`` (the CLI prefixes
``polar-env <cmd>: error:`` and exits 2), found in seconds instead of after every session has run
through INIT and RUNNING to ERROR. Checked: the engine answers and serves the configured model; each
harness is in the shared cache or its installer (npm, a venv-capable python) and node are present;
each runtime is usable (bwrap can create its namespaces and, as root, its unprivileged uids can reach
the runtime folders; a Docker daemon answers on its socket — never started here —; an apptainer
binary exists); the tasks resolve; evaluator dependencies import.
Names (builders, evaluators, harnesses) are validated where the config is built, not here.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from polar_env.errors import ConfigError, EngineError, EngineHTTPError, EngineProtocolError

if TYPE_CHECKING:
    from polar_env.engines.config import AnyEngineConfig
    from polar_env.env import PolarEnvConfig
    from polar_env.staging.job import RolloutJob
    from polar_env.staging.models import TaskRequest

ENGINE_WAIT_S = 2.0  # an engine still loading gets this long; a wrong URL is reported after it
BWRAP_PROBE_TIMEOUT_S = 5.0
DOCKER_PING_TIMEOUT_S = 2.0
# Python modules an evaluator needs beyond the core install, with the extra that provides them.
EVALUATOR_MODULES: dict[str, tuple[str, str]] = {"swebench": ("swebench", "swebench")}
# RolloutJob / TaskRequest fields and the option that sets them.
JOB_OPTIONS = {"samples": "--samples", "num_samples": "--samples", "limit": "--limit",
               "early_stop_min_usable": "--early-stop", "pass_k": "-k", "tasks": "--tasks", "out": "--out"}


def options_error(exc: ValidationError, options: dict[str, str] = JOB_OPTIONS) -> ConfigError:
    """A pydantic error on values the user typed, as one line naming the option."""
    parts = []
    for err in exc.errors():
        field = str(err["loc"][0]) if err["loc"] else ""
        option = options.get(field, f"--{field.replace('_', '-')}")
        parts.append(f"{option} {err.get('input')!r}: {err['msg'].lower()}")
    return ConfigError(f"invalid option {'; '.join(parts)}; see --help")


def check_job_options(args: argparse.Namespace) -> None:
    """The job's own options (``--samples``, ``--limit``, ``--early-stop``, ``-k``) against the
    RolloutJob model's constraints, before the job (or the config) is built."""
    from polar_env.staging.job import RolloutJob

    values = {"samples": args.samples, "limit": args.limit, "early_stop_min_usable": args.early_stop}
    if getattr(args, "k", None):
        values["pass_k"] = args.k
    try:
        RolloutJob.model_validate({k: v for k, v in values.items() if v is not None})
    except ValidationError as exc:
        raise options_error(exc) from None


def check_job(job: RolloutJob, command: str) -> list[TaskRequest]:
    """Tasks resolvable, the tracker's package installed, then everything :func:`check_env`
    checks for them; returns the tasks."""
    from polar_env.observe.tracker import require_tracker
    from polar_env.staging.job import load_tasks

    check_job_bounds(job)
    if job.tracker is not None:
        require_tracker(job.tracker)

    try:
        reqs = load_tasks(job)
    except ValidationError as exc:  # --samples/--early-stop reach the TaskRequests here; anything else is a row's
        if all(err["loc"] and str(err["loc"][0]) in JOB_OPTIONS for err in exc.errors()):
            raise options_error(exc) from None
        fields = "; ".join(f"{'.'.join(map(str, e['loc']))} {e.get('input')!r}: {e['msg'].lower()}" for e in exc.errors())
        raise ConfigError(f"invalid task row ({fields}), in {job.tasks}; fix the row (fields as in TaskRequest)") from None
    except ConfigError as exc:  # a row's names or params (config.task_request): say which file holds it
        if not str(exc).startswith("task ") or str(exc).startswith("task file ") or job.tasks == "toy":
            raise  # not a row's: the file itself (missing, unreadable) says how to fix it
        raise ConfigError(f"{exc}; in {job.tasks}: fix the row") from None
    from polar_env.tasks.eval_scripts import check_gradable

    check_gradable(reqs)  # a row nothing can grade fails now, not after its sessions ran
    check_buildable_images(reqs, str(job.tasks))
    check_env(job.env, reqs, command)
    return reqs


def check_job_bounds(job: RolloutJob) -> None:
    """What one field's bounds cannot say: ``-k`` and ``--early-stop`` within ``--samples`` (pass@k
    needs k samples per task: a larger k was dropped from the report, silently), and ``--out`` a
    folder (or a path to make one at), before the run folder is made."""
    if job.mode == "eval" and max(job.pass_k, default=1) > job.samples:
        k = max(job.pass_k)
        raise ConfigError(f"invalid option -k {k}: pass@{k} needs at least {k} sessions per task and --samples is "
                          f"{job.samples}; pass --samples {k} or a smaller -k")
    if job.early_stop_min_usable is not None and job.early_stop_min_usable > job.samples:
        raise ConfigError(f"invalid option --early-stop {job.early_stop_min_usable}: a group of --samples "
                          f"{job.samples} never has that many usable sessions; give --early-stop at most {job.samples}")
    out = Path(job.out)
    blocker = next((p for p in (out, *out.parents) if p.exists()), None)
    if blocker is not None and not blocker.is_dir():
        where = "is a file" if blocker == out else f"is under the file {blocker}"
        raise ConfigError(f"--out {out} {where}, not a folder; pass a folder for the runs (each run writes "
                          "OUT/<run id>/), or move the file away")


def check_buildable_images(reqs: Sequence[TaskRequest], tasks: str) -> None:
    """SWE rows on a local runtime whose image is not in the store but could be built from their
    own recipe: one line with the exact ``images build`` command (the runtime check names the rest)."""
    from polar_env.runtimes.bundle import images_root, resolve_image_dir
    from polar_env.runtimes.imagestore import is_path

    ids = sorted({r.task_id for r in reqs if r.runtime.kind in ("sandbox", "apptainer") and r.runtime.image
                  and not is_path(r.runtime.image) and "://" not in r.runtime.image
                  and isinstance(r.task.get("extra", {}).get("environment_setup"), dict)
                  and resolve_image_dir(r.runtime.image) is None})
    if ids:
        raise ConfigError(f"{len(ids)} task image(s) are not in the image store {images_root()} ({_few(ids)}); build "
                          f"them from the rows' environment_setup: polar-env images build {tasks} --ids {' '.join(ids)}")


def check_serve(config: PolarEnvConfig, host: str, port: int) -> None:
    """``serve``: the task API's port is free, and the server's defaults work."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            raise ConfigError(f"cannot listen on {host}:{port} ({exc.strerror or exc}), the task API (--host/--port); "
                              "pick another --port, or stop the process that holds it") from None
    check_env(config, [], "serve")


def check_recipe(path: Path, overrides: dict[str, Any]) -> None:
    """``train``: the recipe's pipeline (bwrap sandboxes, its evaluator) is usable."""
    from polar_env.train.recipe import Recipe

    recipe = Recipe.load(path, overrides)
    if recipe.source == "polar_env":
        check_runtime("sandbox")
    for name in sorted({task.evaluator.name for task in [*recipe.toy_tasks(), *recipe.held_out_tasks()]}):
        check_evaluator(name, f"recipe {path}")


def check_env(env: PolarEnvConfig, reqs: Sequence[TaskRequest], command: str) -> None:
    """Engine, harnesses, runtimes and evaluator dependencies of ``env`` and ``reqs``. On an existing
    Ray cluster (``--ray-address``) the nodes may be other machines: what they need is not checked
    from here (only the missing-evaluator warning is given)."""
    if not env.ray_address:
        check_node_side(env, reqs)
    unevaluated = [r.task_id for r in reqs if r.evaluator is None]
    if unevaluated:
        warn(command, f"{len(unevaluated)} of {len(reqs)} task(s) have no evaluator ({_few(unevaluated)}), so every "
             "session of theirs gets reward 0; pass --evaluator (e.g. output, session_completion) or give the rows "
             "an 'evaluator'")


def check_node_side(env: PolarEnvConfig, reqs: Sequence[TaskRequest]) -> None:
    """What the nodes (on this machine) need: the engine, harnesses, runtimes, evaluator modules."""
    asyncio.run(check_engine(env.engine))
    harnesses = {r.agent.harness for r in reqs} if reqs else {env.harness}
    for name in sorted(harnesses):
        check_harness(name, env.harness_cache)
    for kind in sorted({r.runtime.kind for r in reqs} if reqs else {env.runtime.kind}):
        specs = [r.runtime for r in reqs if r.runtime.kind == kind] if reqs else [env.runtime]
        images = [s.image for s in specs if s.image]
        roots = {s.agent_root for s in specs}
        check_runtime(kind, next(iter(images), None), next((a for a in ("require", "auto") if a in roots), "off"),
                      images=[s.image for s in specs if s.image and not (kind == "docker" and s.pull)],
                      unbounded_ok=all(s.allow_unbounded or (s.memory_mb is None and s.pids_limit is None) for s in specs))
    evaluators = {r.evaluator.name: r.task_id for r in reqs if r.evaluator is not None}
    if env.evaluator is not None:
        evaluators.setdefault(env.evaluator.name, "--evaluator")
    for name, where in sorted(evaluators.items()):
        check_evaluator(name, f"task {where}" if where != "--evaluator" else where)


def warn(command: str, message: str) -> None:
    print(f"polar-env {command}: warning: {message}", file=sys.stderr, flush=True)


def _few(items: Iterable[str], n: int = 3) -> str:
    items = list(items)
    return ", ".join(items[:n]) + (f", ... ({len(items)} in all)" if len(items) > n else "")


# -- engine --------------------------------------------------------------------------------------


async def check_engine(config: AnyEngineConfig, wait_s: float = ENGINE_WAIT_S) -> None:
    """An HTTP engine answers ``GET /v1/models`` within ``wait_s`` and serves ``config.model``
    (vLLM: exactly; SGLang ignores the name); the embedded engine's files exist."""
    from polar_env.engines.config import EmbeddedEngineConfig, SimulatedEngineConfig

    if isinstance(config, EmbeddedEngineConfig | SimulatedEngineConfig):
        if isinstance(config, EmbeddedEngineConfig):
            config.weights()  # a folder with config.json or a .gguf file, else one line
        if config.script is not None:
            from polar_env.engines.config import load_policy

            load_policy(config.script)  # one line naming --engine-script and what in the file is wrong
        config.resolved_template()  # template auto: read off model_dir's own files, or one line
        if isinstance(config, EmbeddedEngineConfig):
            config.check_fits()  # a tokenizer with ids past the weights' embedding: one line naming --template
        return
    from polar_env.engines.config import build_engine
    from polar_env.engines.probe import choose_model, engine_urls, served_models

    client = build_engine(config)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait_s
    where = getattr(client, "router_url", None) or getattr(client, "base_url", None) or str(getattr(config, "url", ""))
    try:
        while True:
            try:
                served: dict[str, list[str]] = {}
                for where in await engine_urls(client):
                    served[where] = await served_models(where, engine=client.name, timeout_s=max(0.5, wait_s))
                break
            except (EngineHTTPError, EngineProtocolError) as exc:
                raise ConfigError(f"{where} does not answer like a {client.name} server ({exc.message}), --engine-url; "
                                  "give the server's base URL, e.g. http://127.0.0.1:8000") from None
            except EngineError as exc:
                if loop.time() >= deadline:
                    raise ConfigError(f"no {client.name} engine answers at {where} after {wait_s:g}s ({exc.message}), "
                                      "--engine-url; start the engine first, or fix the URL") from None
                await asyncio.sleep(0.25)
    finally:
        await client.aclose()
    for url, models in served.items():
        choose_model(config.model, models, url, strict=config.kind == "vllm")
    await asyncio.to_thread(config.resolved_template)  # template auto: read off what the engine serves, or one line


# -- harness -------------------------------------------------------------------------------------


def check_harness(name: str, cache_dir: Path | None = None) -> None:
    """The preset's binary is in the shared cache, or what installs it (npm / a python that makes
    venvs) is here; an npm harness also needs node to run."""
    from polar_env.harnesses import get_harness, install_hint, is_installed

    if name == "loop":
        return
    spec = get_harness(name)
    where = f"harness {spec.name}"
    if spec.needs == "node" and shutil.which("node") is None:
        raise ConfigError(f"node is not on PATH, needed by {where}; install Node.js (apt-get install -y nodejs npm)")
    if is_installed(spec, cache_dir):
        return
    install = spec.install
    if install.kind == "path":
        raise ConfigError(f"{install.binary} is not an executable on PATH, {where}; {install_hint(spec)}")
    if install.kind == "npm" and shutil.which("npm") is None:
        raise ConfigError(f"{where} is not installed and npm is not on PATH to install it; install npm "
                          f"(apt-get install -y npm) or run {install_hint(spec)} where npm is")
    if install.kind == "pip" and importlib.util.find_spec("ensurepip") is None:
        raise ConfigError(f"{where} is not installed and {sys.executable} cannot make the venv it goes in "
                          f"(no ensurepip); apt-get install -y python3-venv, or run {install_hint(spec)}")


# -- runtime -------------------------------------------------------------------------------------


def check_runtime(kind: str, image: str | None = None, agent_root: str = "auto", *, images: Sequence[str] = (),
                  unbounded_ok: bool = False) -> None:
    """``image``: one the sessions will use (apptainer runs ``true`` in it); ``agent_root``: the
    strictest the sessions ask of Docker (runtimes/docker_userns.py); ``images``: every image the
    sessions need present (Docker: on the daemon, unless they pull; else a folder or the store's),
    all missing ones named in one line; ``unbounded_ok``: no session needs memory/pids bounded
    (none asks, or all allow_unbounded), so rootless Apptainer without a cgroup is not refused."""
    from polar_env.runtimes.imagestore import missing_local

    if kind == "sandbox":
        _check_bwrap()
        check_runtime_base()
        if (missing := missing_local(images, kind)) is not None:
            raise ConfigError(missing)
    elif kind == "docker":
        _check_docker(agent_root)
        _check_docker_images(images)
    elif kind == "apptainer":
        _check_apptainer(image, images, unbounded_ok=unbounded_ok)


def _check_apptainer(image: str | None, images: Sequence[str] = (), *, unbounded_ok: bool = False) -> None:
    """The binary exists and, for a local image, ``true`` runs in it the way a session's exec will; a
    URI image (``docker://``, ``docker-archive://``, ...) is converted into the store on first use by
    the first session's prepare (``runtimes/apptainer_images.py``), not here: preflight stays quick."""
    from polar_env.runtimes import limits
    from polar_env.runtimes.apptainer import APPTAINER_INSTALL, describe_host, find_apptainer, probe, unbounded_refusal
    from polar_env.runtimes.hostworkspace import drops_privileges
    from polar_env.runtimes.imagestore import URI_SCHEMES, missing_local

    hint = os.environ.get("POLAR_APPTAINER") or "apptainer"
    binary = find_apptainer()
    if binary is None:
        raise ConfigError(f"no {hint!r} binary on PATH, runtime apptainer; {APPTAINER_INSTALL}, or use --runtime "
                          "sandbox")
    if not drops_privileges() and not unbounded_ok and (why := limits.rootless_bound()) is not None:
        raise ConfigError(unbounded_refusal(why))
    if (missing := missing_local([*images, *([image] if image else [])], "apptainer", accepts_files=True)) is not None:
        raise ConfigError(missing)
    if image is not None and not image.startswith(URI_SCHEMES) and (why := asyncio.run(probe(image))) is not None:
        raise ConfigError(f"apptainer cannot run {image} ({why}), runtime apptainer; check unprivileged user namespaces "
                          "(sysctl user.max_user_namespaces, kernel.unprivileged_userns_clone) and, for a .sif, "
                          "squashfuse and /dev/fuse, or use --runtime sandbox")
    print(f"polar-env: runtime apptainer: {describe_host(binary)}", file=sys.stderr, flush=True)


def _check_bwrap() -> None:
    from polar_env.runtimes.sandbox import BWRAP_INSTALL

    bwrap = shutil.which(os.environ.get("POLAR_BWRAP") or "bwrap")
    if bwrap is None:
        raise ConfigError(f"bubblewrap (bwrap) is not on PATH, runtime sandbox; {BWRAP_INSTALL}, or use --runtime docker")
    true = shutil.which("true") or "/bin/true"
    # the namespaces every sandbox exec asks for (runtimes/sandbox.py bwrap_argv)
    argv = [bwrap, "--unshare-all", "--die-with-parent", "--uid", "0", "--gid", "0", "--cap-drop", "ALL",
            "--ro-bind", "/", "/", "--proc", "/proc", "--dev", "/dev", true]
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=BWRAP_PROBE_TIMEOUT_S, check=False,
                              stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ConfigError(f"bwrap did not run ({exc}), runtime sandbox; check {bwrap}") from None
    if proc.returncode != 0:
        why = (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1]
        raise ConfigError(f"bwrap cannot create its namespaces ({why}), runtime sandbox; allow unprivileged user "
                          "namespaces (sysctl kernel.unprivileged_userns_clone=1; in a container: --privileged or a "
                          "seccomp profile that permits clone/unshare), or use --runtime docker")


def check_runtime_base(base: Path | None = None) -> None:
    """As root, sandbox execs drop to unprivileged uids: they must reach the runtime base (default
    ``$TMPDIR/polar-runtimes``) or a stage parent every uid can traverse (runtimes/reach.py)."""
    from polar_env.runtimes.hostworkspace import SANDBOX_UID_BASE, drops_privileges
    from polar_env.runtimes.reach import TRAVERSE_FIX, blocking_dir, describe, stage_parent, stage_parents
    from polar_env.staging.node import NodeConfig, runtime_base

    if not drops_privileges():
        return
    base = base if base is not None else runtime_base(NodeConfig())
    blocked = blocking_dir(base, SANDBOX_UID_BASE)
    if blocked is None or stage_parent() is not None:
        return
    raise ConfigError(f"the sandbox's unprivileged uids cannot traverse {describe(blocked)} to the runtime folder {base}, "
                      f"and none of {', '.join(map(str, stage_parents()))} is a writable dir every user can traverse (for a stage), "
                      f"runtime sandbox; {TRAVERSE_FIX}, or chmod o+x {blocked}")


def _docker_get(host: str, path: str) -> bytes | None:
    """The raw HTTP answer of the daemon at ``host`` to ``GET path`` (None: a scheme left to the SDK)."""
    if host.startswith("unix://"):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        address: Any = host[len("unix://"):]
    elif host.startswith("tcp://"):
        name, _, port = host[len("tcp://"):].rstrip("/").rpartition(":")
        s, address = socket.socket(), (name, int(port))
    else:
        return None  # ssh:// and friends: the SDK's business
    chunks: list[bytes] = []
    with s:
        s.settimeout(DOCKER_PING_TIMEOUT_S)
        s.connect(address)
        s.sendall(f"GET {path} HTTP/1.0\r\nHost: docker\r\n\r\n".encode())
        while (chunk := s.recv(65536)) and sum(map(len, chunks)) < 1 << 20:
            chunks.append(chunk)
    return b"".join(chunks)


def _check_docker(agent_root: str = "auto") -> None:
    """The daemon answers its ping; then one line says who the agent will be (root inside only where
    the daemon remaps uids), and ``agent_root=require`` on a daemon that does not is refused."""
    from polar_env.runtimes.docker import AGENT_UID
    from polar_env.runtimes.docker_userns import Userns, describe, docker_host, parse_info

    if importlib.util.find_spec("docker") is None:
        raise ConfigError("the docker SDK is not installed, runtime docker; pip install -e '.[docker]'")
    host = docker_host()
    hint = "start dockerd (scripts/start_dockerd.sh prints the DOCKER_HOST to export), or fix DOCKER_HOST"
    try:
        answer = _docker_get(host, "/_ping")
    except (OSError, ValueError) as exc:
        raise ConfigError(f"no Docker daemon answers at {host} ({getattr(exc, 'strerror', None) or exc}), runtime docker; "
                          f"{hint}") from None
    if answer is None:
        return
    if b" 200 " not in answer.split(b"\r\n", 1)[0]:
        raise ConfigError(f"{host} does not answer like a Docker daemon ({answer[:80]!r}), runtime docker; {hint}")
    try:
        info = json.loads((_docker_get(host, "/info") or b"").partition(b"\r\n\r\n")[2])
        ns = parse_info(info) if isinstance(info, dict) else Userns(False, None, "dockerd userns state unknown")
    except (OSError, ValueError):
        ns = Userns(False, None, "dockerd userns state unknown (no /info)")
    print(f"polar-env: runtime docker: {describe(ns, agent_root, AGENT_UID)}", file=sys.stderr, flush=True)


def _check_docker_images(images: Sequence[str]) -> None:
    """Every image is on the daemon (``docker image inspect``, over the socket ``_check_docker``
    pinged, else the SDK); all missing ones in one line, each with its pull command."""
    from urllib.parse import quote

    from polar_env.runtimes.docker_image import pull_hint
    from polar_env.runtimes.docker_userns import docker_host

    host = docker_host()
    missing: list[str] = []
    for image in dict.fromkeys(images):
        try:
            answer = _docker_get(host, f"/images/{quote(image, safe='/:@')}/json")
        except (OSError, ValueError):
            return  # the ping answered; a flaky daemon is prepare's to report
        if answer is None:  # ssh:// and friends: the SDK
            import docker

            client = docker.from_env()
            try:
                client.images.get(image)
            except docker.errors.ImageNotFound:
                missing.append(image)
            finally:
                client.close()
        elif b" 404 " in answer.split(b"\r\n", 1)[0]:
            missing.append(image)
    if missing:
        each = "; ".join(f"{i} ({pull_hint(i)})" for i in missing)
        raise ConfigError(f"{len(missing)} docker image(s) not on the daemon at {host}, runtime docker: {each}; pull "
                          "them, or pass --pull (runtime.pull: true) to pull at prepare")


# -- evaluator -----------------------------------------------------------------------------------


def check_evaluator(name: str, where: str) -> None:
    """The evaluator's own dependencies import (its name is validated with the config)."""
    module, extra = EVALUATOR_MODULES.get(name, (name.partition(":")[0] if ":" in name else "", ""))
    if not module:
        return
    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        fix = f"pip install -e '.[{extra}]'" if extra else f"install the package that provides {module}"
        raise ConfigError(f"evaluator {name} needs the Python module {module}, which does not import, {where}; {fix}")
