"""An interrupt (KeyboardInterrupt, SystemExit) raised in the main thread every
few hundred microseconds while a loop consumes a loader, and the checks that the
loop still got every element exactly once. Shared by the loader tests of
interrupts and of the ring."""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

from collective_gc.data import LoaderError

TOTAL = 3000
INTERRUPTS = [KeyboardInterrupt, SystemExit]


class _Hung(BaseException):
    pass


_STDLIB = os.path.dirname(threading.__file__)
# The standard library's finalizers and weak reference callbacks (WeakSet,
# WeakValueDictionary): Python swallows what is raised in them.
_SWALLOWING = frozenset({"__del__", "_remove", "remove"})


def _inside_the_loader(frame: Any) -> bool:
    """Whether the main thread is running the loader's code, or the standard
    library's on its behalf: where the interrupt is the loader's to survive.

    Elsewhere (this file's own loop; a callback of the collector or of pytest,
    a finalizer such as ``Popen.__del__``, or a weak reference's callback such
    as ``WeakSet``'s when the collector frees a test's ``Thread`` meanwhile,
    all of which swallow what is raised in them as an "exception ignored")
    nothing is raised.
    """
    if frame is None:
        return False
    name = frame.f_code.co_filename
    if "collective_gc/data/" in name:
        return True
    while frame is not None and frame.f_code.co_filename.startswith(_STDLIB):
        if frame.f_code.co_name in _SWALLOWING:  # run by the collector meanwhile
            return False
        frame = frame.f_back
    return frame is not None and "collective_gc/data/" in frame.f_code.co_filename


class Pester:
    """Raises ``exc`` in the main thread every 50-500 us, wherever it is except in
    this file's own code (the loop that resumes after each interrupt), until
    :meth:`stop`: a one-shot interval timer (SIGALRM, from the kernel: no thread
    has to get the GIL to send it) re-armed at a random delay by its handler."""

    def __init__(
        self,
        exc: type[BaseException],
        limit: float = 60.0,
        every: tuple[float, float] = (0.00005, 0.0005),
    ) -> None:
        self.exc = exc
        self.every = every
        self.armed = True
        self.deadline = time.monotonic() + limit
        self.rng = random.Random(13)
        self.old = signal.signal(signal.SIGALRM, self._handler)
        signal.setitimer(signal.ITIMER_REAL, 0.001)

    def _handler(self, signum: int, frame: Any) -> None:
        if self.armed:
            signal.setitimer(signal.ITIMER_REAL, self.rng.uniform(*self.every))
            if time.monotonic() > self.deadline:
                # A loader deadlocked by an interrupt: signals still reach us
                # (lock waits are interruptible), so fail instead of hanging.
                self.armed = False
                raise _Hung("the loop made no progress: the loader hangs")
            if _inside_the_loader(frame):
                raise self.exc("pestered")

    def stop(self) -> None:
        self.armed = False  # a signal still on its way must not hit the test's own code
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, self.old)


def consume_under_interrupts(
    it: Iterator[Any],
    exc: type[BaseException],
    *,
    whole: bool = False,
    every: tuple[float, float] = (0.00005, 0.0005),
) -> tuple[list[Any], int, BaseException | None]:
    """Iterate ``it`` to the end, resuming after every interrupt (one every
    ``every`` seconds, a random delay in that range).

    The loop body only appends (a call whose effect is complete before an
    interrupt can be raised after it), so an element can only go missing
    inside the loader. Returns (what was delivered: the (key, first value)
    pairs, or the elements themselves if ``whole``; the number of interrupts
    caught; the LoaderError that ended it or None).
    """
    got: list[Any] = []
    interrupts = 0
    error: BaseException | None = None
    finished = False
    pester = Pester(exc, every=every)
    try:
        while not finished:
            try:
                if whole:
                    for e in it:
                        got.append(e)
                else:
                    for e in it:
                        got.append((e[0], e[1][0]))
                finished = True
            except exc:
                interrupts += 1
            except LoaderError as err:
                error = err
                finished = True
    finally:
        pester.stop()
    return got, interrupts, error


def check_exactly_once(got: list[tuple[Any, Any]], error: BaseException | None) -> None:
    keys = [k for k, _ in got]
    assert keys == list(range(len(keys))), "an element was skipped, repeated or reordered"
    assert all(float(v) == k for k, v in got)
    if error is None:
        assert len(got) == TOTAL, "the loop ended early with no error: a silent short epoch"
