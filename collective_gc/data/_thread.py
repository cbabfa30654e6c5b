"""ThreadPrefetch: iterate an iterable ahead of the consumer, on a background thread.

The producer thread only ever refers to a small shared state (never to the
ThreadPrefetch), so dropping the loader finalizes it, and its finalizer (on
the rank-local reaper) tells the producer to stop. An exception from the
iterable crosses as the object itself, with the locals of its frames cleared
(``traceback.clear_frames``) so that a caller who keeps the error keeps no
element alive through it.
"""

from __future__ import annotations

import collections
import contextlib
import threading
import traceback
from collections.abc import Iterable, Iterator
from typing import Generic, TypeVar

from .._reaper import register

__all__ = ["ThreadPrefetch"]

T = TypeVar("T")


class _State(Generic[T]):
    __slots__ = ("cond", "done", "error", "items", "size", "stop")

    def __init__(self, size: int) -> None:
        self.cond = threading.Condition(threading.Lock())
        self.items: collections.deque[T] = collections.deque()
        self.size = size
        self.stop = False
        self.done = False
        self.error: BaseException | None = None


def _produce(it: Iterator[T], state: _State[T]) -> None:
    try:
        for item in it:
            with state.cond:
                while len(state.items) >= state.size and not state.stop:
                    state.cond.wait()
                if state.stop:
                    return
                state.items.append(item)
                state.cond.notify_all()
            del item  # the frame must not keep the last element alive
    except BaseException as exc:  # noqa: BLE001 (every error crosses to the consumer)
        traceback.clear_frames(exc.__traceback__)
        with state.cond:
            state.error = exc
    finally:
        close = getattr(it, "close", None)
        del it
        if close is not None and state.stop:
            # A generator's cleanup runs on the thread that ran it. Its errors
            # are dropped: the consumer stopped listening, nobody to report to.
            with contextlib.suppress(Exception):
                close()
        with state.cond:
            state.done = True
            state.cond.notify_all()


def _stop(state: _State[T], thread: threading.Thread, timeout: float | None) -> None:
    with state.cond:
        state.stop = True
        state.items.clear()
        state.error = None
        state.cond.notify_all()
    if thread is not threading.current_thread() and timeout != 0:
        thread.join(timeout)


class ThreadPrefetch(Generic[T]):
    """Iterate ``iterable`` with up to ``buffer_size`` elements made ahead by a thread.

    Same contract as :class:`ProcessPrefetch`: elements in order; an exception
    from the iterable is re-raised here (the same object, its frames' locals
    cleared) and ends the iteration; after the end, an error, or :meth:`close`,
    ``next()`` raises StopIteration. ``iter(iterable)`` is called here, at
    construction; the rest runs on the thread.

    The iterable runs on another thread, so it must not need to run on this
    one (thread-local state, most GUI or MPI calls with ``MPI_THREAD_SINGLE``).

    Raises ValueError if ``buffer_size`` < 1.
    """

    def __init__(self, iterable: Iterable[T], *, buffer_size: int = 2) -> None:
        if buffer_size < 1:
            raise ValueError(f"buffer_size must be at least 1, got {buffer_size}")
        self._state: _State[T] = _State(buffer_size)
        self._thread = threading.Thread(
            target=_produce, args=(iter(iterable), self._state), name="ThreadPrefetch", daemon=True
        )
        self._thread.start()
        # Dropped without close(): the reaper tells the thread to stop (no join there).
        self._reg = register(self, _stop, (self._state, self._thread, 0), {}, "ThreadPrefetch")

    def __iter__(self) -> ThreadPrefetch[T]:
        return self

    def __enter__(self) -> ThreadPrefetch[T]:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self, timeout: float | None = None) -> None:
        """Stop the thread, drop buffered elements, and wait for the thread.

        The thread stops at once if it waits for room; if it is inside the
        iterable's ``next()``, after that returns (the wait is bounded by
        ``timeout`` seconds if given). Then a generator is closed on that
        thread. Idempotent.
        """
        self._reg.detach()
        _stop(self._state, self._thread, timeout)

    def __repr__(self) -> str:
        s = self._state
        state = "done" if s.done else "stopping" if s.stop else "running"
        return f"<ThreadPrefetch {len(s.items)}/{s.size} buffered, {state}>"

    def __next__(self) -> T:
        s = self._state
        with s.cond:
            while not s.items and not s.done and not s.stop:
                s.cond.wait()
            if s.items:
                item = s.items.popleft()
                s.cond.notify_all()
                return item
            error, s.error = s.error, None
        if error is None:
            raise StopIteration
        self.close()
        # The traceback keeps this frame: let it keep neither the loader nor
        # the error itself (that would be a cycle).
        del self, s
        try:
            raise error
        finally:
            del error
