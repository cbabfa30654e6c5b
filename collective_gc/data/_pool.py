"""Parent side of the workers: start them, talk to them, lease their slots, stop them.

One :class:`WorkerHandle` per worker process. The consumer thread
(``ProcessPrefetch.__next__``) does all the talking: it receives elements,
attaches new segments, and sends what the worker is owed (credits, the slot
allowance, freed slots) batched in one message per few elements, since every
message wakes a process and wake-ups, not bytes, cost time on a busy machine.

Leases: every array of an element views one uint8 ``base`` array over its
slot. A :class:`_Lease`, a weak reference to ``base`` kept alive by a
module-level set (as ``weakref.finalize`` keeps its finalizers, so a lease is
never part of a user's garbage cycle), pins the slot's :class:`Segment`. Its
callback, on whatever thread ``base`` dies and inside the cyclic collector
too, only records the slot as freed and lets the lease go; the consumer sends
the slot back to the worker, and the worker may only then write into it. When
the last holder of a Segment lets go, its registration on the rank-local
reaper unmaps it, on the reaper thread, exactly once.

Slot reuse does not go through the reaper: a reaper hop per element cost ~40
us of this process's CPU and a thread wake-up per element here (about a third
of the throughput); the callback alone is a list append.

Sends never block (what does not fit the socket stays owed and goes out when
there is room); the consumer's waits wake up every ``_POLL`` seconds to send
slots freed meanwhile on other threads, so a worker waiting for a slot is
never forgotten. The socket is closed under the same lock as sends.

Nothing here refers to a ProcessPrefetch, an element or an exception, so the
pool can join no reference cycle with them.
"""

from __future__ import annotations

import array
import atexit
import fcntl
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import weakref
from typing import Any, Literal

import numpy as np

from . import _protocol as P
from ._shm import Segment
from ._worker import BOOT, STRIP_PREFIXES

__all__ = ["Pool", "WorkerHandle", "child_environment", "shutdown", "track"]

Message = tuple[int, int, int, int, int, memoryview, int]
_FD_SPACE = socket.CMSG_SPACE(array.array("i").itemsize)
# Plain ints: flag arithmetic on the enum members costs microseconds per element.
_DONTWAIT = int(socket.MSG_DONTWAIT)
_TRUNCATED = int(socket.MSG_TRUNC | socket.MSG_CTRUNC)
# How often a consumer waiting for a worker wakes up to send it slots freed
# meanwhile on other threads (the only case where nobody else would).
_POLL = 0.05


def child_environment() -> dict[str, str]:
    """This process's environment without the variables that make a process an MPI rank."""
    return {k: v for k, v in os.environ.items() if not k.startswith(STRIP_PREFIXES)}


class _Lease(weakref.ref):  # type: ignore[type-arg]
    """A weak reference to an element's ``base`` that pins its slot's segment."""

    __slots__ = ("handle", "segment", "slot")
    handle: WorkerHandle
    slot: int
    segment: Segment

    # By identity: weakref.ref's own would hash and compare the (unhashable) array.
    __eq__ = object.__eq__
    __ne__ = object.__ne__
    __hash__ = object.__hash__


# The leases of live elements. Module-level, so a lease is reachable from here
# and never trash itself: its callback runs even when the element dies in a
# garbage cycle together with its loader.
_LEASES: set[_Lease] = set()


def _lease_died(lease: _Lease, _leases: set[_Lease] = _LEASES) -> None:
    # Any thread, possibly inside the cyclic collector: record only. Dropping
    # the lease unpins its segment; if that was the last holder, the segment's
    # own finalizer queues the unmap on the reaper.
    _leases.discard(lease)
    handle = lease.handle
    handle.live.discard(lease.slot)
    handle.freed.append(lease.slot)


class WorkerHandle:
    """One worker process, its socket, its slots and its leases."""

    def __init__(
        self,
        wid: int,
        proc: subprocess.Popen[bytes],
        sock: socket.socket,
        sentinel: int,
        boot: int,
        window: int,
    ) -> None:
        self.wid = wid
        self.proc = proc
        self.sock = sock
        self.sentinel = sentinel  # write end of the worker's parent-watch pipe; never written
        self.boot = boot  # write end of the boot pipe, until the boot data is sent
        self.window = window
        self.lock = threading.Lock()
        self.closed = False
        # Owed to the worker (see "sending" below). `freed` and `live` are also
        # touched by lease callbacks, on any thread: appends and discards only.
        self.owed = 0
        self.batch = max(1, window // 2)
        self.sent_allowance = window
        self.freed: list[int] = []
        self.live: set[int] = set()
        self.slots: dict[int, Segment] = {}

    @classmethod
    def spawn(cls, wid: int, window: int, pdeathsig: bool, env: dict[str, str]) -> WorkerHandle:
        """Start worker ``wid``; it waits for :meth:`send_boot`."""
        parent_sock, child_sock = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        sentinel_r, sentinel_w = os.pipe()
        boot_r, boot_w = os.pipe()
        try:
            try:
                # A big fn pickle should not make us wait for each worker's start-up.
                fcntl.fcntl(boot_w, fcntl.F_SETPIPE_SZ, 1 << 20)
            except (OSError, AttributeError):  # above the system's limit: writes just wait
                pass
            argv = [boot_r, child_sock.fileno(), sentinel_r, int(pdeathsig), os.getpid()]
            proc = subprocess.Popen(
                [sys.executable, "-c", BOOT, *map(str, argv)],
                pass_fds=(boot_r, child_sock.fileno(), sentinel_r),
                env=env,
                stdin=subprocess.DEVNULL,
            )
        except BaseException:
            parent_sock.close()
            os.close(sentinel_w)
            os.close(boot_w)
            raise
        finally:
            child_sock.close()
            os.close(sentinel_r)
            os.close(boot_r)
        return cls(wid, proc, parent_sock, sentinel_w, boot_w, window)

    def send_boot(self, prep: bytes, config: bytes) -> None:
        """Write the boot data (blocks only while the worker starts, for a big pickle)."""
        fd, self.boot = self.boot, -1
        try:
            with open(fd, "wb") as f:
                f.write(prep)
                f.write(config)
        except BrokenPipeError:  # it died starting up: recv() reports how
            pass

    def describe(self) -> str:
        return f"worker {self.wid} (pid {self.proc.pid})"

    # -- sending ----------------------------------------------------------------

    def allowance(self) -> int:
        """Slots the worker may own: ``window`` + live leases + one batch of slack.

        Only live leases count, so a consumer that keeps elements lets the ring
        grow (it never deadlocks) while a dead lease not sent back yet does
        not (the ring never grows for ever); the slack covers a batch of
        freed slots not sent yet.
        """
        return self.window + self.batch + len(self.live)

    def grant(self) -> None:
        """Owe the worker one credit; send what is owed once a batch is due."""
        self.owed += 1
        if self.owed >= self.batch:
            self.flush()

    def flush(self) -> None:
        """Send everything owed that fits; never blocks."""
        with self.lock:
            if self.closed:
                return
            while True:
                allowance = self.allowance()
                freed = self.freed[: P.MAX_RECORDS]
                if not (self.owed or freed or allowance != self.sent_allowance):
                    return
                records = [P.CTRL.pack(P.ALLOW, allowance)]
                if self.owed:
                    records.append(P.CTRL.pack(P.CREDIT, self.owed))
                records.extend(P.CTRL.pack(P.FREE, slot) for slot in freed)
                try:
                    self.sock.send(b"".join(records), _DONTWAIT)
                except BlockingIOError:
                    return  # still owed; recv() waits for room and sends it then
                except OSError:  # the worker is gone; it needs nothing more from us
                    self.owed, self.freed = 0, []
                    return
                self.owed, self.sent_allowance = 0, allowance
                del self.freed[: len(freed)]  # only those: a callback may append meanwhile

    def _owes(self) -> bool:
        return bool(self.owed or self.freed)

    # -- receiving --------------------------------------------------------------

    def recv(self, block: bool) -> Message | None | Literal[False]:
        """The worker's next message; None if it closed its end (it died).

        ``block=False``: False if no message is there yet. ``block=True``:
        waits, sending what is owed whenever there is room, and waking every
        ``_POLL`` seconds to send slots freed meanwhile by other threads.
        """
        if not block:
            try:
                return self._recv(_DONTWAIT)
            except BlockingIOError:
                return False
        while True:
            self.flush()
            owes = [self.sock] if self._owes() else []
            readable, _, _ = select.select([self.sock], owes, [], _POLL)
            if readable:
                return self._recv(0)

    def _recv(self, flags: int) -> Message | None:
        while True:
            try:
                data, ancillary, msg_flags, _ = self.sock.recvmsg(P.MAX_MESSAGE, _FD_SPACE, flags)
                break
            except ConnectionResetError:
                # A worker that exits with control records unread makes Linux
                # report ECONNRESET, once, *before* the messages it sent us,
                # which are still queued: read on (EOF comes after them).
                continue
        fd = -1
        for level, kind, payload in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds = array.array("i")
                fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
                for extra in fds[1:]:
                    os.close(extra)
                fd = fds[0] if fds else -1
        if msg_flags & _TRUNCATED or 0 < len(data) < P.HEAD.size:
            if fd >= 0:
                os.close(fd)
            raise P.WorkerError(f"{self.describe()} sent a malformed message")
        if not data:
            return None
        kind, slot, capacity, pickle_len, nbuf = P.HEAD.unpack_from(data)
        return kind, slot, capacity, pickle_len, nbuf, memoryview(data)[P.HEAD.size :], fd

    def attach(self, slot: int, fd: int, capacity: int) -> None:
        """Map a segment the worker just made for ``slot`` (replacing its old one)."""
        self.slots[slot] = Segment(fd, capacity, f"ProcessPrefetch {self.describe()} slot {slot}")

    def lease(self, slot: int, base: np.ndarray[Any, Any]) -> None:
        """Pin ``slot`` until ``base`` (which every array of the element views) dies."""
        lease = _Lease(base, _lease_died)
        lease.handle, lease.slot, lease.segment = self, slot, self.slots[slot]
        self.live.add(slot)
        _LEASES.add(lease)

    def exit_status(self) -> tuple[str, int | None]:
        """How the worker ended, for an error message: ``(text, exit code)``."""
        try:
            code = self.proc.wait(timeout=2.0)
        except subprocess.TimeoutExpired:
            return "closed its connection but is still running", None
        if code < 0:
            try:
                name = signal.Signals(-code).name
            except ValueError:
                name = f"signal {-code}"
            return f"was killed by {name} (exit code {code})", code
        return f"exited with code {code}", code

    # -- stopping ---------------------------------------------------------------

    def stop(self) -> None:
        """Tell the worker to exit now and drop our mappings. Never blocks; idempotent."""
        with self.lock:
            if self.closed:
                return
            self.closed = True
            # EOF on its watch pipe: the worker's watch thread exits the process at
            # once, even in the middle of the user's function.
            os.close(self.sentinel)
            self.sock.close()
            self.owed = 0
            # Segments no lease holds are unmapped now (on the reaper); the others
            # when their last element dies.
            self.slots.clear()
        if self.boot >= 0:
            fd, self.boot = self.boot, -1
            os.close(fd)

    def join(self, timeout: float) -> None:
        """Wait for the process (after :meth:`stop`); SIGKILL it after ``timeout``."""
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class Pool:
    """The workers of one ProcessPrefetch. Refers to no loader, element or error."""

    __slots__ = ("__weakref__", "close_timeout", "closed", "lock", "workers")

    def __init__(self, workers: list[WorkerHandle], close_timeout: float) -> None:
        self.workers = workers
        self.close_timeout = close_timeout
        self.closed = False
        self.lock = threading.Lock()


_LIVE: set[Pool] = set()


def track(pool: Pool) -> None:
    """Remember ``pool`` so that it is stopped at interpreter exit if still open."""
    _LIVE.add(pool)


def shutdown(pool: Pool) -> None:
    """Stop every worker of ``pool`` and wait for them. Idempotent, any thread."""
    with pool.lock:
        if pool.closed:
            return
        pool.closed = True
    for w in pool.workers:
        w.stop()
    for w in pool.workers:
        w.join(pool.close_timeout)
    _LIVE.discard(pool)


def _at_exit() -> None:
    # Runs before collective_gc's own exit handler (registered earlier), so the
    # segments dropped here are still unmapped by the reaper's final drain.
    for pool in list(_LIVE):
        shutdown(pool)


atexit.register(_at_exit)
# A forked child shares the parent's descriptors but not its workers: it must
# never stop (or wait for) them.
os.register_at_fork(after_in_child=_LIVE.clear)
