#!/usr/bin/env python3
"""Chaos run of the gateway: >=1,000 sessions against a fault-injecting engine, while the gateway is
killed with SIGKILL at random points (often just after an 8 MB request went in) and restarted on the
same store, some restarts under a file-size limit (``RLIMIT_FSIZE``: the disk fills up).

    python scripts/chaos_gateway.py [--sessions 1000] [--concurrency 48] [--seed 0]

``FaultyEngine`` is a test double: a vLLM-shaped HTTP server (token ids, logprobs) that answers
normally or, by a seeded draw per call, with an HTTP 500, a 429, a hang past the gateway's engine
timeout, a connection reset in the middle of the body, garbage JSON, or an infinite logprob.
The gateway is the real one (``polar-env gateway --engine vllm``) in its own process.

At the end the store is read back and checked: every call a client saw answered (200) is in its
session's journal (found by a unique marker in the request), every journal reads back whole, no
call hung. Printed: counts per outcome, lost answered calls, 5xx from our code, hung calls, torn
tails repaired, times. Exit 1 if lost, 5xx-from-our-code or hung is not 0.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import re
import resource
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson
from aiohttp import web

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

ADMIN = "polar-chaos-admin-token"
ENGINE_TIMEOUT_S = 2.0
FAULTS = {"ok": 70, "http500": 5, "http429": 3, "hang": 3, "reset": 5, "garbage": 5, "inf_logprob": 4, "slow": 5}
BIG_BYTES = 8 << 20
FSIZE_LIMIT = 6 << 20  # a "full disk": no journal may grow past 6 MB (an 8 MB record cannot be written)
MARKER = re.compile(rb"chaos call ([0-9a-f]{32})")  # the size at which a kill -9 used to tear the tail


# -- the fault-injecting engine (test double) ----------------------------------------------------


class FaultyEngine:
    """vLLM-shaped ``/v1/chat/completions`` with seeded faults. Test double, named as one."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.counts: Counter[str] = Counter()
        names, weights = zip(*FAULTS.items(), strict=True)
        self._names, self._weights = list(names), list(weights)

    def body(self, logprob: str = "-0.25") -> bytes:
        ids = [self.rng.randrange(1000, 5000) for _ in range(8)] + [248046]
        content = ",".join(f'{{"token":"t","logprob":{logprob},"bytes":[116]}}' for _ in ids)
        return (b'{"id":"x","object":"chat.completion","model":"chaos","prompt_token_ids":[1,2,3,4],'
                b'"choices":[{"index":0,"message":{"role":"assistant","content":"done","reasoning":"think"},'
                b'"logprobs":{"content":[' + content.encode() + b']},"finish_reason":"stop","stop_reason":null,'
                b'"token_ids":' + orjson.dumps(ids) + b'}]}')

    async def chat(self, request: web.Request) -> web.StreamResponse:
        try:
            return await self._chat(request)
        except ConnectionError:  # the gateway was killed while we read or wrote
            return web.Response(status=499)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        await request.read()
        fault = self.rng.choices(self._names, self._weights)[0]
        self.counts[fault] += 1
        await asyncio.sleep(self.rng.uniform(0.005, 0.04))
        if fault == "http500":
            return web.json_response({"error": {"message": "CUDA error at http://10.1.2.3:8000", "code": 500}}, status=500)
        if fault == "http429":
            return web.json_response({"error": {"message": "too many requests", "code": 429}}, status=429)
        if fault == "hang":
            await asyncio.sleep(ENGINE_TIMEOUT_S * 5)
        if fault == "slow":
            await asyncio.sleep(ENGINE_TIMEOUT_S * 0.6)
        if fault == "garbage":
            return web.Response(body=b'{"choices": [{"tok', content_type="application/json")
        if fault == "reset":
            full = self.body()
            resp = web.StreamResponse(headers={"Content-Type": "application/json", "Content-Length": str(len(full))})
            await resp.prepare(request)
            await resp.write(full[: len(full) // 2])
            assert request.transport is not None
            request.transport.abort()
            return resp
        return web.Response(body=self.body("-1e400" if fault == "inf_logprob" else "-0.25"), content_type="application/json")


# -- the gateway process -------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class GatewayProcess:
    def __init__(self, store: Path, engine_url: str) -> None:
        self.store, self.engine_url = store, engine_url
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self.up = asyncio.Event()
        self.starts = 0
        self.fsize_limited = 0

    async def start(self, fsize: int | None = None) -> None:
        def limit() -> None:
            if fsize is not None:
                resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))

        self.proc = subprocess.Popen(
            [sys.executable, "-m", "polar_env.cli", "gateway", "--port", str(self.port), "--engine", "vllm",
             "--engine-url", self.engine_url, "--store", str(self.store), "--admin-token", ADMIN,
             "--engine-timeout", str(ENGINE_TIMEOUT_S), "--log-level", "error"],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=open(self.store.parent / "gateway.log", "ab"),  # noqa: SIM115
            preexec_fn=limit,
        )
        assert self.proc.stdout is not None
        line = await asyncio.to_thread(self.proc.stdout.readline)
        if b"ready" not in line:
            raise RuntimeError(f"gateway did not start: {line!r}")
        self.starts += 1
        self.fsize_limited += fsize is not None
        self.up.set()

    def kill(self) -> None:
        self.up.clear()
        if self.proc is not None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()
            if self.proc.stdout is not None:
                self.proc.stdout.close()

    def stop(self) -> None:
        self.up.clear()
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(timeout=30)
        if self.proc is not None and self.proc.stdout is not None:
            self.proc.stdout.close()


# -- clients -------------------------------------------------------------------------------------


@dataclass
class Tally:
    outcomes: Counter[str] = field(default_factory=Counter)
    answered: dict[str, list[str]] = field(default_factory=dict)  # session -> markers answered 200
    keys: dict[str, str] = field(default_factory=dict)
    latencies: list[float] = field(default_factory=list)
    our_5xx: list[str] = field(default_factory=list)
    hung: int = 0
    sessions_done: int = 0


def request_for(marker: str, big: bool, rng: random.Random) -> tuple[str, dict[str, Any], dict[str, str]]:
    text = f"chaos call {marker}"
    if big:
        text += " " + "x" * BIG_BYTES
    if rng.random() < 0.5:
        return "/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": text}],
                                        "stream": rng.random() < 0.5}, {}
    return "/v1/messages", {"model": "claude", "max_tokens": 64, "messages": [{"role": "user", "content": text}],
                            "stream": rng.random() < 0.5}, {"anthropic-version": "2023-06-01"}


async def one_session(index: int, http: aiohttp.ClientSession, gw: GatewayProcess, tally: Tally, rng: random.Random,
                      big_sent: asyncio.Event) -> None:
    def base() -> str:  # the port stays the same across restarts; read it per call anyway
        return f"http://127.0.0.1:{gw.port}"

    deadline = time.monotonic() + 300
    key = sid = None
    while key is None:
        await gw.up.wait()
        if time.monotonic() > deadline:
            tally.hung += 1
            return
        try:
            async with http.post(f"{base()}/sessions", json={"session_id": f"chaos-{index}-{uuid.uuid4().hex[:6]}"},
                                 headers={"Authorization": f"Bearer {ADMIN}"}) as resp:
                if resp.status == 201:
                    data = await resp.json()
                    key, sid = data["key"], data["session_id"]
                else:
                    tally.outcomes[f"create {resp.status}"] += 1
                    await asyncio.sleep(0.05)
        except (aiohttp.ClientError, TimeoutError):
            tally.outcomes["create: connection lost"] += 1
            await asyncio.sleep(0.05)
    assert sid is not None
    tally.answered[sid] = []
    tally.keys[sid] = key
    for _ in range(rng.randint(1, 4)):
        marker = uuid.uuid4().hex
        big = rng.random() < 0.03
        path, body, extra = request_for(marker, big, rng)
        await gw.up.wait()
        started = time.monotonic()
        try:
            if big:
                big_sent.set()
            async with http.post(f"{base()}{path}", data=orjson.dumps(body),
                                 headers={"Authorization": f"Bearer {key}", "x-api-key": key, "Content-Type": "application/json", **extra},
                                 timeout=aiohttp.ClientTimeout(total=ENGINE_TIMEOUT_S + 20)) as resp:
                raw = await resp.read()
                status = resp.status
        except TimeoutError:
            tally.hung += 1
            tally.outcomes["hung (client timeout)"] += 1
            continue
        except aiohttp.ClientError:
            tally.outcomes["connection lost (gateway killed)"] += 1
            continue
        if status == 200:
            if not raw.startswith(b"{") and not raw.startswith(b"event:") and not raw.startswith(b"data:"):
                tally.our_5xx.append(f"200 with an unreadable body {raw[:80]!r}")
            tally.answered[sid].append(marker)
            tally.latencies.append(time.monotonic() - started)
            tally.outcomes["200 answered"] += 1
            continue
        try:
            message = str(orjson.loads(raw)["error"]["message"])
        except (orjson.JSONDecodeError, KeyError, TypeError):
            tally.our_5xx.append(f"{status} not in provider shape: {raw[:120]!r}")
            continue
        if status == 500 and "could not record" in message:
            tally.outcomes["500 capture refused (file size limit)"] += 1
        elif status >= 500 and status not in (502, 503, 504):
            tally.our_5xx.append(f"{status}: {message[:200]}")
        elif "10.1.2.3" in message:
            tally.our_5xx.append(f"{status} leaked the engine's address: {message[:200]}")
        else:
            tally.outcomes[f"{status} (engine fault, provider-shaped)"] += 1
    tally.sessions_done += 1


async def killer(gw: GatewayProcess, stop: asyncio.Event, rng: random.Random, big_sent: asyncio.Event, log: Counter[str]) -> None:
    while not stop.is_set():
        await asyncio.sleep(rng.uniform(1.5, 4.0))  # let traffic flow between kills
        if rng.random() < 0.5:
            big_sent.clear()
            try:
                await asyncio.wait_for(big_sent.wait(), 10)
                await asyncio.sleep(rng.uniform(0.0, 0.15))  # while the 8 MB record is parsed or written
                log["kills after an 8 MB request"] += 1
            except TimeoutError:
                log["kills at a random point"] += 1
        else:
            log["kills at a random point"] += 1
        if stop.is_set():
            return
        gw.kill()
        await gw.start(fsize=FSIZE_LIMIT if gw.starts % 3 == 2 else None)


async def main_async(args: argparse.Namespace) -> int:
    from polar_env.journal.store import JournalStore

    work = Path(tempfile.mkdtemp(prefix="polar-chaos-"))
    store = work / "store"
    engine = FaultyEngine(args.seed)
    app = web.Application(client_max_size=64 << 20)
    app.router.add_post("/v1/chat/completions", engine.chat)

    async def models(request: web.Request) -> web.Response:  # the gateway's start-up probe reads it
        return web.json_response({"object": "list", "data": [{"id": "chaos", "object": "model"}]})

    app.router.add_get("/v1/models", models)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    engine_url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]
    gw = GatewayProcess(store, engine_url)
    await gw.start()
    rng = random.Random(args.seed)
    tally, kills = Tally(), Counter[str]()
    stop, big_sent = asyncio.Event(), asyncio.Event()
    started = time.monotonic()
    kill_task = asyncio.create_task(killer(gw, stop, random.Random(args.seed + 1), big_sent, kills))
    sem = asyncio.Semaphore(args.concurrency)
    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
            async def guarded(i: int) -> None:
                async with sem:
                    await one_session(i, http, gw, tally, random.Random(rng.random()), big_sent)

            await asyncio.gather(*(guarded(i) for i in range(args.sessions)))
        stop.set()
        big_sent.set()
        await kill_task
        # Journals a kill tore: one more call each after a restart must land after the cut-off tail.
        torn_ids = [p.stem for p in store.glob("*.jsonl") if p.stat().st_size and not p.read_bytes().endswith(b"\n")]
        async with aiohttp.ClientSession() as http:
            for sid in torn_ids:
                for _ in range(20):  # the engine double still injects faults: retry until answered
                    marker = uuid.uuid4().hex
                    path, body, extra = request_for(marker, False, rng)
                    async with http.post(f"http://127.0.0.1:{gw.port}{path}", json=body,
                                         headers={"Authorization": f"Bearer {tally.keys[sid]}", "x-api-key": tally.keys[sid],
                                                  **extra}) as resp:
                        await resp.read()
                        tally.outcomes[f"after-tear call {resp.status}"] += 1
                        if resp.status == 200:
                            tally.answered[sid].append(marker)
                            break
    finally:
        stop.set()
        big_sent.set()
        await kill_task
        gw.stop()
        await runner.cleanup()
    run_s = time.monotonic() - started

    # Read everything back the way a trainer would, after the last restart.
    t = time.monotonic()
    reread = JournalStore(store)
    lost, records, unreadable, duplicate_seq = 0, 0, 0, 0
    for sid, markers in tally.answered.items():
        try:
            recs = reread.read(sid)
        except Exception as exc:  # noqa: BLE001 - counted, reported
            unreadable += 1
            print(f"UNREADABLE {sid}: {exc}")
            continue
        records += len(recs)
        seqs = [r.seq for r in recs]
        duplicate_seq += len(seqs) - len(set(seqs))
        seen = {found.group(1).decode() for r in recs if (found := MARKER.search(orjson.dumps(r.provider_request)[:400]))}
        lost += len(set(markers) - seen)
    read_s = time.monotonic() - t
    torn = sorted(store.glob("*.jsonl.torn"))
    torn_pending = sum(1 for p in store.glob("*.jsonl") if p.stat().st_size and not p.read_bytes().endswith(b"\n"))
    lat = sorted(tally.latencies)
    print(f"chaos_gateway: {args.sessions} sessions ({tally.sessions_done} finished), concurrency {args.concurrency}, "
          f"run {run_s:.1f}s, read-back {read_s:.1f}s")
    print(f"gateway starts {gw.starts} ({gw.fsize_limited} under RLIMIT_FSIZE {FSIZE_LIMIT >> 20} MB); "
          + ", ".join(f"{k} {v}" for k, v in sorted(kills.items())))
    print("engine faults drawn: " + ", ".join(f"{k} {v}" for k, v in sorted(engine.counts.items())))
    print("client outcomes: " + ", ".join(f"{k}: {v}" for k, v in sorted(tally.outcomes.items())))
    if lat:
        print(f"answered latency p50 {statistics.median(lat) * 1000:.0f} ms, p99 {lat[int(len(lat) * 0.99) - 1] * 1000:.0f} ms")
    print(f"journals: {records} records read back, {unreadable} unreadable sessions, {duplicate_seq} duplicate seqs, "
          f"{len(torn)} torn tails repaired on reopen, {torn_pending} torn tails awaiting their next append")
    answered = sum(len(m) for m in tally.answered.values())
    print(f"RESULT answered calls {answered}, lost answered calls {lost}, 5xx from our code {len(tally.our_5xx)}, "
          f"hung {tally.hung}, unreadable journals {unreadable}")
    for line in tally.our_5xx[:10]:
        print(f"  ours: {line}")
    ok = lost == 0 and not tally.our_5xx and tally.hung == 0 and unreadable == 0 and duplicate_seq == 0
    os.environ.get("KEEP_CHAOS") or __import__("shutil").rmtree(work, ignore_errors=True)
    return 0 if ok else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sessions", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=48)
    parser.add_argument("--seed", type=int, default=0)
    return asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    sys.exit(main())
