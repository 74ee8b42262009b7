#!/usr/bin/env python3
"""TCP -> unix-socket relay: the harness's only road to the gateway.

Runs *inside* a runtime whose network namespace has nothing but loopback. It listens on
``127.0.0.1:<port>`` and forwards every connection, byte for byte in both directions (half-close
included), to the gateway's unix socket bound into the runtime (``/run/polar/gw.sock``), so harness
base URLs stay plain ``http://127.0.0.1:<port>``.

Self-contained and stdlib-only on purpose: it is copied as a single file into images that have a
``python3`` (3.7+) but not polar_env.

    python3 relay.py --listen 127.0.0.1:8100 --socket /run/polar/gw.sock              # foreground
    python3 relay.py --listen 127.0.0.1:8100 --socket /run/polar/gw.sock --background # returns once bound
    python3 relay.py --listen 127.0.0.1:8100 --socket /run/polar/gw.sock -- CMD ARGS  # bind, relay in a
                                                             # forked child, exec CMD in this process

What the relay does *not* do: filter paths. It runs inside the runtime with the agent's own
privileges, next to the unix socket it forwards to (bound read-write at ``/run/polar/gw.sock``), so
an allow-list here would be bypassed by connecting to the socket directly. The boundary is on the
gateway side instead: the socket bound into runtimes is served by ``build_provider_app`` (provider
routes only; no session or admin routes exist there), and every provider route checks the
session key. ``tests/runtimes/test_isolation.py`` probes both roads from inside a real sandbox.

In the last two forms the listening socket is bound before this process returns or execs, so the
command can connect at once (the kernel queues connections until the child's loop accepts them).
The forked child detaches (new session, stdio on /dev/null); it ends with the runtime's pid
namespace (sandbox/apptainer: per exec) or with the container (docker: started once at prepare).
"""

import argparse
import asyncio
import errno
import fcntl
import os
import socket
import struct
import sys

CHUNK = 65536
SIOCGIFFLAGS = 0x8913
SIOCSIFFLAGS = 0x8914
IFF_UP = 0x1


def loopback_up() -> None:
    """Best effort: bring ``lo`` up in a fresh network namespace (unshare/apptainer may leave it down)."""
    try:
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    except OSError:
        return
    try:
        ifreq = struct.pack("16sH14x", b"lo", 0)
        flags = struct.unpack("16sH14x", fcntl.ioctl(s.fileno(), SIOCGIFFLAGS, ifreq))[1]
        if not flags & IFF_UP:
            fcntl.ioctl(s.fileno(), SIOCSIFFLAGS, struct.pack("16sH14x", b"lo", flags | IFF_UP))
    except OSError:
        pass
    finally:
        s.close()


def parse_listen(value: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit():
        raise argparse.ArgumentTypeError(f"--listen wants HOST:PORT, got {value!r}")
    return (host.strip("[]") or "127.0.0.1", int(port))


def bind_listener(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        if e.errno != errno.EADDRNOTAVAIL:
            sock.close()
            raise
        loopback_up()
        sock.bind((host, port))
    sock.listen(128)
    sock.setblocking(False)
    return sock


async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while True:
            data = await reader.read(CHUNK)
            if not data:
                break
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
    except (OSError, asyncio.IncompleteReadError):
        writer.close()


async def handle(client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter, unix_path: str) -> None:
    try:
        up_r, up_w = await asyncio.open_unix_connection(unix_path)
    except OSError as e:
        sys.stderr.write(f"relay: cannot reach {unix_path}: {e}\n")
        client_w.close()
        return
    try:
        await asyncio.gather(pipe(client_r, up_w), pipe(up_r, client_w))
    finally:
        for w in (up_w, client_w):
            w.close()


async def serve(listener: socket.socket, unix_path: str) -> None:
    server = await asyncio.start_server(lambda r, w: handle(r, w, unix_path), sock=listener)
    async with server:
        await server.serve_forever()


def run_forever(listener: socket.socket, unix_path: str) -> None:
    try:
        asyncio.run(serve(listener, unix_path))
    except KeyboardInterrupt:
        pass


def detach_child() -> bool:
    """Fork; the child (returns True) detaches from the session and stdio. The parent returns False."""
    pid = os.fork()
    if pid:
        return False
    os.setsid()
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    if devnull > 2:
        os.close(devnull)
    return True


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = []
    if "--" in argv:
        i = argv.index("--")
        argv, command = argv[:i], argv[i + 1 :]
    p = argparse.ArgumentParser(prog="relay", description="Relay TCP connections to a unix socket.")
    p.add_argument("--listen", required=True, type=parse_listen, help="HOST:PORT to listen on")
    p.add_argument("--socket", required=True, help="unix socket to forward to")
    p.add_argument("--background", action="store_true", help="return once bound; relay in a child")
    args = p.parse_args(argv)

    try:
        listener = bind_listener(*args.listen)
    except OSError as e:
        sys.stderr.write(f"relay: cannot listen on {args.listen[0]}:{args.listen[1]}: {e}\n")
        return 125
    if not command and not args.background:
        run_forever(listener, args.socket)
        return 0
    if detach_child():
        try:
            run_forever(listener, args.socket)
        finally:
            os._exit(0)
    listener.close()  # the child holds it now
    if not command:
        return 0
    try:
        os.execvp(command[0], command)
    except OSError as e:
        sys.stderr.write(f"relay: cannot exec {command[0]}: {e}\n")
        return 127 if e.errno == errno.ENOENT else 126


if __name__ == "__main__":
    sys.exit(main())
