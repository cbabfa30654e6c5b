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
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from mpi4py import MPI

from ._state import WINDOW_LIMIT, WINDOW_MIN, WORDS, FamilyState
from ._transport import Deadline, allgather, allreduce, bcast, gave_up_error

__all__ = [
    "FLAG_CYCLIC",
    "FLAG_FAILED",
    "FLAG_DEADLINE",
    "FLAG_BAD_VOTE",
    "FLAG_UNRIPE",
    "FLAG_LEAVING",
    "FIELD_BITS",
    "FIELD_GC",
    "FIELD_PETSC",
    "NO_KEY",
    "Agreed",
    "WORDS",
    "as_int64",
    "child_bit",
    "PERSISTENT",
    "field_shift",
    "fingerprint",
    "intersect",
    "intersect_any",
    "message_words",
    "WINDOW_MIN",
    "WINDOW_LIMIT",
    "resolve",
    "any_flags",
    "any_words",
    "gather",
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
# Some rank listed a family unreached that it may not yet adopt (its other
# ranks may not have listed it): two buckets, which hold back the adoption
# of the families in them at this sync point (collective_gc._tree._Listed).
FLAG_UNRIPE = 0x30
# Some rank recorded a member whose communicator was freed: whether every
# rank has is asked next (collective_gc._syncpoint.SyncPoint.release).
FLAG_LEAVING = 0x40
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
    bcast(comm, theirs, root, deadline, what)
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
# The message (packed by FamilyState.exchange): the sync-point word (number
# and exit mark), the next key and the participants' fingerprint with the
# registrations' order, each as x and ~x; the flags, complemented; the hash
# filter of the pending keys outside the window; the derived families that
# want a visit, complemented; then the window's bitmap. Nothing in it is per
# rank or per communicator.


def message_words(window_bits: int) -> int:
    """The agreement's message, in int64 words, for a window of ``window_bits``
    keys: the same at any number of ranks."""
    return WORDS + window_bits // 64


_NO_KEYS = np.empty(0, dtype=np.int64)
_NO_KEYS.flags.writeable = False  # shared by every agreement that found none
_NOTHING = Agreed(_NO_KEYS, 0, False, False)  # read only, never changed


def resolve(state: FamilyState, deadline: Deadline, what: Callable[[], str]) -> Agreed:
    """What the completed exchange of ``state`` says: the flags, whether the
    ranks disagree, the keys pending everywhere (with the fallback round for
    keys outside the window: collective, and alike on every rank, since
    every rank saw the same filter)."""
    deadline.watch = state
    red = state.reduced()
    agreed_flags = ~red[6]
    if agreed_flags & FLAG_DEADLINE:
        # A rank that had a deadline may have given up after sending its
        # part: then this agreement completed only because of what it left behind.
        if state.fired():
            raise gave_up_error(state, what)
        agreed_flags &= ~FLAG_DEADLINE
    children = ~red[8] & _MASK64
    if red[0] != ~red[1] or red[2] != ~red[3] or red[4] != ~red[5]:
        return Agreed(_NO_KEYS, agreed_flags, True, False, children)
    fallback = red[7] != 0
    first, last = state.first, state.last
    if last == first and not fallback and not agreed_flags and not children:
        return _NOTHING  # the steady state: nothing to destroy, nothing to say
    keys = _NO_KEYS
    if last > first:  # only bits this rank set can have survived the AND
        raw = state.window_keys()
        if raw:
            keys = np.frombuffer(raw, np.int64)
    if fallback:
        raw_pend, _ = state.pending_keys()
        pending = np.frombuffer(raw_pend, np.int64) if raw_pend else _NO_KEYS
        outside = np.concatenate((pending[:first], pending[last:]))
        comm = state.comm
        assert comm is not None
        extra = intersect_any(comm, outside, deadline, what)
        if extra.size:
            keys = np.union1d(keys, extra)
    return Agreed(keys, agreed_flags, False, fallback, children)


def any_flags(state: FamilyState, flags: int, deadline: Deadline, what: Callable[[], str]) -> int:
    """Collective over the family: the OR over the ranks of ``flags`` (one
    word, MPI_BAND of complements)."""
    deadline.watch = state
    assert state.comm is not None
    buf = array.array("q", (~flags,))
    return ~allreduce(state.comm, buf, MPI.BAND, deadline, what)[0]


def any_words(
    state: FamilyState, values: Sequence[int], deadline: Deadline, what: Callable[[], str]
) -> list[int]:
    """Collective: each of ``values`` ORed over the ranks (MPI_BAND of
    complements, as the flags), in one allreduce."""
    deadline.watch = state
    assert state.comm is not None
    buf = array.array("q", (~as_int64(v) for v in values))
    return [~w & _MASK64 for w in allreduce(state.comm, buf, MPI.BAND, deadline, what)]


def gather(
    state: FamilyState, value: Any, deadline: Deadline, what: Callable[[], str]
) -> list[Any]:
    """Collective: every rank's ``value`` (picklable), against ``deadline``
    and the family's watch."""
    deadline.watch = state
    assert state.comm is not None
    return allgather(state.comm, value, deadline, what)


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
