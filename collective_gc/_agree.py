"""The agreement collectives: which keys has every rank queued?

A sync point on a communicator of size > 1 is, in the steady state, one
non-blocking allreduce of int64 words with MPI_BAND, which carries at once:

- the sync-point number (with the exit-agreement mark), the next
  registration key and a 64-bit fingerprint of the participants, each as x
  and ~x: the AND of x and of ~x are equal
  complements exactly when every rank sent the same x, so a rank that
  skipped a sync point or registered differently is seen by every rank;
- flags, sent complemented, so the AND is the complement of their OR: a
  cyclic death drained anywhere, a failed destroy on a derived communicator,
  and one byte per participant (see :class:`Manager.add_participant`), which
  encodes a small maximum as a thermometer code;
- a bitmap of the pending keys in a *window* of keys, ANDed: the keys
  pending on every rank.

The window needs no round of its own. Between sync points, the keys whose
destroy has not run are the same on every rank (registration is collective,
destroys run by agreement or by collective explicit calls), so a window
computed from what earlier sync points agreed (the registrations of the last
few intervals, with room for twice the largest recent one) is the same on
every rank, and so is the message's length, even when the ranks disagree.
Pending keys outside the window (an object kept for many steps, a burst of
registrations larger than any recent one) set bits of a 64-bit hash filter, ANDed too; only if the
filter says a key outside the window may be pending everywhere does a
fallback run: an allreduce of the count and bounds of those keys, then their
intersection (see :func:`intersect`: built-in MPI operations only). Message
size stays O(window + pending): 8 words and the window's bitmap in the steady
state, whatever the number of ranks (:func:`message_words`).

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
import functools
import hashlib
import os
import time
from collections.abc import Callable
from typing import Any, TypeVar, cast

import numpy as np
from mpi4py import MPI

from ._errors import CollectiveTimeoutError
from ._registration import SPEEDUPS

__all__ = [
    "FLAG_CYCLIC",
    "FLAG_FAILED",
    "FLAG_DEADLINE",
    "FLAG_BAD_VOTE",
    "FIELD_BITS",
    "NO_KEY",
    "Deadline",
    "Header",
    "Agreed",
    "Agreement",
    "PERSISTENT",
    "Watch",
    "Window",
    "allreduce",
    "intersect",
    "intersect_any",
    "message_words",
    "allgather",
    "dup",
    "keep_alive",
    "wait",
]

NO_KEY = int(np.iinfo(np.int64).max)

# Flags, ORed over the ranks.
FLAG_CYCLIC = 1  # a cyclic-GC death of a managed object was drained
FLAG_FAILED = 2  # a destroy raised (on a derived communicator, or in the sync point's own)
# Some rank waited for the agreement against a deadline: only then may one have
# given up, and only then is the watch checked once the agreement completed.
FLAG_DEADLINE = 4
FLAG_BAD_VOTE = 8  # a participant voted outside 0..255
FIELD_BITS = 8  # participant field f owns bits [8 (f + 1), 8 (f + 2)) of the flags
MAX_FIELDS = 6


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
        if deadline is None or deadline.at is None:
            if watch is None:
                req.Wait()
            else:
                notice = _WAITANY((req, watch.request)) == 1
        else:
            # Poll. For the first SPIN seconds between Tests only yield the
            # core (to a rank sharing it, perhaps the one we wait for): a
            # collective such as MPI_Comm_idup takes several rounds, each
            # progressed only inside a Test, so a sleep between Tests costs
            # every round its length (most of a sync point of DOLFINx's loop,
            # which adopts two new communicators per step: bench_dolfinx.py).
            # Then back off to a millisecond, so that a long wait does not
            # burn a core.
            delay = 0.0
            at = deadline.at
            spin = time.monotonic() + SPIN
            while not (req.Test() or (watch is not None and watch.fired())):
                now = time.monotonic()
                if now > at:
                    if watch is not None:
                        watch.announce()
                    raise CollectiveTimeoutError(what())
                if now < spin:
                    _YIELD()
                else:
                    time.sleep(delay)
                    delay = min(1e-3, delay * 2 + 2e-5)
            notice = watch is not None and watch.gone is not None
        # A Test of the notice even when Waitany returned the collective: MPI
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


_WAITANY = MPI.Request.Waitany
_YIELD = os.sched_yield  # releases the GIL
# How long a wait against a deadline only yields the core between its Tests.
SPIN = 0.05


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
    sizes = np.empty(comm.Get_size(), dtype=np.int64)
    mine = np.array([data.size], dtype=np.int64)
    wait(comm.Iallgather(mine, sizes), deadline, what, mine, sizes)
    displs = np.concatenate(([0], np.cumsum(sizes)[:-1]))
    buf = np.empty(int(sizes.sum()), dtype=np.uint8)
    wait(comm.Iallgatherv(data, [buf, (sizes, displs), MPI.BYTE]), deadline, what, data, buf)
    return [pickle.loads(buf[d : d + s].tobytes()) for d, s in zip(displs, sizes)]


def intersect(
    comm: MPI.Comm,
    keys: np.ndarray[Any, Any],
    lo: int,
    hi: int,
    fewest: int,
    root: int,
    deadline: Deadline | None,
    what: Callable[[], str],
) -> np.ndarray[Any, Any]:
    """Collective. The keys in sorted ``keys`` that every rank holds, ascending.

    ``lo``/``hi`` bound the intersection (the highest lowest and the lowest
    highest key of any rank), ``fewest`` is the smallest count on any rank and
    ``root`` a rank that holds that many. Every rank must choose the same
    method, so the choice depends only on these agreed values.

    No user-defined MPI operation: a Python callback inside a reduction runs
    wherever MPI progresses it, and Open MPI 4.1's libnbc ring called one on
    an empty segment (issue 25). Either a bitmap of ``[lo, hi]`` is ANDed
    (when it is no longer than the keys themselves would be), or ``root``
    broadcasts its keys and a bitmap of which of them each rank holds is
    ANDed: messages of O(keys), whatever the number of ranks.
    """
    if lo > hi or fewest == 0:
        return keys[:0]
    span = hi - lo + 1
    if span <= 64 * fewest:
        inside = keys[(keys >= lo) & (keys <= hi)] - lo
        bits = np.zeros(span, dtype=bool)
        bits[inside] = True
        common = allreduce(comm, np.packbits(bits), MPI.BAND, deadline, what)
        return np.flatnonzero(np.unpackbits(common, count=span)).astype(np.int64) + lo
    theirs = keys.copy() if comm.Get_rank() == root else np.empty(fewest, dtype=np.int64)
    wait(comm.Ibcast(theirs, root), deadline, what, theirs)
    at = keys.searchsorted(theirs)
    held = at < keys.size
    held[held] = keys[at[held]] == theirs[held]
    common = allreduce(comm, np.packbits(held), MPI.BAND, deadline, what)
    found: np.ndarray[Any, Any] = theirs[np.unpackbits(common, count=fewest).astype(bool)]
    return found


def field_shift(field: int) -> int:
    """The first bit of participant field ``field`` in the flags."""
    if not 0 <= field < MAX_FIELDS:
        raise ValueError(f"participant field {field} is not in 0..{MAX_FIELDS - 1}")
    return FIELD_BITS * (field + 1)


class Header:
    """What one rank brings to a sync point, besides its pending keys.
    ``parts`` is a 64-bit fingerprint of its participants (see
    :func:`fingerprint`), agreed for equality like the sync-point number."""

    __slots__ = ("seq", "next_key", "at_exit", "flags", "parts")

    def __init__(self, seq: int, next_key: int, at_exit: bool, flags: int, parts: int = 0) -> None:
        self.seq = seq
        self.next_key = next_key
        self.at_exit = at_exit
        self.flags = flags
        self.parts = parts


@functools.lru_cache(maxsize=256)
def fingerprint(identities: str) -> int:
    """A 64-bit fingerprint of the participants' identities, as one int64
    word, the same in every process (str hashes are salted per process).

    Sent as x and ~x under MPI_BAND, so ranks whose identities differ pass
    for equal only if their fingerprints collide: with a cryptographic hash,
    a chance of 2**-64 per pair of differing sets (issue 25: a 16-bit CRC
    collided after ~47k tries of a user participant's identity). Cached: a
    manager's participants rarely change between sync points."""
    digest = hashlib.blake2b(identities.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True)


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
# The message: the sync-point word (number and exit mark), the next key and
# the participants' fingerprint, each as x and ~x; the flags, complemented;
# the hash filter of the pending keys outside the window; then the window's
# bitmap. Nothing in it is per rank.
_WORDS = 8


def message_words(window_bits: int) -> int:
    """The agreement's message, in int64 words, for a window of ``window_bits``
    keys: the same at any number of ranks."""
    return _WORDS + window_bits // 64


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

    Keeps the window, the communicator's :class:`Watch` and one message
    buffer between sync points (an ``array.array``, whose item stores are
    cheap): an empty sync point then costs eight stores around its allreduce.
    """

    __slots__ = (
        "comm",
        "rank",
        "size",
        "window",
        "watch",
        "_arr",
        "_dirty",
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
        self.watch = Watch(comm)
        self._lo = self._nbits = -1  # the window the buffers are shaped for
        self._arr = array.array("q")
        self._dirty = False  # the bitmap may hold bits from the last sync point
        # MPI-4's persistent allreduce (mpi4py 4), bound to the buffer while
        # its shape lasts: starting it costs less than a new Iallreduce.
        init = getattr(comm, "Allreduce_init", None)  # mpi4py 4 only
        self._persistent: Callable[..., MPI.Prequest] | None = init if PERSISTENT[0] else None
        self._preq: MPI.Prequest | None = None

    @property
    def words(self) -> int:
        """The length, in int64 words, of the message the last agreement sent."""
        return len(self._arr)

    def close(self) -> None:
        """Free the persistent request, if an inactive one is kept, and withdraw
        the watch's receive. Local; call it before freeing the communicator."""
        self._drop_request()
        self.watch.close()

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
        """A new buffer for the window ``[lo, lo + nbits)`` (agreed, so on every rank)."""
        self._drop_request()  # bound to the old buffer
        self._arr = array.array("q", bytes(8 * message_words(nbits)))
        self._dirty = False
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
        when a rank gave up (see :class:`Watch`).
        """
        deadline.watch = self.watch  # this sync point's later waits too
        self.watch.seq = head.seq
        window = self.window
        lo, nbits = window.lo, window.bits
        if lo != self._lo or nbits != self._nbits:
            self._reshape(lo, nbits)
        buf = self._arr  # same length as before: the memory MPI may be bound to stays
        # Equality of the sync-point number and kind (exit or not), of the
        # next key and of the participants: each word and its complement.
        seqword = head.seq * 2 + head.at_exit
        buf[0] = seqword
        buf[1] = ~seqword
        buf[2] = head.next_key
        buf[3] = ~head.next_key
        buf[4] = head.parts
        buf[5] = ~head.parts
        buf[6] = ~(head.flags if deadline.at is None else head.flags | FLAG_DEADLINE)
        if pending.size:
            # The keys [first, last) of pending are in the window; the whole
            # bitmap is written.
            first, last, buf[7] = _PACK(pending, lo, nbits, buf, _WORDS)
            self._dirty = True
        else:
            first = last = 0
            buf[7] = 0
            if self._dirty:  # the AND of bits this rank sent: clear them
                np.frombuffer(buf, dtype=np.int64)[_WORDS:] = 0
                self._dirty = False
        # In place, against the deadline if any: most of an empty sync point.
        # Non-blocking even without one: a blocking collective never matches
        # the non-blocking one of a rank that has a deadline.
        try:
            wait(self._start(buf), deadline, what, buf, check=False)
        except BaseException:
            # MPI may still write into it, and the request may still be
            # active: neither is used again, and both are kept for ever (wait
            # keeps what it abandons; an interrupt may also land between the
            # start and the wait).
            _ABANDONED.append((self._preq, (buf,)))
            self._forget_buffers()
            raise
        red = buf
        agreed_flags = ~red[6]
        if agreed_flags & FLAG_DEADLINE:
            # A rank that had a deadline may have given up after sending its
            # part (see wait): then this agreement completed only because of
            # what it left behind.
            if self.watch.fired():
                raise self.watch.error(what)
            agreed_flags &= ~FLAG_DEADLINE
        if red[0] != ~red[1] or red[2] != ~red[3] or red[4] != ~red[5]:
            return Agreed(_NO_KEYS, agreed_flags, True, False)
        fallback = red[7] != 0
        if last == first and not fallback and not agreed_flags:
            return _NOTHING  # the steady state: nothing to destroy, nothing to say
        keys = _NO_KEYS
        if last > first:  # only bits this rank set can have survived the AND
            keys = _WINDOW_KEYS(red, _WORDS, nbits, lo)
        if fallback:
            # Every rank saw the same filter, so every rank runs this round.
            outside = np.concatenate((pending[:first], pending[last:]))
            extra = intersect_any(self.comm, outside, deadline, what)
            if extra.size:
                keys = np.union1d(keys, extra)
        return Agreed(keys, agreed_flags, False, fallback)

    def any_flags(self, flags: int, deadline: Deadline, what: Callable[[], str]) -> int:
        """Collective: the OR over the ranks of ``flags`` (one word, MPI_BAND of complements)."""
        deadline.watch = self.watch
        buf = array.array("q", (~flags,))
        return ~allreduce(self.comm, buf, MPI.BAND, deadline, what)[0]

    def allgather(self, value: Any, deadline: Deadline, what: Callable[[], str]) -> list[Any]:
        """Collective: every rank's ``value`` (picklable), against ``deadline``
        and this communicator's watch."""
        deadline.watch = self.watch
        return allgather(self.comm, value, deadline, what)


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
    round for the counts and bounds, then :func:`intersect`."""
    # Under MAX: the largest count, the highest lowest key, the lowest highest
    # key (negated), and the smallest count with the lowest rank holding it
    # (count * 2**32 + rank, negated).
    rank = comm.Get_rank()
    if keys.size:
        head = np.array(
            [keys.size, keys[0], -keys[-1], -((keys.size << 32) + rank)], dtype=np.int64
        )
    else:
        head = np.array([0, NO_KEY, 1, -rank], dtype=np.int64)
    red = allreduce(comm, head, MPI.MAX, deadline, what)
    if red[0] == 0 or red[1] == NO_KEY:
        # Any rank with no keys makes the intersection empty: its lowest key
        # NO_KEY then bounds it beyond every other.
        return keys[:0]
    fewest, root = divmod(-int(red[3]), 1 << 32)
    return intersect(comm, keys, int(red[1]), int(-red[2]), fewest, root, deadline, what)
