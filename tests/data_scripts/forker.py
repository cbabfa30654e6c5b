"""A training loop that forks (an asynchronous checkpoint writer) inside a loader.

Usage: forker.py KIND HOW [probe], KIND ``process`` or ``thread``, HOW one of:
  exit   the child leaves with sys.exit(0) through the ``with`` block;
  close  the child calls loader.close(), then os._exit(0);
  new    the child drops its copy and iterates a loader of its own.
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


def main(kind: str, how: str, probe: bool) -> int:
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
