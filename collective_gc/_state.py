"""The typed state: what a family's sync points, its registrations and the
finalizers read and write, in C where the extension is built, else in the
Python twins below. Bound once, at the end of this module.

As mpi4py keeps ``MPI_Comm ob_mpi`` in a declared field of ``cdef class
Comm``, the state the hot paths touch lives in a few types with declared
fields, each the one writer of its fields (the rest of the library reads
them, and changes them only through these methods; ``tests/test_layout.py``
checks that nothing else assigns them):

- :class:`GcState`, one per process: which thread runs the cyclic collector
  now (its hook in ``gc.callbacks``), whether finalizers are switched off
  (exit, a forked child), whether registrations record where they were made;
- :class:`RegistrationFields`, the fields of every registration (a weak
  reference to the managed object): key, name, state, the destroy call;
  ``collective_gc._registration.Registration`` adds the methods;
- :class:`Region`, one per process: the depth of protected regions and the
  signals deferred to their end (see collective_gc._interrupts);
- :class:`FamilyState`, one per family of congruent communicators: its
  usable state and why not, the sync-point count, whether its collectives
  are under way, its destroys, the registrations (key counter, order
  fingerprint, the thread registering since the last sync point, the inbox
  finalizers append to, the pending keys), the agreement (private
  communicator, message buffer, persistent request, key window) and the
  watch (the standing receive of a rank's notice that it gave up).

The Python twins are the reference; the C types (collective_gc._speedups)
do the same, field for field and method for method, and ``make test`` runs
the whole suite against each. The one method with no Python work of its
own is :meth:`FamilyState.steady`: in C it runs a sync point whose every
step takes its fast case in one call; its twin leaves every sync point to
the steps (collective_gc._syncpoint), whose fast cases are the reference.
"""

from __future__ import annotations

import array
import enum
import functools
import threading
import types
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np
from mpi4py import MPI

from ._switch import SPEEDUPS
from ._transport import (
    DONE,
    TAG_GAVE_UP,
    WATCHED,
    WOKEN,
    free_unless_kept,
    isend,
    keep_alive,
    poll,
)

__all__ = [
    "ALIVE",
    "DESTROYED",
    "DETACHED",
    "State",
    "STATES",
    "OPEN",
    "HOLD_LEAVING",
    "HOLD_PARTS",
    "HOLD_REACH",
    "HOLD_GONE",
    "LOOK",
    "WORDS",
    "WINDOW_MIN",
    "WINDOW_LIMIT",
    "NO_BYTES",
    "GcState",
    "RegistrationFields",
    "Region",
    "FamilyState",
    "new_registration",
    "note_queued",
    "take_call",
    "order_step",
]

# A registration's state.
ALIVE = 0  # the destroy has not run: the object lives, or died and is queued
DESTROYED = 2  # the destroy has run (or is running)
DETACHED = 3  # detach() was called, or the owner was shut down or forked away


class State(enum.Enum):
    """What a manager can still do (:attr:`Manager.state`); :attr:`Manager.broken` says why."""

    OPEN = "open"  #: usable
    UNUSABLE = "unusable"  #: a timeout, a disagreement, an abandoned collective, mark_unusable
    RELEASED = "released"  #: its communicator was freed, and nothing was left registered
    EXITED = "exited"  #: the program is exiting: its exit agreement ran
    CLOSED = "closed"  #: :meth:`Manager.close` let go
    FORKED = "forked"  #: this is a forked child: everything belongs to the parent


# A family's state keeps its State as a code: the index here.
STATES = tuple(State)
OPEN = 0

# Why a family's sync points may not take the steady state, each set by one
# writer: members to let go (collective_gc._collective), a participant whose
# finish must always run (collective_gc._collective), families that may need
# reaching since it last looked (collective_gc._tree), its last member gone
# (collective_gc._collective).
HOLD_LEAVING = 1
HOLD_PARTS = 2
HOLD_REACH = 4
HOLD_GONE = 8

# What a family's voters are given instead of its count of sync points when
# a parent's sync point only asks whether the family has something for it
# (FamilyState.wants): a look, which changes nothing. Whether a rank looks
# depends on what it alone holds (a queued object answers first), so a vote
# that lets go of something (PETSc's holds) must do it in the family's own
# sync points only, which every rank runs alike. (The C twin spells it too.)
LOOK = -1

# The agreement's message: nine header words, then the window's bitmap (see
# collective_gc._agree for the table).
WORDS = 9
_FLAG_DEADLINE = 4  # collective_gc._agree.FLAG_DEADLINE
_SYNC_FLAGS = 0xFF  # the sync point's own flags: the low byte
NO_BYTES = b""

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15


def order_step(key: int, tag: int) -> int:
    """What a registration with ``key`` on the member whose order mark is
    ``tag`` (its tag, or where it was made: collective_gc._lineage) adds to
    the order fingerprint (mod 2**64): nothing on the family's first member
    (tag 0), so a family of one communicator never pays for it. A hash of
    both (splitmix64's finalizer), so that sums of these differ, but for a
    chance of about 2**-64, when some key went to different members."""
    if not tag:
        return 0
    x = (key * _GOLDEN + tag) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def _int64(value: int) -> int:
    value &= _MASK64
    return value - (1 << 64) if value >> 63 else value


# -- the process's collector state -------------------------------------------------


class GcState:
    """What every finalizer reads: the thread running the cyclic collector
    (0: none), whether finalizers are off, how many asked registrations to
    record their origin (they do while any does); and how many collections
    its hook saw start."""

    __slots__ = ("main", "collecting", "off", "origins", "seen", "_lock")

    def __init__(self, main: int) -> None:
        self.main = main  # the main thread's ident
        self.collecting = 0
        self.off = False
        self.origins = 0
        self.seen = 0
        # (The C twin's count is changed under the GIL, in one step.)
        self._lock = threading.Lock()

    def phase(self, phase: str, info: dict[str, Any]) -> None:
        """The hook in ``gc.callbacks``. The collector runs finalizers on the
        thread that started it, between "start" and "stop": recording that
        thread lets a finalizer tell a cyclic-GC death from a refcount death
        on another thread while the collector is paused between bytecodes."""
        if phase == "start":
            self.collecting = threading.get_ident()
            self.seen += 1
        else:
            self.collecting = 0

    def switch_off(self, off: bool) -> None:
        """Every finalizer does nothing at all from now on (exit, fork), or again its work."""
        self.off = bool(off)

    def track(self, on: bool) -> bool:
        """One more asker that registrations record where they were made
        (``on``), or one fewer; returns whether they did before. Counted, not
        set: scopes on two threads, or a scope inside the pytest plugin's
        watch, end in any order, and each ending must not switch off what
        another still asks for."""
        with self._lock:
            was = self.origins > 0
            self.origins = self.origins + 1 if on else max(0, self.origins - 1)
            return was

    def forked(self) -> None:
        """In a forked child: only this thread exists, and it is not
        collecting. A fresh lock: one another thread held at the fork is
        never released there."""
        self.collecting = 0
        self._lock = threading.Lock()

    def finalize(self, reg: RegistrationFields) -> None:
        """The weak-reference callback of every registration: record whether
        the cyclic collector is running on this thread, and queue. No lock,
        no MPI, no destroy: safe wherever Python can run a finalizer."""
        if self.off or reg._state:
            return  # off, or destroyed or detached already: nothing to queue
        collecting = self.collecting
        if collecting and collecting == threading.get_ident():
            _set_cyclic(reg, True)  # the sync point that drains it reports it
        reg._push(reg)


# -- registrations -------------------------------------------------------------------


class RegistrationFields(weakref.ref):  # type: ignore[type-arg]
    """The fields of a registration, which is itself the weak reference to
    the managed object (see collective_gc._registration.Registration).

    Read-only from outside this module: its writers are the functions below
    (new_registration, take_call, note_queued), a family's state (the key)
    and the collector's state (cyclic), and they write through the slots'
    own descriptors. A destroy call rebound or a state rewound from outside
    would lose a destroy or run one twice; the C twin declares its fields
    read-only for the same reason (there a bad ``_args`` would crash the
    process)."""

    __slots__ = (
        "key",
        "name",
        "origin",
        "cyclic",
        "queued_at",
        "_state",
        "_owner",
        "_push",
        "_destroy",
        "_args",
        "_typename",
    )

    key: int
    name: str
    origin: Any
    cyclic: bool
    queued_at: int
    _state: int
    _owner: Any
    _push: Callable[[Any], object]
    # The destroy and its arguments (kwargs folded in with functools.partial),
    # None and () once it has run or was dropped.
    _destroy: Callable[..., object] | None
    _args: tuple[Any, ...]
    _typename: str

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"a registration's {name!r} is read-only")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"a registration's {name!r} is read-only")


# The slots' own setters: the writes of this module (and nowhere else).
(
    _set_key,
    _set_name,
    _set_origin,
    _set_cyclic,
    _set_queued_at,
    _set_state,
    _set_owner,
    _set_push,
    _set_destroy,
    _set_args,
    _set_typename,
) = (RegistrationFields.__dict__[n].__set__ for n in RegistrationFields.__slots__)


def new_registration(
    cls: type[RegistrationFields],
    callback: Callable[[Any], None],
    obj: object,
    owner: Any,
    push: Callable[[Any], object],
    key: int,
    destroy: Callable[..., object],
    args: tuple[Any, ...],
    name: str | None,
    origin: Any,
) -> Any:
    """A registration of class ``cls`` (the weak reference to ``obj`` with
    ``callback``) in the alive state. TypeError if ``obj`` cannot be weakly
    referenced. No Python-level ``__init__``: this is on every object's path."""
    reg = cls(obj, callback)
    typename = type(obj).__name__
    _set_key(reg, key)
    _set_name(reg, typename if name is None else name)
    _set_typename(reg, typename)
    _set_origin(reg, origin)
    _set_cyclic(reg, False)
    _set_queued_at(reg, -1)
    _set_state(reg, ALIVE)
    _set_owner(reg, owner)
    _set_push(reg, push)
    _set_destroy(reg, destroy)
    _set_args(reg, args)
    return reg


def note_queued(reg: RegistrationFields, seq: int) -> None:
    """Record ``seq``, the sync point that took ``reg``'s destroy request in
    (collective_gc._registry.pending finds it), as its ``queued_at``."""
    _set_queued_at(reg, int(seq))


def take_call(
    reg: Any, state: int, live: dict[int, Any]
) -> tuple[Callable[..., object], tuple[Any, ...]] | None:
    """Move ``reg`` from alive to ``state`` (DESTROYED or DETACHED) and out of
    ``live`` (its owner's registrations by key), once: its destroy call, taken
    out of it so that it lets go of the resources, or None if it had left
    alive already (a destroy runs at most once however threads interleave).
    The caller holds its owner's lock. With :func:`new_registration`, the one
    writer of a registration's state and call (a family's, here; a local
    owner's, in _registration's Ledger)."""
    if reg._state != ALIVE:
        return None
    _set_state(reg, state)
    live.pop(reg.key, None)
    fn, args = reg._destroy, reg._args
    _set_destroy(reg, None)
    _set_args(reg, ())
    assert fn is not None
    return fn, args


# -- protected regions -------------------------------------------------------------


class Region:
    """The main thread's protected regions (see collective_gc._interrupts):
    how deep it is inside them, and the signals that arrived meanwhile
    (handler, signal number, frame), delivered by the outermost leave.

    ``guard`` wraps the handlers when they changed since ``guarded`` was
    noted; ``deliver`` runs the deferred handlers and returns the first
    exception (or None)."""

    __slots__ = (
        "main",
        "depth",
        "deferred",
        "signals",
        "guarded",
        "_getsignal",
        "_guard",
        "_deliver",
    )

    def __init__(
        self,
        main: int,
        signals: tuple[int, ...],
        getsignal: Callable[[int], object],
        guard: Callable[[], tuple[object, ...]],
        deliver: Callable[[], BaseException | None],
    ) -> None:
        self.main = main
        self.depth = 0
        self.deferred: list[tuple[Any, int, Any]] = []
        self.signals = signals
        self.guarded: tuple[object, ...] = (object(),) * len(signals)
        self._getsignal, self._guard, self._deliver = getsignal, guard, deliver

    def enter(self) -> bool:
        """Enter a region (on the main thread; elsewhere nothing): returns what
        :meth:`leave` needs. Wraps the handlers first if they changed."""
        if threading.get_ident() != self.main:
            return False
        # Counted first: a signal arriving while the handlers are looked at
        # (calls: the interpreter runs handlers there) is deferred already.
        self.depth += 1
        try:
            if self.depth == 1 and tuple(map(self._getsignal, self.signals)) != self.guarded:
                self.guarded = self._guard()
        except BaseException:  # (a handler not wrapped yet, raising meanwhile)
            self.depth -= 1
            raise
        return True

    def leave(self, entered: bool) -> None:
        """Leave the region :meth:`enter` entered: the outermost runs the
        deferred handlers first, the region still counted as entered (a
        signal arriving meanwhile is deferred and delivered by the same
        loop), and raises what the first of them raised."""
        if not entered:
            return
        if self.depth < 1:
            raise RuntimeError("collective_gc: a protected region was left that was not entered")
        first = self._deliver() if self.depth == 1 and self.deferred else None
        self.depth -= 1
        if first is not None:
            first.add_note(
                "collective_gc: its signal arrived while this rank was inside a sync point "
                "(or another collective of collective_gc), and its handler ran once the "
                "collectives were done, so that every rank left them alike"
            )
            try:
                raise first
            finally:
                first = None


# -- a family's state ----------------------------------------------------------------

_NO_KEYS = np.empty(0, dtype=np.int64)
_NO_KEYS.flags.writeable = False
_HASH = np.uint64(_GOLDEN)

# The key window (see FamilyState.agreed).
WINDOW_MIN = 256
WINDOW_LIMIT = 1 << 20
_MEMORY = 8  # how many sync points back the window remembers a burst of registrations
_SPAN = 4  # how many sync points back the window's first key was the next key


def _keys(raw: bytes) -> np.ndarray[Any, Any]:
    return np.frombuffer(raw, np.int64) if raw else _NO_KEYS


def _filter(keys: np.ndarray[Any, Any]) -> int:
    if not keys.size:
        return 0
    h = (keys.astype(np.uint64) * _HASH) >> np.uint64(58)
    bits = np.bitwise_or.reduce(np.left_shift(np.uint64(1), h))
    return int(np.array(bits, dtype=np.uint64).view(np.int64))


class FamilyState:
    """The collective state of one family (see the module docs). ``stats``
    makes a sync point's :class:`~collective_gc.CollectStats`; ``reg_type``
    is the class of its registrations."""

    __slots__ = (
        # who, and usable or not
        "rank",
        "size",
        "code",
        "reason",
        # sync points
        "seq",
        "inside",
        "destroying",
        "destroyed",
        "progress",
        "hold",
        "unreported",
        # registrations and the queue
        "next_key",
        "order",
        "cut_key",
        "cut_order",
        "thread",
        "busy",
        "live",
        "inbox",
        "stale",
        # the agreement and the watch
        "comm",
        "first",
        "last",
        "gone",
        "_pend",
        "_ages",
        "_lock",
        "_gc",
        "_reg_type",
        "_stats",
        "_parts",
        "_children",
        "_marks",
        "_growths",
        "_idle",
        "_wlo",
        "_wbits",
        "_buf",
        "_lo",
        "_nbits",
        "_dirty",
        "_persistent",
        "_preq",
        "_wbuf",
        "_wreq",
        "_sent",
        "_closed",
        "_wseq",
    )

    def __init__(
        self,
        rank: int,
        size: int,
        gc: GcState,
        reg_type: type[RegistrationFields],
        stats: Callable[..., Any],
    ) -> None:
        self.rank, self.size = rank, size
        self.code = OPEN
        self.reason: str | None = None
        self.seq = 0  # sync points completed
        self.inside = False  # inside the family's collectives on this rank
        self.destroying = 0  # ident of the thread running its destroys
        self.destroyed = 0
        self.progress = 0  # the step the last steady() left the sync point at
        self.hold = 0
        # This rank's failures no sync point has reported yet, with the sync
        # point of each; the next agreement reports them.
        self.unreported: list[tuple[int, Any]] = []
        self.next_key = 0
        self.order = 0  # the registrations' order over the members (order_step), unsigned
        # next_key and order as the last drain found them, before taking the
        # inbox: what the exchange sends. A registration on another thread
        # after that point is the next interval's on this rank, whenever the
        # exchange packs (see drain).
        self.cut_key = 0
        self.cut_order = 0
        # The one thread that has registered since the last sync point on a
        # family of size > 1 (0: none yet; -1: any thread may, size 1).
        self.thread = 0 if size > 1 else -1
        # Registrations between taking their key and storing the next (the
        # guarded path): the fast path leaves the family to them meanwhile.
        self.busy = 0
        self.live: dict[int, Any] = {}
        self.inbox: list[Any] = []
        self.stale = False  # an explicit destroy or detach may have left dead keys queued
        self.comm: MPI.Intracomm | None = None
        self.first = self.last = 0
        self.gone: tuple[int, int, int] | None = None
        self._pend = _NO_KEYS  # keys drained and not yet destroyed, ascending
        self._ages = _NO_KEYS  # the sync point that drained each
        self._lock = threading.RLock()  # (the C twin needs none: the GIL)
        self._gc, self._reg_type, self._stats = gc, reg_type, stats
        self._parts: tuple[tuple[int, Any, Any, bool, str], ...] = ()
        self._children: tuple[FamilyState, ...] = ()
        self._marks = [0]  # the agreed next key at the last sync points, oldest first
        self._growths: list[int] = []
        self._idle = 0
        self._wlo, self._wbits = 0, WINDOW_MIN
        self._buf = array.array("q")
        self._lo = self._nbits = -1
        self._dirty = False
        self._persistent: Callable[..., Any] | None = None
        self._preq: Any = None
        self._wbuf = np.zeros(3, dtype=np.int64)
        self._wreq: Any = None
        self._sent = self._closed = False
        self._wseq = 0

    # -- usable or not ---------------------------------------------------------

    def become(self, code: int, reason: str, first: bool) -> None:
        """Usable -> not: the first reason stays, unless ``first`` is false
        (letting go, which ends whatever state it was in)."""
        if first and self.reason is not None:
            return
        self.code = code
        self.reason = reason

    def set_hold(self, bit: int, on: bool) -> None:
        """Set or clear one reason why sync points may not take the steady state."""
        self.hold = self.hold | bit if on else self.hold & ~bit

    def set_participants(self, parts: tuple[tuple[int, Any, Any, bool, str], ...]) -> None:
        """The family's participants as the steady state sees them: for each,
        (the first bit of its field or -1, vote(seq), finish(flags), whether a
        finish may raise when its field is not 0, what a failure of its
        finish is called)."""
        self._parts = parts

    def set_children(self, children: tuple[FamilyState, ...]) -> None:
        """The states of its child families on this rank (collective_gc._tree's)."""
        self._children = children

    def wants(self) -> bool:
        """Whether this family, a child, has something for its parent's sync
        point to visit it for, on this rank. Local."""
        if self.reason is not None or self.hold & HOLD_GONE:
            return False
        if self.inbox or self.stale or self.unreported or self.hold & (HOLD_LEAVING | HOLD_PARTS):
            return True
        if self.comm is not None and self._marks[-1] != self.next_key:
            return True  # registered since its last sync point: a rank alone is a mismatch now
        for shift, vote, *_ in self._parts:
            if shift < 0:
                continue
            try:
                # A wish, or a bad vote (not an int in 0..255: its own sync
                # point refuses it on every rank), as the C twin's vote_of.
                seen = vote(LOOK)
                if type(seen) is not int or seen:
                    return True
            except BaseException:  # noqa: BLE001 (its own sync point refuses it on every rank)
                # An interrupt too (a vote's sys.exit()): raised here it would
                # leave the parent's sync point before its agreement on this
                # rank only. The visit asks the vote again, in the child's own
                # sync point, which holds what it raises until its collectives
                # are done. (A signal's interrupt does not arrive here: a sync
                # point is a protected region.)
                return True
        return any(c.wants() for c in self._children)

    def _idle_children(self) -> bool:
        return all(not (c.hold & HOLD_GONE) and not c.wants() for c in self._children)

    def quiet(self) -> bool:
        """Whether nothing unusual is known on this rank before a sync
        point's collective (its votes apart): the first half of the one
        decision whether a sync point is steady (the second: the agreement
        found nothing unusual either). Local."""
        return (
            self.code == OPEN
            and not self.destroying
            and not self.hold
            and not self.unreported
            and not self.stale
            and not self._pend.size
            and self.comm is not None
            and self.gone is None
            and not MPI.Is_finalized()
            and self._idle_children()
        )

    def plain(self, votes: tuple[tuple[int, bool], ...]) -> bool:
        """Whether the last exchange found nothing unusual anywhere: the
        same sync point, registrations and participants everywhere, no flag
        of the sync point's own, no key outside the window, no child
        wanted, every key this rank sent pending everywhere, and no
        participant with its byte set whose finish may raise (``votes``:
        (shift, raises) of each). The second half of the one decision. Local."""
        red = self._buf
        agreed = ~red[6]
        if (
            red[0] != ~red[1]
            or red[2] != ~red[3]
            or red[4] != ~red[5]
            or red[7] != 0
            or red[8] != -1
            or agreed & _SYNC_FLAGS & ~_FLAG_DEADLINE
            or self.last - self.first != self._pend.size
            or len(self.window_keys()) // 8 != self._pend.size
        ):
            return False
        if agreed & _FLAG_DEADLINE and self.fired():
            # A rank with a deadline gave up after sending its part: this
            # agreement completed only because of what it left behind.
            return False
        return not any(
            shift >= 0 and (agreed >> shift) & 0xFF and raises for shift, raises in votes
        )

    # -- registrations ---------------------------------------------------------

    def take_key(self, tag: int) -> int:
        """The next key, for the guarded path: taken and the next one stored
        at once (a collection run by the registration's allocation may run
        finalizers that register on this very thread).

        The key and the order move together, with no call between the two
        stores: a signal's handler, which the interpreter runs at calls (and
        which may register, or cut an interval, on this very thread: the
        lock is re-entrant), sees both before or both after; one that took a
        key meanwhile makes this one try again."""
        while True:
            key = self.next_key
            step = order_step(key, tag) if tag else 0
            with self._lock:
                if self.next_key == key:
                    self.next_key = key + 1
                    self.order = (self.order + step) & _MASK64
                    return key

    def give_back(self, key: int, tag: int) -> None:
        """A refused registration's key back, unless one was taken since."""
        step = order_step(key, tag) if tag else 0
        with self._lock:
            if self.next_key == key + 1:
                self.next_key = key
                self.order = (self.order - step) & _MASK64

    def begin_interval(self, ident: int) -> None:
        """``ident`` is the thread that registers until the next sync point."""
        self.thread = ident

    def add_busy(self, delta: int) -> None:
        """A guarded registration begins (+1) or ends (-1)."""
        self.busy += delta

    def store(self, reg: Any) -> None:
        """A registration made with a key from :meth:`take_key` joins the live ones."""
        self.live[reg.key] = reg

    def add_plain(
        self,
        owner: Any,
        tag: int,
        obj: object,
        destroy: Callable[..., object],
        args: tuple[Any, ...],
        name: str | None,
    ) -> Any:
        """Registration's common case in one call, or None having changed
        nothing (the guarded path in collective_gc._registry then does it, or
        says what is wrong): ``destroy`` a plain function without a closure,
        ``args`` a tuple of objects that are not ``obj`` nor what the
        destroy check looks into (functions, methods, partials: a petsc4py
        KSP, callable, is fine),
        ``name`` None or a str, no origin to record, ``obj`` weakly
        referenceable with no other weak reference, no guarded registration
        half-way through, and this thread the one registering since the last
        sync point (or none yet and this is the main thread, whose name a
        refusal can always find: other threads' first registrations take the
        guarded path, which records their names). The registration is made
        first (its allocation may start the collector, and so run other
        code); the key and the order then move together (see take_key),
        and the interval's registrar is noted after.
        Unlike the C twin it leaves a family of size 1 (any thread may
        register) to the guarded path's lock, since Python can switch
        threads between any two of its steps."""
        if (
            self._gc.origins
            or type(destroy) is not _FUNCTION
            or destroy.__closure__ is not None
            or type(args) is not tuple
            or not (name is None or type(name) is str)
        ):
            return None
        for a in args:
            if a is obj or type(a) in _INSPECTED or isinstance(a, functools.partial):
                return None
        try:
            reg = new_registration(
                self._reg_type,
                self._gc.finalize,
                obj,
                owner,
                self.inbox.append,
                -1,
                destroy,
                args,
                name,
                None,
            )
        except TypeError:
            return None  # not weakly referenceable: the guarded path says so
        me = threading.get_ident()
        thread = self.thread
        if (
            len(_getweakrefs(obj)) != 1
            or self.busy
            or thread != me
            and not (thread == 0 and me == self._gc.main)
        ):
            return None  # dropped here: its callback never runs
        key = self.take_key(tag)  # (the key and the order together: drain cuts both)
        # (After: a handler run by that call may end the interval.)
        self.thread = me  # (the interval's first, on the main thread: its registrar)
        _set_key(reg, key)
        self.live[key] = reg
        return reg

    def claim(self, reg: Any, state: int) -> tuple[Callable[..., object], tuple[Any, ...]] | None:
        """Move ``reg`` from alive to ``state`` (DESTROYED or DETACHED), once:
        its destroy call, taken out of it, or None if it had left alive
        already. An object already dead may have its key queued: the next
        drain drops it."""
        with self._lock:
            call = take_call(reg, state, self.live)
            if call is not None and reg() is None:
                self.stale = True
        return call

    def destroy_now(self, reg: Any) -> None:
        """An explicit destroy of ``reg``: claimed and run here, once."""
        call = self.claim(reg, DESTROYED)
        if call is not None:
            self.destroyed += 1
            fn, args = call
            del call
            fn(*args)

    def forget(self, owner: Any = None, calls: list[Any] | None = None) -> list[Any]:
        """Detach the registrations (``owner``'s only, if given) without
        running them; what was live. Their calls go to ``calls`` if given
        (a forked child keeps them: :meth:`after_fork`), else are let go of."""
        with self._lock:
            regs = [r for r in self.live.values() if owner is None or r._owner is owner]
            for reg in regs:
                call = take_call(reg, DETACHED, self.live)
                if calls is not None and call is not None:
                    calls.append(call)
            if owner is None:
                self.inbox.clear()
                self._pend = self._ages = _NO_KEYS
            elif regs:
                self.stale = True
        return regs

    # -- the queue ---------------------------------------------------------------

    def drain(self, seq: int) -> list[Any]:
        """Take the inbox into the pending keys (drained at sync point
        ``seq``); returns the cyclic deaths among them. Only sync points
        drain, every one of them, before its exchange.

        It first cuts the interval: the next key and the order it records are
        what the exchange sends, so that a registration another thread makes
        once the inbox is taken (the sync point may wait long before it packs
        its message) is the next interval's, as it is on a rank where it
        came after the sync point. Cut before the inbox is read: every key
        it holds then is below the cut, save one registered and dropped in
        between, which is pending here and the next interval's everywhere,
        agreed only if every rank has it pending too."""
        with self._lock:
            self.cut_key, self.cut_order = self.next_key, self.order
        inbox = self.inbox
        n = len(inbox)
        if not n and not self.stale:
            return []
        batch = inbox[:n]
        del inbox[:n]  # one C call: appends racing with it land after the slice
        if self.stale:
            # Explicit destroys or detaches of dead objects since the last
            # drain: drop their keys, wherever they are.
            self.stale = False
            batch = [r for r in batch if r._state == ALIVE]
            live = self.live
            keep = np.fromiter((k in live for k in self._pend.tolist()), bool, self._pend.size)
            self._pend, self._ages = self._pend[keep], self._ages[keep]
        cyclic = [r for r in batch if r.cyclic and r._state == ALIVE]
        if batch:
            new = np.fromiter((r.key for r in batch), np.int64, len(batch))
            pend = np.concatenate((self._pend, new))
            ages = np.concatenate((self._ages, np.full(new.size, seq, dtype=np.int64)))
            order = np.argsort(pend, kind="stable")
            self._pend, self._ages = pend[order], ages[order]
        return cyclic

    def pending_keys(self) -> tuple[bytes, bytes]:
        """The pending keys, ascending, and the sync point that drained each,
        as native int64 bytes."""
        return self._pend.tobytes(), self._ages.tobytes()

    def remove_pending(self, keys: bytes) -> None:
        """Agreed keys (a subset of the pending ones) leave them, before any destroy runs."""
        if not self._pend.size:
            return
        agreed = _keys(keys)
        if agreed.size == self._pend.size:
            self._pend = self._ages = _NO_KEYS
        else:
            keep = ~np.isin(self._pend, agreed, assume_unique=True)
            self._pend, self._ages = self._pend[keep], self._ages[keep]

    # -- the agreement -------------------------------------------------------------

    def open(self, comm: MPI.Intracomm, persistent: bool) -> None:
        """The private duplicate is ``comm``: post the watch's standing
        receive there (local), and use MPI-4's persistent allreduce where
        ``persistent`` and mpi4py offer it."""
        self.comm = comm
        # (Notices are MPI_INT64_T everywhere: the C twin's, and late_text's reads.)
        self._wreq = comm.Irecv([self._wbuf, MPI.INT64_T], MPI.ANY_SOURCE, TAG_GAVE_UP)
        init = getattr(comm, "Allreduce_init", None)  # mpi4py 4 only
        self._persistent = init if persistent else None

    @property
    def persistent(self) -> bool:
        """Whether its agreement uses MPI-4's persistent allreduce."""
        return self._persistent is not None

    @property
    def words(self) -> int:
        """The length, in int64 words, of the last agreement's message."""
        return len(self._buf)

    @property
    def window(self) -> tuple[int, int]:
        """The key window's first key and its number of bits."""
        return self._wlo, self._wbits

    def _reshape(self) -> None:
        """A buffer for the window (agreed, so on every rank): the persistent
        request bound to the old one is freed (inactive: local)."""
        self._drop_request()
        self._buf = array.array("q", bytes(8 * (WORDS + self._wbits // 64)))
        self._dirty = False
        self._nbits = self._wbits

    def _drop_request(self) -> None:
        # (An abandoned one is _transport's to free: see free_unless_kept.)
        req, self._preq = self._preq, None
        if req is not None:
            free_unless_kept(req)

    def _start(self) -> Any:
        buf = self._buf
        comm = self.comm
        assert comm is not None
        if self._persistent is not None:
            if self._preq is None:
                try:
                    # Collective, but nonblocking; every rank makes it at the
                    # same sync point (the buffer's shape is agreed).
                    self._preq = self._persistent(MPI.IN_PLACE, buf, MPI.BAND)
                except NotImplementedError:
                    # mpi4py 4 over an MPI without it: the same on every rank.
                    self._persistent = None
                    return comm.Iallreduce(MPI.IN_PLACE, buf, MPI.BAND)
            self._preq.Start()
            return self._preq
        return comm.Iallreduce(MPI.IN_PLACE, buf, MPI.BAND)

    def exchange(
        self, at_exit: bool, flags: int, fingerprint: int, children: int, deadline: float | None
    ) -> int:
        """Collective: one allreduce (MPI_BAND, in place) of the header (this
        sync point's number and kind, the next key and the participants'
        ``fingerprint`` mixed with the registrations' order, both as the
        last drain cut them, each as x and ~x; ``flags`` and
        ``children`` complemented; the hash filter of the pending keys
        outside the window) and the window's bitmap of the pending keys.
        Returns DONE, WATCHED (a rank's notice came first: before the post,
        which is then not made, or in the wait) or LATE (this rank's
        ``deadline`` passed: it told the others). A wait left but by DONE
        (or by an exception, a handler's) leaves the buffer and the request
        to MPI for ever. From the post until the sync point's last
        collective, ``inside`` is set."""
        if self._nbits != self._wbits:
            self._reshape()
        lo, nbits = self._wlo, self._nbits
        self._lo = lo
        self._wseq = self.seq
        buf = self._buf  # same length as before: the memory MPI may be bound to stays
        seqword = self.seq * 2 + at_exit
        buf[0], buf[1] = seqword, ~seqword
        buf[2], buf[3] = self.cut_key, ~self.cut_key
        parts = (fingerprint ^ self.cut_order) & _MASK64
        parts = parts - (1 << 64) if parts >> 63 else parts
        buf[4], buf[5] = parts, ~parts
        buf[6] = ~(flags if deadline is None else flags | _FLAG_DEADLINE)
        buf[8] = ~_int64(children)
        keys = self._pend
        words = np.frombuffer(buf, dtype=np.int64)
        if keys.size:
            first = int(keys.searchsorted(lo))
            last = int(keys.searchsorted(lo + nbits))
            bits = np.zeros(nbits, dtype=bool)
            bits[keys[first:last] - lo] = True
            words[WORDS:] = np.packbits(bits, bitorder="little").view(np.int64)
            buf[7] = _filter(np.concatenate((keys[:first], keys[last:])))
            self._dirty = True
        else:
            first = last = 0
            buf[7] = 0
            if self._dirty:  # the AND of bits this rank sent: clear them
                words[WORDS:] = 0
                self._dirty = False
        del words
        self.first, self.last = first, last
        if self.gone is not None:
            # A notice taken before (fired(), between sync points): nothing
            # completes in step, and an allreduce posted now would only be
            # abandoned, on a communicator the other ranks may use once more.
            return WATCHED
        self.inside = True
        req = None
        try:
            req = self._start()
            found = poll(req, deadline, self)
        except BaseException:
            # (req None: an interrupt as the post returned; a persistent
            # request, started, is still this state's, and kept with it.)
            self._abandon(req if req is not None else self._preq)
            raise
        if found != DONE:
            self._abandon(req)
        return found

    def _abandon(self, req: Any) -> None:
        # MPI may still write into the buffer, and the request may be active:
        # neither is used again, and both are kept until it completes.
        keep_alive(req, self._buf)
        self._lo = self._nbits = -1
        self._preq = None

    def reduced(self) -> tuple[int, ...]:
        """The header words the last exchange's allreduce left."""
        return tuple(self._buf[:WORDS])

    def window_keys(self) -> bytes:
        """The keys whose bits survived the last exchange, ascending (its
        window is the one it packed: :meth:`agreed` comes after)."""
        if self.last <= self.first:
            return NO_BYTES
        words = np.frombuffer(self._buf, dtype=np.int64)[WORDS : WORDS + self._nbits // 64]
        bits = np.unpackbits(words.view(np.uint8), count=self._nbits, bitorder="little")
        return (np.flatnonzero(bits).astype(np.int64) + self._lo).tobytes()

    def agreed(self, next_key: int) -> None:
        """A sync point agreed (``next_key``: the next key every rank sent, or
        -1 on a family of size 1): the window moves, the next registration
        may come from any one thread, the sync point is counted.

        The window covers the keys registered since the SPAN - 1 last sync
        points and room for twice as many new ones as the most registered
        between two of the last MEMORY, in a power of two of bits (the
        buffer, and the request bound to it, are made again only when it
        doubles or halves), MIN at least; half the bits beyond those reach
        back over older keys, the other half are room for more new ones."""
        if next_key >= 0:
            marks, growths = self._marks, self._growths
            if next_key != marks[-1] or self._idle != _MEMORY:
                self._idle = self._idle + 1 if next_key == marks[-1] else 0
                growths.append(next_key - marks[-1])
                marks.append(next_key)
                if len(growths) > _MEMORY:
                    del growths[0]
                if len(marks) > _SPAN:
                    del marks[0]
                lo = marks[0]
                hi = next_key + max(2 * max(growths), 1)
                if hi - lo > WINDOW_LIMIT:
                    lo = hi - WINDOW_LIMIT
                bits = self._wbits = max(WINDOW_MIN, 1 << (hi - lo - 1).bit_length())
                # Of the bits the buffer has beyond those, half reach back
                # over older keys (an object kept for some steps then needs
                # no second round), half are room for a larger burst.
                self._wlo = max(0, lo - (bits - (hi - lo)) // 2)
        if self.thread > 0:
            self.thread = 0
        self.seq += 1

    def left(self) -> None:
        """This rank is done with the sync point's collectives."""
        self.inside = False

    # -- the watch -------------------------------------------------------------

    def fired(self) -> bool:
        """Whether a rank gave up (a notice arrived, or this rank sent one). Local."""
        req = self._wreq
        if self.gone is None and not self._closed and req is not None and req.Test():
            b = self._wbuf
            self.gone = (int(b[0]), int(b[1]), int(b[2]))
        return self.gone is not None

    def notice(self) -> tuple[int, int, int] | None:
        """The notice the watch's standing receive took, if one came (it takes
        only the first: _transport reads the others). Local."""
        req = self._wreq
        if self._closed or req is None:
            return None
        if req != MPI.REQUEST_NULL and not req.Test():
            return None
        b = self._wbuf
        return (int(b[0]), int(b[1]), int(b[2]))

    def announce(self, why: int) -> None:
        """Tell every other rank, once, why this one leaves the collectives:
        GAVE_UP at its deadline, LEFT when an exception took it out, WOKEN
        when another's notice ended its wait (so that every rank can tell
        who was there from who was not: _transport.late_text). Local:
        non-blocking sends, kept until complete (for the life of the
        process if the rank they go to never waits again, never
        receiving). Only on these error paths."""
        if self._sent or self._closed or self.comm is None:
            return
        if self.gone is not None and why != WOKEN:
            return  # (a notice came first: this rank was woken, and says so with WOKEN)
        # Marked sent only once nothing before the sends can fail (memory):
        # a failure leaves the notice to a later call.
        note = np.array((self.rank, self._wseq, why), dtype=np.int64)
        if self.gone is None:
            self.gone = (self.rank, self._wseq, why)
        self._sent = True
        comm = self.comm
        for other in range(self.size):
            if other != self.rank:
                isend(comm, note, other, TAG_GAVE_UP)

    def close(self, let_go: bool) -> MPI.Intracomm | None:
        """Withdraw the watch's receive and free an inactive persistent
        request; then (``let_go``) the private duplicate is no longer this
        state's: returned, for the caller to keep or free (_transport.retire:
        messages may still arrive on it). Local."""
        comm = self.comm
        if MPI.Is_finalized():
            self.comm = None
            return None
        self._drop_request()
        self._closed = True
        req, self._wreq = self._wreq, None
        if req is not None and req != MPI.REQUEST_NULL:
            req.Cancel()
            req.Wait()  # completes at once: cancelled, or a notice had arrived
        if not let_go:
            return None
        self.comm = None
        return comm

    # -- destroys ----------------------------------------------------------------

    def destroy(
        self, keys: bytes, batched: tuple[Any, ...], runners: tuple[Any, ...]
    ) -> tuple[int, list[tuple[int, str, BaseException]], BaseException | None]:
        """Destroy the registrations of the agreed ``keys`` (ascending),
        newest first; returns how many ran, the failures (key, name,
        exception), and an interrupt that landed between two runs of them.

        Every registration is taken out and marked destroyed before any
        destroy runs, and the keys leave the pending ones: a destroy that
        reaches for another of the batch finds it destroyed, and nothing a
        destroy queues is mistaken for them. Consecutive destroys by a
        function of ``batched`` (by identity) run as one call of its runner
        in ``runners`` (PETSc's, from C). Every agreed destroy runs, whatever
        lands in between: the other ranks run them all."""
        agreed = _keys(keys)[::-1].tolist()
        self.destroying = threading.get_ident()
        try:
            with self._lock:
                taken, fns, argss = [], [], []
                live = self.live
                for key in agreed:
                    reg = live.get(key)
                    call = None if reg is None else take_call(reg, DESTROYED, live)
                    if call is None:
                        continue  # destroyed or detached explicitly meanwhile, on every rank
                    fns.append(call[0])
                    argss.append(call[1])
                    taken.append(reg)
                # (The C twin gives an empty dict's memory back here; in Python
                # another thread could store between a look and the clear.)
            return _run_destroys(self, keys, taken, fns, argss, batched, runners)
        finally:
            self.destroying = 0

    def _counted(self, n: int) -> None:
        self.destroyed += n

    # -- failures kept for the next agreement ------------------------------------

    def keep(self, failures: list[tuple[int, Any]]) -> None:
        """Failures known on this rank only, for the next agreement to report."""
        self.unreported.extend(failures)

    def take_unreported(self) -> list[tuple[int, Any]]:
        """The kept failures, now being reported (they leave the state)."""
        out, self.unreported = self.unreported, []
        return out

    def take_failed(self) -> list[tuple[int, str, BaseException]]:
        """What the last :meth:`steady` call's destroys and finishes raised (C only)."""
        return []

    # -- the steady state ----------------------------------------------------------

    def steady(
        self,
        t0: float,
        collected: int | None,
        extra: Any,
        fingerprint: int,
        batches: tuple[tuple[Any, ...], tuple[Any, ...]],
        deadline: float | None,
    ) -> Any:
        """A sync point whose every step takes its fast case, in one call: in C
        (see collective_gc._speedups), waiting in its agreement until
        ``deadline`` (``time.monotonic()``; None: for ever). The twin leaves
        it to the steps, whose fast cases are the reference: None, with
        ``progress`` 0."""
        self.progress = 0
        return None

    def after_fork(self) -> list[Any]:
        """In a forked child nothing here is this process's: a fresh lock (one
        another thread held at the fork is never released there), nothing
        queued. Returns the registrations' calls, (destroy, args): they hold
        the parent's resources, which the child must keep (see
        collective_gc._exit: letting go here would run their destructors)."""
        self._lock = threading.RLock()
        calls: list[Any] = []
        self.forget(calls=calls)
        return calls


def _run_destroys(
    state: FamilyState,
    keys: bytes,
    taken: list[Any],
    fns: list[Callable[..., object]],
    argss: list[tuple[Any, ...]],
    batched: tuple[Any, ...],
    runners: tuple[Any, ...],
) -> tuple[int, list[tuple[int, str, BaseException]], BaseException | None]:
    # The runs of consecutive calls to one batched destroy (index -1: others).
    ids = [id(f) for f in batched]
    segments: list[tuple[int, int, int]] = []
    start = 0
    n = len(fns)
    while start < n:
        f = fns[start]
        index = ids.index(id(f)) if id(f) in ids else -1
        end = start + 1
        while end < n and (ids.index(id(fns[end])) if id(fns[end]) in ids else -1) == index:
            end += 1
        segments.append((start, end, index))
        start = end
    # The loops test a plain name, not a call: a pending signal is raised at
    # calls and loop back-jumps, and one raised at the outer loop's test
    # (outside the try) would leave the sync point half-way on this rank.
    nruns = len(segments)
    ran: list[tuple[int, int, list[tuple[int, BaseException]]]] = []
    errors: list[tuple[int, BaseException]] = []
    own: list[tuple[int, str, BaseException]] = []
    interrupt: BaseException | None = None
    removed = False
    pos = 0  # the next run to begin; it counts as begun before it is called
    strikes = 0  # exceptions in a row at one step: past a few, the step is given up
    while not removed or pos < nruns:
        try:
            if not removed:
                state.remove_pending(keys)  # idempotent: may be made again
                removed = True
                strikes = 0
            while pos < nruns:
                start, end, index = segments[pos]
                fchunk, achunk = fns[start:end], argss[start:end]
                # Nothing that can raise from here to the runner's call, which
                # lets nothing out (it makes every call whatever raises).
                pos += 1
                strikes = 0
                try:
                    errors = _each(fchunk, achunk) if index < 0 else runners[index](achunk)
                except BaseException as runner_exc:
                    # The runner itself failed (out of memory recording a
                    # failure), after trying every call: which one is unknown.
                    errors = [(-1, runner_exc)]
                ran.append((start, end, errors))
                del fchunk, achunk
        except BaseException as exc:  # landed between two runs: the rest still run
            if not isinstance(exc, Exception):
                interrupt = interrupt or exc
            elif strikes == 0:
                own.append((-1, "the sync point's own steps between its destroys", exc))
            strikes += 1
            if strikes >= 3:  # the same step keeps failing (out of memory): give it up
                strikes = 0
                if not removed:
                    removed = True  # the keys stay pending here; their registrations are gone
                else:
                    start, end, _ = segments[pos]
                    pos += 1
                    own.append((-1, f"{end - start} destroys that could not be begun", exc))
    count = len(taken)
    state._counted(count)
    failures = own + [
        (taken[start + i].key, taken[start + i].name, exc)
        if i >= 0
        else (-1, f"one of {end - start} destroys", exc)
        for start, end, errors in ran
        for i, exc in errors
    ]
    del taken, fns, argss  # the destroyed objects go here, unless someone else holds them
    try:
        return count, failures, interrupt
    finally:
        # A caught exception's traceback holds this frame: no local may hold
        # what is returned (see collective_gc._destroy.Failure).
        del ran, errors, own, failures, interrupt


def _each(
    fns: list[Callable[..., object]], argss: list[tuple[Any, ...]]
) -> list[tuple[int, BaseException]]:
    """``fns[i](*argss[i])`` for each i, in order, every call made even if
    some raise; (index, exception) of those that raised."""
    errors: list[tuple[int, BaseException]] = []
    for i, (fn, args) in enumerate(zip(fns, argss)):
        try:
            fn(*args)
        except BaseException as exc:  # every call is made; the caller reports after
            errors.append((i, exc))
    try:
        return errors
    finally:
        del errors


_FUNCTION = type(order_step)
# What collective_gc._registration.check_destroy looks into for a reference
# to the object: an argument of these types goes the guarded way.
_INSPECTED = (
    types.FunctionType,
    types.MethodType,
    types.BuiltinMethodType,
    types.MethodWrapperType,
)
_getweakrefs = weakref.getweakrefs

# The one binding: the C types where the extension is loaded (the one
# decision, collective_gc._switch), else the twins above (kept under these
# names too: tests/test_layout.py holds the C types against them).
PythonGcState, PythonRegistrationFields = GcState, RegistrationFields
PythonRegion, PythonFamilyState = Region, FamilyState
if SPEEDUPS is not None:
    GcState = SPEEDUPS.GcState  # type: ignore[misc]
    RegistrationFields = SPEEDUPS.RegistrationFields  # type: ignore[misc]
    Region = SPEEDUPS.Region  # type: ignore[misc]
    FamilyState = SPEEDUPS.FamilyState  # type: ignore[misc]
    new_registration = SPEEDUPS.new_registration  # type: ignore[assignment]  # (positional-only in C)
    note_queued = SPEEDUPS.note_queued  # type: ignore[assignment]
    take_call = SPEEDUPS.take_call  # type: ignore[assignment]
