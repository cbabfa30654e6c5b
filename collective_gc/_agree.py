"""The agreement collectives: which keys has every rank queued?

Every sync point on a communicator of size > 1 starts with one allreduce of a
small int64 header (MPI_MAX). It carries each rank's pending count, its sync
sequence number and next registration key (both as x and -x, so that one MAX
gives the minimum too and a mismatch is seen), the bounds of its pending keys,
and a few policy fields. With nothing pending anywhere, that is the whole
agreement: one small allreduce.

Otherwise the intersection of the pending key sets is computed in one more
allreduce, restricted to the window [max of the minimum keys, min of the
maximum keys], outside of which no key can be pending on every rank:

- a bitmap of the window reduced with MPI_BAND, when the window is dense
  (at most 64 bits per pending key, i.e. no larger than the key array);
- otherwise the sorted key arrays, padded to the largest count and reduced with
  a merge-intersection operator (the scheme of PETSc's PetscGarbageCleanup).

Both cost O(pending) in time and message size.

Every collective here is a non-blocking one, completed with ``Wait`` or, with
a deadline, polled until it completes or the deadline passes (then
:class:`CollectiveTimeoutError`). Never the blocking kind: MPI does not match
a blocking collective with a non-blocking one, and ranks may differ in whether
they have a deadline (a scope leaving on an exception on some ranks only, the
exit agreement).

A request abandoned at a deadline can still be completed by a rank that
arrives later, which would then carry on as if nothing had happened. So the
header carries every rank's deadline (as wall-clock time, the minimum over the
ranks): a rank that completes a collective of the sync point after that
minimum has passed raises :class:`CollectiveTimeoutError` too, as the rank
that gave up did.
"""

from __future__ import annotations

import array
import time
from collections.abc import Callable
from typing import Any, TypeVar, cast

import numpy as np
from mpi4py import MPI

from ._errors import CollectiveTimeoutError

__all__ = [
    "HEADER_LEN",
    "H_CHILD_ERRORS",
    "H_CYCLIC",
    "H_POLICY",
    "H_VOTE",
    "NO_KEY",
    "NO_DEADLINE",
    "Deadline",
    "allreduce",
    "intersect",
    "allgather",
    "dup",
    "keep_alive",
    "wait",
]

# Header slots (all reduced with MPI_MAX).
H_COUNT = 0  # pending count -> max over ranks
H_SEQ = 1  # sync-point number
H_NEG_SEQ = 2  # -sync-point number, so that max gives -min
H_NEXT = 3  # next registration key
H_NEG_NEXT = 4
H_LO = 5  # smallest pending key (NO_KEY if none) -> max = window start
H_NEG_HI = 6  # -largest pending key (+1 if none) -> -max = window end
H_CYCLIC = 7  # cyclic finalizations drained at this sync point
H_CHILD_ERRORS = 8  # destroys that raised on derived communicators (see _comms)
H_POLICY = 9  # the policy slot filled by _scope (the gc generation)
H_VOTE = 10  # two slots: the vote of the manager's sync hook (see add_sync_hook)
H_KIND = 12  # 0: a sync point, 1: the exit agreement (never matched with a sync point)
H_NEG_KIND = 13
H_NEG_DEADLINE = 14  # -(wall-clock deadline in microseconds), NO_DEADLINE if none
HEADER_LEN = 15

NO_KEY = int(np.iinfo(np.int64).max)
NO_DEADLINE = -NO_KEY  # never the MAX while some rank has a deadline


class Deadline:
    """When a sync point gives up waiting: ``at`` (``time.monotonic()``) for
    this rank's own deadline, ``late_after`` (``time.time()``) for the earliest
    deadline of any rank once the header has told it (see the module docs)."""

    __slots__ = ("at", "late_after")

    def __init__(self, at: float | None) -> None:
        self.at = at
        self.late_after: float | None = None

    def wall_us(self) -> int:
        """This rank's deadline for the header: wall-clock microseconds, or NO_DEADLINE."""
        if self.at is None:
            return NO_DEADLINE
        return -int((time.time() + (self.at - time.monotonic())) * 1e6)

    def agree(self, neg_wall_us: int) -> None:
        """Take the reduced header's earliest deadline of any rank."""
        if neg_wall_us != NO_DEADLINE:
            self.late_after = -neg_wall_us / 1e6


_Buf = TypeVar("_Buf", "np.ndarray[Any, Any]", "array.array[int]")


# Requests abandoned at a deadline, with the buffers MPI may still write into
# or read from if a late rank arrives: kept alive for the life of the process
# (a collective cannot be cancelled), so MPI never touches freed memory.
_ABANDONED: list[tuple[MPI.Request, tuple[object, ...]]] = []


def wait(
    req: MPI.Request, deadline: Deadline | None, what: Callable[[], str], *buffers: object
) -> None:
    """Complete ``req`` (a collective on the manager's communicator) against ``deadline``.

    ``buffers`` are kept alive for ever if the request is abandoned, since MPI
    may still read or write them when a late rank arrives.
    """
    if deadline is None or deadline.at is None:
        req.Wait()
    else:
        # Poll: yield the core at first (ranks may share cores with the one we
        # wait for), then back off to a millisecond so a long wait does not
        # burn a core.
        delay = 0.0
        at = deadline.at
        try:
            while not req.Test():
                if time.monotonic() > at:
                    raise CollectiveTimeoutError(what())
                time.sleep(delay)
                delay = min(1e-3, delay * 2 + 2e-5)
        except BaseException:
            # Timed out, or interrupted (KeyboardInterrupt in the sleep): the
            # request stays pending, and so must what MPI may still touch.
            if req != MPI.REQUEST_NULL:
                _ABANDONED.append((req, buffers))
            raise
    if deadline is not None and deadline.late_after is not None:
        if time.time() > deadline.late_after:
            raise CollectiveTimeoutError(
                what() + "\n(it completed here only after the deadline of another rank had "
                "passed: that rank gave up on this sync point)"
            )


def keep_alive(req: MPI.Request, *buffers: object) -> None:
    """Keep ``buffers`` for ever unless ``req`` is complete (an interrupted wait)."""
    if req != MPI.REQUEST_NULL:
        _ABANDONED.append((req, buffers))


def dup(comm: MPI.Intracomm) -> tuple[MPI.Intracomm, MPI.Request]:
    """Collective, non-blocking: start duplicating ``comm``; complete with :func:`wait`.

    The new communicator must not be used (nor wrapped again, which asks MPI
    about it) before the request completes.
    """
    new, req = comm.Idup()
    return cast(MPI.Intracomm, new), req


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
    import pickle

    data = np.frombuffer(pickle.dumps(value), dtype=np.uint8)
    sizes = np.empty(comm.Get_size(), dtype=np.int64)
    mine = np.array([data.size], dtype=np.int64)
    wait(comm.Iallgather(mine, sizes), deadline, what, mine, sizes)
    displs = np.concatenate(([0], np.cumsum(sizes)[:-1]))
    buf = np.empty(int(sizes.sum()), dtype=np.uint8)
    wait(comm.Iallgatherv(data, [buf, (sizes, displs), MPI.BYTE]), deadline, what, data, buf)
    return [pickle.loads(buf[d : d + s].tobytes()) for d, s in zip(displs, sizes)]


def _merge_intersect(inbuf: Any, inoutbuf: Any, datatype: MPI.Datatype) -> None:
    # Slot 0 holds the length, then the sorted keys. Commutative.
    a = np.frombuffer(inbuf, dtype=np.int64)
    b = np.frombuffer(inoutbuf, dtype=np.int64)
    common = np.intersect1d(a[1 : 1 + a[0]], b[1 : 1 + b[0]], assume_unique=True)
    b[0] = common.size
    b[1 : 1 + common.size] = common


_OP_INTERSECT: list[MPI.Op] = []


def _intersect_op() -> MPI.Op:
    if not _OP_INTERSECT:
        _OP_INTERSECT.append(MPI.Op.Create(_merge_intersect, commute=True))
    return _OP_INTERSECT[0]


def intersect(
    comm: MPI.Comm,
    keys: np.ndarray[Any, Any],
    lo: int,
    hi: int,
    max_count: int,
    deadline: Deadline | None,
    what: Callable[[], str],
) -> np.ndarray[Any, Any]:
    """Collective. The keys in sorted ``keys`` that every rank holds, ascending.

    ``lo``/``hi`` bound the window (the same on every rank, from the header),
    ``max_count`` is the largest count on any rank. Every rank must choose the
    same method, so the choice depends only on these agreed values.
    """
    if lo > hi:
        return keys[:0]
    span = hi - lo + 1
    if span <= 64 * max_count:
        inside = keys[(keys >= lo) & (keys <= hi)] - lo
        bits = np.zeros(span, dtype=bool)
        bits[inside] = True
        packed = np.packbits(bits)
        common = allreduce(comm, packed, MPI.BAND, deadline, what)
        return np.flatnonzero(np.unpackbits(common, count=span)).astype(np.int64) + lo
    buf = np.zeros(max_count + 1, dtype=np.int64)
    buf[0] = keys.size
    buf[1 : 1 + keys.size] = keys
    out = np.empty_like(buf)
    dtype = MPI.BYTE.Create_contiguous(buf.nbytes)
    dtype.Commit()
    req = comm.Iallreduce([buf, 1, dtype], [out, 1, dtype], _intersect_op())
    try:
        wait(req, deadline, what, buf, out, dtype)
    finally:
        if req == MPI.REQUEST_NULL:  # completed: the datatype is ours to free
            dtype.Free()
    return out[1 : 1 + out[0]].copy()
