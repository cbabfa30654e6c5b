"""Exit and fork.

At exit, before mpi4py and petsc4py finalize (they use ``Py_AtExit``, which
runs after every ``atexit`` handler), every manager runs the exit agreement,
newest first (sub-communicators before the communicators they came from),
against ``COLLECTIVE_GC_EXIT_TIMEOUT``, after a full collection that first
thaws whatever ``gc.freeze()`` took out of the collector's reach (garbage
frozen with the rest: see ``_gcpolicy.thaw_all``). A process dying of an
uncaught exception skips it: the other ranks may never get there. In a
forked child nothing of the parent's runs.
"""

from __future__ import annotations

import atexit
import gc
import os
import sys
import time
import types
import warnings
from typing import Any

from mpi4py import MPI

from . import _collective, _gcpolicy, _interrupts, _lookup, _registration, _transport, local
from ._errors import ExitLeakWarning

__all__ = ["exit_timeout"]


EXIT_TIMEOUT_ENV = "COLLECTIVE_GC_EXIT_TIMEOUT"


def exit_timeout() -> float:
    """Seconds the exit agreement may wait (``COLLECTIVE_GC_EXIT_TIMEOUT``, default 10).

    Local. Unset or empty means 10; ``inf`` means no deadline. Anything else
    that is not a positive number is a usage error at import (ValueError): a
    typo silently turned into 10 s would time out an exit the user meant to
    wait for. Read again at each use, so that a value the program sets later
    counts; a bad one set later is warned of and the value read at import
    used instead (raised at exit, it would skip the exit agreement on this
    rank; at a scope's exit, replace the body's exception).
    """
    try:
        return _read_exit_timeout()
    except ValueError as exc:
        text = f"collective_gc: {exc}; using {_AT_IMPORT} s, the value read at import"
    try:
        warnings.warn(text, RuntimeWarning, stacklevel=2)
    except Warning:  # warnings made errors (-W error): said, never raised here
        print(f"RuntimeWarning: {text}", file=sys.stderr)
    return _AT_IMPORT


def _read_exit_timeout() -> float:
    raw = os.environ.get(EXIT_TIMEOUT_ENV, "").strip()
    if not raw:
        return 10.0
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not value > 0:  # also refuses nan
        raise ValueError(
            f"{EXIT_TIMEOUT_ENV}={os.environ[EXIT_TIMEOUT_ENV]!r} is not a positive number of "
            "seconds: set it to the time the exit agreement (and a scope's exit after an "
            "exception) may wait for the other ranks, e.g. 30 or inf, or unset it for the "
            "default of 10"
        )
    return value


def _at_exit() -> None:
    if _registration.shut_down():
        return
    if _transport.forked():
        _registration.set_shut_down(True)  # a forked child runs none of the parent's destroys
        local.shutdown()
        return
    try:
        fams = [f for f in _collective.families() if f.members]
        if _UNCAUGHT[0] and fams:
            # Dying of an uncaught exception, maybe on this rank only: the
            # others may never reach an exit agreement, and under `python -m
            # mpi4py` the job is about to be aborted. Leak, and say so.
            left = sum(len(f.registry.pending(f.seq)) for f in fams)
            if left:
                warnings.warn(
                    f"collective_gc: exiting on an uncaught exception: {left} pending "
                    "collective destroy(s) not run",
                    ExitLeakWarning,
                    stacklevel=1,
                )
            if MPI.Is_initialized() and not MPI.Is_finalized():
                _end_exits()
            return
        if not MPI.Is_initialized() or not fams:
            return
        if MPI.Is_finalized():
            # Finalized by hand: nothing can be agreed any more.
            for fam in fams:
                fam.registry.drain(fam.seq)
                queued = fam.registry.pending(fam.seq)
                if queued:
                    warnings.warn(
                        f"collective_gc: rank {fam.rank}: leaked at exit (MPI was finalized "
                        f"before them): {_collective.leak_text(queued, fam.label)}",
                        ExitLeakWarning,
                        stacklevel=1,
                    )
            return
        interrupt: BaseException | None = None
        # One protected region for the exit collection and every family's
        # exit agreement: a signal's handler runs once they are all done
        # (see _interrupts), not in the collection (which may be long), where
        # it would skip this rank's exit agreements while the others wait in
        # them. Newest first: a derived family's before the one it came from.
        entered = _interrupts.enter()
        try:
            try:
                # Garbage a gc.freeze() took out of reach is found too (see _gcpolicy).
                _gcpolicy.thaw_all()
                gc.collect()
                _lookup.release_freed()
                deadline = time.monotonic() + exit_timeout()
                for fam in reversed(_collective.families()):
                    owner = next((m for _, m in fam.live_members()), None)
                    if owner is None:
                        continue
                    try:
                        fam.exit_agreement(owner, deadline)
                    except BaseException as exc:
                        # An interrupt, raised by a destroy on this rank: the
                        # other ranks go on with the other families' exit
                        # agreements, and so does this one; it is raised once
                        # they are done.
                        if interrupt is None:
                            interrupt = exc
                        else:
                            interrupt.add_note(f"collective_gc: then, at exit: {exc!r}")
            finally:
                _end_exits()  # (whatever raised: no request left posted at MPI_Finalize)
            if interrupt is not None:
                try:
                    raise interrupt
                finally:
                    interrupt = None
        finally:
            _interrupts.leave(entered)
    finally:
        _registration.set_shut_down(True)  # finalizers from now on do nothing
        local.shutdown()


# What the parent's registrations held, in a forked child: the parent's
# resources (a PETSc object, an HDF5 file, a window; rank-local, a buffered
# writer, a temporary file). The child never runs their destroys, and must not
# let go of them either: the last reference dropped runs a resource's own
# destructor (an H5Fclose, a collective MPI call, a flush into the parent's
# file, an unlink of it) in the child. So they stay here for the child's life
# (a forked child usually leaves by os._exit, which runs no destructor). Only
# the rank-local registrations made to be let go of in a child
# (local.register_released_in_child: the loader's segments, whose mappings
# are the child's own copies) are let go of.
_INHERITED: list[Any] = []


def _end_exits() -> None:
    """Every family's watch taken down (local), before MPI_Finalize."""
    for fam in _collective.families():
        fam.end_exit()


def _after_fork_in_child() -> None:
    # Only the forking thread exists in the child: each module makes its
    # locks anew rather than take them (another thread may have held one).
    _registration.after_fork()
    _gcpolicy.after_fork()
    _INHERITED.extend(_lookup.after_fork())
    _INHERITED.extend(local.after_fork())


# Whether the interpreter is dying of an uncaught exception: noted by our
# sys.excepthook, which the interpreter calls only for that (sys.last_value
# is no sign of it: pytest, for one, sets it for every failed test).
_UNCAUGHT: list[bool] = [False]
_previous_excepthook = sys.excepthook


def _excepthook(
    tp: type[BaseException], value: BaseException, tb: types.TracebackType | None
) -> None:
    # The interpreter calls the hook for an exception that kills it once the
    # program's frames are gone: from C, or through another library's hook
    # that wraps ours (a crash reporter's). Code that goes on after (the
    # interactive interpreter of module code for every error it shows, a GUI
    # toolkit for an error in a callback, a program logging one) calls it
    # with the program's frames still below: a module's code among them. No
    # death, so the exit agreement must still run.
    if not _program_running():
        _UNCAUGHT[0] = True
    _previous_excepthook(tp, value, tb)


def _program_running() -> bool:
    """Whether a module's code (a ``<module>`` frame: the main script's, or
    an import's) is below the hook's caller."""
    try:
        frame: types.FrameType | None = sys._getframe(2)  # (the hook's caller)
    except ValueError:
        return False  # none: the interpreter's own call, from C
    while frame is not None:
        if frame.f_code.co_name == "<module>":
            return True
        frame = frame.f_back
    return False


# Read once here so that a bad value is a usage error at import, on every rank
# alike and before anything collective (see exit_timeout).
_AT_IMPORT = _read_exit_timeout()
sys.excepthook = _excepthook
atexit.register(_at_exit)
os.register_at_fork(after_in_child=_after_fork_in_child)
