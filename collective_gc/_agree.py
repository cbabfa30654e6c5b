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
size stays O(window + pending): 9 words and the window's bitmap in the steady
state, whatever the number of ranks (:func:`message_words`).

The collectives themselves, their deadlines and the watch that tells every
rank when one gave up, are :mod:`collective_gc._transport`'s.
"""

from __future__ import annotations

import array
import functools
import hashlib
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from mpi4py import MPI

from ._switch import SPEEDUPS
from ._transport import Deadline, Watch, allgather, allreduce, keep_alive, wait

__all__ = [
    "FLAG_CYCLIC",
    "FLAG_FAILED",
    "FLAG_DEADLINE",
    "FLAG_BAD_VOTE",
    "FIELD_BITS",
    "FIELD_GC",
    "FIELD_PETSC",
    "NO_KEY",
    "Header",
    "Agreed",
    "WORDS",
    "as_int64",
    "child_bit",
    "Agreement",
    "PERSISTENT",
    "Window",
    "field_shift",
    "fingerprint",
    "intersect",
    "intersect_any",
    "message_words",
]

NO_KEY = int(np.iinfo(np.int64).max)

# The agreed flags word, ORed over the ranks: the whole table. Bits 0..7 are
# the sync point's own flags; each participant votes in one byte above them,
# its field, fixed by its kind so that every rank reads the same byte.
FLAG_CYCLIC = 1  # a cyclic-GC death of a managed object was drained
# Some rank holds failures not yet reported (a destroy, a participant's
# finish, a derived family's sync point): reported on every rank at once.
FLAG_FAILED = 2
# Some rank waited for the agreement against a deadline: only then may one have
# given up, and only then is the watch checked once the agreement completed.
FLAG_DEADLINE = 4
FLAG_BAD_VOTE = 8  # a participant voted outside 0..255
FIELD_BITS = 8  # participant field f owns bits [8 (f + 1), 8 (f + 2)) of the flags
MAX_FIELDS = 6
FIELD_GC = 0  # a scope's GC policy: the generation to collect (collective_gc._scope)
FIELD_PETSC = 1  # PETSc's garbage cleanup: who has garbage (collective_gc.petsc)


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
    :func:`fingerprint`) combined with the registrations' order over the
    family's members, agreed for equality like the sync-point number;
    ``children``, 64 bits ORed over the ranks: which derived families
    (hashed, see :func:`child_bit`) want a visit."""

    __slots__ = ("seq", "next_key", "at_exit", "flags", "parts", "children")

    def __init__(
        self,
        seq: int,
        next_key: int,
        at_exit: bool,
        flags: int,
        parts: int = 0,
        children: int = 0,
    ) -> None:
        self.seq = seq
        self.next_key = next_key
        self.at_exit = at_exit
        self.flags = flags
        self.parts = parts
        self.children = children


def child_bit(ident: int) -> int:
    """The bit of the children word that stands for the derived family
    ``ident`` (the same on every rank of it). Families whose bits collide
    are visited together: a visit that finds nothing costs one collective of
    that family, never a wrong result."""
    return 1 << (((ident * _HASH) & _MASK64) >> 58)


def as_int64(value: int) -> int:
    """An unsigned 64-bit value as the int64 word that carries it."""
    value &= _MASK64
    return value - (1 << 64) if value >> 63 else value


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
        the most registered between two of the last MEMORY sync points, in
        a power of two of bits, MIN at least."""
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
        hi = next_key + max(2 * max(growths), 1)
        if hi - lo > self.LIMIT:
            lo = hi - self.LIMIT
        self.lo = lo
        # A power of two: the buffer (and the persistent request bound to it)
        # is made again only when the window doubles or halves, not at each
        # change of the registrations' rate (the steady state needs neither).
        self.bits = max(self.MIN, 1 << (hi - lo - 1).bit_length())


class Agreed:
    """What a sync point's agreement found: the same on every rank."""

    __slots__ = ("keys", "flags", "children", "mismatch", "fallback")

    def __init__(
        self,
        keys: np.ndarray[Any, Any],
        flags: int,
        mismatch: bool,
        fallback: bool,
        children: int = 0,
    ) -> None:
        self.keys = keys  # pending on every rank, ascending
        self.flags = flags  # ORed over the ranks
        self.children = children  # ORed over the ranks: derived families to visit
        self.mismatch = mismatch  # the ranks differ in sync number, kind or registrations
        self.fallback = fallback  # keys outside the window needed a second round


_HASH = 0x9E3779B97F4A7C15  # Fibonacci hashing: consecutive keys spread over the filter
_MASK64 = (1 << 64) - 1
# The message: the sync-point word (number and exit mark), the next key and
# the participants' fingerprint with the registrations' order, each as x and
# ~x; the flags, complemented; the hash filter of the pending keys outside
# the window; the derived families that want a visit, complemented; then the
# window's bitmap. Nothing in it is per rank or per communicator.
_WORDS = 9
WORDS = _WORDS  # the header's length, for the C steady state's twin


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


# The window's packing and reading: in C where the extension is loaded (a few
# numpy calls cost more than the work when numpy is out of cache, as after
# many destroys), else with numpy.
_PACK: Callable[..., tuple[int, int, int]] = (
    pack_window_py if SPEEDUPS is None else SPEEDUPS.pack_window
)
_WINDOW_KEYS: Callable[..., np.ndarray[Any, Any]] = (
    window_keys_py if SPEEDUPS is None else _window_keys_c
)


class Agreement:
    """The agreement of one family's sync points over its private communicator.

    Keeps the window, the communicator's :class:`Watch` and one message
    buffer between sync points (an ``array.array``, whose item stores are
    cheap): an empty sync point then costs nine stores around its allreduce
    (in C, ``_speedups.steady``, where the extension was built with MPI).
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
        "waits",
    )

    def __init__(self, comm: MPI.Intracomm) -> None:
        self.comm = comm
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.window = Window()
        self.watch = Watch(comm)
        # The window of the last exchange, and the number of bits the buffer
        # (and the persistent request bound to it) is shaped for: a window
        # that only moves (lo) keeps both.
        self._lo = self._nbits = -1
        self._arr = array.array("q")
        self._dirty = False  # the bitmap may hold bits from the last sync point
        # MPI-4's persistent allreduce (mpi4py 4), bound to the buffer while
        # its shape lasts: starting it costs less than a new Iallreduce.
        init = getattr(comm, "Allreduce_init", None)  # mpi4py 4 only
        self._persistent: Callable[..., MPI.Prequest] | None = init if PERSISTENT else None
        self._preq: MPI.Prequest | None = None
        # Where the exchange marks its wait for the other ranks ("wait",
        # start, end) while a tracer watches (collective_gc._tracing), else None.
        self.waits: list[tuple[str, float, float]] | None = None

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

    def ready(self) -> bool:
        """Whether the buffer (and the persistent request, where one is used)
        fits the window: the steady state needs nothing made. Local."""
        return self._nbits == self.window.bits and (
            self._persistent is None or self._preq is not None
        )

    def buffer(self) -> array.array[int]:
        """The message buffer, reduced once an exchange completed."""
        return self._arr

    def window_keys(self) -> np.ndarray[Any, Any]:
        """The keys whose bits survived the last exchange, ascending (its
        window is the one the exchange packed: window.advance comes after)."""
        return _WINDOW_KEYS(self._arr, _WORDS, self._nbits, self._lo)

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
        first, last = self.exchange(head, pending, deadline, what)
        return self.resolve(pending, first, last, deadline, what)

    def exchange(
        self,
        head: Header,
        pending: np.ndarray[Any, Any],
        deadline: Deadline,
        what: Callable[[], str],
    ) -> tuple[int, int]:
        """Collective: pack the message and complete its allreduce (the first
        half of :meth:`agree`; the C steady state does the same in
        ``_speedups.steady``). Returns the index range of the keys of
        ``pending`` that are inside the window."""
        deadline.watch = self.watch  # this sync point's later waits too
        self.watch.seq = head.seq
        window = self.window
        lo, nbits = window.lo, window.bits
        if nbits != self._nbits:
            self._reshape(lo, nbits)
        self._lo = lo
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
        buf[8] = ~as_int64(head.children)
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
            if self.waits is None:
                wait(self._start(buf), deadline, what, buf, check=False)
            else:
                req = self._start(buf)
                started = time.perf_counter()
                try:
                    wait(req, deadline, what, buf, check=False)
                finally:
                    self.waits.append(("wait", started, time.perf_counter()))
        except BaseException:
            # MPI may still write into it, and the request may still be
            # active: neither is used again, and both are kept for ever (wait
            # keeps what it abandons; an interrupt may also land between the
            # start and the wait).
            self.abandoned(None)
            raise
        return first, last

    def abandoned(self, req: MPI.Request | None) -> None:
        """The exchange was left before its allreduce completed (``req``, if
        not the persistent one): MPI may still write into the buffer and the
        request may still be active: neither is used again, and both are kept
        for ever."""
        keep_alive(self._preq if req is None else req, self._arr)
        self._forget_buffers()

    def resolve(
        self,
        pending: np.ndarray[Any, Any],
        first: int,
        last: int,
        deadline: Deadline,
        what: Callable[[], str],
    ) -> Agreed:
        """What the completed allreduce says (the second half of :meth:`agree`):
        the flags, whether the ranks disagree, the keys pending everywhere
        (with the fallback round for keys outside the window, collective)."""
        deadline.watch = self.watch
        red = self._arr
        lo, nbits = self._lo, self._nbits
        agreed_flags = ~red[6]
        if agreed_flags & FLAG_DEADLINE:
            # A rank that had a deadline may have given up after sending its
            # part (see wait): then this agreement completed only because of
            # what it left behind.
            if self.watch.fired():
                raise self.watch.error(what)
            agreed_flags &= ~FLAG_DEADLINE
        children = ~red[8] & _MASK64
        if red[0] != ~red[1] or red[2] != ~red[3] or red[4] != ~red[5]:
            return Agreed(_NO_KEYS, agreed_flags, True, False, children)
        fallback = red[7] != 0
        if last == first and not fallback and not agreed_flags and not children:
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
        return Agreed(keys, agreed_flags, False, fallback, children)

    def any_flags(self, flags: int, deadline: Deadline, what: Callable[[], str]) -> int:
        """Collective: the OR over the ranks of ``flags`` (one word, MPI_BAND of complements)."""
        deadline.watch = self.watch
        buf = array.array("q", (~flags,))
        return ~allreduce(self.comm, buf, MPI.BAND, deadline, what)[0]

    def any_words(
        self, values: Sequence[int], deadline: Deadline, what: Callable[[], str]
    ) -> list[int]:
        """Collective: each of ``values`` ORed over the ranks (MPI_BAND of
        complements, as the flags), in one allreduce."""
        deadline.watch = self.watch
        buf = array.array("q", (~as_int64(v) for v in values))
        return [~w & _MASK64 for w in allreduce(self.comm, buf, MPI.BAND, deadline, what)]

    def allgather(self, value: Any, deadline: Deadline, what: Callable[[], str]) -> list[Any]:
        """Collective: every rank's ``value`` (picklable), against ``deadline``
        and this communicator's watch."""
        deadline.watch = self.watch
        return allgather(self.comm, value, deadline, what)


_IN_PLACE = MPI.IN_PLACE
_NO_KEYS = np.empty(0, dtype=np.int64)
_NO_KEYS.flags.writeable = False  # shared by every agreement that found none
_NOTHING = Agreed(_NO_KEYS, 0, False, False)  # read only, never changed


# Whether agreements use MPI-4's persistent allreduce where mpi4py offers it:
# COLLECTIVE_GC_PERSISTENT=0, read once at import, makes a whole process use a
# new Iallreduce each time instead (make test's second leg runs the agreement
# tests so, on the same MPI). All ranks must decide alike: they do, as every
# rank of a job is started with the same environment.
PERSISTENT = os.environ.get("COLLECTIVE_GC_PERSISTENT", "1") != "0"


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
