"""Preflight and option typos (issue 16, findings 1 and 7): each mistake is one line on stderr and
exit code 2, in seconds, before any session, runtime or output folder exists. Before preflight an
unreachable --engine-url ran every session to ERROR (25 s for one session, 16 repeated stderr
lines; 38-59 s and 72 lines for the default six) and exited 1; the typos gave tracebacks."""

from __future__ import annotations

import json
import shutil
import socket
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from fake_engines import MODEL

from polar_env import preflight
from polar_env.cli import main
from polar_env.staging.job import RolloutJob
from tests.conftest import require_bwrap, unavailable

SIMULATED = ["--engine", "simulated", "--harness", "loop", "--no-progress"]


def plain_tasks(folder: Path) -> list[str]:
    """A task file without the toy set (whose first build runs git), for checks that are not about tasks."""
    path = folder / "plain.jsonl"
    path.write_text(json.dumps({"task_id": "echo", "instruction": "run echo hi",
                                "evaluator": {"name": "output", "regex": "hi"}}) + "\n")
    return ["--tasks", str(path)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def one_line(capsys: pytest.CaptureFixture[str], argv: list[str], *expected: str) -> str:
    rc = main(argv)
    out, err = capsys.readouterr()
    errors = [line for line in err.splitlines() if ": error: " in line]
    assert rc == 2, (out, err)
    assert len(err.strip().splitlines()) == 1 and len(errors) == 1, err
    assert errors[0].startswith(f"polar-env {argv[0]}: error: "), err
    for text in expected:
        assert text in errors[0], errors[0]
    return errors[0]


@pytest.mark.slow  # waits out the preflight's engine probe
def test_unreachable_engine_is_one_line_after_the_preflight_wait(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """"In seconds" is the preflight's own wait (ENGINE_WAIT_S): every probe of the dead URL is bounded
    by it, not by the engine client's connect timeout, and the error names it."""
    from polar_env.engines import probe

    probed: list[float] = []
    real = probe.served_models

    async def recorded(url: str, *, engine: str, timeout_s: float) -> list[str]:
        probed.append(timeout_s)
        return await real(url, engine=engine, timeout_s=timeout_s)

    monkeypatch.setattr(probe, "served_models", recorded)
    dead = f"http://127.0.0.1:{free_port()}"
    for command in ("rollout", "eval", "sft"):
        out = tmp_path / command
        probed.clear()
        one_line(capsys, [command, "--engine-url", dead, *plain_tasks(tmp_path), "--out", str(out), "--no-progress"],
                 f"no vllm engine answers at {dead} after {preflight.ENGINE_WAIT_S:g}s", "--engine-url",
                 "start the engine first")
        assert probed and all(t <= preflight.ENGINE_WAIT_S for t in probed), probed
        assert not out.exists(), "preflight must run before the output folder is made"


def test_serve_refuses_an_unreachable_engine(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    one_line(capsys, ["serve", "--local", "--port", str(free_port()), "--store", str(tmp_path / "s"),
                      "--engine-url", f"http://127.0.0.1:{free_port()}"], "no vllm engine answers", "--engine-url")


def test_engine_serving_another_model(tmp_path: Path, capsys: pytest.CaptureFixture[str], fake_vllm: str) -> None:
    one_line(capsys, ["rollout", "--engine-url", fake_vllm, "--served-model-name", "qwen3-typo", *plain_tasks(tmp_path),
                      "--out", str(tmp_path / "o")], f"serves ['{MODEL}'], not 'qwen3-typo'", f"--served-model-name {MODEL}")


def test_engine_check_passes_for_a_serving_engine(fake_vllm: str) -> None:
    from polar_env.engines.config import VLLMEngineConfig

    preflight.check_engine(VLLMEngineConfig(url=fake_vllm, model=MODEL))


def test_not_an_engine(tmp_path: Path, capsys: pytest.CaptureFixture[str], fake_vllm: str) -> None:
    one_line(capsys, ["rollout", "--engine-url", f"{fake_vllm}/v1/chat", "--served-model-name", MODEL,
                      *plain_tasks(tmp_path), "--out", str(tmp_path / "o")], "does not answer like a vllm server", "base URL")


def test_bwrap_missing_or_without_namespaces(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("POLAR_BWRAP", str(tmp_path / "no-bwrap"))
    one_line(capsys, ["rollout", *SIMULATED, *plain_tasks(tmp_path), "--out", str(tmp_path / "o")], "bwrap", "not on PATH",
             "apt-get install")
    # /bin/false stands in for a bwrap whose namespaces the kernel refuses (same exit, no sandbox)
    monkeypatch.setenv("POLAR_BWRAP", "/bin/false")
    one_line(capsys, ["rollout", *SIMULATED, *plain_tasks(tmp_path), "--out", str(tmp_path / "o")], "bwrap cannot create its namespaces",
             "user namespaces")


def test_real_bwrap_passes() -> None:
    require_bwrap()
    preflight.check_runtime("sandbox")


def test_runtime_base_the_sandbox_uids_cannot_reach(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                    monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest) -> None:
    """Issue 23: TMPDIR inside a 0700 job folder. Passes while a stage dir every uid can traverse
    exists (/tmp); without one it is one line naming the folder and the fix."""
    require_bwrap()
    monkeypatch.setattr("polar_env.runtimes.hostworkspace.drops_privileges", lambda: True)  # as root does
    job = Path(tempfile.mkdtemp(prefix="job", dir="/tmp"))  # not under pytest's own 0700 folder
    (job / "tmp").mkdir()
    job.chmod(0o700)
    request.addfinalizer(lambda: shutil.rmtree(job, ignore_errors=True))
    monkeypatch.setenv("TMPDIR", str(job / "tmp"))
    monkeypatch.setattr(tempfile, "tempdir", None)
    preflight.check_runtime("sandbox")
    monkeypatch.setattr("polar_env.runtimes.reach.STAGE_DIRS", ())  # TMPDIR is then the only stage parent
    line = one_line(capsys, ["rollout", *SIMULATED, *plain_tasks(tmp_path), "--out", str(tmp_path / "o")],
                    f"cannot traverse {job} (mode 0700", f"runtime folder {job}/tmp/polar-runtimes", "TMPDIR=/tmp",
                    f"chmod o+x {job}")
    assert "runtime sandbox" in line and not (tmp_path / "o").exists()


class FakeDockerd:
    """A unix socket answering ``GET /_ping`` (a named test double for the daemon's socket)."""

    def __init__(self, path: Path, answer: bytes) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(str(path))
        self.sock.listen(4)
        self.answer = answer
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                conn.recv(4096)
                conn.sendall(self.answer)


@pytest.fixture
def short_tmp() -> Iterator[Path]:  # unix socket paths must stay under 108 bytes
    import tempfile

    with tempfile.TemporaryDirectory(prefix="pf") as d:
        yield Path(d)


def test_docker_daemon_absent_is_detected_not_started(short_tmp: Path, capsys: pytest.CaptureFixture[str],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("docker")
    monkeypatch.setenv("DOCKER_HOST", f"unix://{short_tmp / 'docker.sock'}")
    one_line(capsys, ["rollout", *SIMULATED, *plain_tasks(short_tmp), "--runtime", "docker", "--out", str(short_tmp / "o")],
             "no Docker daemon answers at unix://", "runtime docker", "start dockerd")
    assert not (short_tmp / "docker.sock").exists()
    FakeDockerd(short_tmp / "docker.sock", b"HTTP/1.1 404 Not Found\r\n\r\n")
    one_line(capsys, ["rollout", *SIMULATED, *plain_tasks(short_tmp), "--runtime", "docker", "--out", str(short_tmp / "o")],
             "does not answer like a Docker daemon")


def test_docker_ping_ok_passes(short_tmp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("docker")
    FakeDockerd(short_tmp / "d.sock", b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nOK")
    monkeypatch.setenv("DOCKER_HOST", f"unix://{short_tmp / 'd.sock'}")
    preflight.check_runtime("docker")


def test_apptainer_binary_missing(tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("POLAR_APPTAINER", "no-such-apptainer")
    one_line(capsys, ["rollout", *SIMULATED, *plain_tasks(tmp_path), "--runtime", "apptainer", "--out", str(tmp_path / "o")],
             "no 'no-such-apptainer' binary on PATH", "runtime apptainer")


def test_apptainer_probe_failure_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Preflight runs ``true`` in the image through the runtime: an image that cannot run it (here an
    empty directory: no /bin/sh, through the bwrap-backed fake) is one line before INIT."""
    require_bwrap()
    from tests.runtimes.conftest import FAKE_APPTAINER

    monkeypatch.setenv("POLAR_APPTAINER", str(FAKE_APPTAINER))
    (tmp_path / "empty").mkdir()
    (tmp_path / "env.yaml").write_text(f"runtime:\n  kind: apptainer\n  image: {tmp_path / 'empty'}\n")
    argv = ["rollout", *SIMULATED, *plain_tasks(tmp_path), "--config", str(tmp_path / "env.yaml"), "--out", str(tmp_path / "o")]
    one_line(capsys, argv, f"apptainer cannot run {tmp_path / 'empty'}", "/bin/sh", "runtime apptainer")
    (tmp_path / "env.yaml").write_text(f"runtime:\n  kind: apptainer\n  image: {tmp_path / 'gone'}\n")
    one_line(capsys, argv, f"apptainer image {tmp_path / 'gone'} does not exist")


def test_apptainer_install_unreachable_by_the_agent_uid(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """As root every exec drops to an unprivileged uid, which must reach the install (a 0700 home
    cannot be staged around: Apptainer finds its starter by its compiled-in prefix)."""
    import os
    import shutil

    from tests.runtimes.conftest import FAKE_APPTAINER

    if os.geteuid() != 0:
        pytest.skip("only root callers drop to another uid")
    private = tmp_path / "private"
    (private / "bin").mkdir(parents=True)
    private.chmod(0o700)
    shutil.copy(FAKE_APPTAINER, private / "bin" / "apptainer")
    monkeypatch.setenv("POLAR_APPTAINER", str(private / "bin" / "apptainer"))
    (tmp_path / "img").mkdir()
    with pytest.raises(preflight.ConfigError, match="not reachable by unprivileged uids"):
        preflight.check_runtime("apptainer", str(tmp_path / "img"))


def test_harness_not_installable(tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """An empty harness cache and a PATH with node but no npm: pi can be neither found nor installed."""
    import shutil

    node = shutil.which("node")
    if node is None:
        pytest.skip("node is not installed")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "node").symlink_to(node)
    monkeypatch.setenv("POLAR_HARNESS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("PATH", str(bin_dir))
    tasks = plain_tasks(tmp_path)
    one_line(capsys, ["rollout", "--engine", "simulated", "--harness", "pi", "--no-progress", *tasks, "--out", str(tmp_path / "o")],
             "harness pi is not installed and npm is not on PATH", "install_harnesses.sh pi")
    monkeypatch.setenv("PATH", str(tmp_path / "nothing"))
    one_line(capsys, ["rollout", "--engine", "simulated", "--harness", "pi", "--no-progress", *tasks, "--out", str(tmp_path / "o")],
             "node is not on PATH, needed by harness pi")


def test_evaluator_dependency_missing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(json.dumps({"task_id": "t1", "instruction": "x",
                                 "evaluator": {"name": "polar_no_such_pkg.grading:grade"}}) + "\n")
    one_line(capsys, ["rollout", *SIMULATED, "--tasks", str(tasks), "--out", str(tmp_path / "o")],
             "task 't1': evaluator.name: cannot import evaluator 'polar_no_such_pkg.grading:grade': No module named "
             "'polar_no_such_pkg'", f"in {tasks}")


def test_swebench_evaluator_needs_swebench(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "swebench" else real(name, *a))
    with pytest.raises(preflight.ConfigError, match=r"evaluator swebench needs .* pip install -e '\.\[swebench\]'"):
        preflight.check_evaluator("swebench", "task toy__calc-1")


def test_task_without_evaluator_warns(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    require_bwrap()
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(json.dumps({"task_id": f"t{i}", "instruction": "x"}) + "\n" for i in range(2)))
    job = RolloutJob.model_validate({"env": {"engine": {"kind": "simulated"}, "harness": "loop"}, "tasks": str(tasks)})
    preflight.check_job(job, "rollout")
    err = capsys.readouterr().err
    assert err.strip() == ("polar-env rollout: warning: 2 of 2 task(s) have no evaluator (t0, t1), so every session of "
                           "theirs gets reward 0; pass --evaluator (e.g. output, session_completion) or give the rows "
                           "an 'evaluator'")


def test_happy_path_preflight_passes() -> None:
    """The default job (toy tasks, pi, bwrap sandbox, swebench) passes when its prerequisites are
    here, with its three requirements (how long it takes: scripts/bench_preflight.py)."""
    require_bwrap()
    from polar_env.harnesses import get_harness, is_installed

    if not is_installed(get_harness("pi")):
        pytest.skip("pi is not installed")
    reqs = preflight.check_job(RolloutJob(), "rollout")
    assert len(reqs) == 3


# -- typos (finding 7) -----------------------------------------------------------------------------


def test_unknown_task_id_names_the_closest(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    line = one_line(capsys, ["rollout", *SIMULATED, "--task-id", "toy__nope", "--task-id", "toy__calc1",
                             "--out", str(tmp_path / "o")], "unknown --task-id 'toy__nope'; 'toy__calc1' (closest: toy__calc-1)",
                    "pass one of: toy__bsearch-1, toy__calc-1, toy__textkit-1")
    assert "Traceback" not in line
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(json.dumps({"task_id": "echo-1", "instruction": "x"}) + "\n")
    one_line(capsys, ["rollout", *SIMULATED, "--tasks", str(tasks), "--task-id", "echo1", "--out", str(tmp_path / "o")],
             "unknown --task-id 'echo1' (closest: echo-1)", f"in {tasks}")


@pytest.mark.parametrize(("argv", "expected"), [
    (["--samples", "0"], "invalid option --samples 0: input should be greater than or equal to 1"),
    (["--limit", "0"], "invalid option --limit 0"),
    (["--early-stop", "0"], "invalid option --early-stop 0"),
    (["--evaluator", "{bad json"], "--evaluator '{bad json' is not JSON"),
])
def test_option_typos_are_one_line(argv: list[str], expected: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for command in ("rollout", "sft"):
        one_line(capsys, [command, *SIMULATED, *argv, "--out", str(tmp_path / "o")], expected)
    assert not (tmp_path / "o").exists()


def test_eval_k_zero(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    one_line(capsys, ["eval", *SIMULATED, "-k", "0", "--out", str(tmp_path / "o")], "invalid option -k 0")


def test_serve_on_a_port_in_use(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen(1)
        port = held.getsockname()[1]
        one_line(capsys, ["serve", "--local", "--port", str(port), "--store", str(tmp_path / "s"), *SIMULATED[:4]],
                 f"cannot listen on 127.0.0.1:{port}", "pick another --port, or stop the process that holds it")
    assert not (tmp_path / "s").exists()


def test_train_recipe_needs_its_runtime(tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    recipe = Path(__file__).resolve().parents[1] / "recipes" / "cpu_grpo_toy.yaml"
    if not recipe.exists():
        pytest.skip("no recipes/cpu_grpo_toy.yaml")
    monkeypatch.setenv("POLAR_BWRAP", str(tmp_path / "no-bwrap"))
    one_line(capsys, ["train", str(recipe), "--out-dir", str(tmp_path / "run")], "bwrap", "runtime sandbox")
    assert not (tmp_path / "run").exists()


def test_remote_ray_cluster_skips_node_side_checks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With --ray-address the nodes may be other machines: a missing local bwrap is not a refusal."""
    from polar_env.env import PolarEnvConfig

    monkeypatch.setenv("POLAR_BWRAP", str(tmp_path / "no-bwrap"))
    preflight.check_env(PolarEnvConfig(harness="loop", ray=True, ray_address="ray://10.0.0.1:10001"), [], "serve")
    with pytest.raises(preflight.ConfigError, match="bwrap"):
        preflight.check_env(PolarEnvConfig(harness="loop"), [], "serve")


def test_a_bad_task_row_is_named_as_a_row_not_an_option(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tasks = tmp_path / "rows.jsonl"
    tasks.write_text(json.dumps({"task_id": "t", "instruction": "x", "timeout_s": -1}) + "\n")
    one_line(capsys, ["rollout", *SIMULATED, "--tasks", str(tasks), "--out", str(tmp_path / "o")],
             "task 't': timeout_s: Input should be greater than 0 (got -1)", f"in {tasks}")


def test_a_missing_task_file_is_not_called_a_bad_row(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "nope.jsonl"
    line = one_line(capsys, ["rollout", *SIMULATED, "--tasks", str(missing), "--out", str(tmp_path / "o")],
                    f"task file {missing} does not exist", "give 'toy'")
    assert "fix the row" not in line, line
    assert not (tmp_path / "o").exists()  # refused before any run folder is made


def test_a_tracker_without_its_package_is_refused_before_the_run_folder(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    from polar_env.observe import tracker

    monkeypatch.setitem(tracker.REQUIRES, "tensorboard", "polar_env_not_installed_package")
    out = tmp_path / "o"
    one_line(capsys, ["rollout", *SIMULATED, "--tracker", "tensorboard", "--out", str(out)],
             "--tracker tensorboard needs the polar_env_not_installed_package package", "pip install -e '.[trackers]'")
    assert not out.exists()  # no run folder, and so no `latest` pointing at an empty one


def test_docker_says_who_the_agent_is_in_one_line(short_tmp: Path, capsys: pytest.CaptureFixture[str],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the daemon remaps uids the agent is root inside; where it does not, require is refused."""
    pytest.importorskip("docker")
    info = b'{"SecurityOptions": ["name=seccomp,profile=default", "name=userns"], "DockerRootDir": "/d/data/1000000.1000000"}'
    FakeDockerd(short_tmp / "r.sock", b"HTTP/1.1 200 OK\r\n\r\n" + info)
    monkeypatch.setenv("DOCKER_HOST", f"unix://{short_tmp / 'r.sock'}")
    preflight.check_runtime("docker", None, "require")
    line = capsys.readouterr().err
    assert line.count("\n") == 1 and line.startswith("polar-env: runtime docker: agent is root in the container"), line
    assert "container uid 0 = host uid 1000000" in line
    FakeDockerd(short_tmp / "p.sock", b'HTTP/1.1 200 OK\r\n\r\n{"SecurityOptions": ["name=seccomp,profile=default"]}')
    monkeypatch.setenv("DOCKER_HOST", f"unix://{short_tmp / 'p.sock'}")
    preflight.check_runtime("docker")
    assert "agent is uid 160000, not root" in capsys.readouterr().err
    with pytest.raises(preflight.ConfigError, match=r"^agent_root=require, but the Docker daemon does not remap uids .*runtime docker; "):
        preflight.check_runtime("docker", None, "require")


def test_swe_rows_whose_images_can_be_built_get_the_exact_build_command(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A published row with an environment_setup whose image is not in the store: one line naming the
    rows and the `images build` command for them; a row whose image is there passes."""
    from polar_env.env import PolarEnvConfig, task_request
    from polar_env.errors import ConfigError
    from polar_env.runtimes.bundle import store_name

    shared = Path(__file__).resolve().parents[2] / "shared" / "swe-real" / "instances.jsonl"
    if not shared.is_file():
        unavailable(f"no swe-real set at {shared} (the shared folder beside the checkout)")
    rows = [json.loads(line) for line in shared.read_text().splitlines()[:3]]
    monkeypatch.setenv("POLAR_IMAGES", str(tmp_path))
    reqs = [task_request(row, PolarEnvConfig()) for row in rows]
    (tmp_path / store_name(str(reqs[0].runtime.image))).mkdir()  # the first one is there
    with pytest.raises(ConfigError) as err:
        preflight.check_buildable_images(reqs, "rows.jsonl")
    line = str(err.value)
    ids = sorted(r["instance_id"] for r in rows[1:])
    assert "\n" not in line and line.startswith(f"2 task image(s) are not in the image store {tmp_path}")
    assert line.endswith(f"polar-env images build rows.jsonl --ids {' '.join(ids)}")
    docker = [task_request(row, PolarEnvConfig.model_validate({"runtime": {"kind": "docker"}})) for row in rows]
    preflight.check_buildable_images(docker, "rows.jsonl")  # Docker's own check names pulls
