"""The agreement collectives: which keys has every rank queued?

A sync point on a communicator of size > 1 is, in the steady state, one
non-blocking allreduce of int64 words with MPI_BAND, which carries at once:

- the sync-point number (with the exit-agreement mark) and the next
  registration key, each as x and ~x: the AND of x and of ~x are equal
  complements exactly when every rank sent the same x, so a rank that
  skipped a sync point or registered differently is seen by every rank;
- flags, sent complemented, so the AND is the complement of their OR: a
  cyclic death drained anywhere, a failed destroy on a derived communicator,
  and one byte per participant (see :class:`Manager.add_participant`), which
  encodes a small maximum as a thermometer code;
- each rank's deadline, in a word of its own (every other rank sends all
  ones there), so every rank learns the earliest one;
- a bitmap of the pending keys in a *window* of keys, ANDed: the keys
  pending on every rank.

The window needs no round of its own. Between sync points, the keys whose
destroy has not run are the same on every rank (registration is collective,
destroys run by agreement or by collective explicit calls), so a window
computed from what earlier sync points agreed (the registrations of the last
few intervals, with room for twice the largest recent one) is the same on
every rank, and so is the message's length, even when the ranks disagree.
Pending keys outside the window (an object kept for many steps, a burst of registrations larger
than any recent one) set bits of a 64-bit hash filter, ANDed too; only if the
filter says a key outside the window may be pending everywhere does a
fallback run: an allreduce of (count, lowest, highest) of those keys, then
their intersection (a bitmap, or the sorted keys merged as PETSc's
PetscGarbageCleanup does). Message size stays O(window + pending).

Every collective here is a non-blocking one, completed with ``Wait`` or, with
a deadline, polled until it completes or the deadline passes (then
:class:`CollectiveTimeoutError`). Never the blocking kind: MPI does not match
a blocking collective with a non-blocking one, and ranks may differ in whether
they have a deadline (a scope leaving on an exception on some ranks only, the
exit agreement).

A request abandoned at a deadline can still be completed by a rank that
arrives later, which would then carry on as if nothing had happened. So each
rank's deadline (wall-clock time) rides in the message: a rank that completes
a collective of the sync point after the earliest of them has passed raises
:class:`CollectiveTimeoutError` too, as the rank that gave up did.
"""

from __future__ import annotations

import array
import time
import zlib
from collections.abc import Callable
from typing import Any, TypeVar, cast

import numpy as np
from mpi4py import MPI

from ._errors import CollectiveTimeoutError
from ._registration import SPEEDUPS

__all__ = [
    "FLAG_CYCLIC",
    "FLAG_FAILED",
    "FLAG_BAD_VOTE",
    "FIELD_BITS",
    "NO_KEY",
    "NO_DEADLINE",
    "Deadline",
    "Header",
    "Agreed",
    "Agreement",
    "PERSISTENT",
    "Window",
    "allreduce",
    "intersect",
    "allgather",
    "dup",
    "keep_alive",
    "wait",
]

NO_KEY = int(np.iinfo(np.int64).max)
NO_DEADLINE = NO_KEY  # a rank without a deadline: never the earliest one

# Flags, ORed over the ranks.
FLAG_CYCLIC = 1  # a cyclic-GC death of a managed object was drained
FLAG_FAILED = 2  # a destroy raised (on a derived communicator, or in the sync point's own)
FLAG_BAD_VOTE = 8  # a participant voted outside 0..255
FIELD_BITS = 8  # participant field f owns bits [8 (f + 1), 8 (f + 2)) of the flags
MAX_FIELDS = 6


class Deadline:
    """When a sync point gives up waiting: ``at`` (``time.monotonic()``) for
    this rank's own deadline, ``late_after`` (``time.time()``) for the earliest
    deadline of any rank once the agreement has told it (see the module docs).

    A signal's exception never lands in a wait of a sync point: the callers
    wait inside protected regions (see :mod:`collective_gc._interrupts`).
    """

    __slots__ = ("at", "late_after")

    def __init__(self, at: float | None) -> None:
        self.at = at
        self.late_after: float | None = None

    def wall_us(self) -> int:
        """This rank's deadline as wall-clock microseconds, or NO_DEADLINE."""
        if self.at is None:
            return NO_DEADLINE
        us = (time.time() + (self.at - time.monotonic())) * 1e6
        return int(min(us, NO_DEADLINE - 1))  # a timeout of centuries still fits a word

    def agree(self, wall_us: int) -> None:
        """Take the earliest deadline of any rank (NO_DEADLINE: none had one)."""
        if wall_us != NO_DEADLINE:
            self.late_after = wall_us / 1e6


_Buf = TypeVar("_Buf", "np.ndarray[Any, Any]", "array.array[int]")


# Requests abandoned at a deadline, with the buffers MPI may still write into
# or read from if a late rank arrives: kept alive for the life of the process
# (a collective cannot be cancelled), so MPI never touches freed memory.
_ABANDONED: list[tuple[MPI.Request | None, tuple[object, ...]]] = []


def wait(
    req: MPI.Request, deadline: Deadline | None, what: Callable[[], str], *buffers: object
) -> None:
    """Complete ``req`` (a collective on the manager's communicator) against ``deadline``.

    ``buffers`` are kept alive for ever if the request is abandoned, since MPI
    may still read or write them when a late rank arrives.
    """
    try:
        if deadline is None or deadline.at is None:
            req.Wait()
        else:
            # Poll: yield the core at first (ranks may share cores with the one
            # we wait for), then back off to a millisecond so a long wait does
            # not burn a core.
            delay = 0.0
            at = deadline.at
            while not req.Test():
                if time.monotonic() > at:
                    raise CollectiveTimeoutError(what())
                time.sleep(delay)
                delay = min(1e-3, delay * 2 + 2e-5)
    except BaseException:
        # Timed out, or left (outside a protected region, or by a second
        # Ctrl-C): the request stays pending, and so must what MPI may still
        # touch.
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
    import pickle

    data = np.frombuffer(pickle.dumps(value), dtype=np.uint8)
    # Each rank's size and deadline: a rank that completes this round after
    # another gave up on it raises now, not at its own deadline in the next.
    pairs = np.empty(2 * comm.Get_size(), dtype=np.int64)
    at = NO_DEADLINE if deadline is None else deadline.wall_us()
    mine = np.array([data.size, at], dtype=np.int64)
    wait(comm.Iallgather(mine, pairs), deadline, what, mine, pairs)
    sizes = pairs[0::2].copy()
    earliest = int(pairs[1::2].min())
    if deadline is not None and earliest != NO_DEADLINE:
        deadline.agree(earliest)
        if deadline.late_after is not None and time.time() > deadline.late_after:
            raise CollectiveTimeoutError(
                what() + "\n(it completed here only after the deadline of another rank had "
                "passed: that rank gave up on this gather)"
            )
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


def field_shift(field: int) -> int:
    """The first bit of participant field ``field`` in the flags."""
    if not 0 <= field < MAX_FIELDS:
        raise ValueError(f"participant field {field} is not in 0..{MAX_FIELDS - 1}")
    return FIELD_BITS * (field + 1)


class Header:
    """What one rank brings to a sync point, besides its pending keys.
    ``parts`` is a 16-bit fingerprint of its participants (see
    :func:`fingerprint`): agreed for equality with the sync-point number."""

    __slots__ = ("seq", "next_key", "at_exit", "flags", "parts")

    def __init__(self, seq: int, next_key: int, at_exit: bool, flags: int, parts: int = 0) -> None:
        self.seq = seq
        self.next_key = next_key
        self.at_exit = at_exit
        self.flags = flags
        self.parts = parts


def fingerprint(identities: str) -> int:
    """A 16-bit fingerprint of the participants' identities, the same in
    every process (str hashes are salted per process; CRC-32 is not)."""
    return zlib.crc32(identities.encode()) & 0xFFFF


class Window:
    """The keys whose pending state travels as a bitmap: ``[lo, lo + bits)``.

    Changed only by :meth:`advance` with agreed values, so the same on every
    rank of the communicator.
    """

    __slots__ = ("lo", "bits", "marks", "growths", "idle")

    # Beyond this many keys, the window keeps the newest ones (the rest go
    # through the fallback): a bitmap costs a bit per key, the fallback's
    # merge 64 bits per pending key.
    LIMIT = 1 << 20
    MIN = 256
    # How many sync points back the window remembers the registrations made
    # between two sync points: a burst (a step that makes many objects,
    # followed by a sync point that finds nothing new) must not shrink it
    # before the next burst.
    MEMORY = 8
    # How many sync points back the window's first key was the next key: an
    # object that outlives a few sync points (a previous step's solution, one
    # a sync point between two steps did not see die) is still inside it.
    SPAN = 4

    def __init__(self) -> None:
        self.lo = 0
        self.bits = self.MIN
        self.marks = [0]  # the agreed next key at the last sync points, oldest first
        self.growths: list[int] = []
        self.idle = 0  # sync points in a row (up to MEMORY) that found nothing registered

    def advance(self, next_key: int) -> None:
        """After a sync point agreed on ``next_key``: the keys registered since
        the last SPAN - 1 sync points, and room for twice as many new ones as
        the most registered between two of the last MEMORY sync points."""
        marks, growths = self.marks, self.growths
        if next_key == marks[-1]:
            if self.idle == self.MEMORY:
                # Nothing registered for MEMORY sync points: every growth
                # remembered is 0 and every mark is next_key, so advancing
                # would change nothing.
                return
            self.idle += 1
        else:
            self.idle = 0
        growths.append(next_key - marks[-1])
        marks.append(next_key)
        if len(growths) > self.MEMORY:
            del growths[0]
        if len(marks) > self.SPAN:
            del marks[0]
        lo = marks[0]
        hi = next_key + max(2 * max(growths), self.MIN)
        if hi - lo > self.LIMIT:
            lo = hi - self.LIMIT
        self.lo = lo
        self.bits = -(-(hi - lo) // 64) * 64


class Agreed:
    """What a sync point's agreement found: the same on every rank."""

    __slots__ = ("keys", "flags", "mismatch", "fallback")

    def __init__(
        self, keys: np.ndarray[Any, Any], flags: int, mismatch: bool, fallback: bool
    ) -> None:
        self.keys = keys  # pending on every rank, ascending
        self.flags = flags  # ORed over the ranks
        self.mismatch = mismatch  # the ranks differ in sync number, kind or registrations
        self.fallback = fallback  # keys outside the window needed a second round


_HASH = 0x9E3779B97F4A7C15  # Fibonacci hashing: consecutive keys spread over the filter
_WORDS = 6  # seq, ~seq, next key, ~next key, ~flags, filter
FLAG_DEADLINE = 4  # some rank has a deadline: the earliest one must be read


def _filter(keys: np.ndarray[Any, Any]) -> int:
    h = (keys.astype(np.uint64) * np.uint64(_HASH)) >> np.uint64(58)
    bits = np.bitwise_or.reduce(np.left_shift(np.uint64(1), h))
    return int(np.array(bits, dtype=np.uint64).view(np.int64))


def pack_window_py(
    keys: np.ndarray[Any, Any], lo: int, nbits: int, buf: array.array[int], at: int
) -> tuple[int, int, int]:
    """The window's bitmap of the ascending ``keys``, written into the
    ``nbits // 64`` words of ``buf`` from word ``at`` (bit i of the window is
    bit i % 64 of word i // 64); returns the index range [first, last) of the
    keys inside it and the hash filter of those outside (0 if none).
    ``_speedups.pack_window`` does the same in C."""
    first = int(keys.searchsorted(lo))
    last = int(keys.searchsorted(lo + nbits))
    bits = np.zeros(nbits, dtype=bool)
    bits[keys[first:last] - lo] = True
    words = np.frombuffer(buf, dtype=np.int64)
    words[at : at + nbits // 64] = np.packbits(bits, bitorder="little").view(np.int64)
    outside = first or last < keys.size
    return first, last, _filter(np.concatenate((keys[:first], keys[last:]))) if outside else 0


def window_keys_py(buf: array.array[int], at: int, nbits: int, lo: int) -> np.ndarray[Any, Any]:
    """The keys whose bits are set in a window written by :func:`pack_window_py`,
    ascending. ``_speedups.window_keys`` does the same in C."""
    words = np.frombuffer(buf, dtype=np.int64)[at : at + nbits // 64]
    bits = np.unpackbits(words.view(np.uint8), count=nbits, bitorder="little")
    return np.flatnonzero(bits).astype(np.int64) + lo


def _window_keys_c(buf: array.array[int], at: int, nbits: int, lo: int) -> np.ndarray[Any, Any]:
    assert SPEEDUPS is not None
    return np.frombuffer(SPEEDUPS.window_keys(buf, at, nbits, lo), np.int64)


# The window's packing and reading: in C where the extension is built (a few
# numpy calls cost more than the work when numpy is out of cache, as after
# many destroys), else with numpy.
_PACK: Callable[..., tuple[int, int, int]] = (
    pack_window_py if SPEEDUPS is None else SPEEDUPS.pack_window
)
_WINDOW_KEYS: Callable[..., np.ndarray[Any, Any]] = (
    window_keys_py if SPEEDUPS is None else _window_keys_c
)


class Agreement:
    """The agreement of one manager's sync points over its private communicator.

    Keeps the window and one message buffer between sync points (an
    ``array.array``, whose item stores are cheap, with a numpy view of the
    same memory for the bitmap): an empty sync point then costs a few stores
    around its allreduce.
    """

    __slots__ = (
        "comm",
        "rank",
        "size",
        "window",
        "_arr",
        "_blank",
        "_lo",
        "_nbits",
        "_persistent",
        "_preq",
    )

    def __init__(self, comm: MPI.Intracomm) -> None:
        self.comm = comm
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.window = Window()
        self._lo = self._nbits = -1  # the window the buffers are shaped for
        self._arr = array.array("q")
        self._blank = array.array("q")
        # MPI-4's persistent allreduce (mpi4py 4), bound to the buffer while
        # its shape lasts: starting it costs less than a new Iallreduce.
        init = getattr(comm, "Allreduce_init", None)  # mpi4py 4 only
        self._persistent: Callable[..., MPI.Prequest] | None = init if PERSISTENT[0] else None
        self._preq: MPI.Prequest | None = None

    def close(self) -> None:
        """Free the persistent request, if an inactive one is kept. Local; call
        it before freeing the communicator."""
        self._drop_request()

    def _drop_request(self) -> None:
        req, self._preq = self._preq, None
        if req is not None and req != MPI.REQUEST_NULL:
            req.Free()  # inactive (completed), so local

    def _start(self, buf: array.array[int]) -> MPI.Request:
        """Start the allreduce (MPI_BAND, in place) of ``buf``."""
        if self._persistent is not None:
            req = self._preq
            if req is None:
                try:
                    # Collective, but nonblocking; every rank makes it at the
                    # same sync point (the buffer's shape is agreed).
                    req = self._preq = self._persistent(_IN_PLACE, buf, MPI.BAND)
                except NotImplementedError:
                    # mpi4py 4 over an MPI without it: the same on every rank.
                    self._persistent = None
                    return self.comm.Iallreduce(_IN_PLACE, buf, MPI.BAND)
            req.Start()
            return req
        return self.comm.Iallreduce(_IN_PLACE, buf, MPI.BAND)

    def _reshape(self, lo: int, nbits: int) -> None:
        """New buffers for the window ``[lo, lo + nbits)`` (agreed, so on every rank)."""
        self._drop_request()  # bound to the old buffer
        size = _WORDS + self.size + nbits // 64
        self._arr = array.array("q", bytes(8 * size))
        # What every message starts from, copied in one step: the header
        # words zero, the other ranks' deadline words all ones (the identity
        # of AND), this rank's NO_DEADLINE until it has one, an empty bitmap.
        blank = self._blank = array.array("q", bytes(8 * size))
        blank[_WORDS : _WORDS + self.size] = array.array("q", [-1] * self.size)
        blank[_WORDS + self.rank] = NO_DEADLINE
        self._lo, self._nbits = lo, nbits

    def _forget_buffers(self) -> None:
        """After an abandoned collective: MPI may still use the buffer, so never again."""
        self._lo = self._nbits = -1
        self._preq = None

    def agree(
        self,
        head: Header,
        pending: np.ndarray[Any, Any],
        deadline: Deadline,
        what: Callable[[], str],
    ) -> Agreed:
        """Collective: the keys in ``pending`` (ascending) pending on every rank.

        One allreduce unless keys outside the window may be pending
        everywhere. Raises :class:`CollectiveTimeoutError` at the deadline, or
        when it completes here only after another rank's deadline passed.
        """
        window = self.window
        lo, nbits = window.lo, window.bits
        if lo != self._lo or nbits != self._nbits:
            self._reshape(lo, nbits)
        end = _WORDS + self.size
        buf = self._arr
        buf[:] = self._blank  # same length: the memory MPI may be bound to stays
        flags = head.flags
        at = deadline.at
        if at is not None:
            flags |= FLAG_DEADLINE
            buf[_WORDS + self.rank] = deadline.wall_us()
        # Equality of the sync-point number, the participants and the kind
        # (exit or not) in one word and its complement.
        seqword = ((head.seq << 16) + head.parts) * 2 + head.at_exit
        buf[0] = seqword
        buf[1] = ~seqword
        buf[2] = head.next_key
        buf[3] = ~head.next_key
        buf[4] = ~flags
        if pending.size:
            # The keys [first, last) of pending are in the window.
            first, last, buf[5] = _PACK(pending, lo, nbits, buf, end)
        else:
            first = last = 0
        # In place, against the deadline if any: most of an empty sync point.
        # Non-blocking even without one: a blocking collective never matches
        # the non-blocking one of a rank that has a deadline.
        try:
            wait(self._start(buf), deadline, what, buf)
        except BaseException:
            # MPI may still write into it, and the request may still be
            # active: neither is used again, and both are kept for ever (wait
            # keeps what it abandons; an interrupt may also land between the
            # start and the wait).
            _ABANDONED.append((self._preq, (buf,)))
            self._forget_buffers()
            raise
        red = buf
        agreed_flags = ~red[4]
        if agreed_flags & FLAG_DEADLINE:
            earliest = min(red[_WORDS:end])
            deadline.agree(earliest)
            late = deadline.late_after
            if late is not None and time.time() > late:
                raise CollectiveTimeoutError(
                    what() + "\n(it completed here only after the deadline of another rank "
                    "had passed: that rank gave up on this sync point)"
                )
        agreed_flags &= ~FLAG_DEADLINE
        if red[0] != ~red[1] or red[2] != ~red[3]:
            return Agreed(_NO_KEYS, agreed_flags, True, False)
        fallback = red[5] != 0
        if last == first and not fallback and not agreed_flags:
            return _NOTHING  # the steady state: nothing to destroy, nothing to say
        keys = _NO_KEYS
        if last > first:  # only bits this rank set can have survived the AND
            keys = _WINDOW_KEYS(red, end, nbits, lo)
        if fallback:
            # Every rank saw the same filter, so every rank runs this round.
            outside = np.concatenate((pending[:first], pending[last:]))
            extra = intersect_any(self.comm, outside, deadline, what)
            if extra.size:
                keys = np.union1d(keys, extra)
        return Agreed(keys, agreed_flags, False, fallback)

    def any_flags(self, flags: int, deadline: Deadline, what: Callable[[], str]) -> int:
        """Collective: the OR over the ranks of ``flags`` (one word, MPI_BAND of complements)."""
        buf = array.array("q", (~flags,))
        return ~allreduce(self.comm, buf, MPI.BAND, deadline, what)[0]


_IN_PLACE = MPI.IN_PLACE
_NO_KEYS = np.empty(0, dtype=np.int64)
_NO_KEYS.flags.writeable = False  # shared by every agreement that found none
_NOTHING = Agreed(_NO_KEYS, 0, False, False)  # read only, never changed


# Whether agreements use MPI-4's persistent allreduce where mpi4py offers it
# (tests switch it off to run the other path on the same MPI).
PERSISTENT = [True]


def intersect_any(
    comm: MPI.Comm, keys: np.ndarray[Any, Any], deadline: Deadline, what: Callable[[], str]
) -> np.ndarray[Any, Any]:
    """Collective: the keys of ``keys`` (ascending) that every rank holds: one
    round for the count and bounds, then :func:`intersect`."""
    if keys.size:
        head = np.array([keys.size, keys[0], -keys[-1]], dtype=np.int64)
    else:
        head = np.array([0, NO_KEY, 1], dtype=np.int64)
    red = allreduce(comm, head, MPI.MAX, deadline, what)
    if red[0] == 0 or red[1] == NO_KEY:
        return keys[:0]
    # Any rank with no keys makes the intersection empty: its lowest key
    # NO_KEY then bounds the window beyond every other.
    return intersect(comm, keys, int(red[1]), int(-red[2]), int(red[0]), deadline, what)
