"""A training loop that forks (an asynchronous checkpoint writer) inside a loader.

Usage: forker.py KIND HOW [probe], KIND ``process`` or ``thread``, HOW one of:
  exit   the child leaves with sys.exit(0) through the ``with`` block;
  close  the child calls loader.close(), then os._exit(0);
  new    the child drops its copy and iterates a loader of its own;
  helper (process only) the child is a helper that does not use the loader:
         it must hold no descriptor and no mapping of the loader's memory,
         although it has copies of elements the parent keeps (of the open
         loader, and of one closed already), and those copies must be its
         own: whole, and unchanged when the parent then writes into its
         elements (exit code 7 if not); and
         a helper that lives on does not slow the parent's close() down
         (exit code 8 if it does).
With ``probe``, the child first checks that its copy's next() raises a clear
error (exit code 3 if not). The parent waits for the child (exit code 4 if the
child hangs), then checks that its loader delivers every element, in order
(exit code 5 if not). Prints "ok" on success.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

import mpi4py

mpi4py.rc.initialize = False  # no MPI singleton: this test is about processes only

import numpy as np  # noqa: E402

from collective_gc.data import LoaderError, ProcessPrefetch, ThreadPrefetch  # noqa: E402

TOTAL = 200


def element(i: int) -> np.ndarray[Any, Any]:
    return np.full(16384, i, np.float32)


def make(kind: str, n: int) -> Any:
    if kind == "process":
        return ProcessPrefetch(element, range(n), num_workers=2, buffer_size=4)
    return ThreadPrefetch((element(i) for i in range(n)), buffer_size=4)


def in_child(kind: str, how: str, probe: bool, loader: Any) -> None:
    if probe:
        probe_next(loader)
    if how == "close":
        loader.close()
        os._exit(0)
    if how == "new":
        del loader
        with make(kind, 20) as mine:
            got = [int(e[0]) for e in mine]
        os._exit(0 if got == list(range(20)) else 6)
    sys.exit(0)  # through the parent's `with`, its atexit handlers and finalization


def probe_next(loader: Any) -> None:
    try:
        next(loader)
    except LoaderError as exc:
        if "fork" not in str(exc):
            print("child: unclear error:", exc, file=sys.stderr, flush=True)
            os._exit(3)
    except BaseException as exc:  # noqa: BLE001 (reported)
        print("child: next() raised", repr(exc), file=sys.stderr, flush=True)
        os._exit(3)
    else:
        print("child: next() of the parent's loader gave an element", file=sys.stderr)
        os._exit(3)
    try:  # and again: the loader stays unusable here
        next(loader)
    except LoaderError:
        return
    os._exit(3)


def memfds() -> tuple[list[str], list[str]]:
    """This process's descriptors and mappings of loader memory (memfds)."""
    fds = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # the listing's own descriptor, closed by now
            continue
        if "memfd:collective_gc" in target:
            fds.append(target)
    with open("/proc/self/maps") as f:
        maps = [line.split()[-2] for line in f if "memfd:collective_gc" in line]
    return fds, maps


def fork_a_helper(held: list[Any], keys: list[int]) -> int:
    """Fork a helper while this process holds ``held`` (elements of keys
    ``keys``); the helper checks it maps none of the loader's memory and
    that its copies are its own. Returns the helper's exit code."""
    ready_r, ready_w = os.pipe()
    wrote_r, wrote_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(ready_r)
        os.close(wrote_w)
        fds, maps = memfds()
        if fds or maps:
            print("the helper holds", fds, maps, file=sys.stderr, flush=True)
            os._exit(7)
        whole = all((x == k).all() for x, k in zip(held, keys))
        os.write(ready_w, b"x")
        os.read(wrote_r, 1)  # the parent has written into its elements
        if not whole or not all((x == k).all() for x, k in zip(held, keys)):
            print("the helper's copies are not its own", file=sys.stderr, flush=True)
            os._exit(7)
        os._exit(0)
    os.close(ready_w)
    os.close(wrote_r)
    if os.read(ready_r, 1):  # else the helper failed already
        for x in held:
            x[:] = -1  # the parent's own elements: ours to write while we hold them
        os.write(wrote_w, b"x")
    code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    for x, k in zip(held, keys):
        x[:] = k
    os.close(ready_r)
    os.close(wrote_w)
    return code


def helper() -> int:
    # An element of a loader closed already (it outlives its loader), then
    # four of an open one, kept while the loop goes on.
    with make("process", 3) as first:
        old = next(first)
    with make("process", TOTAL) as loader:
        kept: list[Any] = []
        i = -1
        for e in loader:  # not enumerate(): its cached tuple would keep the last element
            i += 1
            if i in (5, 6, 7, 8):
                kept.append(e)
            if i == 10:
                del e  # dead: its slot waits to be handed back
                code = fork_a_helper([old, *kept], [0, 5, 6, 7, 8])
                if code:
                    return code
        assert [int(x[0]) for x in kept] == [5, 6, 7, 8] and int(old[0]) == 0
    # And a helper that lives on does not hold the workers' parent-watch pipes:
    # close() ends them at once, not after close_timeout's SIGKILL.
    loader = ProcessPrefetch(element, range(TOTAL), num_workers=2, close_timeout=5.0)
    next(loader)
    time.sleep(0.2)  # the workers are a buffer ahead, waiting for us
    pid = os.fork()
    if pid == 0:
        time.sleep(60)
        os._exit(0)
    try:
        t0 = time.monotonic()
        loader.close()
        took = time.monotonic() - t0
    finally:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
    if took > 2.5:
        print(f"close() took {took:.1f} s with a helper alive", file=sys.stderr)
        return 8
    print("ok")
    return 0


def main(kind: str, how: str, probe: bool) -> int:
    if how == "helper":
        return helper()
    got: list[int] = []
    with make(kind, TOTAL) as loader:
        for e in loader:
            got.append(int(e[0]))
            if len(got) == 10:
                pid = os.fork()
                if pid == 0:
                    in_child(kind, how, probe, loader)
                deadline = time.monotonic() + 20
                while True:
                    done, status = os.waitpid(pid, os.WNOHANG)
                    if done:
                        break
                    if time.monotonic() > deadline:
                        os.kill(pid, 9)
                        os.waitpid(pid, 0)
                        print("the child hangs", file=sys.stderr)
                        return 4
                    time.sleep(0.01)
                code = os.waitstatus_to_exitcode(status)
                if code:
                    print("the child failed with", code, file=sys.stderr)
                    return code
    if got != list(range(TOTAL)):
        print(f"the parent got {len(got)} elements", file=sys.stderr)
        return 5
    print("ok")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2], sys.argv[3:] == ["probe"]))
