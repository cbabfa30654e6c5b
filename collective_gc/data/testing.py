"""The loaders' test hook: what a test may look at, and the one fault it may inject.

Tests of :mod:`collective_gc.data` (this project's, and a program's own) use
the loaders' public API and this module, never the loaders' private modules
or attributes, so that those can change without breaking a test. Everything
here reads the loaders' state as it is at the call, and changes nothing but
what :func:`socket_only` and :func:`drop_socket_message` say they change.
Documented in ``docs/loader.md`` ("Testing the loaders").
"""

from __future__ import annotations

import contextlib
import select
import subprocess
from collections.abc import Iterator
from typing import Any

from . import _leases, _loader, _pool, _process, _shm, _thread
from ._channel import Channel
from ._leases import SlotTable
from ._prefetch import ProcessPrefetch
from ._thread import ThreadPrefetch

__all__ = [
    "RELEASE_BACKLOG",
    "RING_AVAILABLE",
    "WORKER_MODULES",
    "Producer",
    "drop_socket_message",
    "internal_types",
    "last_ring_posts",
    "live_leases",
    "socket_only",
    "workers",
]

#: Dead segments allowed to wait for the rank-local reaper before the consumer
#: unmaps them itself (docs/loader.md: "more than 32 wait").
RELEASE_BACKLOG = _leases.BACKLOG

#: Whether loaders post elements through a shared-memory ring on this platform
#: (x86-64), besides the socket.
RING_AVAILABLE = _pool.RING


#: The modules of this package a worker process imports, and the only ones:
#: a worker never imports the parent's side of the loaders (pools, channels,
#: loaders, threads; ``_forked`` is what ``_shm`` finds a forked child's
#: mappings with).
WORKER_MODULES = frozenset(
    {
        "collective_gc.data._worker",
        "collective_gc.data._shm",
        "collective_gc.data._forked",
        "collective_gc.data._protocol",
    }
)


def workers(loader: ProcessPrefetch[Any]) -> list[subprocess.Popen[bytes]]:
    """The worker processes of ``loader``'s running pool, in worker order.

    Empty before the first ``next()``, in-process (``num_workers=0``), and
    after a ``set_state()`` that stopped the pool (until the next
    ``next()`` starts another). The processes of a closed loader stay
    listed: their ``returncode`` says how they ended.
    """
    pool = _loader.running_part(loader)
    return [] if pool is None else [w.process.proc for w in pool.workers]


def live_leases() -> int:
    """How many slots elements of this process's ProcessPrefetch loaders pin.

    An element pins its slot until its last array dies and the consumer (or
    a pool's shutdown) has looked at it; a loader that stopped lets go of
    the slots of elements that outlive it. After the loaders are closed and
    their elements dropped (and a ``gc.collect()`` for elements in cycles),
    it is 0.
    """
    if _leases.DEAD:
        _leases.collect_dead()
    return len(_leases.LEASES)


@contextlib.contextmanager
def socket_only() -> Iterator[None]:
    """Loaders that start their workers inside the ``with`` take the socket
    for every message, as on machines without the ring (not x86-64).

    Not thread-safe: for a test that starts loaders on one thread.
    """
    was = _pool.use_ring(False)
    try:
        yield
    finally:
        _pool.use_ring(was)


def last_ring_posts(loader: ProcessPrefetch[Any]) -> list[int]:
    """For each worker of ``loader``'s running pool, how far its ring went:
    the number of the last of its elements it posted there, plus one (0: none,
    or no ring). A worker's elements are numbered 0, 1, 2, ... in its share.
    """
    pool = _loader.running_part(loader)
    if pool is None:
        return []
    return [_last_post(w.channel) for w in pool.workers]


def _last_post(channel: Channel) -> int:
    ring = channel.ring
    if ring is None:
        return 0
    return max(channel.mark(entry) for entry in range(channel.entries))


def drop_socket_message(loader: ProcessPrefetch[Any], worker: int, timeout: float) -> bool:
    """Take the next message worker ``worker`` of ``loader`` sent by socket, and drop it.

    The fault an interrupt could once cause as a message was received (it
    is the loader's to report, never to wait for). If the loader has
    received that message already and not yet delivered its element, that
    message is dropped. False if no message came within ``timeout`` seconds.
    """
    pool = _loader.running_part(loader)
    if pool is None:
        raise ValueError(f"{loader!r} has no running workers")
    channel = pool.workers[worker].channel
    if channel.has_message():
        channel.done_with_inbox()
        return True
    watch = select.poll()  # not select, which refuses descriptors numbered 1024 and up
    watch.register(channel.sock, select.POLLIN)
    if not watch.poll(timeout * 1000):
        return False
    channel.sock.recv(1 << 16)
    return True


class Producer:
    """The producer thread of a ThreadPrefetch's running part (not the loader:
    holding it keeps no loader alive)."""

    __slots__ = ("_finished",)

    def __init__(self, loader: ThreadPrefetch[Any]) -> None:
        state = _loader.running_part(loader)
        if state is None or not state.launched:
            raise ValueError(f"{loader!r} has no producer thread")
        self._finished = state.finished  # held until the thread has returned

    @property
    def returned(self) -> bool:
        """Whether the thread has returned."""
        return not self._finished.locked()

    def wait(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for the thread to return; whether it did."""
        if self._finished.acquire(timeout=timeout):
            self._finished.release()
            return True
        return False


def internal_types() -> tuple[type, ...]:
    """The classes of the loaders' own objects: none of them may ever be
    cyclic garbage (``gc.garbage`` under ``gc.DEBUG_SAVEALL``)."""
    return (
        ProcessPrefetch,
        ThreadPrefetch,
        _loader.Holder,
        _pool.Pool,
        _pool.WorkerHandle,
        _process.WorkerProcess,
        Channel,
        SlotTable,
        _shm.Segment,
        _thread.State,
    )
