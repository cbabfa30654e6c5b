"""Asynchronous exceptions and collectives: protected regions.

The problem. A Python signal handler runs in the main thread between two
bytecodes, wherever the main thread happens to be, and whatever it raises
(KeyboardInterrupt from Python's SIGINT handler, TimeoutError from a
``signal.alarm`` watchdog, SystemExit from a SIGTERM handler) surfaces there.
Inside a sync point that is anywhere: between starting a collective and
waiting on it, between draining the inbox and storing the pending keys,
between marking a batch destroyed and running it. A rank that leaves a sync
point there has made fewer collectives than the others (they wait for ever at
the next one) or has forgotten destroys it had queued. Catching the exception
at each such spot does not work: every round of hostile testing found the next
spot, and code that only sometimes runs cannot be made to run the rest of the
sync point from an arbitrary bytecode.

The mechanism. Code that must run to its end on every rank (a sync point, the
gathers of ``view`` and of strict mode's report, the first registration on a
communicator, ``Manager.close``, the exit agreements) runs inside a
*protected region*: ``entered = enter()`` before it, ``leave(entered)`` in a
``finally`` after it. While the main thread is inside one, the handlers of
the signals in :data:`SIGNALS` do not run: a signal that arrives is noted, and
its handler is called by the outermost ``leave``, once the region's
collectives are done on this rank, so whatever it raises is raised there, on
its own rank, after every rank left the region through the same collectives
(if the region itself raised, the handler's exception is raised instead, with
the region's as its context). Nothing inside a region is ever cut short by a
signal, so nothing inside needs to catch one.

How. Like trio (``src/trio/_core/_ki.py``), the decision is taken in the
handler, which is ours: on entering an outermost region, every Python handler
of :data:`SIGNALS` that is not already ours (Python's own SIGINT handler, or
the program's) is wrapped, once, by a :class:`Deferring` handler that calls it
at once outside regions and notes the signal inside one. A signal is noted
once per region however often it arrives (as the kernel coalesces a pending
signal), except SIGINT: a second Ctrl-C while one is deferred runs the handler
at once, so that a rank stuck in a region (a destroy that never returns) can
still be interrupted, at the price of leaving that region half-way (its
manager is then unusable, as before this mechanism). Only the main thread's
regions matter: Python runs signal handlers in the main thread only.

A region's first edge. A region begins with a call, and the interpreter
runs handlers before it too (as the function starts, after a C call): a
function that must not be left there, because nobody calls it again (a
scope's ``__exit__``), makes ``enter()`` its first call and is marked by
:func:`protect_entry`; the handler, given the frame the signal arrived in,
defers it when that frame is such a function's, before its call.

Handlers installed inside a region. Code that runs inside a region (a
destroy, a finalizer, a participant's finish) may install a handler itself: a
library that sets up a ``SIGALRM`` preemption in a destructor. Wrapping at the
entry cannot see it, and its signal may arrive before the region ends, in a
collective the other ranks are waiting in. So ``signal.signal`` is routed
through :func:`_signal` (bound in the ``signal`` module once, at import): while
the main thread is inside a region, a Python handler of a signal in
:data:`SIGNALS` is installed already wrapped, and is deferred like the ones
the region found. Outside regions it installs what it is given, unchanged, so
a program that never enters a region sees no difference. Not covered: a
handler installed inside a region through a reference to the original taken
before ``collective_gc`` was imported (``from signal import signal`` in a
module imported earlier, ``_signal.signal``): it is wrapped at the next
region's entry only, and its signal arriving before that runs it where it
arrives, as before this mechanism.

What a program sees. After the first protected region, ``signal.getsignal(s)``
for a signal in :data:`SIGNALS` that had a Python handler returns a
:class:`Deferring` object whose ``__wrapped__`` is that handler; installing
another handler replaces it (the next region wraps that one; inside a region
it is wrapped as it is installed); SIG_DFL and SIG_IGN are left alone.
``signal.signal`` is this module's :func:`_signal`, whose ``__wrapped__`` is
the one it replaced. A handler deferred to the end of a region is called
with the frame in which the signal arrived.
"""

from __future__ import annotations

import dis
import importlib
import signal
import threading
import types
from collections.abc import Callable
from typing import Any, TypeVar

from ._state import PythonRegion, Region

# The stdlib's own C implementation of signal.getsignal, which the public one
# wraps: the wrapper converts every answer to an enum, which costs more than an
# empty sync point.
_getsignal: Callable[[int], object] = importlib.import_module("_signal").getsignal

__all__ = ["SIGNALS", "REGION", "Deferring", "enter", "leave", "deferred", "protect_entry"]

Handler = Callable[[int, types.FrameType | None], Any]

# The signals whose Python handlers are deferred inside regions: those a
# program installs handlers for that raise (Ctrl-C, watchdogs, preemption).
SIGNALS: tuple[int, ...] = tuple(
    int(getattr(signal, name))
    for name in (
        "SIGINT",
        "SIGTERM",
        "SIGALRM",
        "SIGHUP",
        "SIGUSR1",
        "SIGUSR2",
        "SIGVTALRM",
        "SIGPROF",
    )
    if hasattr(signal, name)
)

_MAIN = threading.main_thread().ident
_get_ident = threading.get_ident


class Deferring:
    """A signal handler that calls ``__wrapped__`` at once outside protected
    regions, and at the end of the outermost one inside (see the module docs)."""

    __slots__ = ("__wrapped__",)

    def __init__(self, handler: Handler) -> None:
        self.__wrapped__ = handler

    def __call__(self, signum: int, frame: types.FrameType | None) -> Any:
        handler = self.__wrapped__
        if not REGION.depth and not _at_an_entry(frame):
            return handler(signum, frame)
        deferred = REGION.deferred
        for _, seen, _ in deferred:
            if seen == signum:
                if signum == signal.SIGINT:
                    return handler(signum, frame)  # a second Ctrl-C: now
                return None  # one delivery per signal and region
        deferred.append((handler, signum, frame))
        return None

    def __repr__(self) -> str:
        return f"<collective_gc deferring handler of {self.__wrapped__!r}>"


_F = TypeVar("_F", bound=Callable[..., Any])

# The functions whose first call enters a region, by code object, with the
# offset of the instruction after that call (see protect_entry).
_ENTRIES: dict[types.CodeType, int] = {}


def protect_entry(fn: _F) -> _F:
    """Decorator: ``fn``'s region begins at its first bytecode. A region
    entered by a call cannot cover the instructions before that call, where
    the interpreter still runs handlers (at the function's entry, after a C
    call); a function that must not be left there, because its caller never
    calls it again (``__exit__``: a ``with`` statement calls it once), makes
    ``enter()`` its first call and is decorated: a signal whose handler
    would run in its frame before that call has returned (or in the pure
    twin's ``enter`` itself, before it counts) is deferred as inside the
    region, which then delivers it (trio marks its protected code objects
    the same way, and its handler looks at the interrupted frame)."""
    code = fn.__code__
    ins = list(dis.get_instructions(code))
    loads = [n for n, i in enumerate(ins) if i.argval == "enter"]
    calls = [n for n in range(loads[0], len(ins)) if ins[n].opname == "CALL"] if loads else []
    if not calls or calls[0] + 1 >= len(ins):
        raise TypeError(f"{fn.__qualname__} never calls enter(): it has no region to begin")
    _ENTRIES[code] = ins[calls[0] + 1].offset  # the instruction after that call
    return fn


_PYTHON_ENTER = PythonRegion.enter.__code__


def _at_an_entry(frame: types.FrameType | None) -> bool:
    """Whether ``frame`` is a :func:`protect_entry` function's before its
    call of ``enter``, or the pure twin's ``enter`` called from there (a
    Python method: the handler may run in its frame before it counts)."""
    if frame is not None and frame.f_code is _PYTHON_ENTER:
        frame = frame.f_back
    return frame is not None and _ENTRIES.get(frame.f_code, -1) > frame.f_lasti


def _guard() -> tuple[object, ...]:
    """Wrap the handlers that are not ours; what getsignal() gives after
    (while it gives the same, every Python handler among SIGNALS is ours)."""
    for signum in SIGNALS:
        handler = _getsignal(signum)
        if callable(handler) and not isinstance(handler, Deferring):
            _install(signum, Deferring(handler))
    return tuple(map(_getsignal, SIGNALS))


# signal.signal as it was before this module replaced it (see the module docs:
# "Handlers installed inside a region"); a second import of this module (a
# reload) takes the original from the first one's replacement.
_Installed = Handler | int | signal.Handlers | None  # what signal.signal takes and returns
_install: Callable[[int | signal.Signals, _Installed], _Installed] = getattr(
    signal.signal, "_collective_gc_original", signal.signal
)


def _signal(signalnum: int | signal.Signals, handler: _Installed, /) -> _Installed:
    """``signal.signal``, except that inside a protected region a Python
    handler of a signal in :data:`SIGNALS` is installed wrapped in a
    :class:`Deferring`, so that it runs at the region's end (see the module docs)."""
    if (
        REGION.depth
        and callable(handler)
        and not isinstance(handler, Deferring)
        and signalnum in SIGNALS
        and _get_ident() == _MAIN
    ):
        handler = Deferring(handler)
    return _install(signalnum, handler)


_signal.__wrapped__ = _install  # type: ignore[attr-defined]
_signal._collective_gc_original = _install  # type: ignore[attr-defined]
signal.signal = _signal  # type: ignore[assignment]  # (see the module docs)


def deferred() -> int:
    """How many signals wait for the end of the current region."""
    return len(REGION.deferred)


def _deliver() -> BaseException | None:
    """Call the deferred handlers, in the order their signals arrived, every
    one (and those of signals arriving meanwhile); return the first exception
    (the others as its notes)."""
    first: BaseException | None = None
    deferred = REGION.deferred
    while deferred:
        handler, signum, frame = deferred.pop(0)
        try:
            handler(signum, frame)
        except BaseException as exc:  # every handler runs; the first is raised
            if first is None:
                first = exc
            else:
                first.add_note(f"collective_gc: then signal {signum}'s handler raised {exc!r}")
        finally:
            del frame
    try:
        return first
    finally:
        first = None


# The main thread's regions (in C where the extension is built: a sync point
# enters and leaves one, and the Python pair costs about 0.5 us, the C one
# about 0.2 us); it calls _guard and _deliver for the rare steps.
REGION = Region(_MAIN or 0, SIGNALS, _getsignal, _guard, _deliver)
enter: Callable[[], bool] = REGION.enter
leave: Callable[[bool], None] = REGION.leave
