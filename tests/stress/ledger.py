"""What every managed object of a seed became, the defect classes, and checkpoints.

Every object the fault scenarios register is an :class:`Obj` with a token;
the :class:`Ledger` keeps only a weak reference to it (a liveness token) and
counts the runs of its destroy. So the checks are about the promise itself,
whatever the library does inside:

- ``live``: a destroy ran while its object was still reachable (its weak
  reference still resolves), and the harness had not asked for it;
- ``double``: a destroy ran twice, or after ``detach()`` returned True;
- ``lost``: an object dead on this rank whose destroy never ran, after the
  scenario dropped everything and ran its final agreed collects;
- ``dupkey``: two registrations on one manager got the same key;
- ``disagree``: ranks left the same sync point differently (one OK, another an
  error; different error types; different destroy counts or orders);
- ``hang``: a sync point that should have completed timed out, or overran its
  deadline, or the watchdog / a checkpoint deadline fired;
- ``error``: an error a correct library would not raise (a registration
  refused on another thread while the main thread destroys, say).

Expected errors (a ``CollectiveTimeoutError`` on ranks left waiting by a late
rank, the re-raised interrupt on the rank whose destroy raised it) are not
defects; the scenarios say which they expect.

The checkpoint exchange is an allgather on a communicator of the harness's
own, polled against a deadline: a rank that never arrives (hung inside the
library) makes the others report a hang instead of waiting for ever.
"""

from __future__ import annotations

import itertools
import pickle
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from mpi4py import MPI

import collective_gc as cgc

CLASSES = ("hang", "double", "live", "lost", "disagree", "dupkey", "error")

# Tokens of rank-local objects (threads, COMM_SELF, the reaper) start here, so
# they never collide with the collective ones, which are made in the same
# order on every rank and so have the same token everywhere.
LOCAL_BASE = 1_000_000_000


class CheckpointTimeout(Exception):
    """A checkpoint exchange did not complete on every rank before its deadline."""


@dataclass
class Defect:
    cls: str
    episode: str
    rank: int
    text: str

    def line(self, seed: int) -> str:
        return f"seed {seed} {self.episode}: {self.cls}: rank {self.rank}: {self.text}"


class Obj:
    """A managed user object: a token, and references to make graphs with."""

    __slots__ = ("token", "refs", "__weakref__")

    def __init__(self, token: int) -> None:
        self.token = token
        self.refs: list[Any] = []


class Holders(list[Any]):
    """The harness's strong references to its objects; weakly referenceable, so
    that an action run by a destroy can reach it without keeping it alive."""

    __slots__ = ("__weakref__",)


def _destroy(ledger: Ledger, token: int, label: str) -> None:
    # Module-level, with the ledger as an argument: the registration must hold
    # nothing that holds the object (the ledger keeps weak references only).
    ledger.ran(token, label)


class Ledger:
    """One rank's record of the managed objects of one seed."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.episode = "-"
        self.defects: list[Defect] = []
        self._lock = threading.Lock()
        self._ctok = itertools.count()
        self._ltok = itertools.count(LOCAL_BASE)
        self.refs: dict[int, weakref.ref[Obj]] = {}
        self.label: dict[int, str] = {}
        self.runs: dict[int, int] = {}
        # Destroyed by an explicit reg.destroy() of the harness: may be alive.
        self.explicit: set[int] = set()
        # detach() returned True: the destroy must never run.
        self.detached: set[int] = set()
        # The destroy may rightly never run (its manager was broken on purpose,
        # its communicator freed with it pending).
        self.exempt: set[int] = set()
        # Per communicator label: tokens in destroy order, and (key, token) of
        # every registration.
        self.log: dict[str, list[int]] = {}
        self.keys: dict[str, list[tuple[int, int]]] = {}
        # Per label: what actions inside destroys did, to compare across ranks.
        self.events: dict[str, list[tuple[Any, ...]]] = {}
        # token -> what its destroy does after being counted (raise, meddle).
        self.actions: dict[int, Callable[[], None]] = {}
        # Per episode: what it exercised, to report beside the defects (the
        # agreement paths of the sparse episode), never a defect itself.
        self.notes: dict[str, Any] = {}

    # -- recording -------------------------------------------------------------

    def defect(self, cls: str, text: str) -> None:
        assert cls in CLASSES, cls
        with self._lock:
            self.defects.append(Defect(cls, self.episode, self.rank, text))

    def event(self, label: str, *what: Any) -> None:
        with self._lock:
            self.events.setdefault(label, []).append(what)

    def make(
        self, comm: MPI.Comm | None, label: str, *, local: bool = False
    ) -> tuple[Obj, cgc.Registration]:
        """Create and register one object (collective over ``comm`` unless ``local``)."""
        token = next(self._ltok if local or comm is None else self._ctok)
        obj = Obj(token)
        self.refs[token] = weakref.ref(obj)
        try:
            reg = cgc.register(
                obj, _destroy, self, token, label, comm=comm, name=f"{label}#{token}"
            )
        except BaseException:
            del self.refs[token]
            raise
        self.label[token] = label  # only now: a refused registration is nobody's loss
        with self._lock:
            self.keys.setdefault(label, []).append((reg.key, token))
        return obj, reg

    def ran(self, token: int, label: str) -> None:
        """The destroy of ``token``: count it, check liveness, then its action."""
        alive = self.refs[token]() is not None
        with self._lock:
            n = self.runs.get(token, 0) + 1
            self.runs[token] = n
            self.log.setdefault(label, []).append(token)
        if alive and token not in self.explicit:
            self.defect("live", f"the destroy of {label}#{token} ran while its object is reachable")
        if n > 1:
            self.defect("double", f"the destroy of {label}#{token} ran {n} times")
        if token in self.detached:
            self.defect(
                "double", f"the destroy of {label}#{token} ran after detach() returned True"
            )
        action = self.actions.pop(token, None)
        if action is not None:
            action()

    # -- end-of-scenario checks ------------------------------------------------------

    def tokens(self, *labels: str) -> list[int]:
        return [t for t, lab in self.label.items() if lab in labels]

    def lost_tokens(self, *labels: str) -> list[int]:
        """Objects of ``labels`` dead on this rank whose destroy never ran, unexcused."""
        return [
            t
            for t in self.tokens(*labels)
            if self.refs[t]() is None
            and t not in self.runs
            and t not in self.detached
            and t not in self.exempt
        ]

    def report_lost(self, lost: list[int], where: str = "") -> None:
        if lost:
            names = ", ".join(f"{self.label[t]}#{t}" for t in lost[:8])
            more = f" and {len(lost) - 8} more" if len(lost) > 8 else ""
            self.defect("lost", f"{len(lost)} dead object(s) never destroyed{where}: {names}{more}")

    def check_lost(self, *labels: str) -> None:
        """Rank-local objects: a ``lost`` defect for each one dead and never destroyed."""
        self.report_lost(self.lost_tokens(*labels))

    def check_keys(self, label: str) -> None:
        seen: dict[int, int] = {}
        dups = []
        for key, token in self.keys.get(label, []):
            if key in seen:
                dups.append((key, seen[key], token))
            seen[key] = token
        if dups:
            shown = ", ".join(f"key {k} for #{a} and #{b}" for k, a, b in dups[:5])
            self.defect("dupkey", f"{len(dups)} duplicate key(s) on {label}: {shown}")

    def wait_local(self, labels: tuple[str, ...], seconds: float) -> None:
        """Give the rank-local reaper time to run the destroys of dead objects."""
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            if all(
                self.refs[t]() is not None or t in self.runs or t in self.detached
                for t in self.tokens(*labels)
            ):
                return
            time.sleep(0.01)


def exchange(comm: MPI.Comm, value: Any, timeout: float, what: str) -> list[Any]:
    """Collective over ``comm``: allgather a picklable value, against a deadline.

    Raises :class:`CheckpointTimeout` if some rank does not arrive in time.
    """
    deadline = time.monotonic() + timeout
    data = np.frombuffer(pickle.dumps(value), dtype=np.uint8)
    size = comm.Get_size()
    mine = np.array([data.size], dtype=np.int64)
    sizes = np.empty(size, dtype=np.int64)
    _poll(comm.Iallgather(mine, sizes), deadline, what)
    displs = np.concatenate(([0], np.cumsum(sizes)[:-1]))
    buf = np.empty(int(sizes.sum()), dtype=np.uint8)
    _poll(comm.Iallgatherv(data, [buf, (sizes, displs), MPI.BYTE]), deadline, what)
    return [pickle.loads(buf[d : d + s].tobytes()) for d, s in zip(displs, sizes)]


def _poll(req: MPI.Request, deadline: float, what: str) -> None:
    delay = 0.0
    while not req.Test():
        if time.monotonic() > deadline:
            # The request stays posted; the job is ended by the caller.
            raise CheckpointTimeout(f"checkpoint {what!r} did not complete on every rank")
        time.sleep(delay)
        delay = min(2e-3, delay * 2 + 5e-5)
