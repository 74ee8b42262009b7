from __future__ import annotations

import asyncio

from polar_env.staging.pools import PoolLimits, PrioritySemaphore


async def test_priority_semaphore_serves_higher_priority_first_then_fifo() -> None:
    sem = PrioritySemaphore(1)
    await sem.acquire()
    order: list[str] = []

    async def waiter(name: str, priority: int) -> None:
        await sem.acquire(priority)
        order.append(name)
        sem.release()

    tasks = [asyncio.create_task(waiter(n, p)) for n, p in (("low-a", 10), ("high", 90), ("low-b", 10), ("mid", 50))]
    await asyncio.sleep(0.01)
    sem.release()
    await asyncio.gather(*tasks)
    assert order == ["high", "mid", "low-a", "low-b"]


async def test_cancelled_waiter_does_not_leak_a_place() -> None:
    sem = PrioritySemaphore(1)
    await sem.acquire()
    waiting = asyncio.create_task(sem.acquire(5))
    await asyncio.sleep(0.01)
    waiting.cancel()
    await asyncio.gather(waiting, return_exceptions=True)
    sem.release()
    await asyncio.wait_for(sem.acquire(), 1)  # the place came back


def test_ready_buffer_defaults_to_running_plus_init() -> None:
    assert PoolLimits(max_running=8, max_init=3).ready_buffer == 11
    assert PoolLimits(max_running=8, ready_buffer=2).ready_buffer == 2
