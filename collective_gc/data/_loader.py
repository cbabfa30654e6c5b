"""What the two loaders share: their running part, retiring it, checkpoints.

A loader (``ProcessPrefetch``, ``ThreadPrefetch``) delivers elements in order
from a *running part* it starts at its first ``next()``: a pool of worker
processes, or a producer thread's state. Its :class:`Holder` keeps that part,
and one that :meth:`Loader.set_state` retired and has not stopped yet; the
loader's finalizer stops whatever the holder keeps, and the holder refers to
no loader, so a loader is freed by reference counting alone. The checkpoint
calls (:meth:`Loader.get_state`, :meth:`Loader.set_state`) are the same for
both: a position, and either taking the elements up to it or a new running
part that starts there.

NOTE [ Loader shutdown and interrupts ]
=======================================

Every file of this package cites this note by name where its rules apply.

What can strike where
---------------------

A signal handler runs in the consumer's thread between two bytecodes, and
what it raises (KeyboardInterrupt on Ctrl-C, SystemExit from a SIGTERM
handler, a watchdog's exception) surfaces there: at the entry of a Python
function, at a backward jump, or just after a call returns (even a C call
that did its work: a receive, a lock's acquire). A run of plain loads and
stores, with no call and no loop between them, is never cut. So the loaders
keep six rules, and ``next()``, ``set_state()`` and ``close()`` can be
interrupted anywhere and called again, losing nothing:

1. Everything a call needs to go on lives on the loader or its parts, never
   only in a local: a message received stays in its channel's inbox until
   its element is handed out (``_channel``), with the descriptor that came
   with it; an element made but not returned waits in ``_ready``; an error
   found but not raised in ``_raise_next``; a start-up in progress is the
   pool the holder keeps (``_pool``).
2. A move from one of those places to the next is a run of plain stores
   (delivering an element, taking a descriptor from the receive's control
   buffer, retiring a running part in :meth:`Loader._restart`).
3. Stopping is idempotent and resumable: ``close()``, a pool's shutdown, a
   worker's stop and join check what was done, so the next call finishes
   what an interrupt cut short; a join keeps its deadlines across calls, so
   interrupts faster than ``close_timeout`` still reach the SIGKILL.
4. Waits can be left and resumed: the start-up's event is polled (an
   interrupt inside ``Event.wait`` can leave the event's own lock held for
   ever); a waiting consumer wakes every ``POLL`` seconds.
5. What runs when an element or a segment dies (weak reference callbacks,
   on any thread, inside the cyclic collector too) is a C-level list append
   (``_leases``, ``_shm``): no Python frame runs there, so no interrupt is
   raised there, where it would be swallowed as "Exception ignored"; the
   consumer looks at those lists later.
6. Work that can neither be cut short nor resumed runs where no signal
   handler runs: start-up (pickling ``fn``, spawning) on the spawner thread
   (``_pool``), unmapping segments on collective_gc's rank-local reaper.

Should the element numbers disagree all the same, that call and every later
one raise LoaderError, never a silently short epoch.

Why not collective_gc's protected regions (``_interrupts``): a region defers
a handler to its end, which is right for a sync point (every rank must make
its collectives) and wrong here: ``next()`` waits for a worker, seconds for
a slow ``fn``, for ever for a hung one, and Ctrl-C must end that wait at
once. A region around the bookkeeping between waits alone would cost one
enter and leave per element and still leave the loader open to exceptions
regions do not defer (a handler of a signal outside ``_interrupts.SIGNALS``,
an exception set from another thread), so the rules above would be needed
anyway. And nothing here is collective: a rank that leaves the loader
half-way leaves no other rank waiting; what must hold (each element once,
in order, nothing leaked) is this process's alone, and the rules keep it.

What ``close()`` guarantees
---------------------------

From any thread, while another waits in ``next()`` (which then raises
StopIteration): when it returns the loader is closed for good; every worker
has exited and been reaped (SIGKILL after ``close_timeout`` if it does not
exit when its parent-watch pipe closes), and with it whatever ``fn``
started (its process group); the parent's descriptors of it are closed, by
``close()`` or by the consumer as it leaves its socket call, whichever comes
last, never under a waiting call; the spawner starts no more workers for it.
A ThreadPrefetch's producer is told to stop and is waited for (at most
``timeout``); it stops after the iterable's current ``next()``, and closes
a generator on its own thread. Elements handed out stay valid: a segment is
unmapped when the last array on it dies, on the reaper (or by the consumer
once more than ``_leases.BACKLOG`` wait for it). The end of the elements,
an error, dropping the loader (its finalizer, on the reaper, which does not
wait for a producer) and interpreter exit (``_pool``'s exit handler, before
collective_gc's own drains the reaper) stop the same things. If the rank
dies, its workers die too (``_worker``: the death signal, the parent-watch
pipe, the socket).

What a forked child sees
------------------------

A process forked from the loader's owner (a checkpoint writer) gets a copy
of every loader. Fork handlers (``_pool``, ``_thread``, ``_shm``) run there
with only the forking thread alive, take no lock (one another thread held
at the fork stays held for ever) and make the copies of started loaders
inert: ``next()`` raises LoaderError, ``close()`` and dropping touch nothing
the parent uses (no ``shutdown()`` of a shared socket, no stop of the
parent's workers or producer); the child's copies of the descriptors are
closed; the rings and slots nothing views are unmapped, and each slot an
element of the child views is replaced in place by a private copy of its
bytes (``_shm.detach_in_child``). So a child holds none of the loader's
memory or descriptors, and never waits for the parent's workers or threads.
A loader the child makes (or a copy not started yet) works as anywhere.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Generic, Self, TypeVar

from ..local import register

__all__ = ["NOTHING", "STATE_VERSION", "Holder", "Loader", "running_part"]

T = TypeVar("T")
R = TypeVar("R")  # a loader's running part

NOTHING: Any = object()  # no element kept in _ready (None is a valid element)
STATE_VERSION = 1


class Holder(Generic[R]):
    """A loader's running part, and one :meth:`Loader.set_state` retired.

    What the loader's finalizer stops. ``stopper(part, timeout)`` stops a
    part (a module-level function: the holder refers to no loader); a
    timeout of 0 means "do not wait for it" where the part has something to
    wait for.
    """

    __slots__ = ("retired", "running", "stopper")

    def __init__(self, stopper: Callable[[R, float | None], None]) -> None:
        self.running: R | None = None
        self.retired: R | None = None
        self.stopper = stopper

    def retire(self) -> None:
        """Stop the retired part, if any. Resumable: it is forgotten once stopped."""
        if self.retired is not None:
            self.stopper(self.retired, 0)
            self.retired = None

    def stop(self, timeout: float | None) -> None:
        """Stop both parts (the loader's finalizer, and ``close()``). Resumable."""
        self.retire()
        if self.running is not None:
            self.stopper(self.running, timeout)


class Loader(Generic[T, R]):
    """The base of both loaders: iteration, ``with``, checkpoints; ``R`` is the running part."""

    _holder: Holder[R]
    _pos: int  # elements delivered (or kept in _ready to be)
    _start: int  # the position the running part started (or will start) from
    _ready: Any
    _closed: bool
    _extra_state: dict[str, int]

    def _setup(self, stopper: Callable[[R, float | None], None], name: str) -> None:
        self._holder = Holder(stopper)
        self._pos = self._start = 0
        self._ready = NOTHING
        self._closed = False
        # Dropped without close(): the reaper stops the running part (without
        # waiting for a producer thread; a pool's shutdown is bounded).
        self._reg = register(self, Holder.stop, self._holder, 0, name=name)

    def __iter__(self) -> Self:
        return self

    def __next__(self) -> T:
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        raise NotImplementedError

    @property
    def closed(self) -> bool:
        """True once the loader is done: end, error, :meth:`close`."""
        return self._closed

    def get_state(self) -> dict[str, int]:
        """The loader's position, for :meth:`set_state` of a new loader: a dict of ints.

        ``{"version": 1, "position": k, ...}`` after ``k`` elements were
        delivered.
        """
        position = self._pos - (self._ready is not NOTHING)
        return {"version": STATE_VERSION, "position": position, **self._extra_state}

    def set_state(self, state: Mapping[str, int]) -> None:
        """Go to the position saved by :meth:`get_state`: the next ``next()`` delivers it.

        Before the first ``next()`` (resuming a checkpoint in a new loader) or
        between two ``next()`` calls of a live loader, to rewind or skip
        ahead; at the current position nothing changes. How each loader gets
        there (and what it costs) is in its class's documentation. An
        interrupt inside it is harmless: call it again.

        Raises RuntimeError if the loader is closed (its end, an error,
        :meth:`close`), ValueError for a state it cannot go to.
        """
        if self._closed:
            raise RuntimeError(f"set_state() on {self!r}: the loader is closed")
        self._move_to(self._position_in(state))

    def _position_in(self, state: Mapping[str, int]) -> int:
        """The position ``state`` names, if this loader can go there (else ValueError)."""
        raise NotImplementedError

    def _move_to(self, position: int) -> None:
        raise NotImplementedError

    def _take_up_to(self, position: int) -> bool:
        """Take and drop elements up to ``position``; False if the loader ended first.

        A position is absolute, so a call an interrupt cut short is repeated.
        """
        while self.get_state()["position"] < position:
            try:
                next(self)
            except StopIteration:
                return False
        return True

    def _restart(self, position: int) -> None:
        """Retire the running part: the next ``next()`` starts a new one at ``position``."""
        holder = self._holder
        holder.retire()  # one an earlier, interrupted call left
        # Plain stores from here to the retire() (rule 2 of the NOTE): the
        # running part becomes the retired one, which the next call, the
        # next start or the finalizer stops if an interrupt stops us.
        holder.retired = holder.running
        holder.running = None
        self._ready = NOTHING
        self._pos = self._start = position
        holder.retire()


def running_part(loader: Loader[Any, R]) -> R | None:
    """``loader``'s running part, or None (for the test hook, ``testing``)."""
    return loader._holder.running
