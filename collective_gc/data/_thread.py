"""ThreadPrefetch: iterate an iterable ahead of the consumer, on a background thread.

The producer thread only ever refers to a small shared state (never to the
ThreadPrefetch), so dropping the loader finalizes it, and its finalizer (on
the rank-local reaper) tells the producer to stop. An exception from the
iterable crosses as the object itself, with the locals of its frames cleared
(``traceback.clear_frames``) so that a caller who keeps the error keeps no
element alive through it.

The consumer takes an element with ``items[0]`` and ``del items[0]`` (no
call between them) and keeps it in ``_ready`` while it wakes the producer;
the two sides signal each other through plain locks used as binary
semaphores, whose C-level ``acquire`` and ``release`` leave nothing
half-done when interrupted, and the consumer never holds a lock across a
Python-level call: NOTE [ Loader shutdown and interrupts ] in ``_loader``.
"""

from __future__ import annotations

import _thread
import collections
import contextlib
import itertools
import os
import threading
import traceback
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, Generic, TypeVar

from ._forked import Tracked
from ._loader import NOTHING, STATE_VERSION, Loader
from ._protocol import LoaderError

__all__ = ["ThreadPrefetch"]

T = TypeVar("T")


def _signal(gate: threading.Lock) -> None:
    # A lock as a binary semaphore: released = "look again". Releasing twice is
    # the same signal.
    try:
        gate.release()
    except RuntimeError:  # already released: the signal is already there
        pass


class State(Generic[T]):
    """A ThreadPrefetch's running part: what its producer thread and its consumer share.

    Refers to no loader. With ``buffer_size=0`` it is never launched, and
    ``next()`` reads ``source`` itself.
    """

    __slots__ = (
        "__weakref__",
        "done",
        "error",
        "exited",
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
        # Set just before `finished` is released: a waiter cut short after
        # its acquire (the lock then stays held) must not make later waits
        # wait for a release that never comes again.
        self.exited = False
        self.ident = 0  # the producer thread's
        self.source: Iterator[T] | None = None  # the iterator, until the producer takes it
        # In a process forked while the producer ran: no producer here (see _after_fork).
        self.forked = False


# The states of launched producers, for the fork handler.
_STARTED: Tracked[State[Any]] = Tracked()


def _remember(state: State[Any]) -> None:
    _STARTED.add(state)


def _after_fork_in_child() -> None:
    # NOTE [ Loader shutdown and interrupts ] in _loader, "What a forked child
    # sees": a producer of the parent does not exist here (a lock it held at
    # the fork stays held for ever); its loader is done here, the parent's
    # goes on.
    for state in _STARTED.take():
        state.forked = state.stop = state.done = True
        state.items.clear()  # the parent's elements: the parent delivers them


os.register_at_fork(after_in_child=_after_fork_in_child)


def _produce(state: State[T]) -> None:
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
        state.exited = True
        state.finished.release()


def _stop(state: State[Any], timeout: float | None) -> None:
    state.stop = True
    state.items.clear()
    _signal(state.room)
    _signal(state.filled)
    if (
        state.launched
        and timeout != 0
        and not state.forked
        and threading.get_ident() != state.ident
        and not state.exited  # nothing to wait for (and `finished` may stay held)
    ):
        if state.finished.acquire(timeout=-1 if timeout is None else timeout):
            state.finished.release()


class ThreadPrefetch(Loader[T, State[T]]):
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

    Args:
        iterable: what to iterate (``iter()`` is called at the first ``next()``).
        buffer_size: elements made ahead by the thread; 0: no thread, the
            iterable runs on the thread that calls ``next()``, inside it,
            one element per call.
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
        # What the next start iterates (None: started, or closed).
        self._iterable: Iterable[T] | None = iterable
        # The iterable once started, if iter() can start it again (set_state rewinds).
        self._source: Iterable[T] | None = None
        self._size = buffer_size
        self._extra_state: dict[str, int] = {}
        # The running part is a State: a producer thread's, or with
        # buffer_size=0 one that is never launched, whose source next() reads.
        self._setup(_stop, "ThreadPrefetch")

    def close(self, timeout: float | None = None) -> None:
        """Stop the thread, drop buffered elements, and wait for the thread.

        The thread stops at once if it waits for room; if it is inside the
        iterable's ``next()``, after that returns (the wait is bounded by
        ``timeout`` seconds if given). Then a generator is closed on that
        thread (with ``buffer_size=0``, on this one). Idempotent; any thread.
        """
        self._closed = True
        self._reg.detach()
        holder = self._holder
        holder.stop(timeout)
        self._iterable = self._source = None
        state = holder.running
        if state is not None and not state.launched:  # in-process: the iterator is ours
            it, state.source = state.source, None
            close = getattr(it, "close", None)
            if close is not None:
                close()

    def _position_in(self, state: Mapping[str, int]) -> int:
        if state.get("version") != STATE_VERSION or int(state.get("position", -1)) < 0:
            raise ValueError(f"{self!r} cannot resume from state {dict(state)!r}")
        return int(state["position"])

    def _move_to(self, position: int) -> None:
        # Not started: the start skips to the position. Ahead: made and
        # dropped (past the end, the loader ends). Behind: the iterable again
        # from its start, if it can start again.
        if self._holder.running is None:
            self._pos = self._start = position
            return
        if not self._take_up_to(position) or self.get_state()["position"] == position:
            return
        source = self._source
        if source is None:
            raise ValueError(
                f"{self!r} cannot rewind to position {position}: its iterable is an iterator, "
                "which cannot start again; give ThreadPrefetch a list, a range or another "
                "iterable that iter() starts afresh"
            )
        self._iterable = source  # read only by the next start, which _restart makes due
        self._restart(position)

    def __repr__(self) -> str:
        s = self._holder.running
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

    def _begin(self) -> State[T]:
        """Start the running part: iter() the iterable, skip to ``_start``, and the thread."""
        holder = self._holder
        holder.retire()  # one set_state() left, if it was cut short
        iterable = self._iterable
        if iterable is None:
            raise StopIteration
        it = iter(iterable)
        self._source = iterable if it is not iterable else None
        if self._start:
            it = itertools.islice(it, self._start, None)
        state: State[T] = State(self._size)
        state.source = it
        if not self._size:  # in-process: never launched; next() reads the source
            holder.running = state
            self._iterable = None
            return state
        _remember(state)
        holder.running = state
        self._iterable = None
        # A store, then one C call (rule 2 of the NOTE in _loader): either
        # both happened, or neither and the next call launches it.
        state.launched = True
        _thread.start_new_thread(_produce, (state,))
        return state

    def __next__(self) -> T:
        ready = self._ready
        if ready is not NOTHING:  # taken by a call an interrupt cut short
            self._ready = NOTHING
            return ready  # type: ignore[no-any-return]
        if self._closed:
            raise StopIteration
        if not self._size:
            # In-process: the running part is never launched; its source is
            # the iterator (None once closed).
            state = self._holder.running
            if state is None:
                state = self._begin()
            it = state.source
            if it is None:
                raise StopIteration
            # An interrupt inside the iterable's next() is the iterable's
            # business (a generator is finished by it); one after it returns
            # loses its value. The end and an error end the iteration, as
            # with the thread (which does not close the iterator then either).
            try:
                item = next(it)
            except Exception:  # StopIteration among them
                self._closed = True
                state.source = None
                del self, state, it  # the traceback keeps this frame: not the loader
                raise
            self._pos += 1
            return item
        s = self._holder.running
        if s is None:
            s = self._begin()
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
            # Room first: an interrupt in the call that took the last element
            # may have cut its _signal(s.room) (the element went out through
            # _ready), and a producer waiting for room would never make the
            # one we wait for. A signal too many is harmless: the producer
            # looks at len(items) again.
            _signal(s.room)
            s.filled.acquire()  # interruptible; a lost "True" loses nothing
        # No call between taking the element and keeping it in _ready.
        item = items[0]
        del items[0]
        self._pos += 1
        self._ready = item
        _signal(s.room)
        self._ready = NOTHING
        return item
