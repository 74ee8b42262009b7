"""A run's topology and health, and its curves, from what the run folder records.

Topology: the rollout server (``--server``), each node (host, pid, stage counts against its
limits, sessions held, engine calls in flight, busy fraction, errors, its ``/metrics``), the engine
(kind, model, a pool's members or an SGLang router and its workers) and which nodes died, with the
sessions lost with them (``node_lost``). While a job runs this is ``live.json``'s ``nodes`` (each
node's stats, twice a second); once it has finished, ``report.json``'s. A node is ``alive`` only while
its job is (``liveness.run_state``: its heartbeat, not a file): the nodes of a finished, crashed or
interrupted job are ``stopped``, with no ``/metrics`` URL to scrape (their last one is kept as
``last_metrics_url``); a crashed job's nodes are its last ``live.json``'s.

Curves: reward and pass rate over the run's time (each session counted when it finished), sampled
tokens per second and session latency; per step for a ``polar-env train`` run (its
``steps.jsonl``); and where its TensorBoard / W&B files are, with the command that opens them.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

import orjson

from polar_env.dashboard.runs import FINISHED, Run

_NODE_KEYS = ("node_id", "host", "ip", "pid", "active", "completed", "counts", "peak", "limits", "engine_in_flight",
              "engine_busy_fraction", "engine_slot_utilization", "engine_calls", "engine_errors", "sampled_tokens",
              "elapsed_s", "metrics_url", "metrics_token_file", "engine", "spool")


def _engine_config(run: Run) -> dict[str, Any]:
    job = run.plan().get("job") or (run.report().get("config") or {})
    return dict((job.get("env") or {}).get("engine") or {})


def topology(run: Run, server: dict[str, Any] | None = None) -> dict[str, Any]:
    """Server, nodes, engine and limits; ``server``: a live ``polar-env serve``'s ``/rollout/status``."""
    live = run.is_live()
    state = run.state_name()
    source: str | None
    if server is not None:
        stats, source = list(server.get("nodes") or []), "server"
    elif live:
        stats, source = list((run.live_snapshot() or {}).get("nodes") or []), "live.json"
    elif run.finished:
        stats, source = list(run.report().get("nodes") or []), f"report.json (the job is {state}; its nodes stopped)"
    else:
        stats = list((run.live_snapshot() or {}).get("nodes") or [])
        source = f"live.json, last written before the job {state}; its nodes stopped" if stats else None
    lost: dict[str, int] = {}
    for r in run.rows():
        if r.get("failure_kind") == "node_lost":
            lost[str(r.get("node_id") or "-")] = lost.get(str(r.get("node_id") or "-"), 0) + 1
    nodes = []
    for s in stats:
        node = {k: s.get(k) for k in _NODE_KEYS}
        up = server is not None or live
        node["state"] = "dead" if "dead" in s else ("alive" if up else "stopped")
        node["dead"] = s.get("dead")
        if not up:  # its gateway went with the job: nothing listens at that URL now
            node["last_metrics_url"], node["metrics_url"] = node["metrics_url"], None
        node["node_lost"] = lost.get(str(s.get("node_id")), 0)
        nodes.append(node)
    engine = _engine_config(run)
    urls = engine.get("url")
    urls = [u.strip() for u in urls.split(",")] if isinstance(urls, str) else list(urls or [])
    env = (run.plan().get("job") or run.report().get("config") or {}).get("env") or {}
    return {
        "run": run.name, "live": live or server is not None, "source": source,
        "job": run.state().model_dump(include={"state", "reason", "pid", "host", "error", "resume"}) | {"state": state},
        "server": None if server is None else {"url": getattr(run, "url", None), "tasks": len(server.get("tasks") or []),
                                               "states": _states(server.get("tasks") or [])},
        "engine": {"kind": engine.get("kind", "embedded"), "model": engine.get("model"), "urls": urls},
        "limits": env.get("limits"), "nodes_planned": env.get("nodes"), "ray": env.get("ray"),
        "nodes": nodes, "dead_nodes": [n["node_id"] for n in nodes if n["state"] == "dead"],
        "node_lost": sum(lost.values()),
    }


def _states(tasks: list[dict[str, Any]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for t in tasks:
        out[str(t.get("state"))] = out.get(str(t.get("state")), 0) + 1
    return out


def _read_lines(path: Path) -> list[dict[str, Any]]:
    try:
        return [orjson.loads(line) for line in path.read_bytes().splitlines() if line.strip()]
    except (FileNotFoundError, orjson.JSONDecodeError):
        return []


def trackers(path: Path) -> list[dict[str, str]]:
    """The run's tracker output (``--tracker``: ``tensorboard/``, ``wandb/``) and how to open it."""
    out = []
    if (path / "tensorboard").is_dir():
        out.append({"kind": "tensorboard", "path": str(path / "tensorboard"),
                    "command": f"tensorboard --logdir {path / 'tensorboard'}"})
    if (path / "wandb").is_dir():
        runs = sorted(p for p in (path / "wandb").glob("*run-*") if p.is_dir())
        target = runs[-1] if runs else path / "wandb"
        out.append({"kind": "wandb", "path": str(target), "command": f"wandb sync {target}"})
    return out


def per_rollout(done: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A slime run's finished sessions per rollout id (slime's W&B step): sessions, mean reward,
    pass rate and sampled tokens, in rollout order."""
    by_id: dict[int, list[dict[str, Any]]] = {}
    for r in done:
        if isinstance(r.get("rollout_id"), int):
            by_id.setdefault(int(r["rollout_id"]), []).append(r)
    out = []
    for rid, rows in sorted(by_id.items()):
        rewards = [float(r["reward"] or 0.0) for r in rows]
        out.append({"rollout_id": rid, "sessions": len(rows), "mean_reward": round(statistics.fmean(rewards), 4),
                    "pass_rate": round(sum(x >= 1.0 for x in rewards) / len(rows), 4),
                    "sampled_tokens": sum(int(r.get("tokens") or 0) for r in rows)})
    return out


def curves(run: Run) -> dict[str, Any]:
    """Per finished session in finishing order: seconds since the run started, and the running
    mean reward, pass rate (reward >= 1) and sampled tokens per second up to then; each
    session's wall seconds (latency); a train run's steps; a slime run's rollouts."""
    done = sorted((r for r in run.rows() if r["status"] in FINISHED and r.get("ended_at") is not None),
                  key=lambda r: float(r["ended_at"]))
    t0 = float(run.plan().get("created_at") or (min(float(r["ended_at"]) - float(r["wall_s"] or 0.0) for r in done)
                                                  if done else 0.0))
    points = []
    total = passed = tokens = 0.0
    counted = 0
    for i, r in enumerate(done, 1):
        t = max(0.0, float(r["ended_at"]) - t0)
        reward = float(r["reward"] or 0.0)
        total += reward
        passed += reward >= 1.0
        tokens += float(r.get("tokens") or 0)
        counted += r.get("tokens") is not None
        points.append({"t": round(t, 3), "session_id": r["session_id"], "reward": reward,
                       "mean_reward": round(total / i, 4), "pass_rate": round(passed / i, 4),
                       # None, not 0, while no session so far records its sampled tokens (a train run's)
                       "tokens_per_s": round(tokens / t, 2) if t > 0 and counted else None, "wall_s": r.get("wall_s")})
    walls = [float(r["wall_s"]) for r in done if r.get("wall_s") is not None]
    steps = [{"step": s.get("step"), "reward_mean": s.get("reward_mean"), "rollouts": s.get("rollouts"),
              "sampled_tokens": s.get("sampled_tokens"), "rollout_s": s.get("rollout_s"), "train_s": s.get("train_s"),
              "tokens_per_s": s["sampled_tokens"] / s["rollout_s"] if s.get("rollout_s") else None,
              "loss": s.get("loss")} for s in _read_lines(run.path / "steps.jsonl")]
    return {"run": run.name, "live": run.is_live(), "points": points, "steps": steps, "trackers": trackers(run.path),
            "per_rollout": per_rollout(done),
            "latency": {"sessions": len(walls), "mean_wall_s": round(statistics.fmean(walls), 3) if walls else None,
                        "p50_wall_s": round(statistics.median(walls), 3) if walls else None,
                        "max_wall_s": round(max(walls), 3) if walls else None}}
