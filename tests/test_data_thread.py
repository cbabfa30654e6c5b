"""ThreadPrefetch: real threads, no mocks."""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from collective_gc import local
from collective_gc.data import ThreadPrefetch, testing

from _util import GcDisabled as GcOff


def arrays(n: int, fail_at: int | None = None) -> Iterator[np.ndarray[Any, Any]]:
    for i in range(n):
        if i == fail_at:
            raise KeyError(f"no element {i}")
        yield np.full(1000, i)


def test_order_and_end() -> None:
    with ThreadPrefetch(arrays(20), buffer_size=3) as it:
        assert [int(e[0]) for e in it] == list(range(20))
        with pytest.raises(StopIteration):
            next(it)


def test_error_is_reraised_once_and_ends_the_iteration() -> None:
    it = ThreadPrefetch(arrays(10, fail_at=4))
    assert [int(next(it)[0]) for _ in range(4)] == [0, 1, 2, 3]
    with pytest.raises(KeyError, match="no element 4") as info:
        next(it)
    assert any(f.name == "arrays" for f in info.traceback)  # the original traceback
    with pytest.raises(StopIteration):
        next(it)


def test_no_cycles_keep_the_last_element() -> None:
    with GcOff():
        it = ThreadPrefetch(arrays(10, fail_at=4))
        last = [next(it) for _ in range(4)][-1]
        last_ref, it_ref = weakref.ref(last), weakref.ref(it)
        try:
            next(it)
        except KeyError as exc:
            kept = exc
        del last, it
        assert last_ref() is None and it_ref() is None
        del kept

        def loop(refs: list[weakref.ref[Any]]) -> None:
            for e in ThreadPrefetch(arrays(5)):
                refs.append(weakref.ref(e))

        refs: list[weakref.ref[Any]] = []
        loop(refs)
        assert len(refs) == 5 and all(r() is None for r in refs)


def test_close_while_the_producer_waits_for_room() -> None:
    produced: list[int] = []

    def gen() -> Iterator[int]:
        try:
            for i in range(1000):
                produced.append(i)
                yield i
        finally:
            produced.append(-1)  # the generator was closed, on its own thread

    it = ThreadPrefetch(gen(), buffer_size=2)
    assert next(it) == 0
    producer = testing.Producer(it)
    time.sleep(0.1)
    assert len(produced) <= 4  # bounded by the buffer
    t0 = time.monotonic()
    it.close()
    assert time.monotonic() - t0 < 1.0
    assert produced[-1] == -1 and producer.returned
    with pytest.raises(StopIteration):
        next(it)


def test_dropping_the_loader_stops_its_thread() -> None:
    it = ThreadPrefetch(arrays(10**9), buffer_size=2)
    next(it)
    producer = testing.Producer(it)  # refers to the thread, not to the loader
    del it
    assert local.flush(10)
    assert producer.wait(5)


def test_buffer_size_must_not_be_negative() -> None:
    with pytest.raises(ValueError, match="buffer_size"):
        ThreadPrefetch([1], buffer_size=-1)


class _OldStyle:
    """Iterable through the old sequence protocol (``__getitem__`` only)."""

    def __getitem__(self, i: int) -> int:
        if i >= 3:
            raise IndexError(i)
        return i


class _Refused:
    __iter__ = None  # the documented way to say "not iterable"


@pytest.mark.parametrize(
    "source", [None, 5, object(), _Refused()], ids=["None", "5", "object", "iter_None"]
)
@pytest.mark.parametrize("buffer_size", [0, 2])
def test_a_source_that_is_not_iterable_is_refused_at_construction(
    source: Any, buffer_size: int
) -> None:
    """Issue 24, defect 6: ``ThreadPrefetch(None)`` iterated as empty, silently
    (None was its internal "closed" marker), while ``ThreadPrefetch(5)`` raised
    only at the first ``next()``."""
    with pytest.raises(TypeError, match="iterable"):
        ThreadPrefetch(source, buffer_size=buffer_size)


def test_any_iterable_is_accepted_and_nothing_starts_at_construction() -> None:
    made: list[int] = []

    def gen() -> Iterator[int]:
        made.append(0)
        yield 0

    it = ThreadPrefetch(gen())
    assert made == [] and "not started" in repr(it)
    assert list(it) == [0]
    assert list(ThreadPrefetch(_OldStyle())) == [0, 1, 2]
    assert list(ThreadPrefetch("ab", buffer_size=0)) == ["a", "b"]


def test_thread_prefetch_of_a_thread_unsafe_consumer_is_not_our_business() -> None:
    # The iterable runs on exactly one other thread, never on two at once.
    seen: set[int] = set()

    def gen() -> Iterator[int]:
        for i in range(50):
            seen.add(threading.get_ident())
            yield i

    assert list(ThreadPrefetch(gen())) == list(range(50))
    assert len(seen) == 1 and threading.get_ident() not in seen
