"""The worker process of ProcessPrefetch: bootstrap, parent watch, and the serve loop.

A worker is a fresh interpreter (``python -c BOOT``), started with an
environment that has no ``OMPI_*``/``PMIX_*``/``PMI_*`` variables. ``BOOT``
sets ``mpi4py.rc.initialize = mpi4py.rc.finalize = False`` before anything
else is imported, so that neither ``collective_gc`` (which imports
``mpi4py.MPI``) nor the user's main module (re-imported as ``__mp_main__`` so
that functions defined there unpickle, as multiprocessing's spawn does) can
initialize MPI in a worker: a worker that joins, or even just starts, MPI
inside an ``mpiexec`` job can bring the whole job down. Even a user's explicit
``MPI.Init()`` at module level would then only make a singleton of size 1.

A worker dies with its parent, three ways, whichever comes first:

* ``prctl(PR_SET_PDEATHSIG, SIGKILL)``: the kernel kills it when the thread
  that started it exits; the parent starts every worker from one thread that
  lives as long as the process (``_pool``), so that is the parent's death.
  ``getppid()`` is checked after setting it, in case the parent died before;
* a watch thread blocks on a pipe whose only writer is the parent; EOF means
  the parent closed it (``close()``) or died, and the thread ends the process
  at once, whatever the main thread is doing;
* the socket to the parent: EOF on receive, EPIPE on send.

What the user's function starts dies with the worker too: the worker leads a
process group of its own, and kills that whole group (itself included) on
every way out it takes (the watch thread's, the end of its share, a failed
start); a child it forks through ``os.fork`` (or multiprocessing's fork) is
given ``PR_SET_PDEATHSIG`` of its own at once, so it dies even when the
worker is killed outright. The parent's ``join`` kills what is left of the
group once the worker is reaped (a crash, its SIGKILL). A process started
through ``subprocess`` (no at-fork hook runs) outlives a worker killed by
``PR_SET_PDEATHSIG`` when the parent is SIGKILLed: a documented limitation.

A worker runs under ``SCHED_BATCH`` (see :func:`_be_batch`): the parent's
wake-ups never preempt the parent.

It exits through ``os._exit``: no atexit handler (the user's, mpi4py's or
collective_gc's) runs in a worker, so nothing is printed or finalized there.
"""

from __future__ import annotations

import ctypes
import io
import mmap
import os
import pickle
import reprlib
import runpy
import select
import signal
import socket
import struct
import sys
import threading
import types
from collections.abc import Callable, Sequence
from typing import IO, Any, NoReturn

from . import _protocol as P
from . import _shm

__all__ = ["BOOT", "STRIP_PREFIXES", "Pickler", "bootstrapping", "main", "preparation"]

# Run by ``python -c``; argv: boot fd, socket fd, sentinel fd, pdeathsig (0/1),
# parent pid, ring fd, the parent's doorbell fd and ours (-1: no ring). Only
# the standard library and mpi4py are touched before the rc flags are set.
BOOT = """\
import os, pickle, signal, sys
signal.signal(signal.SIGINT, signal.SIG_IGN)
boot = open(int(sys.argv[1]), "rb")
try:
    prep = pickle.load(boot)
except BaseException:
    os._exit(1)  # no boot data: the parent gave up starting us, and its error says why
sys.path[:] = prep["sys_path"]
try:
    import mpi4py
except ImportError:
    pass  # no mpi4py here: nothing that could initialize MPI
else:
    mpi4py.rc.initialize = False
    mpi4py.rc.finalize = False
from collective_gc.data._worker import main
main(boot, prep, sys.argv[2:])
"""

# Variables through which an MPI launcher tells a process it is a rank.
STRIP_PREFIXES = ("OMPI_", "PMIX_", "PMI_")

_BOOTSTRAPPING = [False]
_DONTWAIT = int(socket.MSG_DONTWAIT)  # a plain int: enum arithmetic is slow


def bootstrapping() -> bool:
    """True while this process is a worker importing the user's main module."""
    return _BOOTSTRAPPING[0]


def preparation() -> dict[str, Any]:
    """Parent side: what a worker needs to look like this process (plain values)."""
    import multiprocessing

    cwd = os.getcwd()
    main_mod = sys.modules.get("__main__")
    spec = getattr(main_mod, "__spec__", None)
    main_name = getattr(spec, "name", None)
    main_path = None
    if main_name is None:
        path = getattr(main_mod, "__file__", None)
        if isinstance(path, str) and not sys.flags.interactive:
            main_path = os.path.join(cwd, path)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    # '' on sys.path means "the directory we started in", not the worker's cwd.
    sys_path = [p if p else cwd for p in sys.path]
    if root not in sys_path:
        sys_path.append(root)
    return {
        "sys_path": sys_path,
        "sys_argv": list(sys.argv),
        "cwd": cwd,
        "main_name": main_name,
        "main_path": main_path,
        "authkey": bytes(multiprocessing.current_process().authkey),
    }


def _import_main(prep: dict[str, Any]) -> None:
    # Functions defined in the user's __main__ pickle as "__main__.f"; make
    # that name resolve, without running its `if __name__ == "__main__":` part.
    name, path = prep["main_name"], prep["main_path"]
    if name is not None:
        if name == "__main__" or name.endswith(".__main__"):
            return  # `python -m pkg`: a package's __main__ is never re-run
        module = types.ModuleType("__mp_main__")
        module.__dict__.update(runpy.run_module(name, run_name="__mp_main__", alter_sys=True))
    elif path is not None:
        module = types.ModuleType("__mp_main__")
        module.__dict__.update(runpy.run_path(path, run_name="__mp_main__"))
    else:
        return
    sys.modules["__main__"] = sys.modules["__mp_main__"] = module


def _exit(code: int) -> NoReturn:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a broken or closed stream: nothing to flush to
            continue
    _end_group(code)


def _end_group(code: int) -> NoReturn:
    # Our process group is this worker and whatever its fn started (the worker
    # leads it, see _pool): none of it may outlive the worker. This kills the
    # worker too, at once.
    try:
        os.killpg(os.getpid(), signal.SIGKILL)
    finally:
        os._exit(code)


def _watch(fd: int) -> None:
    # Blocks without the GIL; returns only at EOF (or an error, which means the
    # same: the parent is gone).
    try:
        while os.read(fd, 1):
            pass
    finally:
        _end_group(0)  # not _exit(): flushing could block on a dead parent's pipe


def _readable(fd: Any, timeout: float) -> bool:
    # poll, not select: select refuses descriptors numbered 1024 and up (the
    # doorbells keep the parent's numbers, which may be that high).
    watch = select.poll()
    watch.register(fd, select.POLLIN)
    return bool(watch.poll(timeout * 1000))


def _set_pdeathsig(parent_pid: int) -> None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, ctypes.c_ulong(signal.SIGKILL), 0, 0, 0)
    except (OSError, AttributeError):  # no prctl here: the watch thread still acts
        return
    if os.getppid() != parent_pid:  # the parent died before the signal was armed
        os._exit(0)


def _be_normal() -> None:
    # Back to the default policy while we sleep (see _Server._sleep).
    try:
        os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
    except (AttributeError, OSError):  # not Linux, or refused: we stay as we were
        return


def _be_batch() -> None:
    # SCHED_BATCH: the same share of the CPU as any process, but a worker woken
    # (the parent handing it credit or slots, mid-step) never preempts the
    # running process; it takes the next free moment, or the other core. The
    # rank's own loop is the latency that counts; without this each wake-up
    # can push the consumer off its core for the worker's next element.
    try:
        os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
    except (AttributeError, OSError):  # not Linux, or refused: the default policy works too
        return


def _guard_forked_child(worker_pid: int) -> None:
    # In a child that the user's fn forked: die with the worker, however the
    # worker dies (a worker killed by PR_SET_PDEATHSIG runs no code to kill it).
    try:
        _set_pdeathsig(worker_pid)
    except BaseException:  # noqa: BLE001 (never let the guard break the user's fork)
        return


def main(boot: IO[bytes], prep: dict[str, Any], argv: Sequence[str]) -> NoReturn:
    """Worker entry point, called by ``BOOT`` only."""
    sock_fd, sentinel_fd, pdeathsig, parent_pid, ring_fd, bell_fd, wake_fd = (int(a) for a in argv)
    if pdeathsig:
        _set_pdeathsig(parent_pid)
    threading.Thread(target=_watch, args=(sentinel_fd,), name="parent-watch", daemon=True).start()
    # After the watch thread started (the policy is per thread, inherited by
    # threads and children made later): that thread keeps the default policy,
    # so it still takes a core at once when the parent closes the loader or dies.
    _be_batch()
    me = os.getpid()
    os.register_at_fork(after_in_child=lambda: _guard_forked_child(me))
    sock = socket.socket(fileno=sock_fd)
    try:
        os.chdir(prep["cwd"])
        sys.argv[:] = prep["sys_argv"]
        import multiprocessing

        multiprocessing.current_process().authkey = prep["authkey"]
        _BOOTSTRAPPING[0] = True
        try:
            _import_main(prep)
        finally:
            _BOOTSTRAPPING[0] = False
        fn, init_fn, keys, worker_id, window = pickle.load(boot)
        boot.close()
    except BaseException as exc:  # noqa: BLE001 (whatever stops start-up is reported)
        _send_error(sock, exc, "at start-up")
        _exit(1)
    if init_fn is not None:
        try:
            init_fn(worker_id)
        except BaseException as exc:  # noqa: BLE001 (reported like an error of fn)
            _send_error(sock, exc, "in worker_init_fn")
            _exit(1)
    try:
        _Server(sock, fn, worker_id, window, ring_fd, bell_fd, wake_fd).serve(keys)
    except _ParentGone:
        pass  # the parent closed the loader or died: nobody to report to
    except BaseException as exc:  # noqa: BLE001 (SystemExit from fn, a bug of ours)
        # Never out through the interpreter's own exit: it would run atexit
        # handlers and leave what fn started alive; _exit ends the group.
        _send_error(sock, exc, "while serving")
        _exit(1)
    _exit(0)


def _send_error(sock: socket.socket, exc: BaseException, where: str) -> None:
    # Never raises: each caller leaves through _exit() next, which kills the
    # worker's group; raising here would leave by the interpreter's own exit.
    try:
        blob = P.pack_error(exc, where)
    except BaseException:  # noqa: BLE001 (its text or pickling raised: the type's name crosses)
        stand_in = RuntimeError(f"{type(exc).__name__} (its details could not be sent)")
        blob = P.pack_error(stand_in, where)
    _send_quietly(sock, P.HEAD.pack(P.ERROR, -1, 0, 0, len(blob), 0) + blob)


class _ParentGone(Exception):
    """The parent closed the socket: stop without a word."""


def _send_quietly(sock: socket.socket, data: bytes) -> None:
    try:
        sock.send(data)
    except OSError:  # the parent is gone: nobody to tell
        pass


class _Slot:
    __slots__ = ("capacity", "mapping", "view")

    def __init__(self, mapping: mmap.mmap, capacity: int) -> None:
        self.mapping = mapping
        self.view = memoryview(mapping)
        self.capacity = capacity

    def unmap(self) -> None:
        self.view.release()
        self.mapping.close()


# Booleans and numbers: dtype.str describes them fully, and they export buffers
# (dates and times do not).
_PLAIN_KINDS = frozenset("biufc")


class Pickler(pickle.Pickler):
    """Protocol 5, large buffers out of band, plain numpy arrays reduced cheaply.

    One per worker, reused for every element (``dumps``).
    """

    def __init__(self, buffers: list[memoryview]) -> None:
        self._file = io.BytesIO()
        self._buffers = buffers
        super().__init__(self._file, protocol=5, buffer_callback=self._out_of_band)

    def reducer_override(self, obj: Any) -> Any:
        np = sys.modules.get("numpy")
        if np is None or type(obj) is not np.ndarray or obj.dtype.kind not in _PLAIN_KINDS:
            return NotImplemented
        if obj.flags.c_contiguous:
            order = "C"
        elif obj.flags.f_contiguous:
            order = "F"
        else:
            return NotImplemented  # numpy copies it in-band
        return P.rebuild_array, (pickle.PickleBuffer(obj), obj.dtype.str, obj.shape, order)

    def _out_of_band(self, buf: pickle.PickleBuffer) -> bool:
        # pickle's buffer_callback: False keeps the buffer out of the pickle.
        try:
            raw = buf.raw()
        except BufferError:  # not contiguous: let pickle copy it in-band
            return True
        if raw.nbytes < P.OUT_OF_BAND_MIN:
            return True
        self._buffers.append(raw)
        return False

    def dumps(self, obj: Any) -> bytes:
        self._file.seek(0)
        self._file.truncate()
        self.clear_memo()
        self.dump(obj)
        return self._file.getvalue()


_ONE = (1).to_bytes(8, sys.byteorder)  # one count on an eventfd
# A wait for the parent longer than this is taken under the default policy (_Server._sleep).
LONG_SLEEP = 2e-3
# The longest a worker sleeps on its doorbell before it looks at the control area anyway.
POLL = 0.05


def _recv(sock: socket.socket, size: int) -> bytes:
    return sock.recv(size)


class _Server:
    def __init__(
        self,
        sock: socket.socket,
        fn: Callable[[Any], Any],
        wid: int,
        window: int,
        ring_fd: int = -1,
        bell_fd: int = -1,
        wake_fd: int = -1,
    ) -> None:
        self.sock = sock
        # The ring (see _protocol): messages that fit go there, the rest by
        # socket; the parent's records come from its control area. `bell`
        # wakes the parent, `wake` (blocking) is where we sleep.
        self.ring: memoryview | None = None
        self.marks: memoryview | None = None
        self.entries = self.control = 0
        self.taken = 0  # FREE records read from the control area
        self.rang = 0  # the parent's last ASK we rang for (see _protocol: "Doorbells")
        self.bell, self.wake = bell_fd, wake_fd
        if ring_fd >= 0:
            size = os.fstat(ring_fd).st_size
            mapping = mmap.mmap(ring_fd, size)
            os.close(ring_fd)
            self.ring = memoryview(mapping)
            # Marks are stored as whole aligned int64 (one store), never byte by byte.
            self.marks = self.ring.cast("q")
            self.entries, self.control = P.ring_control(size)
        self.fn = fn
        self.wid = wid
        self.window = window
        self.seq = 0  # our elements sent so far; the next one's number
        self.consumed = 0  # of them, taken by the parent (it says so)
        self.allowance = window  # how many slots we may own (the parent says)
        self.slots: list[_Slot] = []
        self.free: list[int] = []
        self.leased: dict[int, int] = {}  # slot -> the element in it, until FREE
        self.buffers: list[memoryview] = []  # of the element being sent
        self.described: dict[tuple[Any, ...], bytes] = {}  # see _send_array
        self.pickler = Pickler(self.buffers)
        np = sys.modules.get("numpy")
        self.ndarray: type | None = None if np is None else np.ndarray

    # -- control messages -------------------------------------------------------

    def _handle(self, data: bytes) -> None:
        if not data:
            raise _ParentGone
        for kind, slot, value in P.CTRL.iter_unpack(data):
            if kind == P.CONSUMED:
                if value > self.consumed:
                    self.consumed = value
            elif kind == P.ALLOW:
                self.allowance = value
            elif kind == P.FREE and self.leased.get(slot) == value:
                del self.leased[slot]  # a repeated FREE finds nothing here
                self.free.append(slot)

    def _take(self) -> None:
        """Read what the parent wrote in the ring's control area (counts are absolute)."""
        ring, at = self.ring, self.control
        assert ring is not None
        word = P.WORD.unpack_from
        consumed = word(ring, at + P.CONSUMED_AT)[0]
        if consumed > self.consumed:
            self.consumed = consumed
        self.allowance = word(ring, at + P.ALLOWANCE_AT)[0]
        put, taken = word(ring, at + P.PUT_AT)[0], self.taken
        if put == taken:
            return
        record, leased = P.FREED_RECORD.unpack_from, self.leased
        for i in range(taken, put):
            slot, seq = record(ring, at + P.RECORDS_AT + i % P.FREED_RECORDS * P.FREED_RECORD.size)
            if leased.get(slot) == seq:
                del leased[slot]  # a repeated record finds nothing here
                self.free.append(slot)
        self.taken = put
        P.WORD.pack_into(ring, at + P.TAKEN_AT, put)
        if put - taken >= P.FREED_RECORDS:
            self._ring_bell()  # the records were full: the parent may hold more

    def _ring_bell(self) -> None:
        try:
            os.write(self.bell, _ONE)
        except OSError:  # cannot happen while the parent lives; if it is gone, so are we
            raise _ParentGone from None

    def _ring_if_asked(self, posted: int, before_sleep: bool = False) -> None:
        """Ring the parent's doorbell if its ASK is reached (or, before we sleep, pending).

        ``posted``: our count of elements posted. Called after a fence: our
        post is visible before ASK is read (see _protocol: "Doorbells").
        """
        ring = self.ring
        assert ring is not None
        ask = P.WORD.unpack_from(ring, self.control + P.ASK_AT)[0]
        if ask > self.rang and (before_sleep or posted >= ask):
            if posted >= ask:
                self.rang = ask  # rung for this ASK; before a sleep it stays pending
            self._ring_bell()

    def _wait(self, need: int = P.NEEDS_SLOT) -> None:
        """Wait for the parent: CONSUMED to reach ``need``, or (``NEEDS_SLOT``) a slot.

        The caller looks at its condition again afterwards (a wake-up may be
        early: a count left on the doorbell).
        """
        ring = self.ring
        if ring is not None:
            at = self.control + P.SLEEP_AT
            before = (len(self.free), self.allowance)
            P.WORD.pack_into(ring, at, need)  # our condition, then the fence, then a look
            P.fence()
            self._take()
            if (self.consumed >= need) if need > 0 else (len(self.free), self.allowance) != before:
                P.WORD.pack_into(ring, at, 0)
                return
            self._ring_if_asked(self.seq, before_sleep=True)  # it may wait for what we posted
            self._sleep(os.read, self.wake, 8, timeout=POLL)
            P.WORD.pack_into(ring, at, 0)
            self._take()
            return
        self._handle(self._sleep(_recv, self.sock, P.MAX_MESSAGE))

    def _sleep(
        self, call: Callable[..., bytes], fd: Any, *args: Any, timeout: float | None = None
    ) -> bytes:
        """``call(fd, *args)``, a blocking wait for the parent on ``fd``.

        Under the default policy once the wait is long (``LONG_SLEEP``): a
        SCHED_BATCH worker asleep when a SIGKILL comes (its parent died: the
        death signal) waits for a running task's time slice to end before it
        can exit, milliseconds on a busy machine; under the default policy
        it takes a core at once. A short wait stays SCHED_BATCH: a worker
        woken under the default policy would preempt the parent that woke
        it, which is what SCHED_BATCH is for (see ``_be_batch``).

        With a ``timeout`` (the ring's doorbell), returns ``b""`` after it
        without a ring: the caller looks at the control area again, so a
        ring the parent never made costs a stall, never a hang.
        """
        try:
            if _readable(fd, LONG_SLEEP):
                return call(fd, *args)
            _be_normal()
            try:
                if timeout is None or _readable(fd, timeout):
                    return call(fd, *args)
                return b""
            finally:
                _be_batch()
        except OSError:
            raise _ParentGone from None

    def _drain(self) -> None:
        if self.ring is not None:
            self._take()
            return
        while True:
            try:
                data = self.sock.recv(P.MAX_MESSAGE, _DONTWAIT)
            except BlockingIOError:
                return
            except OSError:
                raise _ParentGone from None
            self._handle(data)

    # -- slots ------------------------------------------------------------------

    def _new_segment(self, index: int, capacity: int) -> tuple[int, _Slot]:
        fd, mapping = _shm.create(capacity, f"collective_gc-w{self.wid}-s{index}")
        return fd, _Slot(mapping, capacity)

    def _acquire(self, total: int) -> tuple[int, int, int]:
        """A slot for ``total`` bytes: ``(slot, fd to send or -1, its capacity)``."""
        free, slots = self.free, self.slots
        for i in reversed(free):  # the most recently freed first: still in cache
            if slots[i].capacity >= total:
                free.remove(i)
                return i, -1, 0
        self._drain()
        while True:
            fits = [i for i in free if slots[i].capacity >= total]
            if fits:
                free.remove(fits[0])
                return fits[0], -1, 0
            if free and len(slots) >= self.allowance:
                # Too small, and we may not own more: replace its segment.
                index = max(free, key=lambda i: slots[i].capacity)
                free.remove(index)
                capacity = _shm.round_capacity(max(total, 2 * slots[index].capacity))
                slots[index].unmap()
                fd, slots[index] = self._new_segment(index, capacity)
                return index, fd, capacity
            if len(slots) < self.allowance:
                index = len(slots)
                capacity = _shm.round_capacity(total)
                fd, slot = self._new_segment(index, capacity)
                slots.append(slot)
                return index, fd, capacity
            # Every slot is leased, and at least one lease is dead: the parent
            # sends freed slots before it waits, and then every 50 ms (_pool).
            self._wait()

    # -- the loop ---------------------------------------------------------------

    def serve(self, keys: Sequence[Any]) -> None:
        fn = self.fn
        # Woken once per half window, not per element (see _protocol: "Doorbells").
        batch = max(1, self.window // 2)
        for key in keys:
            if self.seq >= self.consumed + self.window and self.ring is not None:
                self._take()  # the parent stores CONSUMED after every element
            while self.seq >= self.consumed + self.window:
                self._wait(self.seq - self.window + batch)
            try:
                self._send_element(fn(key))
            except _ParentGone:
                raise
            except Exception as exc:  # noqa: BLE001 (any error of fn crosses to the parent)
                # reprlib: a key's repr may be as long as the key (its error must fit one message).
                blob = P.pack_error(exc, f"while loading key {reprlib.repr(key)}")
                self._post(P.HEAD.pack(P.ERROR, -1, self.seq, 0, len(blob), 0) + blob, last=True)
                return
            self.seq += 1
        self._post(P.HEAD.pack(P.DONE, -1, self.seq, 0, 0, 0), last=True)

    def _post(self, message: bytes, fd: int = -1, last: bool = False) -> None:
        """Send the message of element ``self.seq``: through the ring if it can, else the socket.

        The parent's doorbell rings only when the post reaches what it asked
        for, and after the ``last`` message (DONE, ERROR): see _protocol, "Doorbells".
        """
        ring = self.ring
        if ring is not None and fd < 0 and len(message) <= P.RING_MESSAGE:
            seq = self.seq
            index = seq % self.entries
            start = index * P.RING_ENTRY + 8
            ring[start : start + len(message)] = message
            self.marks[index * P.MARK] = seq + 1  # type: ignore[index]  # the message is whole
            if last:
                self._ring_bell()
                return
            P.fence()  # the mark is visible before we read ASK
            self._ring_if_asked(seq + 1)
            return
        self._send(message, fd)

    def _send(self, data: bytes, fd: int = -1) -> None:
        try:
            if fd >= 0:
                socket.send_fds(self.sock, [data], [fd])
            else:
                self.sock.send(data)
        except OSError:
            raise _ParentGone from None

    def _send_element(self, element: Any) -> None:
        if type(element) is self.ndarray and self._send_array(element):
            return
        buffers = self.buffers
        buffers.clear()  # left over if pickling the previous element failed
        payload = self.pickler.dumps(element)
        del element
        if not buffers and len(payload) <= P.INLINE_MAX:
            self._post(P.HEAD.pack(P.ITEM, -1, self.seq, 0, len(payload), 0) + payload)
            return
        lengths = [b.nbytes for b in buffers]
        lengths_offset, offsets, total = P.layout(len(payload), lengths)
        index, fd, capacity = self._acquire(total)
        view = self.slots[index].view
        view[: len(payload)] = payload
        struct.pack_into(f"<{len(lengths)}q", view, lengths_offset, *lengths)
        for buf, offset in zip(buffers, offsets):
            view[offset : offset + buf.nbytes] = buf
        buffers.clear()  # drop our views of the element now, not at the next one
        self.leased[index] = self.seq
        head = P.HEAD.pack(P.ITEM, index, self.seq, capacity, len(payload), len(lengths))
        try:
            self._post(head, fd)
        finally:
            if fd >= 0:
                os.close(fd)

    def _send_array(self, a: Any) -> bool:
        """A plain contiguous numpy array: straight into a slot, no pickle. False if not."""
        dtype = a.dtype
        nbytes = a.nbytes
        if dtype.kind not in _PLAIN_KINDS or nbytes < P.OUT_OF_BAND_MIN or a.ndim > 32:
            return False
        flags = a.flags
        if flags.c_contiguous:
            order = "C"
        elif flags.f_contiguous:
            order = "F"
        else:
            return False
        # Its description, encoded once per distinct dtype, shape and order:
        # a stream mostly repeats one. Bounded, as the consumer's.
        key = (dtype, a.shape, order)
        meta = self.described.get(key)
        if meta is None:
            code = dtype.str.encode()
            if len(code) > 8:
                return False
            meta = P.ARRAY_META.pack(code, order.encode()) + struct.pack(f"<{a.ndim}q", *a.shape)
            if len(self.described) >= 256:
                self.described.clear()
            self.described[key] = meta
        index, fd, capacity = self._acquire(nbytes)
        # Its bytes in memory order (the transpose of an F-ordered array is C-ordered).
        self.slots[index].view[:nbytes] = memoryview(a if order == "C" else a.T).cast("B")
        self.leased[index] = self.seq
        head = P.HEAD.pack(P.ARRAY, index, self.seq, capacity, nbytes, a.ndim)
        try:
            self._post(head + meta, fd)
        finally:
            if fd >= 0:
                os.close(fd)
        return True
