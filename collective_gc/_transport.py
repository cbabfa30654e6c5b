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
import collections
import contextlib
import os
import pickle
import threading
import time
import warnings
from collections.abc import Callable
from typing import Any, Protocol, TypeVar, cast

import numpy as np
from mpi4py import MPI

from ._errors import CollectiveTimeoutError

__all__ = [
    "Deadline",
    "Watched",
    "poll",
    "gave_up_error",
    "late_text",
    "GRACE",
    "keep_alive",
    "test_kept",
    "forked",
    "mpi_usable",
    "dup",
    "retire",
    "kept",
    "requests_kept",
    "RETIRED",
    "allreduce",
    "allgather",
    "bcast",
    "ibarrier",
    "isend",
    "SPIN",
    "TAG_GAVE_UP",
    "GAVE_UP",
    "LEFT",
    "WOKEN",
]


class Deadline:
    """When a sync point gives up waiting: ``at`` (``time.monotonic()``, this
    rank's own clock only), or None; ``watch``, the family state whose watch
    its collectives wait beside (see the module docs).

    A signal's exception never lands in a wait of a sync point: the callers
    wait inside protected regions (see :mod:`collective_gc._interrupts`).
    """

    __slots__ = ("at", "watch")

    def __init__(self, at: float | None) -> None:
        self.at = at
        self.watch: Watched | None = None


_Buf = TypeVar("_Buf", "np.ndarray[Any, Any]", "array.array[int]")


class _Kept:
    """A request MPI may still use, with the buffers it may still read or
    write (see :func:`keep_alive`), and what posting it returned
    (``posted``: the request, or MPI_Comm_idup's pair, whose new handle MPI
    writes later). ``req`` None: not tested by a prune, kept for ever unless
    its owner lets it go (see :func:`_post`). Compared by identity, the
    default: the list's ``remove`` finds this entry, never another that
    compares equal (every complete request equals MPI.REQUEST_NULL)."""

    __slots__ = ("req", "buffers", "posted")

    def __init__(self, req: MPI.Request | None, buffers: tuple[object, ...]) -> None:
        self.req = req
        self.buffers = buffers
        self.posted: object = None


# What keep_alive and _post keep; only this module's functions write this list.
_KEPT: list[_Kept] = []
# Held while a thread tests kept requests (_prune, test_kept): MPI_Test
# runs without the GIL, and two threads completing one request at once is
# erroneous (Open MPI frees it in both). Re-entrant: a signal's handler run
# between two tests may prune too, one test after the other.
_TESTING = threading.RLock()
_PID = os.getpid()


def forked() -> bool:
    """Whether this process is a fork of the one that imported collective_gc.
    Its MPI state, requests and communicators are the parent's copies: it
    makes no MPI call on them. Local."""
    return os.getpid() != _PID


def mpi_usable() -> bool:
    """Whether this process may call MPI on what it kept from earlier
    (requests, communicators): not in a forked child (see :func:`forked`),
    not after MPI_Finalize. Local."""
    return not forked() and not MPI.Is_finalized()


# The tag of a watch's notices (see collective_gc._state.FamilyState: the
# watch is part of a family's state): the private communicator carries no
# other point-to-point message.
TAG_GAVE_UP = 25
GAVE_UP, LEFT, WOKEN = 0, 1, 2  # why, in a notice


class Watched(Protocol):
    """What waits ask of a family's state about its watch (see the module
    docs): whether a rank gave up, and telling the others that this one does."""

    rank: int
    size: int
    comm: MPI.Intracomm | None
    gone: tuple[int, int, int] | None

    def fired(self) -> bool: ...
    def announce(self, why: int) -> None: ...
    def notice(self) -> tuple[int, int, int] | None: ...


def gave_up_error(watch: Watched, what: Callable[[], str]) -> CollectiveTimeoutError:
    """The error of a wait that a rank's notice ended (``watch.gone`` is set):
    it names a rank that gave up or left (a woken rank's notice only says it
    was woken), and who the ranks waited for (see late_text)."""
    assert watch.gone is not None
    heard = _tally(watch)
    rank, why = min(heard.items(), key=lambda rw: (rw[1] == WOKEN, rw[0]))
    seq = watch.gone[1]
    how = {
        GAVE_UP: "gave up waiting at its deadline",
        LEFT: "left the collectives by an exception",
    }.get(why, "was woken by another rank's notice")
    return CollectiveTimeoutError(
        f"rank {watch.rank}: rank {rank} {how} at sync point {seq} of this "
        "communicator, so the collectives there can no longer complete in step on "
        f"every rank{_late(watch, heard)} ({what()})"
    )


# How long a rank whose wait ended (its deadline, or another's notice) looks
# for the notices of the others: ranks whose deadlines are alike give up
# within about this of each other.
GRACE = 0.25


def _tally(watch: Watched) -> dict[int, int]:
    """The notices this rank can read, within a bounded grace: rank -> why
    (this rank's own among them). Every rank that leaves the collectives
    says so once, woken ones too (announce WOKEN). Local, error path only."""
    watch.announce(WOKEN)  # (once: nothing if it gave up, or said so, already)
    heard: dict[int, int] = {}
    seq = None if watch.gone is None else watch.gone[1]

    def note_of(known: tuple[int, int, int] | None) -> None:
        if known is not None and known[1] == seq:  # (not an earlier failure's)
            heard.setdefault(known[0], known[2])

    note_of(watch.gone)
    comm = watch.comm
    if comm is None:
        return heard
    note = np.zeros(3, dtype=np.int64)
    status = MPI.Status()
    end = time.monotonic() + GRACE
    while len(heard.keys() | {watch.rank}) < watch.size and time.monotonic() < end:
        note_of(watch.notice())  # the standing receive takes one of them, any time
        if comm.Iprobe(MPI.ANY_SOURCE, TAG_GAVE_UP, status):
            comm.Recv([note, MPI.INT64_T], status.Get_source(), TAG_GAVE_UP)
            note_of((int(note[0]), int(note[1]), int(note[2])))
        else:
            time.sleep(1e-4)
    return heard


def _late(watch: Watched, heard: dict[int, int]) -> str:
    if watch.size < 3:
        return ""  # (two ranks: the other one is all there is to name)
    missing = sorted(set(range(watch.size)) - set(heard) - {watch.rank})
    if not missing:
        return (
            "; every other rank had given up waiting when this one arrived: "
            f"rank {watch.rank} was the late one"
        )
    return (
        f"; rank(s) {missing} had not reached it (the others had: no notice came "
        f"from rank(s) {missing} within {GRACE} s)"
    )


def late_text(watch: Watched) -> str:
    """Who the ranks waited for, as far as this rank can know it: every rank
    that left the wait said so (its notice); after a bounded grace, the ranks
    it heard nothing from were not there. Error path only."""
    return _late(watch, _tally(watch))


DONE, WATCHED, LATE = 0, 1, 2  # what poll found


def poll(req: MPI.Request, at: float | None, watch: Watched | None) -> int:
    """Complete ``req``: DONE, or WATCHED if a rank's notice came first, or
    LATE once this rank's own deadline ``at`` (``time.monotonic()``) passed
    (it has then told the others). Polls: a blocking wait would run no
    signal handler until it returned, and a second Ctrl-C (which the
    library's wrapper raises at once inside a protected region) would wait
    for the late rank; a handler that raises leaves it by that exception.

    For the first SPIN seconds between Tests it only yields the core (to a
    rank sharing it, perhaps the one waited for): a collective such as
    MPI_Comm_idup takes several rounds, each progressed only inside a Test,
    so a sleep between Tests costs every round its length. Then it backs off
    to a millisecond, so that a long wait does not burn a core. The C twin
    (collective_gc._speedups) polls the same way."""
    if watch is None and at is None:
        req.Wait()  # (no deadline, no other rank's notice to watch for)
        return DONE
    delay = 0.0
    spin = time.monotonic() + SPIN
    while not req.Test():
        if watch is not None and watch.fired():
            return WATCHED
        now = time.monotonic()
        if at is not None and now > at:
            if watch is not None:
                watch.announce(GAVE_UP)
            return LATE
        if now < spin:
            _YIELD()
        else:
            time.sleep(delay)
            delay = min(1e-3, delay * 2 + 2e-5)
    return DONE


def _post(*buffers: object) -> _Kept:
    """The entry that keeps a request this module is about to post, kept
    before the request exists: the caller posts into its ``posted``.

    The one mechanism for the window between MPI posting a request and the
    caller holding it. An interrupt (a second Ctrl-C inside a protected
    region, any signal outside one, raised by its handler at the next
    bytecode) can land anywhere in it; the buffers were kept first, so
    whatever it hits, MPI never reads or writes freed memory, and the
    request, once stored in the entry, is never freed while active. Until
    its owner lets it go the entry's ``req`` is None: kept for ever, and
    never tested by another thread's prune while the owner polls it (two
    threads completing one request is erroneous). Let go complete, it is
    dropped; abandoned, ``req`` is set and the prunes test it from then on
    (see :func:`_wait`)."""
    entry = _Kept(None, buffers)
    _KEPT.append(entry)
    return entry


def _wait(
    entry: _Kept, req: MPI.Request, deadline: Deadline | None, what: Callable[[], str]
) -> None:
    """Complete ``req``, posted into ``entry`` (:func:`_post`; a collective
    on a family's private communicator) against ``deadline`` and, if it has
    one, its watch: a rank that gave up anywhere ends the wait here with
    :class:`CollectiveTimeoutError`, whether or not this rank has a
    deadline, and so does a notice found once ``req`` completed.

    Complete, the entry is dropped. Abandoned (a timeout, an exception out
    of the poll), it stays, with the buffers MPI may still read or write
    when a late rank arrives, until a prune finds the request complete.
    """
    try:
        watch = None if deadline is None else deadline.watch
        if watch is not None and watch.gone is not None:
            raise gave_up_error(watch, what)  # a rank gave up earlier: nothing completes in step
        found = poll(req, None if deadline is None else deadline.at, watch)
        if found == LATE:
            raise CollectiveTimeoutError(what() + ("" if watch is None else late_text(watch)))
        # A look at the notice even when the collective completed first: MPI
        # returns at the first completion it finds (MPICH without matching a
        # notice that had waited in its queue since long before: a rank
        # arriving late then carried on as if nobody had given up).
        if watch is not None and watch.fired():
            raise gave_up_error(watch, what)
        entry.req = req  # complete: an interrupt from here on leaves it to a prune
    except BaseException:
        # Timed out, or left (outside a protected region, or by a second
        # Ctrl-C): the request stays pending, and its entry with it.
        entry.req = req
        _prune()
        raise
    _forget(entry)


def _start(entry: _Kept, post: Callable[..., Any], *args: Any) -> Any:
    """``post(*args)``, its result stored in ``entry`` (see :func:`_post`).
    A post that fails (an MPI error) posted nothing: its entry goes."""
    try:
        entry.posted = posted = post(*args)
    except MPI.Exception:
        _forget(entry)
        raise
    return posted


def _forget(entry: _Kept) -> None:
    try:
        _KEPT.remove(entry)
    except ValueError:
        pass  # (a prune run here, by a handler or a thread, dropped it first)


_YIELD = os.sched_yield  # releases the GIL
# How long a wait only yields the core between its Tests.
SPIN = 0.05


def keep_alive(req: MPI.Request | None, *buffers: object) -> None:
    """Keep ``req`` and ``buffers`` until ``req`` completes: a request nobody
    waits for (an abandoned wait's, a barrier only tested, a notice sent to a
    rank that may never receive it), since MPI may still read or write the
    buffers and forbids freeing a non-blocking collective's request before
    it completes (nor can it be cancelled). ``req`` None: kept for ever (it
    may have started). Then drops the entries kept earlier that a test
    finds complete. Local; MPI_Test on each entry kept.

    For a request posted elsewhere (the C twin's, the agreement's); the
    ones this module posts are kept before they exist (:func:`_post`), in
    the same list. An entry is removed only once found complete (MPI
    touches neither it nor its buffers again), and the new one is added
    first: an interrupt or another thread at any point loses none (a
    complete entry left by one is dropped by the next call). One that never
    completes (the others never arrived) stays for the life of the process,
    tested at each call: a timeout leaves its family unusable, so there are
    few."""
    if req is None or req != MPI.REQUEST_NULL:
        _KEPT.append(_Kept(req, buffers))
    _prune()


def _prune() -> None:
    """Drop the kept entries a test finds complete (see :func:`keep_alive`)."""
    if not mpi_usable():
        return  # (a forked child's kept requests are its parent's)
    if not _TESTING.acquire(blocking=False):
        return  # another thread is testing them: its call, or the next, prunes
    try:
        for kept in _KEPT[:]:
            if kept.req is not None and _complete(kept.req):
                try:
                    _KEPT.remove(kept)
                except ValueError:
                    continue  # (a handler run here removed it first)
                if isinstance(kept.req, MPI.Prequest):
                    # Complete, a persistent request stays allocated (inactive)
                    # until freed: an abandoned agreement's, nobody else's now.
                    with contextlib.suppress(MPI.Exception):
                        kept.req.Free()
    finally:
        _TESTING.release()


def free_unless_kept(req: MPI.Request) -> None:
    """Free ``req``, a persistent request its owner lets go of, unless an
    abandoned wait gave it to :func:`keep_alive`: then it may still be
    active, and the prune that finds it complete frees it. The owner's two
    stores when it abandons one (the request kept, its own field cleared)
    have an interrupt's width between them, so the owner cannot know; this
    module's list can. Local; one thread at a time with the prunes (a
    request complete and freed by one is seen as freed here: the same
    object, its handle null)."""
    with _TESTING:
        if req == MPI.REQUEST_NULL or any(kept.req is req for kept in _KEPT):
            return
        req.Free()


def test_kept(req: MPI.Request) -> bool:
    """Whether ``req``, a request given to :func:`keep_alive` that its
    caller also looks at, has completed (False on an MPI error, as for the
    entries kept). Local; MPI_Test, one thread at a time."""
    with _TESTING:
        return _complete(req)


def _complete(req: MPI.Request) -> bool:
    try:
        return bool(req.Test())
    except MPI.Exception:
        # An error on a request nobody waits for is not this caller's to
        # raise (it may be a sync point of another family): the entry is
        # kept, as one that never completes.
        return False


def dup(comm: MPI.Intracomm, deadline: Deadline | None, what: Callable[[], str]) -> MPI.Intracomm:
    """Collective. Duplicate ``comm`` (``MPI_Comm_idup``) against ``deadline``.

    If the wait is abandoned (a timeout, an interrupt), the request, the new
    handle and a hold on ``comm`` are kept for the life of the process (see
    :func:`_hold_parent`).
    """
    entry = _post()
    try:
        new, req = cast("tuple[MPI.Intracomm, MPI.Request]", _start(entry, comm.Idup))
        _wait(entry, req, deadline, what)
    except BaseException:
        # (Held also when the post itself failed: needless then, and harmless.)
        posted = cast("tuple[MPI.Intracomm, MPI.Request] | None", entry.posted)
        if posted is None or posted[1] != MPI.REQUEST_NULL:
            try:
                _HELD.append(_hold_parent(comm))
            except MPI.Exception:
                pass  # (a workaround's failure must not replace why the wait ended)
        raise
    return new


# Open MPI before 5 (open-mpi/ompi#12465): an MPI_Comm_idup that never
# completes leaves, in the table MPI_Finalize walks, a second pointer to its
# parent communicator, and finalize releases the parent through both: the
# second release writes into freed memory, which can abort the process at
# exit. Inactive persistent receives on the parent (local calls, never started
# nor freed) each hold a reference to it: with three, the user's free and
# finalize's two releases only decrement, and the parent is leaked instead.
_HOLDS = 3
_HELD: list[tuple[object, ...]] = []  # never freed


def _hold_parent(comm: MPI.Intracomm) -> tuple[object, ...]:
    name, version = MPI.get_vendor()
    if name != "Open MPI" or version >= (5,):
        return ()
    buf = bytearray(1)
    me = comm.Get_rank()  # a real source: with MPI_PROC_NULL the request holds no communicator
    return (buf, *(comm.Recv_init(buf, source=me, tag=0) for _ in range(_HOLDS)))


# A family's private duplicate, let go of, is kept (the newest RETIRED of
# them) rather than freed at once. A rank that was still in one of its sync
# points (late, or alone in one too many) gives up there and sends its
# notices to the others on it, however long after they let go; Open MPI (4
# and 5) matches a message that arrives for a freed communicator to the next
# communicator given its context id (a stray message there, a crash in
# mca_pml_ob1_add_comm when the sizes differ), where MPICH drops it. Kept,
# the communicator takes such messages in. It is freed once RETIRED newer
# ones are kept, and what it took in goes with it (Open MPI 4 and 5 and
# MPICH match none of it to a later communicator: test_families). A bound,
# not all of them: an MPI has only so many context ids (a few thousand in
# MPICH), and a program may open and let go of families for ever. Only this
# module writes _RETIRED.
RETIRED = 64
_RETIRED: collections.deque[MPI.Intracomm] = collections.deque()


def retire(comm: MPI.Intracomm | None) -> None:
    """Keep ``comm``, a private duplicate no family uses any more, and free
    the oldest kept beyond :data:`RETIRED`. Local."""
    if comm is None or not mpi_usable():
        return
    _RETIRED.append(comm)
    while len(_RETIRED) > RETIRED:
        oldest = _RETIRED.popleft()
        try:
            oldest.Free()
        except MPI.Exception as exc:
            # The delete callback of an attribute it copied from the user's
            # communicator (MPI_Comm_idup) failed: the program's, which this
            # unrelated call (a lookup, a sync point's end) must not raise.
            warnings.warn(
                f"collective_gc: freeing a family's private duplicate it let go of: {exc}",
                RuntimeWarning,
                stacklevel=2,
            )


def kept() -> int:
    """How many let-go private duplicates :func:`retire` keeps now."""
    return len(_RETIRED)


def requests_kept() -> int:
    """How many requests (with their buffers) are kept now: posted and not
    yet let go of, or abandoned and not yet found complete."""
    return len(_KEPT)


def allreduce(
    comm: MPI.Comm, send: _Buf, op: MPI.Op, deadline: Deadline | None, what: Callable[[], str]
) -> _Buf:
    """Collective. Allreduce ``send`` (a numpy or int64 ``array.array``) with ``op``."""
    recv = send[:] if isinstance(send, array.array) else np.empty_like(send)
    entry = _post(send, recv)
    _wait(entry, _start(entry, comm.Iallreduce, send, recv, op), deadline, what)
    return recv


def allgather(
    comm: MPI.Comm, value: Any, deadline: Deadline | None, what: Callable[[], str]
) -> list[Any]:
    """Collective. Allgather a picklable value."""
    # A pickled value of unknown size: gather the sizes, then the bytes.
    data = np.frombuffer(pickle.dumps(value), dtype=np.uint8)
    sizes = np.empty(comm.Get_size(), dtype=np.int64)
    mine = np.array([data.size], dtype=np.int64)
    entry = _post(mine, sizes)
    _wait(entry, _start(entry, comm.Iallgather, mine, sizes), deadline, what)
    displs = np.concatenate(([0], np.cumsum(sizes)[:-1]))
    buf = np.empty(int(sizes.sum()), dtype=np.uint8)
    entry = _post(data, buf, sizes, displs)
    spec = [buf, (sizes, displs), MPI.BYTE]
    _wait(entry, _start(entry, comm.Iallgatherv, data, spec), deadline, what)
    return [pickle.loads(buf[d : d + s].tobytes()) for d, s in zip(displs, sizes)]


def bcast(
    comm: MPI.Comm,
    buf: np.ndarray[Any, Any],
    root: int,
    deadline: Deadline | None,
    what: Callable[[], str],
) -> None:
    """Collective. Broadcast ``buf`` (numpy) from ``root``, in place."""
    entry = _post(buf)
    _wait(entry, _start(entry, comm.Ibcast, buf, root), deadline, what)


def ibarrier(comm: MPI.Comm) -> MPI.Request:
    """Collective, non-blocking: post a barrier that is only tested
    (:func:`test_kept`), kept until it completes; then drops the kept
    entries found complete (the earlier barriers'). Local."""
    entry = _post()
    entry.req = req = _start(entry, comm.Ibarrier)
    _prune()
    return cast(MPI.Request, req)


def isend(comm: MPI.Comm, note: np.ndarray[Any, Any], dest: int, tag: int) -> None:
    """Send ``note`` (int64) to ``dest`` without waiting: kept until
    complete (for the life of the process if ``dest`` never receives it),
    then drops the kept entries found complete. Local."""
    entry = _post(note)
    entry.req = _start(entry, comm.Isend, [note, MPI.INT64_T], dest, tag)
    _prune()
