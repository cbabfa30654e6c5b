"""The parent side of the workers: one handle per worker, a pool per loader, starting and stopping.

A :class:`WorkerHandle` is one worker and all the parent keeps of it, in
three parts, each in a file of its own and owning its state:

* ``handle.process`` (``_process``): spawning the worker, its boot data and
  parent-watch pipe, stopping it and waiting for it;
* ``handle.slots`` (``_leases``): its slots, the segments mapped for them,
  the leases elements hold on them;
* ``handle.channel`` (``_channel``): its socket, inbox, ring and doorbells,
  receiving, waiting, and sending what the worker is owed; it maps new
  segments into the slot table and sends back the slots it frees.

A :class:`Pool` is the handles of one loader's running part and their
start-up, which runs on the spawner thread (below); :func:`shutdown` stops a
pool, at the loader's request or at exit, and a fork handler makes pools
inert in a forked child (NOTE [ Loader shutdown and interrupts ] in
``_loader``).

Nothing here refers to a ProcessPrefetch, an element or an exception (but a
start-up's error, until its loader takes it), so a pool joins no reference
cycle with them.
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
    "Pool",
    "WorkerHandle",
    "child_environment",
    "shutdown",
    "submit",
    "use_ring",
]

# The ring's reads without a system call rely on stores becoming visible in
# program order (the mark after the message): x86's memory model. Elsewhere
# every message takes the socket.
RING = platform.machine().lower() in ("x86_64", "amd64")
_USE_RING = [RING]  # read when a pool is made (see use_ring)


def use_ring(on: bool) -> bool:
    """Whether pools made from now on use the ring, where this machine has one.

    Returns the previous setting. For the test hook (``testing.socket_only``):
    the socket alone is what other machines use.
    """
    previous = _USE_RING[0]
    _USE_RING[0] = on and RING
    return previous


def child_environment() -> dict[str, str]:
    """This process's environment without the variables that make a process an MPI rank."""
    return {k: v for k, v in os.environ.items() if not k.startswith(STRIP_PREFIXES)}


class WorkerHandle:
    """One worker: its process, its slots and its channel (see the module's docs)."""

    __slots__ = ("channel", "process", "slots")

    def __init__(self, wid: int, spawned: _process.Spawned, window: int) -> None:
        self.process = WorkerProcess(wid, spawned.proc, spawned.sentinel, spawned.boot)
        self.slots = SlotTable()
        self.channel = Channel(
            spawned.sock,
            window,
            spawned.ring,
            spawned.bell,
            spawned.wake,
            spawned.proc,
            self.slots,
            self.process.name,
        )

    @classmethod
    def spawn(
        cls, wid: int, window: int, pdeathsig: bool, env: dict[str, str], ring: bool = False
    ) -> WorkerHandle:
        """Start worker ``wid``; it waits for its boot data (``process.send_boot``)."""
        return cls(wid, _process.spawn(wid, window, pdeathsig, env, ring), window)

    @property
    def closed(self) -> bool:
        """Stopped (or inert in a forked child): its channel talks no more."""
        return self.channel.closed

    def stop(self) -> None:
        """Tell the worker to exit now and let go of its slots. Never blocks; any thread.

        Idempotent and resumable (each part's step checks whether it was
        done). Does nothing in a forked child (see :meth:`forget_in_child`).
        """
        if self.process.forked:
            return
        self.process.stop()
        self.channel.shut()
        self.slots.close()

    def join(self, timeout: float) -> None:
        """Wait for the worker (after :meth:`stop`); SIGKILL it after ``timeout``."""
        self.process.join(timeout)

    def forget_in_child(self) -> None:
        """In a process forked from the owner: close our copies, unmap what nothing views."""
        self.process.forget_in_child()
        self.channel.forget_in_child()
        self.slots.forget_in_child()


# -- the spawner thread ---------------------------------------------------------------


class _Spawner:
    """One daemon thread that starts every worker of this process.

    ``PR_SET_PDEATHSIG`` fires when the *thread* that started a process exits;
    this one lives as long as the process, so for workers started here the
    signal means the parent's death, whichever thread made the loader.
    """

    def __init__(self) -> None:
        self.requests: queue.SimpleQueue[Pool] = queue.SimpleQueue()
        self.launched = False

    def _run(self) -> None:
        while True:
            self.requests.get().start()

    def submit(self, pool: Pool) -> None:
        self.requests.put(pool)
        if not self.launched:
            # A store, then one C call (rule 2 of the NOTE in _loader): the
            # thread exists exactly when `launched` says so.
            self.launched = True
            _thread.start_new_thread(self._run, ())


_SPAWNER = [_Spawner()]


class Pool:
    """The workers of one ProcessPrefetch's running part, from their start-up to their end.

    The start-up (:meth:`start`) runs on the spawner thread, all of it, the
    boot data too (``prepare``: it imports ``multiprocessing`` and pickles
    ``fn`` and each worker's share), where no signal handler runs (NOTE
    [ Loader shutdown and interrupts ] in ``_loader``, rule 6). The loader
    keeps the pool from before it is submitted, so a ``next()`` interrupted
    while it submits or waits resumes the same start-up instead of beginning
    another; a pool submitted twice (an interrupt after the submit) starts
    once. Refers to no loader or element.
    """

    __slots__ = (
        "__weakref__",
        "close_timeout",
        "closed",
        "count",
        "done",
        "error",
        "forked",
        "lock",
        "owner",
        "prepare",
        "ready",
        "ring",
        "started",
        "submitted",
        "window",
        "workers",
    )

    def __init__(
        self, count: int, window: int, prepare: Callable[[], list[bytes]], close_timeout: float
    ) -> None:
        self.workers: list[WorkerHandle] = []
        self.count, self.window, self.prepare = count, window, prepare
        self.close_timeout = close_timeout
        self.ring = _USE_RING[0]
        self.closed = False
        # True in a process forked from the owner: there the pool is inert
        # (see _after_fork_in_child), closed for good, and touches nothing.
        self.forked = False
        self.owner = os.getpid()
        self.lock = threading.Lock()
        self.done = threading.Event()  # start() has returned, well or not
        self.error: BaseException | None = None  # why it failed, until the loader takes it
        self.started = False  # on the spawner thread: start() began
        self.submitted = False  # by the loader, once submit() returned
        self.ready = False  # by the loader: started without an error, in use

    def start(self) -> None:
        """Spawn the workers and send them their boot data (the spawner thread)."""
        if self.started:
            return
        self.started = True
        doing = "preparing the workers' boot data"
        try:
            boots = self.prepare()
            env = child_environment()
            for w in range(self.count):
                doing = f"starting worker {w} of {self.count}"
                handle = WorkerHandle.spawn(w, self.window, True, env, self.ring)
                with self.lock:
                    if not self.closed:
                        self.workers.append(handle)
                        continue
                # The loader gave up on this pool: never leave a worker behind.
                handle.stop()
                handle.join(self.close_timeout)
                return
            doing = "sending the workers their boot data"
            for handle, boot in zip(self.workers, boots):
                handle.process.send_boot(boot)
        except BaseException as exc:  # noqa: BLE001 (handed to the loader)
            if self.workers or isinstance(exc, OSError):
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


def submit(pool: Pool) -> None:
    """Start the workers of ``pool`` on the spawner thread (wait on its ``done``).

    Repeating it is harmless (for a call an interrupt cut short). From now
    on the pool is stopped at interpreter exit if it is still open.
    """
    _LIVE.add(pool)
    _SPAWNER[0].submit(pool)


# The pools submitted and not yet shut down: stopped at exit, made inert in a forked child.
_LIVE: set[Pool] = set()


def shutdown(pool: Pool, timeout: float | None = None) -> None:
    """Stop every worker of ``pool`` and wait for them (each ``close_timeout`` at most,
    then SIGKILL; ``timeout`` is not used: a Holder's stopper). Any thread.

    Idempotent and resumable (NOTE [ Loader shutdown and interrupts ] in
    ``_loader``, rule 3). In a process forked from the pool's owner it does
    nothing: the workers, their sockets and rings are the owner's, and its
    loader goes on using them.
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
    # NOTE [ Loader shutdown and interrupts ] in _loader, "What a forked child
    # sees": the parent's pools are inert here, and nothing of them is kept.
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
