"""A worker's process: spawning it, its boot data, stopping it and reaping it.

Workers are started from one thread that lives as long as the process (the
spawner, see ``_pool``), so ``PR_SET_PDEATHSIG`` means the parent's death
whichever thread made the loader. Each worker leads its own process group
(whatever its function starts is killed with it).

Stopping closes the worker's parent-watch pipe (its watch thread then ends
the process group at once); waiting for it keeps its deadlines across calls
(NOTE [ Loader shutdown and interrupts ] in ``_loader``, rule 3). In a
process forked from the owner the part is inert (:meth:`WorkerProcess.forget_in_child`).

:class:`WorkerProcess` is the process part of a worker's handle (``_pool``).
"""

from __future__ import annotations

import fcntl
import mmap
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import NamedTuple

from . import _protocol as P
from . import _shm
from ._forked import close_fields
from ._worker import BOOT

__all__ = ["Spawned", "WorkerProcess", "spawn"]


class Spawned(NamedTuple):
    """A worker just started, and the parent's ends of what connects it."""

    proc: subprocess.Popen[bytes]
    sock: socket.socket
    sentinel: int  # write end of its parent-watch pipe
    boot: int  # write end of its boot pipe
    ring: mmap.mmap | None
    bell: int
    wake: int


def spawn(
    wid: int, window: int, pdeathsig: bool, env: dict[str, str], ring: bool = False
) -> Spawned:
    """Start worker ``wid``: its process, waiting for its boot data, and our ends."""
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
    return Spawned(proc, parent_sock, sentinel_w, boot_w, ring_map, bell, wake)


class WorkerProcess:
    """A worker's process: its boot data, its parent-watch pipe, stopping and reaping it."""

    __slots__ = (
        "boot",
        "forked",
        "group_gone",
        "join_at",
        "kill_at",
        "lock",
        "name",
        "proc",
        "sentinel",
    )

    def __init__(self, wid: int, proc: subprocess.Popen[bytes], sentinel: int, boot: int) -> None:
        self.proc = proc
        self.name = f"worker {wid} (pid {proc.pid})"
        self.sentinel = sentinel  # write end of the worker's parent-watch pipe; never written
        self.boot = boot  # write end of the boot pipe, until the boot data is sent
        self.lock = threading.Lock()  # the two descriptors: send_boot() and stop() race
        self.forked = False  # this process was forked from the owner (see forget_in_child)
        # When join gives up waiting, then waiting after the SIGKILL: kept
        # across calls (see join).
        self.join_at: float | None = None
        self.kill_at: float | None = None
        # Set once join has reaped the worker and killed what was left of its
        # group: a later join (close() stops more than once, and may be
        # called again) must not kill that group number, which may belong to
        # another process group by then.
        self.group_gone = False

    def send_boot(self, data: bytes) -> None:
        """Write the boot data (blocks only while the worker starts, for a big pickle)."""
        with self.lock:
            fd, self.boot = self.boot, -1
        if fd < 0:  # stopped meanwhile
            return
        try:
            with open(fd, "wb") as f:
                f.write(data)
        except BrokenPipeError:  # it died starting up: the channel reports how
            pass

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
        """Tell the worker to exit now. Never blocks; any thread; idempotent.

        EOF on its parent-watch pipe: the worker's watch thread ends its
        process group at once, even in the middle of the user's function.
        """
        with self.lock:
            sentinel, self.sentinel = self.sentinel, -1
            boot, self.boot = self.boot, -1
        for fd in (sentinel, boot):
            if fd >= 0:
                os.close(fd)

    def join(self, timeout: float) -> None:
        """Wait for the process (after :meth:`stop`); SIGKILL it after ``timeout``;
        then SIGKILL what is left of its process group.

        Bounded even if an interrupt left the ``Popen``'s own wait lock held
        (it can land between CPython's acquire and its ``try``, in an earlier
        ``wait`` cut short inside ``next()``): then the child is reaped here.
        """
        if self.forked:
            return  # not our child: the owner waits for it
        # The deadlines are kept across calls (NOTE [ Loader shutdown and
        # interrupts ] in _loader, rule 3).
        if self.group_gone:
            return
        if self.join_at is None:
            self.join_at = time.monotonic() + timeout
        try:
            self.proc.wait(max(0.0, self.join_at - time.monotonic()))
        except subprocess.TimeoutExpired:
            self._kill_group()  # the worker and what its fn started
            if self.kill_at is None:
                self.kill_at = time.monotonic() + timeout
            try:
                self.proc.wait(max(0.0, self.kill_at - time.monotonic()))
            except subprocess.TimeoutExpired:
                try:
                    _, status = os.waitpid(self.proc.pid, 0)  # SIGKILLed: exits at once
                except ChildProcessError:
                    pass  # reaped by someone else meanwhile
                else:
                    self.proc.returncode = os.waitstatus_to_exitcode(status)
        # Reaped. The worker kills its group on its own ways out, but not when
        # it dies of a signal (a crash in fn, our SIGKILL): what fn started
        # (subprocess, ffmpeg-style helpers) is still there, and must go now.
        self._kill_group()
        self.group_gone = True

    def _kill_group(self) -> None:
        # The worker leads its own process group (start_new_session=True). Its
        # number cannot be reused while any member lives, so this reaches only
        # what is left of the group; none left: ESRCH (another group taking the
        # number in the microseconds since the reap would need the pids to wrap).
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):  # nothing left of the group
            pass

    def forget_in_child(self) -> None:
        """In a process forked from the owner: close our copies of the pipes; inert from now.

        Only the forking thread exists here: no lock is taken (another thread
        may have held it at the fork).
        """
        self.forked = True
        self.lock = threading.Lock()
        close_fields(self, ("sentinel", "boot"))
