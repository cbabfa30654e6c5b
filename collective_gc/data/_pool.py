"""Parent side of the workers: start them and stop them; one handle per worker.

A :class:`WorkerHandle` is one worker process and all the parent keeps of
it, in three parts, each in a file of its own:

* the worker process (``_process``): spawning it, its boot data, its pidfd,
  stopping it and waiting for it, with deadlines kept across calls;
* the channel (``_channel``): its socket, inbox, ring and doorbells,
  receiving, waiting, and sending what the worker is owed;
* the leases (``_leases``): its slots, the segments mapped for them, the
  leases elements hold on them, and the bounded release of dead segments.

This module starts workers (on the spawner thread, below), groups the
handles of one loader in a :class:`Pool`, stops pools (:func:`shutdown`,
and at exit), and makes them inert in a forked child.

Workers are started from one thread that lives as long as the process, so
``PR_SET_PDEATHSIG`` means the parent's death whichever thread made the
loader.

Nothing here refers to a ProcessPrefetch, an element or an exception, so the
pool can join no reference cycle with them.
"""

from __future__ import annotations

import _thread
import atexit
import errno
import os
import platform
import queue
import resource
import threading
from collections.abc import Callable

from . import _leases, _process, _shm
from ._channel import Channel
from ._leases import SlotTable
from ._process import WorkerProcess
from ._worker import STRIP_PREFIXES

__all__ = [
    "RING",
    "Launch",
    "Pool",
    "WorkerHandle",
    "child_environment",
    "shutdown",
    "submit",
    "track",
]

# The ring's reads without a system call rely on stores becoming visible in
# program order (the mark after the message): x86's memory model. Elsewhere
# every message takes the socket. Read when a pool starts its workers.
RING = platform.machine().lower() in ("x86_64", "amd64")


def child_environment() -> dict[str, str]:
    """This process's environment without the variables that make a process an MPI rank."""
    return {k: v for k, v in os.environ.items() if not k.startswith(STRIP_PREFIXES)}


class WorkerHandle(WorkerProcess, Channel, SlotTable):
    """One worker process, its channel, its slots and their leases."""

    def __init__(self, wid: int, spawned: _process.Spawned, window: int) -> None:
        self.window = window
        self.lock = threading.Lock()
        self.closed = False
        self.init_process(wid, spawned.proc, spawned.sentinel, spawned.boot)
        self.init_channel(spawned.sock, window, spawned.ring, spawned.bell, spawned.wake)
        self.init_slots()

    @classmethod
    def spawn(
        cls, wid: int, window: int, pdeathsig: bool, env: dict[str, str], ring: bool = False
    ) -> WorkerHandle:
        """Start worker ``wid``; it waits for :meth:`send_boot`."""
        return cls(wid, _process.spawn(wid, window, pdeathsig, env, ring), window)


# -- the spawner thread ---------------------------------------------------------------


class _Spawner:
    """One daemon thread that starts every worker of this process.

    ``PR_SET_PDEATHSIG`` fires when the *thread* that started a process exits;
    this one lives as long as the process, so for workers started here the
    signal means the parent's death, whichever thread made the loader.
    """

    def __init__(self) -> None:
        self.requests: queue.SimpleQueue[Launch] = queue.SimpleQueue()
        self.launched = False

    def _run(self) -> None:
        while True:
            self.requests.get().run()

    def submit(self, launch: Launch) -> None:
        self.requests.put(launch)
        if not self.launched:
            # A store, then one C call: no interrupt can fall between them, so
            # the thread exists exactly when `launched` says so.
            self.launched = True
            _thread.start_new_thread(self._run, ())


_SPAWNER = [_Spawner()]


class Launch:
    """Starting the workers of one pool, on the spawner thread.

    All of the start-up's work runs there, the boot data too (``prepare``:
    it imports ``multiprocessing`` and pickles ``fn`` and each worker's
    share), where no signal handler runs: an interrupt every few hundred
    microseconds in the loader's thread cannot cut it short. The loader keeps
    the Launch until ``done`` is set, so a ``next()`` interrupted while it
    submits or waits resumes the same start-up instead of beginning another;
    a Launch submitted twice (an interrupt after the submit) runs once.
    """

    def __init__(
        self, pool: Pool, count: int, window: int, prepare: Callable[[], list[bytes]]
    ) -> None:
        self.pool, self.count, self.window, self.prepare = pool, count, window, prepare
        self.ring = RING
        self.done = threading.Event()
        self.error: BaseException | None = None
        self.started = False  # on the spawner thread: run() began
        self.submitted = False  # by the loader, once submit() returned

    def run(self) -> None:
        if self.started:
            return
        self.started = True
        pool = self.pool
        doing = "preparing the workers' boot data"
        try:
            boots = self.prepare()
            env = child_environment()
            for w in range(self.count):
                doing = f"starting worker {w} of {self.count}"
                handle = WorkerHandle.spawn(w, self.window, True, env, self.ring)
                with pool.lock:
                    if not pool.closed:
                        pool.workers.append(handle)
                        continue
                # The loader gave up on this pool: never leave a worker behind.
                handle.stop()
                handle.join(pool.close_timeout)
                return
            doing = "sending the workers their boot data"
            for handle, boot in zip(pool.workers, boots):
                handle.send_boot(boot)
        except BaseException as exc:  # noqa: BLE001 (handed to the loader)
            if pool.workers or isinstance(exc, OSError):
                exc.add_note(_start_failure(doing, exc))
            self.error = exc
        finally:
            boots = []
            self.prepare = _NO_BOOTS  # let go of fn and the indices now
            self.done.set()


def _no_boots() -> list[bytes]:
    return []


_NO_BOOTS = _no_boots


def _start_failure(doing: str, exc: BaseException) -> str:
    """What the note on a failed start-up says: where it failed, and for a
    descriptor shortage, how many this process has and may have."""
    note = (
        f"collective_gc.data: a ProcessPrefetch failed {doing}; every worker it had "
        "started is stopped, and none of them reports anything"
    )
    if isinstance(exc, OSError) and exc.errno in (errno.EMFILE, errno.ENFILE):
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        try:
            used = str(len(os.listdir("/proc/self/fd")))
        except OSError:  # listing needs a descriptor too
            used = "about as many"
        note += (
            f". This process has {used} descriptors open, of a limit of {soft} "
            "(RLIMIT_NOFILE, `ulimit -n`); each worker needs about 6, and a few more "
            "while it starts"
        )
    return note


def submit(launch: Launch) -> None:
    """Start the workers of ``launch`` into its pool on the spawner thread (wait on ``done``).

    Repeating it is harmless (for a call an interrupt cut short).
    """
    track(launch.pool)
    _SPAWNER[0].submit(launch)


class Pool:
    """The workers of one ProcessPrefetch. Refers to no loader, element or error."""

    __slots__ = ("__weakref__", "close_timeout", "closed", "forked", "lock", "owner", "workers")

    def __init__(self, workers: list[WorkerHandle], close_timeout: float) -> None:
        self.workers = workers
        self.close_timeout = close_timeout
        self.closed = False
        # True in a process forked from the owner: there the pool is inert
        # (see _after_fork_in_child), closed for good, and touches nothing.
        self.forked = False
        self.owner = os.getpid()
        self.lock = threading.Lock()


_LIVE: set[Pool] = set()


def track(pool: Pool) -> None:
    """Remember ``pool`` so that it is stopped at interpreter exit if still open."""
    _LIVE.add(pool)


def shutdown(pool: Pool) -> None:
    """Stop every worker of ``pool`` and wait for them. Any thread.

    Idempotent and resumable (an interrupt may cut it short; the next call
    finishes it): every step is repeated at no cost once done. In a process
    forked from the pool's owner it does nothing: the workers, their sockets
    and rings are the owner's, and its loader goes on using them.
    """
    if pool.forked:
        return
    with pool.lock:
        pool.closed = True
    for w in pool.workers:
        w.stop()
    for w in pool.workers:
        w.join(pool.close_timeout)
    _LIVE.discard(pool)
    if _leases.DEAD:
        _leases.collect_dead()
    _leases.release_backlog()


def _at_exit() -> None:
    # Runs before collective_gc's own exit handler (registered earlier), so the
    # segments dropped here are still unmapped by the reaper's final drain.
    for pool in list(_LIVE):
        shutdown(pool)


def _after_fork_in_child() -> None:
    # A forked child shares the parent's descriptors but not its workers: it
    # must never stop (or wait for) them, nor write to their rings; nor has it
    # the spawner thread. Only this thread exists here, so nothing else reads
    # the handles while they are taken apart, and no lock is taken (another
    # thread may have held one at the fork: it stays held here for ever).
    for pool in list(_LIVE):
        pool.forked = pool.closed = True
        pool.lock = threading.Lock()
        for handle in pool.workers:
            handle.forget_in_child()
    _LIVE.clear()
    _leases.forget_in_child()
    _shm.detach_in_child()  # after the handles let go of their views
    _SPAWNER[0] = _Spawner()


atexit.register(_at_exit)
os.register_at_fork(after_in_child=_after_fork_in_child)
