"""A sync point, as the sequence of its steps.

A manager's sync point on this rank, from a dead object's point of view: its
finalizer appended its registration to the registry's inbox. Then:

1. prepare: the manager's visitor (derived communicators) and the
   participants' own collective work, their votes, and the drain of the
   inbox into the pending keys;
2. agree: one collective over the private communicator says which keys are
   pending on every rank, ORs the flags and votes, and checks that every rank
   is at the same sync point (:meth:`._agree.Agreement.agree`);
3. destroy: those keys' destroys, newest first (:func:`._destroy.run`);
4. check: if some ran, or a rank failed before, one more word says whether a
   destroy raised anywhere, and takes the votes again;
5. finish: the participants act on the agreed flags (one more word if any
   of them might raise);
6. report: a failure anywhere raises the same error on every rank.

Each step decides from agreed values only, so every rank takes the same
branches and makes the same collectives. One :class:`SyncPoint` holds what a
sync point carries from step to step; :class:`Books` what the manager's sync
points share between them.

Participants (:class:`Participant`) are what takes part in a sync point
beside the destroys: a scope's GC policy, PETSc's own garbage cleanup. Each
may vote in a byte (its field) of the agreed flags and act on the result.
"""

from __future__ import annotations

import os
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, NoReturn

import numpy as np
from mpi4py import MPI

from . import _agree, _destroy
from ._agree import FLAG_BAD_VOTE, FLAG_CYCLIC, FLAG_FAILED
from ._errors import CollectiveGCError, CollectiveMismatchError
from ._registry import Registry
from ._transport import Deadline, allgather

if TYPE_CHECKING:
    from ._manager import Manager

__all__ = ["Books", "CollectStats", "Participant", "SyncPoint"]


class CollectStats(NamedTuple):
    """What one sync point did on this rank.

    Attributes:
        destroyed: destroys run at this sync point (the same on every rank).
        pending: destroy requests still queued on this rank afterwards (keys
            not yet queued on every rank).
        cyclic: finalizations drained at this sync point that happened inside
            the cyclic collector.
        seconds: wall time of the sync point on this rank, including the local
            ``gc.collect``.
        sync: the sync-point number on this communicator (0 for the first).
        collected: what the local ``gc.collect`` returned, or None if skipped.
    """

    destroyed: int
    pending: int
    cyclic: int
    seconds: float
    sync: int
    collected: int | None = None


class Participant:
    """Something that takes part in a manager's sync points (subclass it).

    ``field`` (0..5, or None) is the byte of the agreed flags it votes in,
    fixed by its kind so that every rank reads the same byte. Every method
    runs on every rank of the communicator at every sync point, in the order
    participants were added (sync points' own participants last).
    """

    field: int | None = None

    def prepare(self, mgr: Manager, deadline: float | None) -> list[_destroy.Failure]:
        """Before the agreement: collective work of its own (on other
        communicators); failures returned join the sync point's."""
        return []

    def vote(self, mgr: Manager) -> int:
        """This rank's byte (0..255), ORed over the ranks. Local, no MPI."""
        return 0

    def finish(self, mgr: Manager, flags: int) -> None:
        """After the destroys, with the agreed flags (the votes taken again
        after the destroys, if any ran). May make collective calls on ``mgr.comm``.

        If it raises on any rank (when :meth:`may_raise` said it could), every
        rank raises :class:`DestroyError` naming it, after the other
        participants' finishes ran (an interrupt is re-raised on its rank)."""

    def may_raise(self, flags: int) -> bool:
        """Whether :meth:`finish`, given the agreed ``flags``, might raise on
        some ranks only. Then the sync point runs one more small collective
        after the finishes, so that a failure anywhere is raised on every
        rank. Answer from ``flags`` alone, so that every rank answers alike.

        It must not raise (if it does, alike on every rank, that counts as a
        yes and is reported). The default: True if the class overrides
        :meth:`finish`. A finish that raises where this said False raises on
        its own rank only, unless the sync point reports another failure
        anyway (then it is in that DestroyError)."""
        return type(self).finish is not Participant.finish

    def identity(self) -> str:
        """What the participant at the same place in every rank's sync point
        must share (its class and field, by default; a subclass adds what
        changes which collectives it makes). The agreement compares a
        fingerprint of these: ranks whose sync points have different
        participants (a scope's ``gc=`` or ``strict=`` differing between
        ranks, two threads' sync points paired differently) raise
        :class:`CollectiveMismatchError` on every rank, before anything is
        destroyed or any participant's collective is made."""
        return f"{type(self).__module__}.{type(self).__qualname__}/{self.field}"

    def votes(self, flags: int) -> int:
        """This participant's byte of the agreed ``flags``."""
        if self.field is None:
            return 0
        return (flags >> _agree.field_shift(self.field)) & 0xFF


def identities(parts: Sequence[Participant]) -> str:
    """The participants' identities, joined (what the agreement fingerprints)."""
    return "\0".join(p.identity() for p in parts)


def what_raised(exc: BaseException) -> str:
    """``"Type: message"`` of ``exc``, whatever its ``str()`` does (it may raise too)."""
    try:
        return f"{type(exc).__name__}: {exc}"
    except Exception:  # noqa: BLE001
        return f"{type(exc).__name__} (whose str() raised)"


def _raise_own(failures: list[_destroy.Failure]) -> NoReturn:
    """Raise the first of this rank's ``failures`` (the others as its notes)."""
    _, what, first = failures[0]
    notes = [f"collective_gc: {w} raised too: {exc!r}" for _, w, exc in failures[1:]]
    failures.clear()  # the caller's frame must not hold what its traceback holds
    for note in notes:
        first.add_note(note)
    try:
        raise first
    finally:
        del first


class Books:
    """What one manager's sync points share: its registry, its agreement
    (made with the private communicator), the count of sync points and
    destroys, the participants, and what the manager reads while a sync
    point is under way. Owned by the manager; read and written by its sync
    points."""

    __slots__ = (
        "rank",
        "size",
        "label",
        "registry",
        "agreement",
        "seq",
        "destroyed",
        "destroying",
        "collective",
        "participants",
        "identities",
        "visitor",
    )

    def __init__(self, rank: int, size: int, label: str, registry: Registry) -> None:
        self.rank, self.size, self.label = rank, size, label
        self.registry = registry
        self.agreement: _agree.Agreement | None = None
        self.seq = 0  # sync points completed
        self.destroyed = 0
        self.destroying = 0  # ident of the thread running this manager's destroys
        # True while a sync point is inside its collectives on this rank (from
        # its agreement to its error report, participants' finishes included):
        # leaving it by an exception then makes the manager unusable, and the
        # private communicator is not released under it.
        self.collective = False
        self.participants: list[Participant] = []
        self.identities = ""  # of participants (see Participant.identity)
        self.visitor: Callable[[Manager, float | None], Sequence[_destroy.Failure]] | None = None

    def idle(self, extra: Sequence[Participant]) -> bool:
        """Whether a sync point on COMM_SELF would have nothing to do."""
        r = self.registry
        return not (
            r.inbox
            or r.pend.size
            or r.stale
            or r.last_cyclic
            or extra
            or self.participants
            or self.visitor is not None
        )

    def what(self, stage: str) -> Callable[[], str]:
        """The message of a timeout at ``stage``: formatted only then, while the
        caller's frames are on the stack."""

        def describe() -> str:
            here = os.path.dirname(__file__)
            frames = [f for f in traceback.extract_stack() if not f.filename.startswith(here)]
            where = "".join(traceback.format_list(frames[-3:]))
            return (
                f"rank {self.rank}: sync point {self.seq} on the {self.label} did "
                f"not complete {stage} before its deadline; called from:\n{where}"
            )

        return describe


class SyncPoint:
    """One sync point on this rank, run as its steps (see the module docs).

    The failures it collects hold tracebacks, whose frames hold this record:
    :meth:`run` drops them as it ends, however it ends, so that no reference
    cycle (with a user's objects in it, perhaps) outlives the sync point and
    waits for the cyclic collector.
    """

    __slots__ = (
        "mgr",
        "books",
        "private",
        "dl",
        "at_exit",
        "parts",
        "identities",
        "seq",
        "flags",
        "keys",
        "cyclic",
        "count",
        "bad",
        "failures",
        "caught",
    )

    def __init__(
        self,
        mgr: Manager,
        books: Books,
        private: Callable[[Deadline], MPI.Intracomm],
        deadline: Deadline,
        extra: Sequence[Participant],
        at_exit: bool,
    ) -> None:
        self.mgr, self.books, self.private = mgr, books, private
        self.dl, self.at_exit = deadline, at_exit
        self.parts: Sequence[Participant] = books.participants
        self.identities = books.identities
        if extra:
            self._check_fields(extra)
            self.parts = books.participants + list(extra)
            self.identities = identities(self.parts)
        self.seq = books.seq
        self.flags = 0
        self.keys: np.ndarray[Any, Any] = _NO_KEYS
        self.cyclic = 0
        self.count = 0
        self.bad: list[str] = []  # participants' votes outside 0..255, on this rank
        self.failures: list[_destroy.Failure] = []
        # Interrupts of the sync point's own steps (not from a signal: those
        # wait for the end of the protected region: a second Ctrl-C between two
        # runs of destroys, an exception's str()), raised on this rank once the
        # collectives are done.
        self.caught: list[BaseException] = []

    def run(self, collected: int | None, t0: float) -> CollectStats:
        """The steps, in order. Collective: from the agreement on, whether a
        step runs depends on agreed values only (the keys, the flags, the
        participants), so every rank runs the same steps."""
        try:
            self.prepare()
            self.agree()
            if self.keys.size:
                self.destroy()
            if self.keys.size or self.flags & FLAG_FAILED:
                self.check()
            if self.parts:
                self.finish()
            if self.failures or self.caught or self.flags & FLAG_FAILED:
                self.report()
        finally:
            self.failures = self.caught = _NONE  # see the class docs
        r = self.books.registry
        return CollectStats(
            self.count,
            r.pend.size + len(r.inbox),
            self.cyclic,
            time.perf_counter() - t0,
            self.seq,
            collected,
        )

    # -- 1. prepare ------------------------------------------------------------

    def prepare(self) -> None:
        """The visitor's and participants' own work, their votes, the drain."""
        books, mgr = self.books, self.mgr
        if books.visitor is not None:
            self.failures.extend(books.visitor(mgr, self.dl.at))
        if self.parts:
            for p in self.parts:
                self.failures.extend(p.prepare(mgr, self.dl.at))
            self.flags = self._votes()
        if self.failures:
            self.flags |= FLAG_FAILED
        r = books.registry
        if r.inbox or r.stale or r.last_cyclic:
            self.cyclic = r.drain(self.seq)
            if self.cyclic:
                self.flags |= FLAG_CYCLIC

    # -- 2. agree ----------------------------------------------------------------

    def agree(self) -> None:
        """The keys pending on every rank, and the agreed flags. Collective."""
        books = self.books
        r = books.registry
        if books.size == 1:
            self.keys = r.pend
        else:
            # From here until the last collective, leaving by an exception on
            # this rank only makes the manager unusable (see Manager.sync).
            books.collective = True
            if books.agreement is None:
                self.private(self.dl)  # makes the agreement
            agreement = books.agreement
            assert agreement is not None
            head = _agree.Header(
                self.seq,
                r.next_key,
                self.at_exit,
                self.flags,
                _agree.fingerprint(self.identities) if self.identities else 0,
            )
            agreed = agreement.agree(head, r.pend, self.dl, books.what("its agreement"))
            if agreed.mismatch:
                raise self._mismatch(agreement.comm)
            agreement.window.advance(r.next_key)
            r.new_interval()
            self.keys, self.flags = agreed.keys, agreed.flags
        if self.flags & FLAG_BAD_VOTE:
            # Seen alike by every rank, before anything is destroyed: the keys
            # stay pending, and the manager stays usable. (An interrupt held
            # meanwhile is raised in its place by the protected region's end.)
            books.collective = False
            raise CollectiveGCError(
                f"rank {books.rank}: a participant of the {books.label} voted outside "
                f"0..255 at sync point {self.seq} (here: {'; '.join(self.bad) or 'none'}); "
                "nothing was destroyed"
            )
        books.seq = self.seq + 1

    # -- 3. destroy --------------------------------------------------------------

    def destroy(self) -> None:
        """The agreed keys' destroys, newest first, on every rank alike."""
        books = self.books
        books.destroying = threading.get_ident()
        try:
            self.count, more, interrupt = _destroy.run(books.registry, self.keys)
        finally:
            books.destroying = 0
            books.destroyed += self.count
        self.failures.extend(more)
        if interrupt is not None:
            self.caught.append(interrupt)
        # A frame on the failures' tracebacks (through f_back) must not hold them.
        del more, interrupt

    # -- 4. check ----------------------------------------------------------------

    def check(self) -> None:
        """Whether a destroy failed anywhere, and the votes again. Collective.

        Whether anything ran depends only on agreed values, so every rank takes
        the same branch (interrupts are re-raised only after this)."""
        after = self._votes() | (FLAG_FAILED if self.failures else 0)
        agreement = self.books.agreement
        if agreement is not None:
            after = agreement.any_flags(after, self.dl, self.books.what("its error check"))
        self.flags = after | (self.flags & FLAG_CYCLIC)

    # -- 5. finish ---------------------------------------------------------------

    def finish(self) -> None:
        """Every participant's finish, whatever raises; then, if any of them
        said it might raise (agreed, so on every rank alike), one more word
        says whether anything failed anywhere (FLAG_FAILED in the flags)."""
        # Whether to check is asked of every participant before any finish
        # runs, from agreed values only, so it is decided alike on every rank.
        # No signal's handler runs in between (the sync point is a protected
        # region): what raises is the participants' own code.
        # (No local name for the failures: a frame in their tracebacks would
        # hold them; the record's end drops them, see the class docs.)
        flags = self.flags
        check = False
        for p in self.parts:
            try:
                check = p.may_raise(flags) or check
            except BaseException as exc:  # a yes (alike on every rank: see may_raise)
                check = True
                self.failures.append((-1, f"the may_raise of {type(p).__name__}", exc))
        for p in self.parts:
            try:
                p.finish(self.mgr, flags)
            except BaseException as exc:  # every participant finishes; reported after
                self.failures.append((-1, f"the finish of {type(p).__name__}", exc))
        if not check:
            return
        mine = FLAG_FAILED if self.failures else 0
        agreement = self.books.agreement
        if agreement is not None:
            mine = agreement.any_flags(mine, self.dl, self.books.what("its finish check"))
        self.flags |= mine  # on COMM_SELF, reported as on a larger communicator

    # -- 6. report ---------------------------------------------------------------

    def report(self) -> None:
        """Raise on every rank what failed on any, and then this rank's interrupt."""
        books = self.books
        if self.failures and not self.flags & FLAG_FAILED:
            # A finish that said it could not raise did, on this rank: the
            # others know nothing of it, so it is raised here only, as is.
            books.collective = False
            _raise_own(self.failures)
        if self.flags & FLAG_FAILED:
            rows = _destroy.rows_of(self.failures, books.rank, self.caught)
            if books.size > 1:
                everyone = allgather(
                    self.private(self.dl), rows, self.dl, books.what("its error report")
                )
                rows = [row for per_rank in everyone for row in per_rank]
            books.collective = False
            _destroy.raise_failures(
                rows,
                self.caught + [e for _, _, e in self.failures],
                f"sync point {self.seq} on the {books.label}",
                books.rank,
                self.mgr.broken,
            )
        books.collective = False
        if self.caught:
            self.caught[0].add_note(
                "collective_gc: it was held until the sync point's collectives were "
                "done, so that every rank ran the same destroys"
            )
            _raise_own([(-1, "the sync point's own steps", e) for e in self.caught])

    # -- the votes and the mismatch ----------------------------------------------

    def _check_fields(self, extra: Sequence[Participant]) -> None:
        # The same participants on every rank (the call is collective), so
        # refusing here, before any collective, is the same everywhere.
        taken = {p.field for p in self.books.participants if p.field is not None}
        for p in extra:
            if p.field is None:
                continue
            _agree.field_shift(p.field)
            if p.field in taken:
                raise CollectiveGCError(
                    f"two participants of a sync point on the {self.books.label} vote in "
                    f"field {p.field}"
                )
            taken.add(p.field)

    def _votes(self) -> int:
        flags = 0
        for p in self.parts:
            if p.field is not None:
                vote = p.vote(self.mgr)
                if type(vote) is not int or not 0 <= vote <= 0xFF:
                    self.bad.append(f"{type(p).__name__} voted {vote!r}")
                    flags |= FLAG_BAD_VOTE
                    continue
                flags |= vote << _agree.field_shift(p.field)
        return flags

    def _mismatch(self, comm: MPI.Intracomm) -> CollectiveMismatchError:
        # Every rank saw the disagreement: one more gather says who differs.
        books = self.books
        next_key = books.registry.next_key
        mine = (self.seq, next_key, self.at_exit, self.identities)
        everyone = allgather(comm, mine, self.dl, books.what("its mismatch report"))
        seqs = [s for s, _, _, _ in everyone]
        keys = [k for _, k, _, _ in everyone]
        kinds = [e for _, _, e, _ in everyone]
        ids = [i for _, _, _, i in everyone]
        parts = []
        if len(set(ids)) > 1:
            shown = {i: [r for r, j in enumerate(ids) if j == i] for i in dict.fromkeys(ids)}
            parts.append(
                "the ranks' sync points have different participants ("
                + "; ".join(
                    f"ranks {r}: {i.replace(chr(0), ', ') or 'none'}" for i, r in shown.items()
                )
                + "): a collective_scope's gc= or strict= differs between the ranks, or "
                "two threads ran sync points on this communicator at once and the ranks "
                "paired them differently"
            )
        if len(set(kinds)) > 1:
            parts.append(
                "some ranks were at a sync point of the program and others at the exit "
                f"agreement (this rank: {'exit' if self.at_exit else 'a sync point'}; at exit: "
                f"ranks {[r for r, e in enumerate(kinds) if e]}); a rank ran more sync points "
                "than the others, or exited early"
            )
        if len(set(seqs)) > 1:
            parts.append(
                f"sync-point numbers range from {min(seqs)} to {max(seqs)} across the ranks "
                f"(by rank: {seqs}; this rank: {self.seq}); a rank skipped a sync point"
            )
        if len(set(keys)) > 1:
            parts.append(
                f"registration counts range from {min(keys)} to {max(keys)} (by rank: {keys}; "
                f"this rank: {next_key}); the ranks did not register the same "
                "objects (register is collective)"
            )
        return CollectiveMismatchError(
            f"rank {books.rank}: the ranks of the {books.label} disagree at sync "
            f"point {self.seq}: " + "; ".join(parts) + ". Nothing was destroyed."
        )


_NO_KEYS = np.empty(0, dtype=np.int64)
_NO_KEYS.flags.writeable = False
_NONE: list[Any] = []  # what a finished record holds; never appended to
