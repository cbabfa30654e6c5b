"""Rank-local deferred destroys: ``register(obj, destroy)`` with no communicator.

Public: :func:`register`, :func:`flush`, :func:`live` (``register`` is also
reached as ``collective_gc.register(..., comm=None)``). The per-rank data
loader (:mod:`collective_gc.data`) releases its shared-memory segments and
worker pools through it.

Rank-local resources (shared-memory segments, plain files) need no agreement,
but their release should neither run inside a finalizer (which may be the
cyclic collector, at an arbitrary point of the consumer's code) nor block the
thread that dropped them (munmap of a large segment is not free). So their
finalizer puts the registration on a ``queue.SimpleQueue`` (whose ``put`` is
safe to call re-entrantly from a finalizer), and one daemon thread runs the
destroys in the order the objects died, each exactly once.

The thread starts with the first rank-local registration. At exit it is
drained (see :func:`shutdown`); in a forked child it does not exist, and the
parent's registrations are detached, never run, their calls kept for the
child's life (see :func:`after_fork`).
"""

from __future__ import annotations

import itertools
import queue
import sys
import threading
import traceback
import weakref
from collections.abc import Callable
from typing import Any

from ._registration import (
    DESTROYED,
    DETACHED,
    Ledger,
    Registration,
    check_destroy,
    check_name,
    make_registration,
)

__all__ = ["register", "flush", "live"]


class _Reaper:
    def __init__(self) -> None:
        self.queue: queue.SimpleQueue[Registration | threading.Event | None] = queue.SimpleQueue()
        self.ledger = Ledger()
        # What registrations hold: the reaper holds them (in its ledger).
        self.proxy = weakref.proxy(self)
        self.lock = threading.Lock()
        self.keys = itertools.count()
        self.thread: threading.Thread | None = None
        self.closed = False
        self.destroyed = 0
        self.errors = 0

    # -- what a Registration asks of its owner ---------------------------------

    def describe(self) -> str:
        return "the rank-local reaper"

    def destroy_registration(self, reg: Registration) -> None:
        call = self.ledger.claim(reg, DESTROYED)
        if call is not None:
            fn, args = call
            del call
            fn(*args)
            self.destroyed += 1

    def detach_registration(self, reg: Registration) -> bool:
        return self.ledger.claim(reg, DETACHED) is not None

    # -- the thread ----------------------------------------------------------

    def register(
        self,
        obj: object,
        destroy: Callable[..., object],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        name: str | None,
        released_in_child: bool = False,
    ) -> Registration:
        check_name(name)
        check_destroy(obj, destroy, args, kwargs)
        reg = make_registration(
            obj, self.proxy, self.queue.put, next(self.keys), destroy, args, kwargs, name
        )
        if released_in_child:
            self.ledger.released.add(reg.key)
        self.ledger.live[reg.key] = reg
        if self.thread is None:
            self._start()
        return reg

    def _start(self) -> None:
        with self.lock:
            if self.thread is None and not self.closed:
                self.thread = threading.Thread(
                    target=self._run, name="collective_gc-reaper", daemon=True
                )
                self.thread.start()

    def _run(self) -> None:
        get = self.queue.get
        while True:
            item = get()
            if item is None:
                return
            if isinstance(item, threading.Event):
                item.set()
                continue
            self._reap(item)
            del item  # drop it now, not when the next one arrives

    def _reap(self, reg: Registration) -> None:
        call = self.ledger.claim(reg, DESTROYED)
        if call is None:
            return
        fn, args = call
        del call
        try:
            fn(*args)
        except BaseException as exc:  # reported, never propagated into the thread's death
            self.errors += 1
            _report(reg, exc)
        else:
            self.destroyed += 1

    def flush(self, timeout: float | None) -> bool:
        if self.thread is None or not self.thread.is_alive():
            self._drain_inline()
            return True
        done = threading.Event()
        self.queue.put(done)
        return done.wait(timeout)

    def _drain_inline(self) -> None:
        while True:
            try:
                item = self.queue.get_nowait()
            except queue.Empty:
                return
            if isinstance(item, Registration):
                self._reap(item)
            elif isinstance(item, threading.Event):
                item.set()

    def shutdown(self, timeout: float) -> None:
        with self.lock:
            self.closed = True
        if self.thread is not None and self.thread.is_alive():
            self.queue.put(None)
            self.thread.join(timeout)
            if self.thread.is_alive():
                # A destroy blocks; leave it: the thread is a daemon.
                sys.stderr.write(
                    "collective_gc: the rank-local reaper is still busy at exit; "
                    "remaining rank-local destroys are skipped\n"
                )
                return
        self._drain_inline()


def _report(reg: Registration, exc: BaseException) -> None:
    try:
        sys.stderr.write(
            f"collective_gc: rank-local destroy of key {reg.key} ({reg.name!r}) raised:\n"
            + "".join(traceback.format_exception(exc))
        )
    except Exception:  # stderr gone at shutdown: nothing left to report to
        return


_REAPER = _Reaper()


def register(
    obj: object, destroy: Callable[..., object], *args: Any, name: str | None = None, **kwargs: Any
) -> Registration:
    """Rank-local: when ``obj`` dies, run ``destroy(*args, **kwargs)`` on a background thread.

    Exactly once, soon after ``obj`` dies (by refcounting or in the cyclic
    collector, on any thread), in the order objects die; never inside the
    finalizer itself, and with no agreement between ranks. For resources that
    are safe to release from another thread (shared-memory segments, files).
    The same checks as :func:`collective_gc.register` (no strong reference to
    ``obj`` in the destroy). A destroy that raises is reported on stderr.
    """
    return _REAPER.register(obj, destroy, args, kwargs, name)


def register_released_in_child(
    obj: object, destroy: Callable[..., object], *args: Any, name: str | None = None
) -> Registration:
    """:func:`register`, for a resource a forked child must let go of.

    A forked child keeps every rank-local registration's call, never run and
    never let go of (see :func:`after_fork`), save this one's, which it lets
    go of, without running it: for a resource of which the child's copy is
    its own, to be released there (the per-rank loader's shared-memory
    mappings: collective_gc.data's ``_shm``).
    """
    return _REAPER.register(obj, destroy, args, {}, name, released_in_child=True)


def flush(timeout: float | None = None) -> bool:
    """Wait until every rank-local destroy queued so far has run.

    Returns False if ``timeout`` seconds passed first.
    """
    return _REAPER.flush(timeout)


def live() -> dict[int, Registration]:
    """The rank-local registrations whose destroy has not run, by key (a copy)."""
    return dict(_REAPER.ledger.live)


def shutdown(timeout: float = 5.0) -> None:
    """Run the queued rank-local destroys and stop the thread (at exit)."""
    _REAPER.shutdown(timeout)


def after_fork() -> list[tuple[Callable[..., object], tuple[Any, ...]]]:
    """In a forked child: forget the parent's registrations, never run them.
    Returns their calls, which the child keeps (see collective_gc._exit),
    save those of :func:`register_released_in_child`, let go of here."""
    global _REAPER
    calls = _REAPER.ledger.after_fork()
    _REAPER = _Reaper()
    return calls
