"""Parent side of the workers: start them, talk to them, lease their slots, stop them.

One :class:`WorkerHandle` per worker process. The consumer thread
(``ProcessPrefetch.__next__``) does all the talking: it receives elements,
attaches new segments, and sends what the worker is owed (the count of its
elements consumed, the slot allowance, freed slots) batched in one message
per few elements, since every message wakes a process and wake-ups, not
bytes, cost time on a busy machine.

Receiving survives an interrupt: a message is received into the handle's own
``inbox`` (a buffer that outlives the call), and the inbox counts as full
until the consumer has delivered the element, so an interrupt anywhere in
between leaves the message there for the next call. The receive itself
writes the message and its descriptor into memory of the handle (libc's
``recvmsg``, see below), so even an interrupt raised as that call returns
loses neither; the element numbers in the messages would show a loss, and
the loader would then fail loudly.

Leases: every array of an element views one ``base`` array over its slot. A
:class:`_Lease`, a weak reference to ``base`` kept alive by a module-level
set (as ``weakref.finalize`` keeps its finalizers, so a lease is never part
of a user's garbage cycle), pins the slot's :class:`Segment`. Its callback,
on whatever thread ``base`` dies and inside the cyclic collector too, is a
C-level list append (no Python code runs, so no interrupt can strike there);
the consumer looks at the dead leases when it next talks to a worker
(:func:`collect_dead`) and sends their slots back, and the worker may only
then write into them. A lease of an element that was built but never
delivered (an interrupt struck first) frees nothing: the element is rebuilt
from the same slot by the next call. When a loader closes, its leases are let
go: an element that outlives the loader releases its memory with its last
array.

Workers are started from one thread that lives as long as the process, so
``PR_SET_PDEATHSIG`` means the parent's death whichever thread made the
loader. Each worker leads its own process group (whatever its function
starts is killed with it), and the parent watches the worker process itself
(a pidfd), not only the socket: a child the function forked may hold the
socket open after the worker died.

On x86-64 a worker posts most messages into a shared-memory ring instead of
the socket (see ``_protocol``): the consumer takes an element there with no
system call, and sleeps on the worker's doorbell (an ``eventfd``, with the
socket and the pidfd) only when the element it needs is not posted yet.

Sends never block (what does not fit the socket stays owed and goes out when
there is room); the consumer's waits wake up every ``_POLL`` seconds to send
slots freed meanwhile on other threads, so a worker waiting for a slot is
never forgotten. :meth:`WorkerHandle.stop` may come from any thread: it shuts
the socket down (which wakes a consumer waiting on it) and the descriptors
are closed by whichever of the two comes last, never under a waiting call.

Segment release is bounded: when the rank-local reaper falls behind (a slow
or blocked destroy ahead of ours), the consumer unmaps dead segments itself
once more than ``_BACKLOG`` wait (:func:`release_backlog`).

Nothing here refers to a ProcessPrefetch, an element or an exception, so the
pool can join no reference cycle with them.
"""

from __future__ import annotations

import _thread
import atexit
import collections
import ctypes
import errno
import fcntl
import mmap
import os
import platform
import queue
import resource
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np

from .. import Registration
from . import _protocol as P
from . import _shm
from ._shm import Segment
from ._worker import BOOT, STRIP_PREFIXES

__all__ = [
    "END",
    "EMPTY",
    "Pool",
    "WorkerHandle",
    "child_environment",
    "collect_dead",
    "release_backlog",
    "shutdown",
    "submit",
    "track",
]

# -- receiving into memory that outlives the call -------------------------------------
#
# socket.recvmsg_into returns the descriptors that came with a message in a
# new list: an interrupt raised as the call returns (CPython runs signal
# handlers right after a C call) dropped that list, so the slot's memfd was
# lost (its element could not be built) and leaked. libc's recvmsg, called
# through ctypes, writes the message *and* its control data into buffers the
# handle owns; whatever strikes after the call, both are still there for the
# next call to take.


class _Iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


class _Msghdr(ctypes.Structure):
    _fields_ = [
        ("name", ctypes.c_void_p),
        ("namelen", ctypes.c_uint32),
        ("iov", ctypes.POINTER(_Iovec)),
        ("iovlen", ctypes.c_size_t),
        ("control", ctypes.c_void_p),
        ("controllen", ctypes.c_size_t),
        ("flags", ctypes.c_int),
    ]


_MAX_FDS = 4  # a worker sends one; room for a few more, closed at once


class _Cmsg(ctypes.Structure):
    # struct cmsghdr then its data, at CMSG_LEN(0) on Linux (checked below).
    _fields_ = [
        ("len", ctypes.c_size_t),
        ("level", ctypes.c_int),
        ("type", ctypes.c_int),
        ("fds", ctypes.c_int * _MAX_FDS),
    ]


_CMSG_HEAD = socket.CMSG_LEN(0)
_CMSG_ROOM = socket.CMSG_SPACE(_MAX_FDS * ctypes.sizeof(ctypes.c_int))
if _Cmsg.fds.offset != _CMSG_HEAD or ctypes.sizeof(_Cmsg) < _CMSG_ROOM:
    raise ImportError("collective_gc.data: unexpected struct cmsghdr layout")
_LIBC = ctypes.CDLL(None, use_errno=True)
_RECVMSG = _LIBC.recvmsg
_RECVMSG.argtypes = [ctypes.c_int, ctypes.POINTER(_Msghdr), ctypes.c_int]
_RECVMSG.restype = ctypes.c_ssize_t
_SCM_RIGHTS = int(socket.SCM_RIGHTS)
_SOL_SOCKET = int(socket.SOL_SOCKET)
# Plain ints: flag arithmetic on the enum members costs microseconds per element.
_DONTWAIT = int(socket.MSG_DONTWAIT)
_TRUNCATED = int(socket.MSG_TRUNC | socket.MSG_CTRUNC)
# How often a consumer waiting for a worker wakes up to send it slots freed
# meanwhile on other threads (the only case where nobody else would).
_POLL = 0.05
# Dead segments allowed to wait for the reaper before the consumer unmaps them itself.
_BACKLOG = 32
# The ring's reads without a system call rely on stores becoming visible in
# program order (the mark after the message): x86's memory model. Elsewhere
# every message takes the socket. Read when a pool starts its workers.
RING = platform.machine().lower() in ("x86_64", "amd64")
EMPTY = bytes(4)  # written over an inbox's kind: the inbox is empty
_ONE = (1).to_bytes(8, sys.byteorder)  # one count on an eventfd
END = 256  # the inbox's kind once the worker's end is seen (no message has it)


def child_environment() -> dict[str, str]:
    """This process's environment without the variables that make a process an MPI rank."""
    return {k: v for k, v in os.environ.items() if not k.startswith(STRIP_PREFIXES)}


class _Lease(weakref.ref):  # type: ignore[type-arg]
    """A weak reference to an element's ``base`` that pins its slot's segment."""

    __slots__ = ("delivered", "handle", "segment", "seq", "slot")
    handle: WorkerHandle
    slot: int
    seq: int
    segment: Segment
    delivered: bool

    # By identity: weakref.ref's own would hash and compare the (unhashable) array.
    __eq__ = object.__eq__
    __ne__ = object.__ne__
    __hash__ = object.__hash__


# The leases of live elements. Module-level, so a lease is reachable from here
# and never trash itself: its callback runs even when the element dies in a
# garbage cycle together with its loader.
_LEASES: set[_Lease] = set()
# Leases whose element died, not yet looked at. The callback of every lease is
# this list's C-level append: no Python frame runs when an element dies, so
# no interrupt (KeyboardInterrupt) can strike, and be swallowed, there.
_DEAD: list[_Lease] = []


def collect_dead() -> None:
    """Hand the slots of dead elements back to their handles (consumer thread)."""
    dead, leases = _DEAD, _LEASES
    while dead:
        # Taken with bytecodes that call nothing, then recorded before it is let go.
        lease = dead[-1]
        del dead[-1]
        if lease.delivered:
            handle = lease.handle
            # The slot first: an interrupt after that call (the only place one
            # can strike here) must not lose it, or the worker's ring shrinks
            # for good and it may end up waiting for ever.
            if not handle.closed:
                handle.freed.append((lease.slot, lease.seq))
            handle.live.discard(lease.slot)
        # Unpins the segment; if that was its last holder, the segment's own
        # finalizer queues the unmap on the reaper.
        leases.discard(lease)


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
        ring: mmap.mmap | None = None,
        bell: int = -1,
        wake: int = -1,
    ) -> None:
        self.wid = wid
        self.proc = proc
        self.sock = sock
        self.sentinel = sentinel  # write end of the worker's parent-watch pipe; never written
        self.boot = boot  # write end of the boot pipe, until the boot data is sent
        try:
            self.pidfd = os.pidfd_open(proc.pid)  # readable once the worker has exited
        except (AttributeError, OSError):  # no pidfd here: poll the process every _POLL
            self.pidfd = -1
        self.window = window
        self.lock = threading.Lock()
        self.closed = False
        self.forked = False  # this process was forked from the owner (see forget_in_child)
        # When join gives up waiting, then waiting after the SIGKILL: kept
        # across calls (see join).
        self.join_at: float | None = None
        self.kill_at: float | None = None
        self.busy = False  # the consumer is inside a socket call: it closes the descriptors
        self.fds_closed = False
        # The message being delivered: received, its element not yet handed out.
        self.inbox = bytearray(P.MAX_MESSAGE)
        self.inview = memoryview(self.inbox)
        self.inbox_fd = -1  # a descriptor that came with it, not yet mapped
        # Where recvmsg writes (see "receiving into memory that outlives the call").
        self.cmsg = _Cmsg()
        self.inbox_c = ctypes.c_char.from_buffer(self.inbox)  # pins its address
        self.iov = _Iovec(ctypes.addressof(self.inbox_c), P.MAX_MESSAGE)
        self.msg = _Msghdr(None, 0, ctypes.pointer(self.iov), 1, ctypes.addressof(self.cmsg))
        self.msg_ref = ctypes.byref(self.msg)
        self.sockfd = sock.fileno()  # used only between _enter() and _leave(): still open
        # The worker's ring (None: every message by socket) and its doorbell.
        # stop() drops the view; the mapping goes with the last reference, so a
        # reader holding it in a local never sees it unmapped.
        self.ring: memoryview | None = None
        self.shared = ring is not None  # the ring's mode, for good (ring is dropped at stop)
        self.entries, self.control = 1, 0
        self.bell, self.wake = bell, wake
        self.put = 0  # FREE records written into the ring's control area
        if ring is not None:
            self.ring = memoryview(ring)
            self.entries, self.control = P.ring_control(len(ring))
        self.attached = -1  # the element whose new segment was mapped last
        # Owed to the worker (see "sending" below). `freed` and `live` are also
        # touched by lease callbacks, on any thread: appends and discards only.
        self.consumed = 0
        self.sent_consumed = 0
        self.batch = max(1, window // 2)
        self.sent_allowance = window
        self.freed: list[tuple[int, int]] = []
        self.live: set[int] = set()
        self.slots: dict[int, Segment] = {}

    @classmethod
    def spawn(
        cls, wid: int, window: int, pdeathsig: bool, env: dict[str, str], ring: bool = False
    ) -> WorkerHandle:
        """Start worker ``wid``; it waits for :meth:`send_boot`."""
        parent_sock, child_sock = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        sentinel_r, sentinel_w = os.pipe()
        boot_r, boot_w = os.pipe()
        ring_map: mmap.mmap | None = None
        ring_fd = bell = wake = -1
        try:
            if ring:
                ring_fd, ring_map = _shm.create(P.ring_bytes(window), f"collective_gc-ring-w{wid}")
                _, control = P.ring_control(len(ring_map))
                P.WORD.pack_into(ring_map, control + P.ALLOWANCE_AT, window)
                # The worker rings `bell` for us (non-blocking: the consumer drains
                # it before it sleeps); we ring `wake`, where it sleeps.
                bell = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)
                wake = os.eventfd(0, os.EFD_CLOEXEC)
        except BaseException:
            for fd in (ring_fd, bell, wake, sentinel_r, sentinel_w, boot_r, boot_w):
                if fd >= 0:
                    os.close(fd)
            parent_sock.close()
            child_sock.close()
            raise
        try:
            try:
                # A big fn pickle should not make us wait for each worker's start-up.
                fcntl.fcntl(boot_w, fcntl.F_SETPIPE_SZ, 1 << 20)
            except (OSError, AttributeError):  # above the system's limit: writes just wait
                pass
            argv = [boot_r, child_sock.fileno(), sentinel_r, int(pdeathsig), os.getpid()]
            argv += [ring_fd, bell, wake]
            passed = [boot_r, child_sock.fileno(), sentinel_r] + [fd for fd in argv[-3:] if fd >= 0]
            proc = subprocess.Popen(
                [sys.executable, "-c", BOOT, *map(str, argv)],
                pass_fds=passed,
                env=env,
                stdin=subprocess.DEVNULL,
                # Its own process group, which its watch thread kills on the way out.
                start_new_session=True,
            )
        except BaseException:
            parent_sock.close()
            os.close(sentinel_w)
            os.close(boot_w)
            for fd in (bell, wake):
                if fd >= 0:
                    os.close(fd)
            raise
        finally:
            child_sock.close()
            os.close(sentinel_r)
            os.close(boot_r)
            if ring_fd >= 0:
                os.close(ring_fd)  # the worker has its own copy; ours is mapped
        return cls(wid, proc, parent_sock, sentinel_w, boot_w, window, ring_map, bell, wake)

    def send_boot(self, data: bytes) -> None:
        """Write the boot data (blocks only while the worker starts, for a big pickle)."""
        with self.lock:
            fd, self.boot = self.boot, -1
        if fd < 0:  # stopped meanwhile
            return
        try:
            with open(fd, "wb") as f:
                f.write(data)
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

    def flush(self) -> None:
        """Send everything owed that fits; never blocks. Repeating it is harmless."""
        if _DEAD:
            collect_dead()
        if self.shared:
            self._write_control()
            return
        if not self._enter():
            return
        try:
            while True:
                allowance = self.allowance()
                freed = self.freed[: P.MAX_RECORDS]
                consumed = self.consumed
                if not (
                    consumed != self.sent_consumed or freed or allowance != self.sent_allowance
                ):
                    return
                pack = P.CTRL.pack
                records = [pack(P.ALLOW, 0, allowance), pack(P.CONSUMED, 0, consumed)]
                records.extend([pack(P.FREE, slot, seq) for slot, seq in freed])
                try:
                    self.sock.send(b"".join(records), _DONTWAIT)
                except BlockingIOError:
                    return  # still owed; the consumer's wait sends it when there is room
                except OSError:  # the worker is gone; it needs nothing more from us
                    self.freed = []
                    return
                self.sent_consumed, self.sent_allowance = consumed, allowance
                del self.freed[: len(freed)]  # only those: a callback may append meanwhile
        finally:
            self._leave()

    def _write_control(self) -> None:
        """Write what is owed into the ring's control area, then wake the worker.

        Counts are absolute and a record written twice is ignored by the
        worker, so an interrupt anywhere here only makes the next call repeat
        some of it. Records that do not fit wait for the worker to read the
        others (it rings our bell when it empties a full record ring).
        """
        ring = self.ring  # one load: stop() may drop it meanwhile
        if ring is None:
            return
        at = self.control
        word = P.WORD.pack_into
        wrote = False
        consumed = self.consumed
        if consumed != self.sent_consumed:
            word(ring, at + P.CONSUMED_AT, consumed)
            self.sent_consumed = consumed
            wrote = True
        allowance = self.allowance()
        if allowance != self.sent_allowance:
            word(ring, at + P.ALLOWANCE_AT, allowance)
            self.sent_allowance = allowance
            wrote = True
        freed = self.freed
        if freed:
            put = self.put
            room = P.FREED_RECORDS - (put - P.WORD.unpack_from(ring, at + P.TAKEN_AT)[0])
            batch = freed[: max(0, room)]
            record = P.FREED_RECORD.pack_into
            for slot, seq in batch:
                record(ring, at + P.RECORDS_AT + put % P.FREED_RECORDS * P.FREED_RECORD.size,
                       slot, seq)  # fmt: skip
                put += 1
            if batch:
                word(ring, at + P.PUT_AT, put)
                self.put = put
                del freed[: len(batch)]  # only those: collect_dead may append meanwhile
                wrote = True
        if wrote and self._enter():
            try:
                os.write(self.wake, _ONE)
            except OSError:  # the worker is gone; it needs nothing more from us
                pass
            finally:
                self._leave()

    def _owes(self) -> bool:
        if self.shared:
            return False  # nothing waits for room on the socket
        return bool(self.consumed != self.sent_consumed or self.freed)

    # -- the consumer and stop() ------------------------------------------------
    #
    # Only the consumer's thread receives and sends; stop() may come from any
    # thread. Under the GIL these stores and loads happen in one order, so of
    # "busy = True, then read closed" (consumer) and "closed = True, then read
    # busy" (stop) at least one sees the other's store: either the consumer
    # leaves the socket alone, or stop() leaves its descriptors to the
    # consumer's _leave(). No lock is taken per element.

    def _enter(self) -> bool:
        self.busy = True
        if self.closed:
            self._leave()
            return False
        return True

    def _leave(self) -> None:
        self.busy = False
        if self.closed:
            self._close_fds()

    # -- receiving --------------------------------------------------------------

    def has_message(self) -> bool:
        """Whether the inbox holds a message not yet delivered (or the worker's end)."""
        return self.inbox[0] != 0 or self.inbox[1] != 0

    def poll(self) -> bool:
        """Receive a message into the inbox if one is there; never blocks."""
        return self._recv(_DONTWAIT)

    def posted(self, seq: int) -> bool:
        """Whether the worker's element ``seq`` is in its ring (see ``_protocol``)."""
        ring = self.ring
        if ring is None:
            return False
        mark: int = P.read_mark(ring, (seq % self.entries) * P.RING_ENTRY)[0]
        return mark == seq + 1

    def wait(self, seq: int) -> None:
        """Wait until element ``seq`` is in the ring, the inbox holds a message, or the end.

        Sends what is owed whenever there is room, and wakes every ``_POLL``
        seconds to send slots freed meanwhile by other threads. The worker's
        end is a header of kind ``END`` in the inbox: its socket reached EOF,
        the worker exited, or the handle was stopped. Returns with the inbox
        empty and ``seq`` not in the ring only when ``seq`` was lost (see
        :meth:`_ring_moved`).
        """
        while True:
            self.flush()
            if self._ring_moved(seq):
                return
            if not self._enter():
                self._mark_end()
                return
            moved = False
            try:
                bell = self.bell
                if bell >= 0:
                    # Drain the counts of posts taken already, then look again:
                    # a post after this look rings the bell we are about to sleep on.
                    try:
                        os.read(bell, 8)
                    except BlockingIOError:
                        pass  # no count to drain: nothing was posted since
                    moved = self.posted(seq) or self.posted(seq + 1)
                if not moved:
                    owes = [self.sock] if self._owes() else []
                    watch: list[Any] = [self.sock]
                    if bell >= 0:
                        watch.append(bell)
                    if self.pidfd >= 0:
                        watch.append(self.pidfd)
                    readable, _, _ = select.select(watch, owes, [], _POLL)
            finally:
                self._leave()
            if moved:
                continue  # _ring_moved() says what it found
            if self.sock in readable:
                if self._recv(_DONTWAIT):
                    return
            elif (self.pidfd >= 0 and self.pidfd in readable) or (
                self.pidfd < 0 and self.proc.poll() is not None
            ):
                # The worker has exited: what it posted or sent before is there;
                # after that, the end.
                if not self._ring_moved(seq) and not self._recv(_DONTWAIT):
                    self._mark_end()
                return

    def _ring_moved(self, seq: int) -> bool:
        """Whether the ring has element ``seq``, or is past it.

        Past it (the worker posted ``seq + 1``, or its end there): element
        ``seq`` went by the socket, before that post, so it is queued there,
        and is received into the inbox now; if nothing is queued, an
        interrupt took it as it was received, and the inbox stays empty for
        the loader to report the loss (waiting would never end).
        """
        if self.posted(seq):
            return True
        if not self.posted(seq + 1):
            return False
        if not self.has_message():
            self._recv(_DONTWAIT)
        return True

    def _mark_end(self) -> None:
        P.HEAD.pack_into(self.inbox, 0, END, -1, -1, 0, 0, 0)

    def _recv(self, flags: int) -> bool:
        if not self._enter():
            self._mark_end()
            return True
        msg = self.msg
        try:
            # Only ever called with the inbox empty: a descriptor still here
            # came with a message delivered already (its receive was cut short
            # after the mapping was made). Closed, not leaked.
            if self.cmsg.len or self.inbox_fd >= 0:
                self._take_descriptor()
                self._close_inbox_fd()
            while True:
                self.cmsg.len = 0
                msg.controllen = _CMSG_ROOM
                msg.flags = 0
                n: int = _RECVMSG(self.sockfd, self.msg_ref, flags)
                if n >= 0:
                    break
                err = ctypes.get_errno()
                if err in (errno.EAGAIN, errno.EWOULDBLOCK):
                    return False
                if err in (errno.ECONNRESET, errno.EINTR):
                    # A worker that exits with control records unread makes Linux
                    # report ECONNRESET, once, *before* the messages it sent us,
                    # which are still queued: read on (EOF comes after them).
                    continue
                n = 0  # shut down under us by stop(): the end
                break
        finally:
            self._leave()
        if self.cmsg.len:
            self._take_descriptor()
        if msg.flags & _TRUNCATED or 0 < n < P.HEAD.size:
            self._close_inbox_fd()
            self._mark_end()
            raise P.WorkerError(f"{self.describe()} sent a malformed message")
        if n == 0:
            self._mark_end()
        return True

    def _take_descriptor(self) -> None:
        """Move a descriptor recvmsg left in ``cmsg`` to ``inbox_fd``. Repeating it is harmless.

        The move is two stores with no call between them, so no interrupt can
        split it: the descriptor is in exactly one of the two places.
        """
        cmsg = self.cmsg
        length = cmsg.len
        if not length:
            return
        if cmsg.level != _SOL_SOCKET or cmsg.type != _SCM_RIGHTS:
            cmsg.len = 0
            return
        count = min(_MAX_FDS, (length - _CMSG_HEAD) // 4)
        if count <= 0:
            cmsg.len = 0
            return
        self.inbox_fd = cmsg.fds[0]
        cmsg.len = 0
        for i in range(1, count):
            os.close(cmsg.fds[i])

    def _close_inbox_fd(self) -> None:
        fd, self.inbox_fd = self.inbox_fd, -1
        if fd >= 0:
            os.close(fd)

    def done_with_inbox(self) -> None:
        """The inbox's message is delivered: mark it empty."""
        self.inview[:4] = EMPTY

    def attach(self, slot: int, capacity: int, seq: int) -> bool:
        """Map the segment that came with the inbox's message (element ``seq``) for ``slot``.

        False if its descriptor is gone (an interrupt took it: the loader must
        fail). The descriptor is closed only after the mapping is stored: an
        interrupt before that leaves it for the next call (a mapping made and
        dropped meanwhile unmaps itself).
        """
        if self.inbox_fd < 0:  # an interrupt struck before the receive could take it
            self._take_descriptor()
        fd = self.inbox_fd
        if fd < 0:
            return False
        mapping = mmap.mmap(fd, capacity)
        segment = Segment(mapping, capacity, f"ProcessPrefetch {self.describe()} slot {slot}")
        _watch_segment(segment)
        self.slots[slot] = segment
        self.attached = seq
        self.inbox_fd = -1
        os.close(fd)
        return True

    def lease(self, slot: int, seq: int, base: np.ndarray[Any, Any]) -> _Lease:
        """Pin ``slot`` until ``base`` (which every array of the element views) dies."""
        lease = _Lease(base, _DEAD.append)
        lease.handle, lease.slot, lease.seq, lease.segment = self, slot, seq, self.slots[slot]
        lease.delivered = False
        self.live.add(slot)
        _LEASES.add(lease)
        return lease

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

    def forget_in_child(self) -> None:
        """In a process forked from the owner: let go of our copies, touch nothing shared.

        Closes this process's copies of the descriptors (never a
        ``shutdown()``, which would cut the owner's connection too) and unmaps
        the ring and every slot no element of this process views, so that a
        forked helper pins none of the loader's memory. Only the forking
        thread exists here: no lock is taken.
        """
        self.forked = self.closed = self.fds_closed = True
        self.lock = threading.Lock()
        self.sock.close()  # this process's descriptor only: the owner's socket lives on
        self._take_descriptor()
        for name in ("sentinel", "boot", "inbox_fd", "bell", "wake", "pidfd"):
            fd = getattr(self, name)
            if fd >= 0:
                setattr(self, name, -1)
                try:
                    os.close(fd)
                except OSError:  # closed already (a close cut short by the fork)
                    pass
        ring, self.ring = self.ring, None
        if ring is not None:
            _shm.unmap_view(ring)
        for segment in self.slots.values():
            segment.unmap_if_unused()
        self.slots.clear()

    def stop(self) -> None:
        """Tell the worker to exit now; drop our mappings. Never blocks; any thread.

        Idempotent, and resumable: every step checks whether it was done, so a
        call an interrupt cut short is finished by the next one. Does nothing
        in a forked child (see :meth:`forget_in_child`).
        """
        if self.forked:
            return
        with self.lock:
            self.closed = True
            # EOF on its watch pipe: the worker's watch thread exits the process at
            # once, even in the middle of the user's function.
            fd, self.sentinel = self.sentinel, -1
            if fd >= 0:
                os.close(fd)
            try:
                # Wakes a consumer waiting on the socket (it reads EOF).
                self.sock.shutdown(socket.SHUT_RDWR)
            except OSError:  # shut down already, or closed: nothing to wake
                pass
            self.consumed = self.sent_consumed = 0
            # Segments no lease holds are unmapped now (on the reaper); the others
            # when their last element dies. The ring with the consumer's last use.
            self.slots.clear()
            self.ring = None
            fd, self.boot = self.boot, -1
        if fd >= 0:
            os.close(fd)
        if not self.busy:
            self._close_fds()
        # Nobody will hand our slots back any more: let our leases go, so that
        # a segment viewed by an element that outlives the loader is unmapped
        # with that element's last array (mmap's own release), not pinned.
        for lease in [x for x in list(_LEASES) if x.handle is self]:
            _LEASES.discard(lease)

    def _close_fds(self) -> None:
        # Once closed and the consumer is out of its socket calls; idempotent.
        with self.lock:
            if self.fds_closed:
                return
            self.fds_closed = True
        self.sock.close()
        self._take_descriptor()
        self._close_inbox_fd()
        for name in ("bell", "wake"):
            fd = getattr(self, name)
            if fd >= 0:
                setattr(self, name, -1)
                os.close(fd)
        if self.pidfd >= 0:
            fd, self.pidfd = self.pidfd, -1
            os.close(fd)

    def join(self, timeout: float) -> None:
        """Wait for the process (after :meth:`stop`); SIGKILL it after ``timeout``.

        Bounded even if an interrupt left the ``Popen``'s own wait lock held
        (it can land between CPython's acquire and its ``try``, in an earlier
        ``wait`` cut short inside ``next()``): then the child is reaped here.
        """
        if self.forked:
            return  # not our child: the owner waits for it
        # The deadlines are kept across calls: a join cut short by an
        # interrupt and called again (close is resumable) goes on towards the
        # same deadline, so that interrupts arriving faster than the timeout
        # cannot keep it from ever reaching the SIGKILL.
        if self.join_at is None:
            self.join_at = time.monotonic() + timeout
        try:
            self.proc.wait(max(0.0, self.join_at - time.monotonic()))
            return
        except subprocess.TimeoutExpired:
            self.proc.kill()
        if self.kill_at is None:
            self.kill_at = time.monotonic() + timeout
        try:
            self.proc.wait(max(0.0, self.kill_at - time.monotonic()))
        except subprocess.TimeoutExpired:
            try:
                _, status = os.waitpid(self.proc.pid, 0)  # SIGKILLed: exits at once
            except ChildProcessError:
                return  # reaped by someone else meanwhile
            self.proc.returncode = os.waitstatus_to_exitcode(status)


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
    if _DEAD:
        collect_dead()
    release_backlog()


# -- bounded segment release ------------------------------------------------------------

# Registrations of dead segments whose unmap may still wait on the reaper, oldest first.
_DUE: collections.deque[Registration] = collections.deque()


class _SegmentWatch(weakref.ref):  # type: ignore[type-arg]
    __slots__ = ("reg",)
    reg: Registration


# Watches of live segments, and of segments that died (their callback is this
# list's C-level append, for the same reason as the leases').
_WATCHES: set[_SegmentWatch] = set()
_DIED: list[_SegmentWatch] = []


def _watch_segment(segment: Segment) -> None:
    watch = _SegmentWatch(segment, _DIED.append)
    watch.reg = segment.reg
    _WATCHES.add(watch)


def release_backlog(limit: int = _BACKLOG) -> None:
    """Unmap dead segments on this thread while more than ``limit`` wait for the reaper.

    The reaper runs every rank-local destroy of the process, in order: one slow
    or blocked destroy ahead of ours would let unmapped memory pile up. The
    registration runs each unmap exactly once, whoever gets there first.
    """
    due, died = _DUE, _DIED
    while died:
        watch = died[-1]
        del died[-1]
        due.append(watch.reg)
        _WATCHES.discard(watch)
    while due and not due[0].alive:
        due.popleft()
    while len(due) > limit:
        due.popleft().destroy()


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
    # The parent's leases: nobody here hands their slots back.
    _LEASES.clear()
    _DEAD.clear()
    _SPAWNER[0] = _Spawner()
    _DUE.clear()
    _DIED.clear()
    _WATCHES.clear()


atexit.register(_at_exit)
os.register_at_fork(after_in_child=_after_fork_in_child)
