"""Transport: the collectives a sync point and the pytest plugin's checks make.

Every collective here is a non-blocking one, completed with ``Wait`` (beside
the watch's receive, see below) or, with a deadline, polled until it
completes or the deadline passes (then :class:`CollectiveTimeoutError`).
Never the blocking kind: MPI does not match a blocking collective with a
non-blocking one, and ranks may differ in whether they have a deadline (a
scope leaving on an exception on some ranks only, the exit agreement).

A request abandoned at a deadline can still be completed by a rank that
arrives later, which would then carry on as if nothing had happened; and a
rank waiting without a deadline would wait for ever for one that gave up.
Comparing deadlines across ranks would need their clocks to agree, which
the nodes of a cluster do not. Instead a rank that gives up at its own
(``time.monotonic()``) deadline says so to every other rank, by a message of
its own on the private communicator (:class:`Watch`: only on that error
path, so its cost in ranks does not matter); every rank keeps a receive of
it posted, waits on it together with each collective, and checks it once
each collective completes, before anything is destroyed. The agreement's
flags say whether any rank had a deadline (only such a rank gives up): when
none had, the check after the agreement is skipped. What is left is
message latency, not clock skew: a rank whose collective completes before
the notice reaches it carries on with that sync point (it hears of it at
its next wait).
"""

from __future__ import annotations

import array
import os
import pickle
import time
from collections.abc import Callable
from typing import Any, TypeVar, cast

import numpy as np
from mpi4py import MPI

from ._errors import CollectiveTimeoutError

__all__ = ["Deadline", "Watch", "wait", "keep_alive", "dup", "allreduce", "allgather", "SPIN"]


class Deadline:
    """When a sync point gives up waiting: ``at`` (``time.monotonic()``, this
    rank's own clock only), or None; ``watch``, the :class:`Watch` of the
    communicator its collectives are on once the agreement has set it (see
    the module docs).

    A signal's exception never lands in a wait of a sync point: the callers
    wait inside protected regions (see :mod:`collective_gc._interrupts`).
    """

    __slots__ = ("at", "watch")

    def __init__(self, at: float | None) -> None:
        self.at = at
        self.watch: Watch | None = None


_Buf = TypeVar("_Buf", "np.ndarray[Any, Any]", "array.array[int]")


# Requests abandoned at a deadline, with the buffers MPI may still write into
# or read from if a late rank arrives: kept alive for the life of the process
# (a collective cannot be cancelled), so MPI never touches freed memory.
_ABANDONED: list[tuple[MPI.Request | None, tuple[object, ...]]] = []


# The tag of a Watch's notices: the private communicator carries no other
# point-to-point message.
_TAG_GAVE_UP = 25
_GAVE_UP, _LEFT = 0, 1  # why, in a notice


class Watch:
    """The notice a rank that gave up at its deadline, or left a sync point's
    collectives by an exception, sends to every other rank of a private
    communicator, and the receive of it each rank keeps posted there (see
    the module docs).

    Once a notice arrived (or this rank sent one) the communicator's
    collectives can never again complete in step on every rank: every later
    wait on it raises :class:`CollectiveTimeoutError` at once.
    """

    __slots__ = ("comm", "rank", "seq", "gone", "_buf", "_req", "_sent", "_closed")

    def __init__(self, comm: MPI.Intracomm) -> None:
        self.comm = comm
        self.rank = comm.Get_rank()
        self.seq = 0  # the sync point under way, named in a notice
        # (rank, sync point, why: _GAVE_UP or _LEFT) of the one that gave up
        self.gone: tuple[int, int, int] | None = None
        self._buf = np.zeros(3, dtype=np.int64)
        self._sent = self._closed = False
        # Local: posting a receive waits for nobody.
        self._req: MPI.Request = comm.Irecv(self._buf, MPI.ANY_SOURCE, _TAG_GAVE_UP)

    @property
    def request(self) -> MPI.Request:
        """The standing receive, to wait on together with a collective."""
        return self._req

    def fired(self) -> bool:
        """Whether a rank gave up (a notice arrived, or this rank sent one). Local."""
        # A receive that Waitany or Test completed is already null.
        if (
            self.gone is None
            and not self._closed
            and (self._req == MPI.REQUEST_NULL or self._req.Test())
        ):
            self.gone = (int(self._buf[0]), int(self._buf[1]), int(self._buf[2]))
        return self.gone is not None

    def error(self, what: Callable[[], str]) -> CollectiveTimeoutError:
        assert self.gone is not None
        rank, seq, why = self.gone
        how = (
            "gave up waiting at its deadline"
            if why == _GAVE_UP
            else "left the collectives by an exception"
        )
        return CollectiveTimeoutError(
            f"rank {self.rank}: rank {rank} {how} at sync point {seq} of this "
            "communicator, so the collectives there can no longer complete in step on "
            f"every rank ({what()})"
        )

    def announce(self, left: bool = False) -> None:
        """Tell every other rank that this one gives up: at its deadline, or
        (``left``) because an exception took it out of a sync point's
        collectives. Local: non-blocking sends, kept for the life of the
        process like any abandoned request (a rank that never waits again
        never receives)."""
        if self._sent or self.gone is not None or self._closed:
            return  # once: the others need only one notice
        self._sent = True
        self.gone = (self.rank, self.seq, _LEFT if left else _GAVE_UP)
        note = np.array(self.gone, dtype=np.int64)
        for other in range(self.comm.Get_size()):
            if other != self.rank:
                _ABANDONED.append((self.comm.Isend(note, other, _TAG_GAVE_UP), (note,)))

    def close(self) -> None:
        """Withdraw the standing receive (before the communicator is freed). Local."""
        self._closed = True
        req, self._req = self._req, MPI.REQUEST_NULL
        if req != MPI.REQUEST_NULL:
            req.Cancel()
            req.Wait()  # completes at once: cancelled, or a notice had arrived


def wait(
    req: MPI.Request,
    deadline: Deadline | None,
    what: Callable[[], str],
    *buffers: object,
    check: bool = True,
) -> None:
    """Complete ``req`` (a collective on the manager's communicator) against
    ``deadline`` and, if it has one, its watch: a rank that gave up anywhere
    ends the wait here with :class:`CollectiveTimeoutError`, whether or not
    this rank has a deadline, and so does a notice found once ``req`` completed
    (unless ``check`` is false: the caller checks, see Agreement.agree).

    ``buffers`` are kept alive for ever if the request is abandoned, since MPI
    may still read or write them when a late rank arrives.
    """
    watch = None if deadline is None else deadline.watch
    try:
        if watch is not None and watch.gone is not None:
            raise watch.error(what)  # a rank gave up earlier: nothing completes in step
        notice = False
        at = None if deadline is None else deadline.at
        if watch is None and at is None:
            req.Wait()  # (no deadline, no other rank's notice to watch for)
        else:
            # Poll, with or without a deadline: a blocking Waitany would run
            # no signal handler until it returned, and a second Ctrl-C (which
            # the library's wrapper raises at once inside a protected region)
            # would wait for the late rank (_speedups' wait_either polls the
            # same way). For the first SPIN seconds between Tests only yield
            # the core (to a rank sharing it, perhaps the one we wait for): a
            # collective such as MPI_Comm_idup takes several rounds, each
            # progressed only inside a Test, so a sleep between Tests costs
            # every round its length (most of a sync point of DOLFINx's loop,
            # which adopts two new communicators per step: bench_dolfinx.py).
            # Then back off to a millisecond, so that a long wait does not
            # burn a core; a signal interrupts the sleep, and its handler runs.
            delay = 0.0
            spin = time.monotonic() + SPIN
            while not (req.Test() or (watch is not None and watch.fired())):
                now = time.monotonic()
                if at is not None and now > at:
                    if watch is not None:
                        watch.announce()
                    raise CollectiveTimeoutError(what())
                if now < spin:
                    _YIELD()
                else:
                    time.sleep(delay)
                    delay = min(1e-3, delay * 2 + 2e-5)
            notice = watch is not None and watch.gone is not None
        # A Test of the notice even when the collective completed first: MPI
        # returns at the first completion it finds (MPICH without matching a
        # notice that had waited in its queue since long before: a rank
        # arriving late then carried on as if nobody had given up).
        if watch is not None and (notice or check) and watch.fired():
            raise watch.error(what)
    except BaseException:
        # Timed out, or left (outside a protected region, or by a second
        # Ctrl-C): the request stays pending, and so must what MPI may still
        # touch.
        if req != MPI.REQUEST_NULL:
            _ABANDONED.append((req, buffers))
        raise


_YIELD = os.sched_yield  # releases the GIL
# How long a wait only yields the core between its Tests.
SPIN = 0.05


def keep_alive(req: MPI.Request | None, *buffers: object) -> None:
    """Keep ``buffers`` (and ``req``) for ever unless ``req`` is complete: MPI
    may still use them after a wait was abandoned."""
    if req is None or req != MPI.REQUEST_NULL:
        _ABANDONED.append((req, buffers))


def dup(comm: MPI.Intracomm, deadline: Deadline | None, what: Callable[[], str]) -> MPI.Intracomm:
    """Collective. Duplicate ``comm`` (``MPI_Comm_idup``) against ``deadline``.

    If the wait is abandoned (a timeout, an interrupt), the request, the new
    handle and a hold on ``comm`` are kept for the life of the process (see
    :func:`_hold_parent`).
    """
    new, req = comm.Idup()
    try:
        wait(req, deadline, what, new)
    except BaseException:
        if req != MPI.REQUEST_NULL:
            _HELD.append(_hold_parent(comm))
        raise
    return cast(MPI.Intracomm, new)


# Open MPI before 5 (open-mpi/ompi#12465): an MPI_Comm_idup that never
# completes leaves, in the table MPI_Finalize walks, a second pointer to its
# parent communicator, and finalize releases the parent through both: the
# second release writes into freed memory, which can abort the process at
# exit. Inactive persistent receives on the parent (local calls, never started
# nor freed) each hold a reference to it: with three, the user's free and
# finalize's two releases only decrement, and the parent is leaked instead.
_HOLDS = 3
_HELD: list[tuple[object, ...]] = []  # never freed, like _ABANDONED


def _hold_parent(comm: MPI.Intracomm) -> tuple[object, ...]:
    name, version = MPI.get_vendor()
    if name != "Open MPI" or version >= (5,):
        return ()
    buf = bytearray(1)
    me = comm.Get_rank()  # a real source: with MPI_PROC_NULL the request holds no communicator
    return (buf, *(comm.Recv_init(buf, source=me, tag=0) for _ in range(_HOLDS)))


def allreduce(
    comm: MPI.Comm, send: _Buf, op: MPI.Op, deadline: Deadline | None, what: Callable[[], str]
) -> _Buf:
    """Collective. Allreduce ``send`` (a numpy or int64 ``array.array``) with ``op``."""
    recv = send[:] if isinstance(send, array.array) else np.empty_like(send)
    wait(comm.Iallreduce(send, recv, op), deadline, what, send, recv)
    return recv


def allgather(
    comm: MPI.Comm, value: Any, deadline: Deadline | None, what: Callable[[], str]
) -> list[Any]:
    """Collective. Allgather a picklable value."""
    # A pickled value of unknown size: gather the sizes, then the bytes.
    data = np.frombuffer(pickle.dumps(value), dtype=np.uint8)
    sizes = np.empty(comm.Get_size(), dtype=np.int64)
    mine = np.array([data.size], dtype=np.int64)
    wait(comm.Iallgather(mine, sizes), deadline, what, mine, sizes)
    displs = np.concatenate(([0], np.cumsum(sizes)[:-1]))
    buf = np.empty(int(sizes.sum()), dtype=np.uint8)
    wait(comm.Iallgatherv(data, [buf, (sizes, displs), MPI.BYTE]), deadline, what, data, buf)
    return [pickle.loads(buf[d : d + s].tobytes()) for d, s in zip(displs, sizes)]
