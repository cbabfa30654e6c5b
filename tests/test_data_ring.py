"""The shared-memory ring between a worker and the consumer, used as a hostile
user would: workers killed while they post into it, interrupts inside
``next()`` while it is full, both message channels (ring and socket) in one
stream, and the socket-only transport other machines use. Real processes,
real signals, real shared memory; no mocks.

Launcher tests (they start worker processes): serial session only.
"""

from __future__ import annotations

import gc
import os
import platform
import random
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from data_scripts.fns import (
    mixed_channels,
    plain,
    policy,
    second_by_socket,
    slow,
    small,
    tagged,
)

from collective_gc.data import LoaderError, ProcessPrefetch, WorkerError, testing

from _pester import INTERRUPTS, TOTAL, check_exactly_once, consume_under_interrupts
from _util import in_thread

pytestmark = pytest.mark.launcher


@pytest.fixture(params=["ring", "socket"])
def transport(request: Any) -> Iterator[str]:
    """Run the test over the ring (where the platform has it) and over the socket alone."""
    if request.param == "ring" and not testing.RING_AVAILABLE:
        pytest.skip("no shared-memory ring on this platform (x86-64 only)")
    if request.param == "ring":
        yield request.param
    else:
        with testing.socket_only():
            yield request.param
    gc.collect()
    assert not testing.live_leases(), "a lease outlived its loader and its elements"


def test_the_ring_is_used_on_x86_64() -> None:
    assert testing.RING_AVAILABLE == (platform.machine().lower() in ("x86_64", "amd64"))
    if not testing.RING_AVAILABLE:
        pytest.skip("no shared-memory ring on this platform (x86-64 only)")
    with ProcessPrefetch(plain, range(40), num_workers=2, buffer_size=4) as it:
        assert [next(it) for _ in range(30)][:3] == [(0, "0"), (1, "1"), (2, "2")]
        # Each worker has its ring, and its elements were posted there.
        assert all(last >= 15 for last in testing.last_ring_posts(it)), testing.last_ring_posts(it)
    with testing.socket_only(), ProcessPrefetch(plain, range(40), num_workers=2) as it:
        assert [next(it) for _ in range(30)][:3] == [(0, "0"), (1, "1"), (2, "2")]
        assert testing.last_ring_posts(it) == [0, 0]  # no ring: everything by socket


def test_both_channels_in_one_stream_keep_the_order(transport: str) -> None:
    # Small pickles fit a ring entry, medium ones take the socket, arrays take
    # slots (their first use carries a descriptor: the socket), all interleaved.
    with ProcessPrefetch(mixed_channels, range(300), num_workers=3, buffer_size=6) as it:
        for i, e in enumerate(it):
            assert e[0] == i
            if i % 3 == 1:
                assert len(e[1]) == 5000 + i
            elif i % 3 == 2:
                assert e[1].shape == (1024,) and float(e[1][0]) == i and float(e[1][-1]) == i


def _kill_after(pid: int, delay: float) -> threading.Timer:
    def kill() -> None:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    timer = threading.Timer(delay, kill)
    timer.start()
    return timer


@pytest.mark.parametrize("fn", [plain, tagged], ids=["inline", "array"])
def test_a_worker_killed_while_posting_never_delivers_half_an_element(
    fn: Any, transport: str
) -> None:
    # The worker spends most of its time posting (tiny elements, or arrays it
    # only copies): killed at random moments, it often dies in the middle of
    # writing an entry. Every element before the error must be whole and in
    # order, and the error must say the worker died.
    rng = random.Random(7)
    for _ in range(12):
        it = ProcessPrefetch(fn, range(10**6), num_workers=1, buffer_size=8)
        try:
            first = next(it)
            assert (first[0] if fn is plain else int(first[0])) == 0
            (worker,) = testing.workers(it)
            timer = _kill_after(worker.pid, rng.uniform(0.0, 0.03))
            n = 1
            with pytest.raises(WorkerError) as info:
                for e in it:
                    if fn is plain:
                        assert e == (n, str(n))
                    else:
                        assert e.shape == (4096,) and int(e[0]) == n and int(e[-1]) == n
                        assert (e == n).all()
                    n += 1
            timer.join()
            assert info.value.exitcode == -signal.SIGKILL
            with pytest.raises(StopIteration):  # the error ended the iteration
                next(it)
        finally:
            it.close()
        e = first = None  # noqa: F841 (drop the last elements: the fixture counts leases)


@pytest.mark.parametrize("exc", INTERRUPTS)
def test_interrupts_inside_next_while_the_ring_is_full(
    exc: type[BaseException], transport: str
) -> None:
    it = ProcessPrefetch(small, range(TOTAL), num_workers=2, buffer_size=8)
    try:
        assert next(it)[0] == 0
        time.sleep(0.3)  # every worker runs a window ahead: its ring is full
        got, interrupts, error = consume_under_interrupts(it, exc)
        assert interrupts > 0
        got.insert(0, (0, np.float32(0)))
        check_exactly_once(got, error)
        if error is not None:  # the only other outcome: the same clear error on every call
            with pytest.raises(LoaderError, match="lost element"):
                next(it)
    finally:
        it.close()


def test_close_from_another_thread_while_next_sleeps_on_the_bell(transport: str) -> None:
    it = ProcessPrefetch(slow, range(10), num_workers=2)
    for _ in range(4):
        next(it)  # the next element takes 30 s: next() sleeps on the worker's doorbell
    threading.Timer(0.3, it.close).start()
    t0 = time.monotonic()
    with pytest.raises(StopIteration):
        next(it)
    assert time.monotonic() - t0 < 10


def test_workers_never_preempt_the_rank_when_woken() -> None:
    # SCHED_BATCH: a worker the consumer wakes (credit, slots) waits for a free
    # moment instead of taking the consumer's core mid-step; fn's children too.
    with ProcessPrefetch(policy, range(4), num_workers=2) as it:
        assert {p for _, p in it} == {os.SCHED_BATCH}
    assert os.sched_getscheduler(0) != os.SCHED_BATCH  # the rank itself is left alone


def test_the_parent_watch_thread_keeps_the_default_policy() -> None:
    # It ends the worker when the loader closes or the rank dies: that must not
    # wait for a free moment.
    with ProcessPrefetch(policy, range(40), num_workers=1) as it:
        next(it)
        (worker,) = testing.workers(it)
        pid = worker.pid
        policies = {int(t): os.sched_getscheduler(int(t)) for t in os.listdir(f"/proc/{pid}/task")}
    assert policies.pop(pid) == os.SCHED_BATCH  # the thread that runs fn
    assert os.SCHED_OTHER in policies.values()  # the parent watch


def test_a_socket_message_lost_before_a_ring_post_is_reported_not_awaited(
    transport: str,
) -> None:
    # A message gone (an interrupt as it was received could do that before the
    # receive wrote into buffers of the handle). Here the test takes it off the
    # socket itself. The next
    # element is in the ring: next() must see the gap and fail, not wait for
    # a message that will never come.
    it = ProcessPrefetch(second_by_socket, range(8), num_workers=1, buffer_size=4)
    try:
        assert next(it) == (0, "x")
        # Element 1's message (taken in already while next() waited for element
        # 0, or still on the socket).
        assert testing.drop_socket_message(it, 0, 20), "element 1 never came"
        finished, outcome = in_thread(lambda: next(it), 20)
        assert finished, "next() waits for an element that was lost"
        assert isinstance(outcome, LoaderError) and "lost element 1" in str(outcome), outcome
        with pytest.raises(LoaderError, match="lost element 1"):  # and on every later call
            next(it)
    finally:
        it.close()
