"""``load_once``: a tokenizer asked for by many threads at once is built once."""

from __future__ import annotations

import threading
import time

from polar_env.chat.base import load_once


def test_threads_asking_while_the_first_load_runs_wait_for_it() -> None:
    calls: list[str] = []
    entered, release = threading.Event(), threading.Event()

    @load_once
    def load(name: str) -> object:
        calls.append(name)
        entered.set()
        release.wait(10)
        return object()

    results: list[object] = []
    first = threading.Thread(target=lambda: results.append(load("qwen")))
    first.start()
    assert entered.wait(10)
    others = [threading.Thread(target=lambda: results.append(load("qwen"))) for _ in range(7)]
    for t in others:
        t.start()
    time.sleep(0.2)  # let them reach the call; functools.cache would run the load in each of them
    release.set()
    for t in [first, *others]:
        t.join(10)
    assert calls == ["qwen"]
    assert len(results) == 8 and all(r is results[0] for r in results)


def test_each_argument_tuple_loads_once() -> None:
    calls: list[str] = []

    @load_once
    def load(name: str) -> str:
        calls.append(name)
        return name.upper()

    assert [load("a"), load("b"), load("a")] == ["A", "B", "A"]
    assert calls == ["a", "b"]
