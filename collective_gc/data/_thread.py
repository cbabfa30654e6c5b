"""ThreadPrefetch: iterate an iterable ahead of the consumer, on a background thread.

The producer thread only ever refers to a small shared state (never to the
ThreadPrefetch), so dropping the loader finalizes it, and its finalizer (on
the rank-local reaper) tells the producer to stop. An exception from the
iterable crosses as the object itself, with the locals of its frames cleared
(``traceback.clear_frames``) so that a caller who keeps the error keeps no
element alive through it.

Interrupts (KeyboardInterrupt, SystemExit) in the consumer's ``next()``: the
consumer takes an element with ``items[0]`` and ``del items[0]`` (bytecodes
that call nothing, so no signal handler can run between them), and keeps it
in ``_ready`` while it wakes the producer (a call, which an interrupt can
follow); the next call returns it. The two sides signal each other through
plain locks used as binary semaphores, whose C-level ``acquire`` and
``release`` leave nothing half-done when interrupted, and the consumer never
holds a lock across a Python-level call.
"""

from __future__ import annotations

import _thread
import collections
import contextlib
import itertools
import os
import threading
import traceback
import weakref
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, Generic, TypeVar

from ..local import register
from ._protocol import LoaderError

__all__ = ["ThreadPrefetch"]

T = TypeVar("T")

_NOTHING: Any = object()  # no element kept in _ready (None is a valid element)
_STATE_VERSION = 1


def _signal(gate: threading.Lock) -> None:
    # A lock as a binary semaphore: released = "look again". Releasing twice is
    # the same signal.
    try:
        gate.release()
    except RuntimeError:  # already released: the signal is already there
        pass


class _State(Generic[T]):
    __slots__ = (
        "__weakref__",
        "done",
        "error",
        "filled",
        "finished",
        "forked",
        "ident",
        "items",
        "launched",
        "room",
        "size",
        "source",
        "stop",
    )

    def __init__(self, size: int) -> None:
        self.items: collections.deque[T] = collections.deque()
        self.size = size
        self.stop = False
        self.done = False
        self.error: BaseException | None = None
        # Both start acquired (no signal pending).
        self.filled = threading.Lock()  # producer -> consumer: an item or the end
        self.room = threading.Lock()  # consumer -> producer: room, or stop
        self.filled.acquire()
        self.room.acquire()
        self.launched = False  # the producer thread exists
        self.finished = threading.Lock()  # held until the producer has returned
        self.finished.acquire()
        self.ident = 0  # the producer thread's
        self.source: Iterator[T] | None = None  # the iterator, until the producer takes it
        # In a process forked while the producer ran: no producer here (see _after_fork).
        self.forked = False


# The states of started loaders, for the fork handler.
_STARTED: weakref.WeakSet[_State[Any]] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    # Only the forking thread exists here: a producer of the parent does not,
    # and a lock it held at the fork stays held for ever. Its loader is done
    # here (next() raises, close() returns at once); the parent's goes on.
    for state in list(_STARTED):
        state.forked = state.stop = state.done = True
        state.items.clear()  # the parent's elements: the parent delivers them


os.register_at_fork(after_in_child=_after_fork_in_child)


def _produce(state: _State[T]) -> None:
    state.ident = threading.get_ident()
    it, state.source = state.source, None
    assert it is not None
    items, size = state.items, state.size
    try:
        for item in it:
            while len(items) >= size and not state.stop:
                state.room.acquire()
            if state.stop:
                return
            items.append(item)
            _signal(state.filled)
            del item  # the frame must not keep the last element alive
    except BaseException as exc:  # noqa: BLE001 (every error crosses to the consumer)
        traceback.clear_frames(exc.__traceback__)
        state.error = exc
    finally:
        close = getattr(it, "close", None)
        del it
        if close is not None and state.stop:
            # A generator's cleanup runs on the thread that ran it. Its errors
            # are dropped: the consumer stopped listening, nobody to report to.
            with contextlib.suppress(Exception):
                close()
        state.done = True
        _signal(state.filled)
        state.finished.release()


def _stop(state: _State[T], timeout: float | None) -> None:
    state.stop = True
    state.items.clear()
    _signal(state.room)
    _signal(state.filled)
    if (
        state.launched
        and timeout != 0
        and not state.forked
        and threading.get_ident() != state.ident
    ):
        if state.finished.acquire(timeout=-1 if timeout is None else timeout):
            state.finished.release()


class _Holder:
    """What the finalizer stops; refers to no loader."""

    __slots__ = ("retired", "state")

    def __init__(self) -> None:
        self.state: _State[Any] | None = None
        self.retired: _State[Any] | None = None  # left by set_state(), not yet told to stop


def _stop_holder(holder: _Holder, timeout: float | None) -> None:
    _retire(holder)
    if holder.state is not None:
        _stop(holder.state, timeout)


def _retire(holder: _Holder) -> None:
    # The producer set_state() left: told to stop, not waited for (it
    # finishes the iterable's current next(), then returns).
    if holder.retired is not None:
        _stop(holder.retired, 0)
        holder.retired = None


class ThreadPrefetch(Generic[T]):
    """Iterate ``iterable`` with up to ``buffer_size`` elements made ahead by a thread.

    Same contract as :class:`ProcessPrefetch`: elements in order; an exception
    from the iterable is re-raised here (the same object, its frames' locals
    cleared) and ends the iteration; after the end, an error, or :meth:`close`
    (from any thread, even while another waits in ``next()``), ``next()``
    raises StopIteration. KeyboardInterrupt or SystemExit inside ``next()``
    loses nothing: the next call delivers the next element.

    Nothing starts at construction: the first ``next()`` calls
    ``iter(iterable)`` and starts the thread. ``buffer_size=0`` runs the
    iterable in this thread, inside ``next()``: no thread, the same API.

    In a process forked while the thread runs, the loader's copy is inert
    (its ``next()`` raises :class:`LoaderError`, ``close()`` returns at once);
    this process's loader goes on.

    The iterable runs on another thread, so it must not need to run on this
    one (thread-local state, most GUI or MPI calls with ``MPI_THREAD_SINGLE``).

    :meth:`get_state` after ``k`` elements, passed to :meth:`set_state` of a
    new loader (before its first ``next()``), makes it skip the first ``k``
    elements of its iterable: they are made again and dropped (the loader
    cannot know how to jump ahead in an arbitrary iterable). Between two
    ``next()`` calls of a live loader, :meth:`set_state` skips ahead the same
    way, and rewinds by iterating the iterable again from its start, if it is
    not an iterator (a list, a range, a dataset with ``__iter__``).

    Raises ValueError if ``buffer_size`` < 0, TypeError if ``iterable`` is
    not iterable (has neither ``__iter__`` nor ``__getitem__``).
    """

    def __init__(self, iterable: Iterable[T], *, buffer_size: int = 2) -> None:
        if buffer_size < 0:
            raise ValueError(f"buffer_size must be at least 0, got {buffer_size}")
        # What iter() accepts, checked without calling it (nothing starts
        # here): __iter__, or the old sequence protocol. None among them too:
        # it is this class's own "closed" mark, and must not iterate as empty.
        kind = type(iterable)
        if getattr(kind, "__iter__", None) is None and getattr(kind, "__getitem__", None) is None:
            raise TypeError(
                f"ThreadPrefetch needs an iterable, got {kind.__qualname__} object {iterable!r:.80}"
            )
        self._iterable: Iterable[T] | None = iterable
        # The iterable once started, if iter() can start it again (set_state rewinds).
        self._source: Iterable[T] | None = None
        self._size = buffer_size
        self._it: Iterator[T] | None = None  # in-process mode only
        self._holder = _Holder()
        self._count = 0  # elements delivered (or kept in _ready to be)
        self._skip = 0
        self._ready: Any = _NOTHING
        self._closed = False
        # Dropped without close(): the reaper tells the thread to stop (no join there).
        self._reg = register(self, _stop_holder, self._holder, 0, name="ThreadPrefetch")

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
        thread. Idempotent; any thread.
        """
        self._closed = True
        self._reg.detach()
        _stop_holder(self._holder, timeout)
        self._iterable = self._source = None
        it, self._it = self._it, None
        close = getattr(it, "close", None)
        if close is not None:
            close()

    def get_state(self) -> dict[str, int]:
        """The loader's position, for :meth:`set_state` of a new loader: a dict of ints."""
        return {"version": _STATE_VERSION, "position": self._count - (self._ready is not _NOTHING)}

    def set_state(self, state: Mapping[str, int]) -> None:
        """Go to the position saved by :meth:`get_state`: the next ``next()`` delivers it.

        Before the first ``next()``, the first ``position`` elements will be
        skipped. Between two ``next()`` calls: skipping ahead makes the
        elements in between and drops them here (an error of the iterable
        among them is raised here, and ends the iteration; past the end, the
        loader ends); rewinding stops the thread (after the iterable's
        current ``next()``) and iterates the iterable again from its start,
        skipping to the position. An interrupt inside it is harmless: call it
        again.

        Raises RuntimeError if the loader is closed, ValueError for a state of
        another version, or to rewind a loader of an iterator (it cannot start
        again).
        """
        if self._closed:
            raise RuntimeError(f"set_state() on {self!r}: the loader is closed")
        if state.get("version") != _STATE_VERSION or int(state.get("position", -1)) < 0:
            raise ValueError(f"{self!r} cannot resume from state {dict(state)!r}")
        position = int(state["position"])
        holder = self._holder
        if holder.state is None and self._it is None:  # not started
            self._count = self._skip = position
            return
        while self.get_state()["position"] < position:  # ahead: made and dropped
            try:
                next(self)
            except StopIteration:
                return
        if self.get_state()["position"] == position:
            return
        source = self._source
        if source is None:
            raise ValueError(
                f"{self!r} cannot rewind to position {position}: its iterable is an iterator, "
                "which cannot start again; give ThreadPrefetch a list, a range or another "
                "iterable that iter() starts afresh"
            )
        _retire(holder)
        # Stores only from here to the retirement (no call, so no interrupt
        # between them); the finalizer or the next start stops the producer
        # if an interrupt strikes first.
        holder.retired = holder.state
        holder.state = None
        self._it = None
        self._iterable = source
        self._ready = _NOTHING
        self._count = self._skip = position
        _retire(holder)

    def __repr__(self) -> str:
        s = self._holder.state
        if self._closed:
            state = "closed"
        elif not self._size:
            state = "in-process"
        elif s is None:
            state = "not started"
        else:
            state = "done" if s.done else "running"
        buffered = len(s.items) if s is not None else 0
        return f"<ThreadPrefetch {buffered}/{self._size} buffered, {state}>"

    def _start(self) -> _State[T]:
        _retire(self._holder)  # one set_state() left, if it was cut short
        iterable = self._iterable
        if iterable is None:
            raise StopIteration
        it = iter(iterable)
        self._source = iterable if it is not iterable else None
        if self._skip:
            it = itertools.islice(it, self._skip, None)
        if not self._size:
            self._it = it
            self._iterable = None
            return _State(1)  # unused: in-process mode reads self._it
        state: _State[T] = _State(self._size)
        state.source = it
        _STARTED.add(state)
        self._holder.state = state
        self._iterable = None
        # `launched` is set and the thread created with no check for an
        # interrupt between them (a store, then one C call): either both
        # happened, or neither and the next call launches it.
        state.launched = True
        _thread.start_new_thread(_produce, (state,))
        return state

    def __next__(self) -> T:
        ready = self._ready
        if ready is not _NOTHING:  # taken by a call an interrupt cut short
            self._ready = _NOTHING
            return ready  # type: ignore[no-any-return]
        if self._closed:
            raise StopIteration
        if not self._size:
            return self._next_in_process()
        s = self._holder.state
        if s is None:
            s = self._start()
        elif not s.launched:  # an interrupt struck between publishing and launching
            s.launched = True
            _thread.start_new_thread(_produce, (s,))
        items = s.items
        while not items:
            if s.done or s.stop:
                if items:
                    break
                if s.forked:
                    raise LoaderError(
                        f"{self!r} was started by the process this one was forked from: "
                        "its thread is there, not here (the parent's loader is untouched); "
                        "make a new loader in the child"
                    )
                error, s.error = s.error, None
                self._closed = True
                if error is None:
                    raise StopIteration
                # The traceback keeps this frame: let it keep neither the loader
                # nor the error itself (that would be a cycle).
                del self, s, items
                try:
                    raise error
                finally:
                    del error
            s.filled.acquire()  # interruptible; a lost "True" loses nothing
        # No call between taking the element and keeping it in _ready.
        item = items[0]
        del items[0]
        self._count += 1
        self._ready = item
        _signal(s.room)
        self._ready = _NOTHING
        return item

    def _next_in_process(self) -> T:
        it = self._it
        if it is None:
            if self._iterable is None:
                raise StopIteration
            self._start()
            it = self._it
            assert it is not None
        # An interrupt inside the iterable's next() is the iterable's business
        # (a generator is finished by it); one after it returns loses its value.
        item = next(it)
        self._count += 1
        return item
