"""What every runtime shares about the inside of a session: where the gateway relay and the
gateway socket live, and how a command becomes an argv (a string runs under ``/bin/sh -c``)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from polar_env.errors import ConfigError

RELAY_SOURCE = Path(__file__).with_name("relay.py")
POLAR_RUN_DIR = "/run/polar"
GATEWAY_SOCKET = "/run/polar/gw.sock"
RELAY_PATH = "/run/polar/relay.py"


def relay_argv(port: int, command: Sequence[str]) -> list[str]:
    """The in-runtime launcher: bind 127.0.0.1:port, relay to the gateway socket, exec ``command``."""
    return ["python3", RELAY_PATH, "--listen", f"127.0.0.1:{port}", "--socket", GATEWAY_SOCKET, "--", *command]


def shell_argv(command: str | Sequence[str]) -> list[str]:
    """A string runs under ``/bin/sh -c``; a list is the argv itself."""
    argv = ["/bin/sh", "-c", command] if isinstance(command, str) else [str(a) for a in command]
    if not argv:
        raise ConfigError("empty command")
    return argv
