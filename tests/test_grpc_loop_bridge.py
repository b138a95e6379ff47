"""LoopBridge: engine futures settled from another thread reach the loop, in bursts."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import Future

import pytest

from prefill_node.server.loop_bridge import LoopBridge


def _running(n: int) -> list[Future]:
    futures = [Future() for _ in range(n)]
    for f in futures:
        f.set_running_or_notify_cancel()
    return futures


def test_a_burst_from_another_thread_settles_every_waiter_with_few_wakeups():
    async def run():
        loop = asyncio.get_running_loop()
        bridge = LoopBridge(loop)
        futures = _running(200)
        waiters = [bridge.watch(f) for f in futures]
        drains = 0
        original = bridge._drain

        def counting_drain():
            nonlocal drains
            drains += 1
            original()

        bridge._drain = counting_drain

        def settle():
            for i, f in enumerate(futures):
                if i % 7 == 0:
                    f.set_exception(ValueError(f"bad {i}"))
                else:
                    f.set_result(i)

        worker = threading.Thread(target=settle)
        worker.start()
        worker.join()  # blocks the loop: all 200 complete while it cannot drain
        results = await asyncio.gather(*waiters, return_exceptions=True)
        return results, drains

    results, drains = asyncio.run(run())
    for i, r in enumerate(results):
        if i % 7 == 0:
            assert isinstance(r, ValueError) and str(r) == f"bad {i}"
        else:
            assert r == i
    assert drains == 1  # the whole burst cost one loop wakeup


def test_already_done_and_cancelled_waiters():
    async def run():
        bridge = LoopBridge(asyncio.get_running_loop())
        done = Future()
        done.set_result("early")
        assert await bridge.watch(done) == "early"
        (late,) = _running(1)
        waiter = bridge.watch(late)
        waiter.cancel()  # the caller gave up (deadline): the engine result is dropped
        threading.Thread(target=late.set_result, args=("ignored",)).start()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        await asyncio.sleep(0.05)
        cancelled = Future()
        other = bridge.watch(cancelled)
        cancelled.cancel()
        with pytest.raises(asyncio.CancelledError):
            await other

    asyncio.run(run())
