"""Functions the loader tests run in worker processes (importing only numpy)."""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any

import numpy as np

N = 65536  # float32 elements: 256 KiB, well above the out-of-band threshold


def make(i: int) -> np.ndarray[Any, Any]:
    return np.full(N, i, np.float32)


def make_nested(i: int) -> dict[str, Any]:
    return {
        "x": np.full((64, 256), i, np.float64),
        "f": np.asfortranarray(np.arange(i, i + 2048, dtype=np.int32).reshape(32, 64)),
        "strided": (np.arange(10_000, dtype=np.int64) + i)[::3],  # not contiguous: in-band
        "pair": (np.full(3, i, np.int8), f"tag{i}"),
        "list": [i, None, 2.5],
        "big_text": "y" * (100_000 if i % 3 == 0 else 10),  # sometimes larger than a message
    }


def make_sized(i: int) -> np.ndarray[Any, Any]:
    # Sizes that vary a lot, so slots must grow and be replaced.
    return np.full(1 + (i * 7919) % 300_000, i % 251, np.uint8)


def plain(i: int) -> tuple[int, str]:
    return i, str(i)


def fail_at_3(i: int) -> np.ndarray[Any, Any]:
    if i == 3:
        raise ValueError(f"cannot load {i}")
    return make(i)


class OddError(Exception):
    def __init__(self, a: int, b: int) -> None:
        # Neither rebuilt by unpickling (its args are one string) nor from a message.
        super().__init__(f"{a}/{b}")


def odd_fail(i: int) -> int:
    raise OddError(i, i)


class LockedError(Exception):
    """Its instances hold a lock, so they cannot be pickled; the class can."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.lock = threading.Lock()


def locked_fail(i: int) -> int:
    raise LockedError(f"no {i}")


def crash_at_2(i: int) -> np.ndarray[Any, Any]:
    if i == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    return make(i)


def slow(i: int) -> np.ndarray[Any, Any]:
    time.sleep(30 if i >= 4 else 0)
    return make(i)


def batch(i: int) -> dict[str, Any]:
    return {"x": np.full((16, 1024), i, np.float32), "i": i}


def small(i: int) -> tuple[int, np.ndarray[Any, Any]]:
    # 4 KiB: the smallest array that travels through a slot, so thousands can be kept.
    return i, np.full(1024, i, np.float32)


def tagged(i: int) -> np.ndarray[Any, Any]:
    # 16 KiB: made and copied fast, so a worker spends much of its time posting.
    return np.full(4096, i, np.int32)


def second_by_socket(i: int) -> tuple[int, str]:
    # Element 1 is too big for a ring entry (the socket); the others fit one.
    return i, "x" * (5000 if i == 1 else 1)


def policy(i: int) -> tuple[int, int]:
    return i, os.sched_getscheduler(0)


def mixed_channels(i: int) -> tuple[int, Any]:
    # A pickle that fits a ring entry, one that does not (the socket), and an
    # array in a slot (ring, or socket with the slot's descriptor), in turn.
    if i % 3 == 0:
        return i, "s"
    if i % 3 == 1:
        return i, "x" * (5000 + i)
    return i, np.full(1024, i, np.float32)


class ForkThenCrash:
    """At key ``at``: fork a child that outlives the worker (it sleeps, holding
    every descriptor the worker had), write the child's pid to ``path``, then
    die by SIGKILL. Other keys: an element like :func:`make`."""

    def __init__(self, path: str, at: int = 2, crash: bool = True) -> None:
        self.path, self.at, self.crash = path, at, crash

    def __call__(self, i: int) -> np.ndarray[Any, Any]:
        if i == self.at:
            pid = os.fork()
            if pid == 0:  # the grandchild: a long-lived helper the user's fn started
                time.sleep(120)
                os._exit(0)
            with open(self.path, "a") as f:
                f.write(f"{pid}\n")
            if self.crash:
                os.kill(os.getpid(), signal.SIGKILL)
        return make(i)


_INIT: list[int] = []  # set in a worker by record_init


def record_init(worker_id: int) -> None:
    _INIT.append(worker_id)


def failing_init(worker_id: int) -> None:
    raise OSError(f"no device for worker {worker_id}")


def whoami(i: int) -> tuple[int, int, int | None]:
    """(key, this process's pid, the id record_init saw here, or None)."""
    return i, os.getpid(), _INIT[-1] if _INIT else None


def array_kinds(i: int) -> np.ndarray[Any, Any]:
    # Shapes, dtypes and memory orders that take the no-pickle path (>= 4 KiB).
    kinds: list[np.ndarray[Any, Any]] = [
        np.arange(2048, dtype=np.int32) + i,
        np.full((32, 64), i, np.float64),
        np.asfortranarray(np.arange(4096, dtype=np.int16).reshape(64, 64) + i),
        np.full((4, 8, 16, 8), i, np.complex64),
        np.ones(5000, dtype=np.bool_),
        np.full((0, 8192), i, np.float32),  # empty: small, pickled inline
        np.full(4097, i % 256, np.uint8),
        np.full((1, 1024), i, ">f4"),  # big-endian
    ]
    return kinds[i % len(kinds)]
