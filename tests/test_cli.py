"""``polar-env`` as a new user meets it: each mistake is one line on stderr (what, where, how to
fix) with exit code 2, never a traceback. The gateway checks its engine at start, accepts a ``/v1``
URL, infers ``--engine`` and the model, shows its store in the ready line and logs requests."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest
from fake_engines import MODEL

from polar_env import __version__
from polar_env.cli import build_parser, main
from polar_env.engines import engine_base_url
from polar_env.engines.probe import choose_model
from polar_env.errors import ConfigError

REPO_ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def one_line_error(capsys: pytest.CaptureFixture[str], argv: list[str], *expected: str) -> str:
    rc = main(argv)
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert rc == 2, (out, err)
    assert len(lines) == 1, err
    assert lines[0].startswith(f"polar-env {argv[0]}: error: "), err
    for text in expected:
        assert text in lines[0], lines[0]
    return lines[0]


# Each case: argv built from a scratch folder (with a file ``f`` and an empty folder ``empty``),
# and the words the one line must contain.
CASES: dict[str, tuple[Callable[[Path], list[str]], tuple[str, ...]]] = {
    "build: missing store": (lambda d: ["build", "--store", str(d / "nope")], ("--store", "no such folder")),
    "verify: missing store": (lambda d: ["verify", "--store", str(d / "nope")], ("--store", "no such folder")),
    "build: store is a file": (lambda d: ["build", "--store", str(d / "f")], ("is a file, not a folder",)),
    "build: empty store": (lambda d: ["build", "--store", str(d / "empty")], ("holds no session journals",)),
    "build: --out in a missing folder": (
        lambda d: ["build", "--store", str(d / "empty"), "--out", str(d / "no" / "t.jsonl")], ("--out", "mkdir -p")),
    "build: --out is a folder": (lambda d: ["build", "--store", str(d / "empty"), "--out", str(d)], ("--out", "is a folder")),
    "gateway: store is a file": (lambda d: ["gateway", "--store", str(d / "f")], ("--store", "is a file")),
    "gateway: store under a missing folder": (
        lambda d: ["gateway", "--store", str(d / "no" / "s")], ("--store", "does not exist", "mkdir -p")),
    "gateway: missing engine URL": (
        lambda d: ["gateway", "--engine", "vllm", "--store", str(d / "s")], ("--engine vllm needs --engine-url",)),
    "gateway: sglang without URL": (
        lambda d: ["gateway", "--engine", "sglang", "--store", str(d / "s")], ("--engine sglang needs --engine-url",)),
    "gateway: embedded with a URL": (
        lambda d: ["gateway", "--engine", "embedded", "--engine-url", "http://127.0.0.1:1", "--store", str(d / "s")],
        ("--engine-url is for --engine vllm or sglang",)),
    "gateway: not an http URL": (
        lambda d: ["gateway", "--engine-url", "127.0.0.1:8000", "--store", str(d / "s")], ("not an http(s) URL",)),
    "gateway: embedded-only option with vllm": (
        lambda d: ["gateway", "--engine-url", "http://127.0.0.1:1", "--scripted", "--seed", "3", "--store", str(d / "s")],
        ("--seed, --scripted only apply to --engine embedded",)),
    "engine: missing --script": (lambda d: ["engine", "--engine-script", str(d / "p.json")], ("--engine-script", "no such file")),
    "engine: --script not JSON": (lambda d: ["engine", "--engine-script", str(d / "f")], ("--engine-script", "is not JSON")),
    "engine: --script not a policy": (lambda d: ["engine", "--script", str(d / "bad.json")], ("is not a scripted policy",)),
    "engine: missing --model-dir": (lambda d: ["engine", "--model-dir", str(d / "m")], ("--model-dir", "no such folder", "export-model")),
    "verify: --model-dir without config": (
        lambda d: ["verify", "--store", str(d / "empty"), "--model-dir", str(d / "empty")], ("no config.json",)),
    "gateway: missing --model-dir": (
        lambda d: ["gateway", "--model-dir", str(d / "m"), "--store", str(d / "s")], ("--model-dir", "no such folder")),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_user_mistakes_are_one_line(case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "f").write_text("not a folder {")
    (tmp_path / "bad.json").write_text(json.dumps({"steps": [{"comand": "typo"}]}))
    (tmp_path / "empty").mkdir()
    make_argv, expected = CASES[case]
    before = sorted(p.name for p in tmp_path.iterdir())
    one_line_error(capsys, make_argv(tmp_path), *expected)
    assert sorted(p.name for p in tmp_path.iterdir()) == before, "a failed command created something"


def test_build_and_verify_never_create_the_store(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for command in ("build", "verify"):
        one_line_error(capsys, [command, "--store", str(tmp_path / "typo")], "no such folder")
        assert not (tmp_path / "typo").exists()


def test_gateway_requires_a_store(capsys: pytest.CaptureFixture[str]) -> None:
    """No silent ``./polar_capture`` in whatever directory the trainer started from."""
    with pytest.raises(SystemExit) as exit_:
        main(["gateway", "--engine-url", "http://127.0.0.1:1"])
    assert exit_.value.code == 2
    assert "the following arguments are required: --store" in capsys.readouterr().err


def test_dead_engine_url_fails_at_start(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    dead = f"http://127.0.0.1:{free_port()}/v1"
    rc = main(["gateway", "--engine-url", dead, "--engine-wait-s", "0.3", "--store", str(tmp_path / "s")])
    err = capsys.readouterr().err
    assert rc == 2  # at start, after the --engine-wait-s it names below (not after serving anything)
    assert err.splitlines()[0].startswith("waiting up to 0.3s for the vllm engine at")
    assert "error: no vllm engine answers at http://127.0.0.1:" in err.splitlines()[-1]
    assert "--engine-wait-s" in err.splitlines()[-1] and len(err.splitlines()) == 2


def test_not_an_engine_fails_at_start(tmp_path: Path, capsys: pytest.CaptureFixture[str], fake_vllm: str) -> None:
    """A URL that answers, but not like vLLM (here: one path too deep), fails at once."""
    one_line_error(capsys, ["gateway", "--engine-url", f"{fake_vllm}/v1/chat", "--store", str(tmp_path / "s")],
                   "does not answer like a vllm server", "base URL")


def test_unknown_model_name_fails_at_start(tmp_path: Path, capsys: pytest.CaptureFixture[str], fake_vllm: str) -> None:
    one_line_error(capsys, ["gateway", "--engine-url", fake_vllm, "--served-model-name", "polar-tiny-qwen3",
                            "--store", str(tmp_path / "s")], f"serves ['{MODEL}'], not 'polar-tiny-qwen3'", "--served-model-name")


def test_port_in_use(tmp_path: Path, capsys: pytest.CaptureFixture[str], fake_vllm: str) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen(1)
        port = held.getsockname()[1]
        one_line_error(capsys, ["gateway", "--engine-url", fake_vllm, "--port", str(port), "--store", str(tmp_path / "s")],
                       f"cannot listen on 127.0.0.1:{port}", "address already in use", "--port")
        one_line_error(capsys, ["dashboard", "--port", str(port), str(tmp_path)],
                       f"cannot listen on 127.0.0.1:{port} (address already in use); pick another --port")


def test_unix_socket_in_a_missing_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str], fake_vllm: str) -> None:
    one_line_error(capsys, ["gateway", "--engine-url", fake_vllm, "--port", "0", "--store", str(tmp_path / "s"),
                            "--unix-socket", str(tmp_path / "no" / "gw.sock")], "--unix-socket", "existing, writable folder")


def test_unwritable_out_file_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """An OSError on a path the user gave (here /proc refuses new files) is one line, too."""
    (tmp_path / "s").mkdir()
    (tmp_path / "s" / "x.jsonl").write_bytes(b"")
    one_line_error(capsys, ["build", "--store", str(tmp_path / "s"), "--out", "/proc/polar-out.jsonl"],
                   "No such file or directory", "/proc/polar-out.jsonl")


def test_engine_url_forms() -> None:
    assert engine_base_url("http://127.0.0.1:8000/v1") == "http://127.0.0.1:8000"
    assert engine_base_url(" http://h:8000/v1/ ") == "http://h:8000"
    assert engine_base_url("https://h/serving/") == "https://h/serving"
    for bad in ("127.0.0.1:8000", "ftp://h", "http://"):
        with pytest.raises(ConfigError, match="not an http"):
            engine_base_url(bad)


def test_model_choice() -> None:
    assert choose_model(None, ["m"], "u", strict=True) == "m"
    assert choose_model("m", ["m", "lora"], "u", strict=True) == "m"
    assert choose_model("other", ["m"], "u", strict=False) == "other"  # SGLang ignores the name
    assert choose_model(None, ["a", "b"], "u", strict=False) == ""
    with pytest.raises(ConfigError, match=r"serves \['a', 'b'\]; pick one with --served-model-name"):
        choose_model(None, ["a", "b"], "u", strict=True)


def test_help_shows_defaults_and_every_option_has_help(capsys: pytest.CaptureFixture[str]) -> None:
    parser = build_parser()
    subparsers = next(a for a in parser._actions if a.dest == "command").choices  # noqa: SLF001
    for name, sub in subparsers.items():
        for action in sub._actions:  # noqa: SLF001
            assert action.help, f"polar-env {name} {action.option_strings or action.dest} has no help text"
    with pytest.raises(SystemExit):
        main(["gateway", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "(default: 8100)" in text and "(default: 30.0)" in text and "(default: None)" not in text
    with pytest.raises(SystemExit):
        main(["--version"])
    assert capsys.readouterr().out.strip() == f"polar-env {__version__}"


def _post(url: str, body: object, headers: dict[str, str] | None = None) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.load(resp)
    except urllib.error.HTTPError as exc:
        return exc.code, json.load(exc)


def test_gateway_process_infers_engine_and_model_and_logs_requests(tmp_path: Path, fake_vllm: str) -> None:
    """A real ``polar-env gateway`` process given only ``--engine-url …/v1``: vLLM inferred, the
    engine's one model adopted, the absolute store path in the ready line; one log line per
    request, and the session key a Gemini client sends as ``?key=`` never reaches the log."""
    port = free_port()
    store = tmp_path / "capture"
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "polar_env.cli", "gateway", "--engine-url", f"{fake_vllm}/v1", "--port", str(port),
         "--store", str(tmp_path / "." / "capture"), "--log-level", "info"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path,
    )
    try:
        assert proc.stdout is not None
        ready = proc.stdout.readline()
        assert f"engine: vllm {fake_vllm}, model '{MODEL}'" in ready, ready
        token_file = store / "admin_token"
        assert ready.rstrip().endswith(f"on http://127.0.0.1:{port}; store {store}; admin token in {token_file}"), ready
        base = f"http://127.0.0.1:{port}"
        admin = {"Authorization": f"Bearer {token_file.read_text().strip()}"}
        status, session = _post(f"{base}/sessions", {"session_id": "s1"}, admin)
        assert status == 201, session
        status, reply = _post(f"{base}/v1/chat/completions", {"model": "any", "messages": [{"role": "user", "content": "hi"}]},
                              {"Authorization": f"Bearer {session['key']}"})
        assert status == 200 and reply["choices"][0]["message"]["tool_calls"], reply
        status, _ = _post(f"{base}/v1beta/models/m:generateContent?key=SECRET-KEY-123", {"contents": []})
        assert status == 401
        assert (store / "s1.jsonl").read_bytes().count(b"\n") == 1
    finally:
        proc.send_signal(signal.SIGTERM)
        _out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert "method=POST path=/v1/chat/completions status=200" in err, err
    denied = [line for line in err.splitlines() if "status=401" in line]
    assert len(denied) == 1 and " WARNING " in denied[0] and "error=" in denied[0], err
    assert "SECRET-KEY-123" not in err
