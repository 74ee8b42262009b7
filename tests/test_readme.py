"""Every fenced block in README.md is checked, so the README cannot drift from the code.

- ``python`` blocks run for real, each in a fresh interpreter in a temporary folder (the embedded
  engine, small groups);
- ``bash`` lines run for real where this machine can (``slime-args``, the NeMo Gym root); the rest
  need GPUs, slime, a Ray cluster, a NeMo Gym venv or the network, so the command is checked to
  exist and its flags to parse (``build_parser().parse_args``), and each such kind is reported as a
  skipped test that names what it needs;
- the ``yaml`` block (NeMo RL's config) parses and names a config that exists; the layout block
  names only paths that exist.

A README line that no check covers fails ``test_every_bash_line_is_checked`` (add its check here).
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
README = (REPO / "README.md").read_text()
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
GYM_ROOT = REPO / "polar_env" / "integrations" / "nemo_gym" / "gym_root"
PYTHON_TIMEOUT_S = 600


@dataclass(frozen=True)
class Block:
    lang: str
    code: str
    line: int  # 1-based line of the opening fence


def blocks(lang: str | None = None) -> list[Block]:
    found = [Block(m.group(1), m.group(2), README.count("\n", 0, m.start()) + 1) for m in FENCE.finditer(README)]
    return [b for b in found if lang is None or b.lang == lang]


def bash_lines() -> list[str]:
    """Every command line of the bash blocks, comments stripped."""
    out = []
    for block in blocks("bash"):
        for raw in block.code.splitlines():
            line = re.sub(r"\s+#\s.*$", "", raw).strip()
            if line and not line.startswith("#"):
                out.append(line)
    return out


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
    first = blocks()[0]
    assert first.lang == "bash" and first.line == 3, first
    install, tests = [line for line in first.code.splitlines() if line.strip()]
    assert install.rstrip().endswith("# install; run the main job on the embedded CPU defaults"), install
    assert tests.rstrip().endswith("# run the tests"), tests


def _chain(line: str) -> list[str]:
    return [part.strip() for part in re.sub(r"\s+#\s.*$", "", line).split("&&")]


def test_setup_commands_name_real_extras_and_the_ci_torch() -> None:
    """The install steps need the network, so they are not run here; what they name is checked:
    the extras exist, torch is the CPU wheel CI pins, and the final commands are the real ones."""
    install, tests = [line for line in blocks()[0].code.splitlines() if line.strip()]
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
}


def _check_setup(line: str, tmp_path: Path) -> None:
    test_setup_commands_name_real_extras_and_the_ci_torch()


def _check_cli(line: str, tmp_path: Path) -> None:
    argv = shlex.split(line.replace("[GROUP_ID]", ""))
    assert argv[0] == "polar-env", argv
    parse_cli(argv[1:])


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


CHECKS: list[tuple[str, str | None, Callable[[str, Path], None]]] = [  # (line prefix, kind not run, check)
    ("(command -v bwrap", "network", _check_setup),
    ("pip install torch==", "suite", _check_setup),
    ("polar-env serve", "ray-cluster", _check_cli),
    ("polar-env submit", "ray-cluster", _check_cli),
    ("polar-env status", "ray-cluster", _check_cli),
    ("export NEMO_GYM_EXTRA_ROOTS=", None, _check_gym_root),
    ("ng_run ", "nemo-gym", _check_gym_names),
    ("gym eval run", "nemo-gym", _check_gym_names),
    ("uv run python examples/nemo_gym/run_grpo_nemo_gym.py", "nemo-rl", _check_nemo_rl),
    ("polar-env slime-args", None, _check_slime_args),
    ("bash run/launch_slime.sh", "slime-gpu", _check_launch),
]


def _check_for(line: str) -> tuple[str, str | None, Callable[[str, Path], None]] | None:
    return next((c for c in CHECKS if line.startswith(c[0])), None)


def test_every_bash_line_is_checked() -> None:
    missing = [line for line in bash_lines() if _check_for(line) is None]
    assert not missing, f"README bash lines with no check in tests/test_readme.py: {missing}"


@pytest.mark.parametrize("line", bash_lines(), ids=lambda line: line.split("  ")[0][:60])
def test_bash_line(line: str, tmp_path: Path) -> None:
    check = _check_for(line)
    assert check is not None, line
    check[2](line, tmp_path)


@pytest.mark.parametrize("kind", sorted(NOT_RUN))
def test_not_run_here(kind: str) -> None:
    """One visible skip per kind of README command that is parsed, not run (see NOT_RUN)."""
    lines = [line for line in bash_lines() if (c := _check_for(line)) is not None and c[1] == kind]
    assert lines, f"NOT_RUN[{kind!r}] covers no README line any more: remove it"
    pytest.skip(f"{kind}: not run here ({NOT_RUN[kind]}); checked as a CLI parse or named-file check instead: {lines}")


# -- python blocks --------------------------------------------------------------------------------

def _python_block(marker: str) -> str:
    (block,) = [b for b in blocks("python") if marker in b.code]
    return block.code


PYTHON_MARKERS = {  # a line that identifies each python block
    "api": 'env = PolarEnv({"harness": "loop", "engine": {"kind": "embedded"}, "sampling": {"max_tokens": 32},',
    "credit": "from polar_env.integrations.credit import annotate",
    "wandb": "import json, pathlib, wandb",
}


def test_every_python_block_is_run() -> None:
    unknown = [b.line for b in blocks("python") if not any(m in b.code for m in PYTHON_MARKERS.values())]
    assert not unknown, f"README python blocks (at lines {unknown}) that no test runs"


@pytest.fixture(scope="module")
def api_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The Python API block, as written, in a fresh folder (its store lands there)."""
    cwd = tmp_path_factory.mktemp("readme-api")
    proc = run_python(_python_block(PYTHON_MARKERS["api"]), cwd)
    assert proc.returncode == 0, proc.stderr[-4000:]
    yield cwd


@pytest.mark.slow
def test_python_api_block_runs(api_run: Path) -> None:
    results = sorted(api_run.glob("polar_rollouts/capture/*/*.result.json"))
    assert len(results) == 2, results  # n=2: one result per session


@pytest.mark.slow
def test_custom_trainer_block_runs(tmp_path: Path) -> None:
    code = _python_block(PYTHON_MARKERS["credit"])
    proc = run_python(code, tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert len(list(tmp_path.glob("polar_rollouts/capture/*/*.result.json"))) == 2


@pytest.mark.slow
def test_wandb_block_runs(api_run: Path, tmp_path: Path) -> None:
    """Offline W&B (nothing leaves the machine) over a real store: the block's slime-run folder is
    replaced by the Python API block's store, whose results get the ``slime_rollout_id`` a slime
    run's sessions carry."""
    code = _python_block(PYTHON_MARKERS["wandb"])
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
    config = yaml.safe_load(block.code)
    (path,) = config["env"]["nemo_gym"]["config_paths"]
    assert (GYM_ROOT / path).is_file(), path
    assert config["env"]["should_use_nemo_gym"] is True


def test_layout_block_names_existing_paths() -> None:
    (layout,) = [b for b in blocks("") if b.code.startswith("polar_env/\n")]
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
