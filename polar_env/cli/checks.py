"""Checks of user input for the command line: each failure is one line that says what, where and how to fix."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, NoReturn

from polar_env.errors import ConfigError

# Top-level modules that come from an optional extra: a missing one names the extra to install.
EXTRA_OF_MODULE = {
    "torch": "embedded",
    "transformers": "embedded",
    "safetensors": "embedded",
    "swebench": "swebench",
    "pyarrow": "parquet",
    "docker": "docker",
}


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows ``(default: X)`` only where there is a default worth showing (not None, not off)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False or action.default == argparse.SUPPRESS:
            return action.help
        return super()._get_help_string(action)


class OneLineParser(argparse.ArgumentParser):
    """A subcommand's parser whose mistakes (``--nodes abc``, a missing ``--store``) are one line,
    the flag named, not that line under the whole usage block."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}; see {self.prog} --help\n")


def add_command(sub: argparse._SubParsersAction[argparse.ArgumentParser], name: str, text: str) -> argparse.ArgumentParser:
    """A subcommand whose one-line help is also its description, in the project's help format."""
    sub._parser_class = OneLineParser  # noqa: SLF001 - argparse's documented way is parser_class= at add_subparsers
    return sub.add_parser(name, help=text, description=text, formatter_class=HelpFormatter)


# -- checks of user input: each failure is one line that says what, where and how to fix ------------


def existing_dir(path: str, flag: str, hint: str) -> Path:
    p = Path(path)
    if not p.exists():
        raise ConfigError(f"{flag} {path}: no such folder; {hint}")
    if not p.is_dir():
        raise ConfigError(f"{flag} {path} is a file, not a folder; {hint}")
    return p


def store_to_write(path: str) -> Path:
    """The gateway's capture store: created if absent, but never on top of a file."""
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise ConfigError(f"--store {path} is a file, not a folder; pass a directory for the session journals")
    if not p.exists() and not p.parent.is_dir():
        raise ConfigError(f"--store {path}: its parent folder {p.parent} does not exist; create it (mkdir -p {p.parent})")
    return p.resolve()


def file_to_write(path: str, flag: str) -> Path:
    p = Path(path)
    if p.is_dir():
        raise ConfigError(f"{flag} {path} is a folder; give a file path such as {p / 'out.jsonl'}")
    if not p.parent.is_dir():
        raise ConfigError(f"{flag} {path}: folder {p.parent} does not exist; create it first (mkdir -p {p.parent})")
    return p


def model_dir(path: str) -> Path:
    """A local HF folder or ``.gguf`` file (nothing is ever downloaded: transformers would read a
    missing path as a hub repo id and fail with a misleading message)."""
    from polar_env.weights import check_weights

    return check_weights(Path(path), "--model-dir")


def load_script(path: str) -> Any:
    """The scripted policy from ``--script FILE`` (JSON: ``{"steps": [{command|text, reasoning}]}``)."""
    from polar_env.engines.config import load_policy

    return load_policy(Path(path), "--script")


def check_numbers(args: argparse.Namespace, fields: dict[str, str], bounds: dict[str, tuple[float, float]]) -> None:
    """Flags of commands without a config (``engine``, ``gateway``) against the bounds of the config
    fields they mirror (``fields``: dest -> path, e.g. ``env.engine.seed``) or plain ``bounds``
    (dest -> inclusive low, high): one line naming the flag, before anything starts."""
    from typing import Annotated

    from pydantic import TypeAdapter, ValidationError

    from polar_env.cli.options import fields_at

    for dest, path in fields.items():
        value = getattr(args, dest, None)
        if value is None:
            continue
        field = fields_at(path)[0]
        try:
            TypeAdapter(Annotated[(field.annotation, *field.metadata)]).validate_python(value)
        except ValidationError as exc:
            message = str(exc.errors(include_url=False)[0]["msg"])
            raise ConfigError(f"invalid option --{dest.replace('_', '-')} {_shown(value)}: "
                              f"{message[:1].lower()}{message[1:]}; see --help") from None
    for dest, (low, high) in bounds.items():
        value = getattr(args, dest, None)
        if value is not None and not low <= value <= high:  # NaN fails too
            raise ConfigError(f"invalid option --{dest.replace('_', '-')} {_shown(value)}: give a number from {low:g} "
                              f"to {high:g}; see --help")


def _shown(value: object) -> str:
    """A number as the user typed it, near enough: ``-5`` for -5.0, ``70000`` for 70000."""
    return f"{value:g}" if isinstance(value, float) else str(value)


def missing_extra_message(exc: ModuleNotFoundError, command: str) -> str | None:
    top = (exc.name or "").split(".")[0]
    extra = EXTRA_OF_MODULE.get(top)
    if extra is None:
        return None
    hint = " (CPU-only machine: pip install torch --index-url https://download.pytorch.org/whl/cpu first)" if extra == "embedded" else ""
    return (f"polar-env {command} needs the '{extra}' extra ({top} is not installed): "
            f"pip install 'polar-env[{extra}]', or pip install -e '.[{extra}]' in a checkout{hint}")


# -- engine ------------------------------------------------------------------------------------
