"""A worker's channel: its socket, inbox, ring and doorbells; receiving, waiting, sending.

The consumer thread (``ProcessPrefetch.__next__``) does all the talking: it
receives elements, attaches new segments (into the worker's slot table,
``_leases``), and sends what the worker is owed (the count of its elements
consumed, the slot allowance, freed slots) batched in one message per few
elements, since every message wakes a process and wake-ups, not bytes, cost
time on a busy machine.

Receiving survives an interrupt (NOTE [ Loader shutdown and interrupts ] in
``_loader``, rules 1 and 2): a message is received into the channel's own
``inbox``, which counts as full until the consumer has delivered the
element, and the receive writes the message and its descriptor into memory
of the channel (libc's ``recvmsg``, see below).

On x86-64 a worker posts most messages into a shared-memory ring instead of
the socket (see ``_protocol``): the consumer takes an element there with no
system call, and sleeps on the worker's doorbell (an ``eventfd``, with the
socket and the worker's pidfd) only when the element it needs is not posted
yet.

Sends never block (what does not fit the socket stays owed and goes out when
there is room); the consumer's waits wake up every ``POLL`` seconds to send
slots freed meanwhile on other threads, so a worker waiting for a slot is
never forgotten. :meth:`Channel.shut` may come from any thread: it shuts the
socket down (which wakes a consumer waiting on it), and the descriptors are
closed by whichever of the two comes last, never under a waiting call: the
consumer marks its socket calls (:meth:`Channel._begin_io`, ``_end_io``).

:class:`Channel` is the channel part of a worker's handle (``_pool``).
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import select
import socket
import subprocess
import sys
import threading
import time

from . import _protocol as P
from ._forked import close_fields
from ._leases import DEAD, SlotTable, collect_dead, watch_segment
from ._shm import Segment, map_fd, unmap_view

__all__ = ["EMPTY", "END", "POLL", "Channel"]

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
# Received descriptors close-on-exec, as every other of ours: a subprocess
# started meanwhile (by any thread) must not inherit a worker's segment.
_CLOEXEC = int(socket.MSG_CMSG_CLOEXEC)
_TRUNCATED = int(socket.MSG_TRUNC | socket.MSG_CTRUNC)
# How often a consumer waiting for a worker wakes up to send it slots freed
# meanwhile on other threads (the only case where nobody else would).
POLL = 0.05
POLL_MS = POLL * 1000
_POLLIN = select.POLLIN
_POLLOUT = select.POLLIN | select.POLLOUT
# What select() counted as readable: data, the end, an error.
_READABLE = select.POLLIN | select.POLLHUP | select.POLLERR
# A waiting consumer asks to be woken once per this many seconds of a
# worker's posts (at most a window of them): see _protocol, "Doorbells".
ASK_SPAN = 5e-4
EMPTY = bytes(4)  # written over an inbox's kind: the inbox is empty
_ONE = (1).to_bytes(8, sys.byteorder)  # one count on an eventfd
END = 256  # the inbox's kind once the worker's end is seen (no message has it)


class Channel:
    """The socket, inbox, ring and doorbells of one worker, and what it is owed.

    Takes what it needs of the worker's other parts explicitly: the process
    (``proc``: its pid for a pidfd, which the channel watches and closes,
    and its ``poll`` where there is no pidfd), its name for messages, and
    its slot table, which :meth:`attach` fills and whose dead leases
    :meth:`flush` sends back.
    """

    def __init__(
        self,
        sock: socket.socket,
        window: int,
        ring: mmap.mmap | None,
        bell: int,
        wake: int,
        proc: subprocess.Popen[bytes],
        slots: SlotTable,
        name: str,
    ) -> None:
        self.sock = sock
        self.window = window
        self.slots = slots
        self.name = name
        self.proc = proc
        try:
            self.pidfd = os.pidfd_open(proc.pid)  # readable once the worker has exited
        except (AttributeError, OSError):  # no pidfd here: poll the process every POLL
            self.pidfd = -1
        self.lock = threading.Lock()  # shut() and the consumer's last socket call race
        self.closed = False  # shut (or forked): no socket call from now
        self.busy = False  # the consumer is inside a socket call: it closes the descriptors
        self.fds_closed = False
        # The message being delivered: received, its element not yet handed out.
        self.inbox = bytearray(P.MAX_MESSAGE)
        self.inview = memoryview(self.inbox)
        self.inbox_fd = -1  # a descriptor that came with it, not yet mapped
        self.attached = -1  # the element whose new segment was mapped last
        # Where recvmsg writes (see "receiving into memory that outlives the call").
        self.cmsg = _Cmsg()
        self.inbox_c = ctypes.c_char.from_buffer(self.inbox)  # pins its address
        self.iov = _Iovec(ctypes.addressof(self.inbox_c), P.MAX_MESSAGE)
        self.msg = _Msghdr(None, 0, ctypes.pointer(self.iov), 1, ctypes.addressof(self.cmsg))
        self.msg_ref = ctypes.byref(self.msg)
        self.sockfd = sock.fileno()  # used only between _begin_io() and _end_io(): still open
        # The worker's ring (None: every message by socket) and its doorbell.
        # shut() drops the view; the mapping goes with the last reference, so a
        # reader holding it in a local never sees it unmapped.
        self.ring: memoryview | None = None
        self.shared = ring is not None  # the ring's mode, for good (ring is dropped at shut)
        self.entries, self.control = 1, 0
        self.bell, self.wake = bell, wake
        self.put = 0  # FREE records written into the ring's control area
        self.rang = 0  # the worker's SLEEP we last rang its doorbell for
        # How fast the worker posts, for ASK (see _protocol, "Doorbells"): when
        # the last wait ended, and the element it waited for.
        self.tick, self.tick_seq = 0.0, 0
        if ring is not None:
            self.ring = memoryview(ring)
            self.entries, self.control = P.ring_control(len(ring))
        # Owed to the worker (see "sending" below).
        self.consumed = 0
        self.sent_consumed = 0
        # Freed slots go back once per `batch` elements (CONSUMED through the
        # ring goes per element, a store: the ring's batch is free to be longer).
        self.batch = max(1, window if self.shared else window // 2)
        self.sent_allowance = window

    # -- sending ----------------------------------------------------------------

    def allowance(self) -> int:
        """Slots the worker may own: ``window`` + live leases + one batch of slack.

        Only live leases count, so a consumer that keeps elements lets the ring
        grow (it never deadlocks) while a dead lease not sent back yet does
        not (the ring never grows for ever); the slack covers a batch of
        freed slots not sent yet.
        """
        return self.window + self.batch + len(self.slots.live)

    def flush(self) -> None:
        """Send everything owed that fits; never blocks. Repeating it is harmless."""
        if DEAD:
            collect_dead()
        if self.shared:
            self._write_control()
            return
        if not self._begin_io():
            return
        try:
            while True:
                allowance = self.allowance()
                freed = self.slots.freed[: P.MAX_RECORDS]
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
                    self.slots.freed.clear()
                    return
                self.sent_consumed, self.sent_allowance = consumed, allowance
                del self.slots.freed[: len(freed)]  # only those: collect_dead may append
        finally:
            self.busy = False  # a store before any call (see _end_io)
            self._end_io()

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
        wrote = False  # a slot for a worker that waits for one
        consumed = self.consumed
        word(ring, at + P.CONSUMED_AT, consumed)  # the consumer stores it per element too
        self.sent_consumed = consumed
        allowance = self.allowance()
        if allowance != self.sent_allowance:
            word(ring, at + P.ALLOWANCE_AT, allowance)
            self.sent_allowance = allowance
            wrote = True
        freed = self.slots.freed
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
        # Our progress, then the fence, then the worker's condition: a worker
        # that stored it and looked at our progress before we stored it is
        # seen asleep here (see _protocol, "Doorbells").
        P.fence()
        need = P.WORD.unpack_from(ring, at + P.SLEEP_AT)[0]
        if need == P.NEEDS_SLOT:
            ring_it = wrote
        else:
            # Again while it still sleeps (it clears SLEEP when it wakes): a
            # second count is harmless, a sleeper left waiting is not.
            ring_it = 0 < need <= consumed
        if ring_it and self._begin_io():
            try:
                os.write(self.wake, _ONE)
                # Only once rung: an interrupt before this store rings again (harmless);
                # one after an earlier store would leave the worker asleep for ever.
                self.rang = need
            except OSError:  # the worker is gone; it needs nothing more from us
                pass
            finally:
                self.busy = False  # a store before any call (see _end_io)
                self._end_io()

    def _owes(self) -> bool:
        if self.shared:
            return False  # nothing waits for room on the socket
        return bool(self.consumed != self.sent_consumed or self.slots.freed)

    def _begin_io(self) -> bool:
        self.busy = True
        if self.closed:
            self.busy = False
            self._end_io()
            return False
        return True

    def _end_io(self) -> None:
        # Called once the caller has stored busy = False, in its finally, with
        # no call before the store: an interrupt at the entry of this call
        # (or of close_fds) leaves the consumer out of its socket call, so a
        # later close() (shut) closes the descriptors. Were the store in here,
        # such an interrupt would leave busy set for good, and them open.
        if self.closed:
            self.close_fds()

    # -- receiving --------------------------------------------------------------

    def has_message(self) -> bool:
        """Whether the inbox holds a message not yet delivered (or the worker's end)."""
        return self.inbox[0] != 0 or self.inbox[1] != 0

    def poll(self) -> bool:
        """Receive a message into the inbox if one is there; never blocks."""
        return self._recv(_DONTWAIT)

    def mark(self, entry: int) -> int:
        """Ring entry ``entry``'s mark: the number of the element posted there last,
        plus one (0: none yet, or no ring)."""
        ring = self.ring
        if ring is None:
            return 0
        mark: int = P.read_mark(ring, entry * P.RING_ENTRY)[0]
        return mark

    def posted(self, seq: int) -> bool:
        """Whether the worker's element ``seq`` is in its ring (see ``_protocol``)."""
        ring = self.ring
        if ring is None:
            return False
        mark: int = P.read_mark(ring, (seq % self.entries) * P.RING_ENTRY)[0]
        return mark == seq + 1

    def wait(self, seq: int) -> None:
        """Wait until element ``seq`` is in the ring, the inbox holds a message, or the end.

        Sends what is owed whenever there is room, and wakes every ``POLL``
        seconds to send slots freed meanwhile by other threads. The worker's
        end is a header of kind ``END`` in the inbox: its socket reached EOF,
        the worker exited, or the handle was stopped. Returns with the inbox
        empty and ``seq`` not in the ring only when ``seq`` was lost (see
        :meth:`_ring_moved`).
        """
        # Wake once the worker has posted `ask` elements: k more than we need
        # now when it posts fast (a wake-up per k elements), 1 when it is slow
        # (no element waits for others). See _protocol, "Doorbells".
        now = time.perf_counter()
        gap = (now - self.tick) / max(1, seq - self.tick_seq)
        k = max(1, min(self.window, int(ASK_SPAN / gap) if gap > 0 else self.window))
        ask = seq + k
        while True:
            self.flush()
            if self._ring_moved(seq):
                break
            if not self._begin_io():
                self._mark_end()
                break
            moved = False
            ready: dict[int, int] = {}
            try:
                bell = self.bell
                ring = self.ring
                if bell >= 0 and ring is not None:
                    # Our condition, then the fence, then a look: a post after
                    # this look sees ASK and rings the bell we sleep on.
                    P.WORD.pack_into(ring, self.control + P.ASK_AT, ask)
                    P.fence()
                    try:
                        os.read(bell, 8)  # drain the rings of posts taken already
                    except BlockingIOError:
                        pass  # no count to drain: nothing rang since
                    moved = self.posted(ask - 1) or self.posted(seq + 1)
                if not moved:
                    # poll, not select: select refuses descriptors numbered
                    # 1024 and up, which a process with many files open gets.
                    watch = select.poll()
                    watch.register(self.sockfd, _POLLOUT if self._owes() else _POLLIN)
                    if bell >= 0:
                        watch.register(bell, _POLLIN)
                    if self.pidfd >= 0:
                        watch.register(self.pidfd, _POLLIN)
                    ready = dict(watch.poll(POLL_MS))
            finally:
                self.busy = False  # a store before any call (see _end_io)
                self._end_io()
            if moved:
                continue  # _ring_moved() says what it found
            if ready.get(self.sockfd, 0) & _READABLE:
                if self._recv(_DONTWAIT):
                    break
            elif (self.pidfd >= 0 and ready.get(self.pidfd, 0) & _READABLE) or (
                self.pidfd < 0 and self.proc.poll() is not None
            ):
                # The worker has exited: what it posted or sent before is there;
                # after that, the end.
                if not self._ring_moved(seq) and not self._recv(_DONTWAIT):
                    self._mark_end()
                break
        self.tick, self.tick_seq = time.perf_counter(), seq

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
        if not self._begin_io():
            self._mark_end()
            return True
        msg = self.msg
        try:
            # Only ever called with the inbox empty: a descriptor still here
            # came with a message delivered already (its receive was cut short
            # after the mapping was made). Closed, not leaked.
            if self.cmsg.len or self.inbox_fd >= 0:
                self.take_descriptor()
                self._close_inbox_fd()
            while True:
                self.cmsg.len = 0
                msg.controllen = _CMSG_ROOM
                msg.flags = 0
                n: int = _RECVMSG(self.sockfd, self.msg_ref, flags | _CLOEXEC)
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
            # Still inside the socket call: a close_fds() from another thread
            # between the receive and this move would close the descriptor and
            # leave its number here, for attach() to map whatever reuses it.
            if self.cmsg.len:
                self.take_descriptor()
        finally:
            self.busy = False  # a store before any call (see _end_io)
            self._end_io()
        if msg.flags & _TRUNCATED or 0 < n < P.HEAD.size:
            self._close_inbox_fd()
            self._mark_end()
            raise P.WorkerError(f"{self.name} sent a malformed message")
        if n == 0:
            self._mark_end()
        return True

    def take_descriptor(self) -> None:
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

        Also False if :meth:`shut` came first (from another thread): the
        descriptor is used only inside ``_begin_io``/``_end_io``, as the
        socket is, so close_fds() never closes it under us (its number could
        be reused meanwhile by another thread's file, which we would map,
        then close).
        """
        if not self._begin_io():
            return False
        try:
            if self.inbox_fd < 0:  # an interrupt struck before the receive could take it
                self.take_descriptor()
            fd = self.inbox_fd
            if fd < 0:
                return False
            mapping = map_fd(fd, capacity)
            segment = Segment(mapping, capacity, f"ProcessPrefetch {self.name} slot {slot}")
            watch_segment(segment)
            self.slots.segments[slot] = segment
            self.attached = seq
            self.inbox_fd = -1
            os.close(fd)
            return True
        finally:
            self.busy = False  # a store before any call (see _end_io)
            self._end_io()

    # -- stopping ---------------------------------------------------------------

    def shut(self) -> None:
        """No more talking: the worker is being stopped. Never blocks; any thread; idempotent.

        Shuts the socket down, which wakes a consumer waiting on it (it reads
        the end); the descriptors are closed now if the consumer is in no
        socket call, else by the consumer as it leaves it. The ring's view is
        dropped; the mapping goes with the last reference to it.
        """
        with self.lock:
            self.closed = True
            try:
                self.sock.shutdown(socket.SHUT_RDWR)
            except OSError:  # shut down already, or closed: nothing to wake
                pass
            self.consumed = self.sent_consumed = 0
            self.ring = None
        if not self.busy:
            self.close_fds()

    def close_fds(self) -> None:
        # Once shut and the consumer is out of its socket calls; idempotent.
        with self.lock:
            if self.fds_closed:
                return
            self.fds_closed = True
        self.sock.close()
        self.take_descriptor()
        self._close_inbox_fd()
        for name in ("bell", "wake"):
            fd = getattr(self, name)
            if fd >= 0:
                setattr(self, name, -1)
                os.close(fd)
        if self.pidfd >= 0:
            fd, self.pidfd = self.pidfd, -1
            os.close(fd)

    def forget_in_child(self) -> None:
        """In a process forked from the owner: let go of our copies, touch nothing shared.

        Closes this process's copies of the descriptors (never a
        ``shutdown()``, which would cut the owner's connection too) and
        unmaps the ring unless something here views it. Only the forking
        thread exists here: no lock is taken.
        """
        self.closed = self.fds_closed = True
        self.lock = threading.Lock()
        try:
            self.sock.close()  # this process's descriptor only: the owner's socket lives on
        except OSError:  # never let one descriptor keep the others open
            pass
        self.take_descriptor()
        close_fields(self, ("inbox_fd", "bell", "wake", "pidfd"))
        ring, self.ring = self.ring, None
        if ring is not None:
            unmap_view(ring)
