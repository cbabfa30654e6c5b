"""What users of Grain and PyTorch's DataLoader reach for: checkpoints, the
in-process mode, per-worker setup, lazy start, bounded memory release.

Launcher tests (they start worker processes): serial session only.
"""

from __future__ import annotations

import gc
import os
import random
import threading
import weakref
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from data_scripts.fns import fail_at_3, failing_init, make, make_sized, plain, record_init, whoami

import collective_gc as cgc
from collective_gc import local
from collective_gc.data import (
    ProcessPrefetch,
    RemoteTraceback,
    ThreadPrefetch,
    WorkerError,
    testing,
)

from _util import mapped_segments

pytestmark = pytest.mark.launcher


def _children() -> set[int]:
    me = str(os.getpid())
    found = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if f.read().rsplit(")", 1)[1].split()[1] == me:
                        found.add(int(entry))
            except (OSError, IndexError):
                continue
    return found


def _keys(n: int, seed: int) -> list[int]:
    keys = list(range(n))
    random.Random(seed).shuffle(keys)
    return keys


# -- checkpoints ------------------------------------------------------------------------


@pytest.mark.parametrize(("workers", "resumed_workers"), [(2, 2), (2, 3), (0, 2), (3, 0)])
def test_process_loader_resumes_in_a_fresh_loader(workers: int, resumed_workers: int) -> None:
    keys = _keys(23, seed=workers * 10 + resumed_workers)
    first = ProcessPrefetch(plain, keys, num_workers=workers, buffer_size=4)
    before = [next(first)[0] for _ in range(9)]
    state = first.get_state()
    assert state["position"] == 9
    first.close()

    resumed = ProcessPrefetch(plain, keys, num_workers=resumed_workers)
    resumed.set_state(state)
    after = [e[0] for e in resumed]
    assert before + after == keys  # the exact sequence: nothing lost, nothing twice
    assert resumed.get_state()["position"] == len(keys)


def test_process_state_at_the_ends_and_misuse() -> None:
    keys = list(range(6))
    fresh = ProcessPrefetch(plain, keys, num_workers=1)
    fresh.set_state(fresh.get_state())  # position 0: from the start
    assert [e[0] for e in fresh] == keys
    done = ProcessPrefetch(plain, keys, num_workers=1)
    done.set_state({"version": 1, "position": 6, "length": 6})
    assert list(done) == []  # resumed at the end: nothing left

    started = ProcessPrefetch(plain, keys, num_workers=1)
    next(started)
    started.close()
    with pytest.raises(RuntimeError, match="closed"):
        started.set_state({"version": 1, "position": 0, "length": 6})
    other = ProcessPrefetch(plain, keys[:5], num_workers=1)
    with pytest.raises(ValueError, match="length 5"):
        other.set_state({"version": 1, "position": 2, "length": 6})
    with pytest.raises(ValueError, match="outside"):
        other.set_state({"version": 1, "position": 9, "length": 5})


@pytest.mark.parametrize("workers", [0, 1, 3])
def test_process_set_state_between_two_next_calls_rewinds_or_skips_ahead(workers: int) -> None:
    """Issue 24, parity: set_state() worked only before the first next() of a
    new loader (RuntimeError after); Grain's iterators accept it mid-iteration,
    and evaluation loops rewind."""
    keys = _keys(40, seed=workers)
    it = ProcessPrefetch(plain, keys, num_workers=workers, buffer_size=4)
    got = [next(it)[0] for _ in range(9)]
    at9 = it.get_state()
    got += [next(it)[0] for _ in range(5)]
    assert got == keys[:14]
    it.set_state(at9)  # rewind
    assert it.get_state() == at9
    assert [next(it)[0] for _ in range(3)] == keys[9:12]
    it.set_state({"version": 1, "position": 30, "length": 40})  # skip ahead
    assert [e[0] for e in it] == keys[30:]
    assert it.get_state()["position"] == 40
    with pytest.raises(RuntimeError, match="closed"):  # the end closed it
        it.set_state(at9)


def test_process_set_state_keeps_the_workers_at_or_a_buffer_ahead_of_the_position() -> None:
    it = ProcessPrefetch(whoami, range(40), num_workers=2, buffer_size=4)
    first = {next(it)[1] for _ in range(4)}
    it.set_state(it.get_state())
    assert [next(it)[0] for _ in range(4)] == [4, 5, 6, 7]
    it.set_state({"version": 1, "position": 12, "length": 40})  # a buffer ahead
    assert next(it)[0] == 12
    assert {e[1] for e in it} == first  # the same two worker processes throughout
    # An error of fn among the elements skipped: raised, as next() would.
    it = ProcessPrefetch(fail_at_3, range(20), num_workers=1, buffer_size=4)
    next(it)
    with pytest.raises(ValueError, match="cannot load 3"):
        it.set_state({"version": 1, "position": 5, "length": 20})
    assert it.closed
    # Further, or back: new workers.
    it = ProcessPrefetch(whoami, range(20), num_workers=2, buffer_size=4)
    first = {next(it)[1] for _ in range(4)}
    workers = testing.workers(it)
    it.set_state({"version": 1, "position": 1, "length": 20})
    assert all(p.returncode is not None for p in workers)  # stopped, and waited for
    assert [e[0] for e in it] == list(range(1, 20))


def test_thread_loader_resumes_in_a_fresh_loader() -> None:
    keys = _keys(30, seed=3)
    first = ThreadPrefetch(iter(keys), buffer_size=3)
    before = [next(first) for _ in range(11)]
    state = first.get_state()
    first.close()
    resumed = ThreadPrefetch(iter(keys), buffer_size=3)
    resumed.set_state(state)
    assert before + list(resumed) == keys
    with pytest.raises(RuntimeError, match="closed"):
        resumed.set_state(state)


@pytest.mark.parametrize("buffer_size", [0, 3])
def test_thread_set_state_between_two_next_calls_rewinds_or_skips_ahead(buffer_size: int) -> None:
    """Issue 24, parity: as for ProcessPrefetch; rewinding starts the iterable
    again, which only an iterable that is not an iterator can do."""
    keys = _keys(30, seed=4)
    it = ThreadPrefetch(keys, buffer_size=buffer_size)
    got = [next(it) for _ in range(7)]
    at7 = it.get_state()
    got += [next(it) for _ in range(6)]
    assert got == keys[:13]
    it.set_state(at7)  # rewind
    assert it.get_state() == at7
    assert [next(it) for _ in range(2)] == keys[7:9]
    it.set_state({"version": 1, "position": 20})  # skip ahead
    assert [next(it) for _ in range(2)] == keys[20:22]
    it.set_state(it.get_state())  # where it is: nothing changes
    assert list(it) == keys[22:]

    once = ThreadPrefetch(iter(keys), buffer_size=buffer_size)
    assert [next(once) for _ in range(5)] == keys[:5]
    once.set_state({"version": 1, "position": 8})  # ahead: fine with an iterator
    assert next(once) == keys[8]
    with pytest.raises(ValueError, match="iterator"):
        once.set_state(at7)
    assert next(once) == keys[9]  # refused: nothing changed
    once.set_state({"version": 1, "position": 99})  # past the end: the loader ends
    assert list(once) == []
    once.close()


# -- in-process mode --------------------------------------------------------------------


def test_num_workers_0_runs_fn_here_with_the_same_api() -> None:
    before = _children()
    with ProcessPrefetch(whoami, range(5), num_workers=0) as it:
        assert "in-process" in repr(it)
        got = list(it)
        assert _children() == before  # no worker process, ever
    assert [g[0] for g in got] == list(range(5))
    assert all(g[1] == os.getpid() for g in got)
    assert it.closed
    # An error of fn ends the iteration, as with workers (raised as itself, here).
    it2 = ProcessPrefetch(fail_at_3, range(6), num_workers=0)
    assert [int(next(it2)[0]) for _ in range(3)] == [0, 1, 2]
    with pytest.raises(ValueError, match="cannot load 3"):
        next(it2)
    with pytest.raises(StopIteration):
        next(it2)


def test_num_workers_0_makes_each_element_inside_next_on_the_calling_thread() -> None:
    """Issue 32 (held-out rounds): ``num_workers=0`` was accepted and delivered
    elements, with no meaning a user could find. It means what PyTorch's does:
    ``fn`` runs in this process, on the thread that calls ``next()``, one
    element per call, nothing made ahead (``buffer_size`` changes nothing),
    and ``fn`` need not pickle (a lambda: there is no worker to send it to)."""
    calls: list[tuple[int, int]] = []

    def fn(i: int) -> int:
        calls.append((i, threading.get_ident()))
        return 10 * i

    before, running = _children(), threading.active_count()
    it = ProcessPrefetch(fn, range(6), num_workers=0, buffer_size=16)
    assert calls == []  # nothing at construction
    for k in range(3):
        assert next(it) == 10 * k
        assert calls == [(i, threading.get_ident()) for i in range(k + 1)]  # none ahead
    assert _children() == before and threading.active_count() == running
    # An interrupt inside fn (a Ctrl-C while it reads a file): the next call
    # makes the same element again; nothing is skipped.
    stop = [True]

    def interrupted(i: int) -> int:
        if stop and i == 1:
            stop.clear()
            raise KeyboardInterrupt
        return i

    it2 = ProcessPrefetch(interrupted, range(3), num_workers=0)
    assert next(it2) == 0
    with pytest.raises(KeyboardInterrupt):
        next(it2)
    assert not it2.closed and list(it2) == [1, 2]
    # close() ends it at once; after the end, it is closed too.
    it.close()
    with pytest.raises(StopIteration):
        next(it)
    assert len(calls) == 3 and it.closed and it2.closed


def test_buffer_size_0_makes_each_element_inside_next_on_the_calling_thread() -> None:
    """Issue 32 (held-out rounds): ``ThreadPrefetch(..., buffer_size=0)``: the
    iterable runs on the thread that calls ``next()``, one element per call,
    no thread, nothing made ahead; the rest of the contract is the loader's."""
    threads: list[int] = []

    def gen() -> Iterator[int]:
        try:
            for i in range(6):
                threads.append(threading.get_ident())
                yield i
        finally:
            threads.append(-1)  # closed: on the thread that closed the loader

    running = threading.active_count()
    it = ThreadPrefetch(gen(), buffer_size=0)
    assert threads == [] and "in-process" in repr(it)
    for k in range(3):
        assert next(it) == k
        assert threads == [threading.get_ident()] * (k + 1)  # none ahead
    assert threading.active_count() == running
    it.close()  # the generator is closed here, at once
    assert threads[-1] == -1
    with pytest.raises(StopIteration):
        next(it)
    assert it.closed


class _Flaky:
    """An iterator whose ``__next__`` fails once and would then go on."""

    def __init__(self) -> None:
        self.i = 0

    def __iter__(self) -> _Flaky:
        return self

    def __next__(self) -> int:
        self.i += 1
        if self.i == 3:
            raise OSError("a read failed")
        if self.i > 6:
            raise StopIteration
        return self.i


@pytest.mark.parametrize("buffer_size", [0, 2])
def test_thread_loader_end_and_error_whatever_the_buffer(buffer_size: int) -> None:
    """The same contract with and without the thread: an error of the
    iterable ends the iteration (even one that would go on); after the end
    the loader is closed, and set_state() says so. Before (buffer_size=0):
    the iterator went on after its error, and an exhausted loader was not
    ``closed``."""
    it = ThreadPrefetch(_Flaky(), buffer_size=buffer_size)
    assert [next(it), next(it)] == [1, 2]
    with pytest.raises(OSError, match="a read failed"):
        next(it)
    with pytest.raises(StopIteration):
        next(it)
    assert it.closed
    done = ThreadPrefetch([1, 2], buffer_size=buffer_size)
    assert list(done) == [1, 2] and done.closed
    with pytest.raises(RuntimeError, match="closed"):
        done.set_state({"version": 1, "position": 0})


# -- worker_init_fn -----------------------------------------------------------------------


def test_worker_init_fn_runs_in_each_worker_before_its_elements() -> None:
    with ProcessPrefetch(whoami, range(12), num_workers=3, worker_init_fn=record_init) as it:
        got = list(it)
    pids = {g[1] for g in got}
    assert len(pids) == 3 and os.getpid() not in pids
    for position, (key, _pid, init_id) in enumerate(got):
        assert key == position and init_id == position % 3  # worker w makes w, w+3, ...
    # Not in-process (PyTorch's rule): nothing to set up in this process.
    assert [g[2] for g in ProcessPrefetch(whoami, range(2), num_workers=0)] == [None, None]


def test_an_error_in_worker_init_fn_is_raised_by_next() -> None:
    it = ProcessPrefetch(plain, range(4), num_workers=1, worker_init_fn=failing_init)
    with pytest.raises(OSError, match="no device for worker 0") as info:
        next(it)
    assert isinstance(info.value.__cause__, RemoteTraceback)
    assert "worker_init_fn" in str(info.value.__cause__)
    assert it.closed


# -- lazy start ---------------------------------------------------------------------------


def test_nothing_starts_before_the_first_next() -> None:
    before = _children()
    it = ProcessPrefetch(make, range(4), num_workers=2)
    assert _children() == before and "not started" in repr(it)
    assert next(it)[0] == 0
    assert len(_children() - before) == 2
    it.close()

    unstarted = ProcessPrefetch(make, range(4), num_workers=2)
    unstarted.close()  # closing a loader that never started starts nothing
    assert _children() == before
    with pytest.raises(StopIteration):
        next(unstarted)

    running = threading.active_count()
    made: list[int] = []

    def gen() -> Iterator[int]:
        made.append(1)
        yield 1

    t = ThreadPrefetch(gen())
    assert made == [] and threading.active_count() == running
    assert next(t) == 1
    t.close()


def test_picklability_is_still_checked_at_construction() -> None:
    with pytest.raises(TypeError, match="picklable"):
        ProcessPrefetch(plain, range(3), num_workers=1, worker_init_fn=lambda w: None)


# -- bounded release of shared memory -------------------------------------------------------


class _Blocker:
    """A rank-local registration whose destroy holds the reaper until released."""


def test_segments_are_released_even_when_the_reaper_is_stuck() -> None:
    gc.collect()
    assert local.flush(10)
    base = mapped_segments()
    gate = threading.Event()
    entered = threading.Event()

    def stuck() -> None:
        entered.set()
        gate.wait(60)

    blocker = _Blocker()
    cgc.register(blocker, stuck, comm=None, name="stuck destroy")
    del blocker
    assert entered.wait(10)  # the reaper is now stuck behind another library's destroy
    try:
        peak = 0
        for _ in range(8):
            # Each loader maps a ring of segments and drops it at close: with no
            # fallback they would all wait, mapped, behind the stuck destroy.
            with ProcessPrefetch(make_sized, range(30), num_workers=2, buffer_size=4) as it:
                for i, e in enumerate(it):
                    assert e.size == 1 + (i * 7919) % 300_000
                del e
            peak = max(peak, mapped_segments() - base)
        # Dead segments waiting for the reaper never exceed the backlog bound
        # (plus a ring being dropped, at most all the slots one loader had).
        assert peak <= testing.RELEASE_BACKLOG + 2 * 12, peak
    finally:
        gate.set()
    assert local.flush(10)
    gc.collect()
    assert local.flush(10)
    assert mapped_segments() == base


def test_array_elements_keep_their_shape_dtype_and_order() -> None:
    # Plain arrays go into a slot with no pickle: every layout must come back as sent.
    from data_scripts.fns import array_kinds

    with ProcessPrefetch(array_kinds, range(8), num_workers=2) as it:
        for i, e in enumerate(it):
            want = array_kinds(i)
            assert e.dtype == want.dtype and e.shape == want.shape
            assert e.flags.f_contiguous == want.flags.f_contiguous
            np.testing.assert_array_equal(e, want)


def test_worker_error_type_is_a_loader_error() -> None:
    from collective_gc.data import LoaderError

    assert issubclass(WorkerError, LoaderError)


def _fails_in_process(kind: str) -> Any:
    if kind == "process":
        return ProcessPrefetch(fail_at_3, range(6), num_workers=0)
    return ThreadPrefetch(_Flaky(), buffer_size=0)


@pytest.mark.parametrize("kind", ["process", "thread"])
def test_an_error_kept_in_process_keeps_no_loader(kind: str) -> None:
    # As with workers and threads: the traceback of an error of fn (of the
    # iterable) holds no frame that holds the loader.
    it = _fails_in_process(kind)
    ref = weakref.ref(it)
    kept: BaseException | None = None
    try:
        for _ in it:
            pass
    except (ValueError, OSError) as exc:
        kept = exc
    del it
    assert kept is not None
    assert ref() is None, "the error keeps its loader alive"
