"""ProcessPrefetch: real worker processes, real shared memory, no mocks.

Launcher tests (each starts worker processes, some start scripts): they run in
the serial session; ``test_data_mpi.py`` runs loaders on every rank under
``mpiexec -n 4``. The functions the workers call live in
``data_scripts/fns.py``, which workers import by name, as they would a user's
module, without pulling in pytest.
"""

from __future__ import annotations

import fcntl
import gc
import mmap
import os
import resource
import signal
import subprocess
import sys
import time
import traceback
import types
import weakref
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from data_scripts.fns import (
    LockedError,
    N,
    crash_at_2,
    fail_at_3,
    locked_fail,
    make,
    make_nested,
    make_sized,
    odd_fail,
    plain,
    slow,
)

import collective_gc.data
from collective_gc import local
from collective_gc.data import ProcessPrefetch, RemoteTraceback, WorkerError, testing

from _util import GcDisabled as GcOff
from _util import mapped_segments, process_alive, script_env

SCRIPTS = os.path.join(os.path.dirname(__file__), "data_scripts")

# -- helpers ------------------------------------------------------------------------


# A zombie is dead: only its parent (init, after reparenting) can reap it.
_alive = process_alive


def _root(a: Any) -> Any:
    """The object at the end of an array's chain of bases."""
    while True:
        nxt = a.base if isinstance(a, np.ndarray) else getattr(a, "obj", None)
        if nxt is None:
            return a
        a = nxt


def _settle() -> None:
    """Let every pending lease and segment release happen."""
    gc.collect()
    assert local.flush(10)


@pytest.fixture
def clean() -> Iterator[None]:
    """Each test leaves no lease, no mapping, no descriptor and no worker behind."""
    _settle()
    fds = set(os.listdir("/proc/self/fd"))
    maps = mapped_segments()
    yield
    _settle()
    assert not testing.live_leases()
    assert mapped_segments() == maps
    assert set(os.listdir("/proc/self/fd")) <= fds | {"0", "1", "2"}


pytestmark = [pytest.mark.usefixtures("clean"), pytest.mark.launcher]


# -- the contract -------------------------------------------------------------------


def test_order_and_content() -> None:
    with ProcessPrefetch(make, range(40), num_workers=2, buffer_size=4) as it:
        for k, e in enumerate(it):
            assert e.shape == (N,) and e.dtype == np.float32
            assert e[0] == k and e[-1] == k
        assert k == 39
        assert it.closed


def test_indices_in_any_order_and_nested_structures() -> None:
    keys = [7, 3, 3, 0, 11, 5, 9]
    with ProcessPrefetch(make_nested, keys, num_workers=3) as it:
        got = list(it)
    assert len(got) == len(keys)
    for i, e in zip(keys, got):
        want = make_nested(i)
        assert e.keys() == want.keys()
        for k in ("x", "f", "strided"):
            np.testing.assert_array_equal(e[k], want[k])
        assert e["f"].flags.f_contiguous
        np.testing.assert_array_equal(e["pair"][0], want["pair"][0])
        assert e["pair"][1] == want["pair"][1] and e["list"] == want["list"]
        assert e["big_text"] == want["big_text"]


def test_plain_values_and_empty() -> None:
    assert list(ProcessPrefetch(plain, range(25), num_workers=2)) == [
        (i, str(i)) for i in range(25)
    ]
    assert list(ProcessPrefetch(plain, [], num_workers=2)) == []
    assert list(ProcessPrefetch(plain, [5], num_workers=4)) == [(5, "5")]


def test_slots_grow_and_are_replaced() -> None:
    with ProcessPrefetch(make_sized, range(60), num_workers=2, buffer_size=2) as it:
        for i, e in enumerate(it):
            assert e.size == 1 + (i * 7919) % 300_000 and (e == i % 251).all()


def test_kept_elements_stay_valid_and_the_ring_grows() -> None:
    # list() keeps every element alive: the ring must grow instead of deadlocking,
    # and no slot may be reused under a live array.
    before = mapped_segments()
    loader = ProcessPrefetch(make, range(50), num_workers=2, buffer_size=2)
    kept = list(loader)
    assert loader.closed
    del loader
    _settle()  # the loader and its workers are gone; the kept arrays still map memory
    assert mapped_segments() >= before + 50
    for i, e in enumerate(kept):
        assert e[0] == i and e[-1] == i
    del kept, e
    _settle()
    assert mapped_segments() == before


def test_arrays_are_views_of_shared_memory() -> None:
    with ProcessPrefetch(make_nested, [1, 2], num_workers=1) as it:
        e = next(it)
        assert e["x"].flags.writeable
        assert isinstance(_root(e["x"]), mmap.mmap)  # a view of the slot
        assert not isinstance(_root(e["strided"]), mmap.mmap)  # crossed in-band: a copy
        e["x"][:] = -1  # ours to write while we hold it
        assert next(it)["x"][0, 0] == 2


# -- errors -------------------------------------------------------------------------


def test_error_in_fn_is_reraised_with_worker_traceback() -> None:
    it = ProcessPrefetch(fail_at_3, range(8), num_workers=2)
    got = [next(it)[0] for _ in range(3)]
    assert got == [0, 1, 2]
    with pytest.raises(ValueError) as info:
        next(it)
    # The worker's own exception (it pickles), its traceback chained as the cause,
    # as concurrent.futures does.
    assert info.value.args == ("cannot load 3",)
    cause = info.value.__cause__
    assert isinstance(cause, RemoteTraceback)
    assert "in fail_at_3" in str(cause) and "worker 1" in str(cause)
    assert "Traceback (most recent call last)" in str(cause) and "key 3" in str(cause)
    assert cause.__traceback__ is None  # text only: no frame of ours or the worker's
    printed = "".join(traceback.format_exception(info.value))
    assert printed.index("in fail_at_3") < printed.index("direct cause")
    assert it.closed
    with pytest.raises(StopIteration):  # the error ended the iteration
        next(it)


def test_unpicklable_error_crosses_as_its_type_or_worker_error() -> None:
    # OddError pickles but cannot be rebuilt from its args, nor from one message.
    with pytest.raises(WorkerError, match="OddError") as info:
        list(ProcessPrefetch(odd_fail, range(3), num_workers=1))
    assert isinstance(info.value.__cause__, RemoteTraceback)
    # Not picklable at all (a lock inside), but its type is importable: rebuilt as that type.
    with pytest.raises(LockedError, match="LockedError raised in worker 0") as info2:
        list(ProcessPrefetch(locked_fail, range(3), num_workers=1))
    assert "in locked_fail" in str(info2.value.__cause__)


class RaiseText:
    """Raise ValueError(``text`` + the key) for every key. Defined here, so
    workers import this module."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __call__(self, key: Any) -> None:
        raise ValueError(self.text + str(key)[:10])


@pytest.mark.parametrize(
    "text, key",
    [("bad sample: " + "\u6c49" * 30000, 0), ("bad sample", "k" * 300_000)],
    ids=["non-ascii-text", "long-key"],
)
def test_an_error_too_big_for_one_message_crosses_cut(text: str, key: Any) -> None:
    """An error whose message is short in characters but long in bytes (CJK:
    3 bytes each), or whose key has a long repr, is cut to fit one message:
    the parent raises the worker's type with the end of its traceback, never
    "sent a malformed message" (nor a silent end for a worker whose send failed).

    From a review of the loader (fds_and_errors.py, part 1).
    """
    with pytest.raises(ValueError) as info:
        next(ProcessPrefetch(RaiseText(text), [key], num_workers=1))
    assert not isinstance(info.value, WorkerError)
    cause = str(info.value.__cause__)
    assert cause.endswith(text[-20:] + str(key)[:10] + '\n"""')  # the end, where the error is
    if key:  # the key's repr is cut
        assert "while loading key 'kkk" in cause and "k" * 100 not in cause
    else:  # the text is cut
        assert "[... traceback cut ...]" in cause and len(cause.encode()) < 1 << 16


def test_worker_crash_reports_exit_code() -> None:
    it = ProcessPrefetch(crash_at_2, range(6), num_workers=3)
    assert next(it)[0] == 0 and next(it)[0] == 1
    with pytest.raises(WorkerError) as info:
        next(it)
    assert info.value.exitcode == -signal.SIGKILL
    assert "SIGKILL" in str(info.value) and "worker 2" in str(info.value)
    assert it.closed


def test_works_with_descriptors_numbered_above_1024() -> None:
    """With more than 1024 files open, the loader's descriptors (socket, pidfd,
    doorbells: the worker keeps their numbers) are numbered 1024 and up, which
    ``select`` refuses; every wait (the consumer's, and the worker's while the
    window is full) must still work.

    From a review of the loader (fds_and_errors.py, part 2).
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1400:
        pytest.skip(f"at most {hard} descriptors may be open here")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1400), hard))
    held = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
    try:
        it = ProcessPrefetch(make, range(40), num_workers=1, buffer_size=2)
        try:
            got = [int(next(it)[0])]
            time.sleep(0.2)  # the worker fills its window and sleeps until we consume
            got += [int(x[0]) for x in it]
            assert got == list(range(40))
        finally:
            it.close()
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_received_segment_descriptors_are_close_on_exec() -> None:
    """A slot's descriptor, received from the worker, is close-on-exec from the
    receive on: a subprocess started meanwhile by any thread does not inherit it.

    From a review of the loader (received memfds). Looked at as the consumer maps it
    (a profile hook at the entry of ``_shm.map_fd``, the descriptor's only use).
    """
    seen: list[int] = []

    def hook(frame: Any, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code is collective_gc.data._shm.map_fd.__code__:
            seen.append(fcntl.fcntl(frame.f_locals["fd"], fcntl.F_GETFD))

    it = ProcessPrefetch(make, range(4), num_workers=1)
    sys.setprofile(hook)
    try:
        got = [int(x[0]) for x in it]
    finally:
        sys.setprofile(None)
        it.close()
    assert got == [0, 1, 2, 3]
    assert seen, "no segment was mapped"
    assert all(flags & fcntl.FD_CLOEXEC for flags in seen), seen


def test_unpicklable_fn_is_refused_before_any_worker_starts() -> None:
    with pytest.raises(TypeError, match="picklable"):
        ProcessPrefetch(lambda i: i, range(3), num_workers=1)


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="num_workers"):
        ProcessPrefetch(plain, range(3), num_workers=-1)
    with pytest.raises(ValueError, match="buffer_size"):
        ProcessPrefetch(plain, range(3), num_workers=1, buffer_size=0)


# -- stopping -----------------------------------------------------------------------


def _pids(it: ProcessPrefetch[Any]) -> list[int]:
    return [p.pid for p in testing.workers(it)]


def test_close_while_workers_block_on_a_full_buffer() -> None:
    it = ProcessPrefetch(make, range(1000), num_workers=2, buffer_size=2)
    first = next(it)
    time.sleep(0.3)  # both workers fill their credit and wait
    pids = _pids(it)
    t0 = time.monotonic()
    it.close()
    assert time.monotonic() - t0 < 1.0
    assert not any(_alive(p) for p in pids)
    assert first[5] == 0  # handed-out elements outlive the loader
    it.close()  # idempotent
    with pytest.raises(StopIteration):
        next(it)


def test_close_while_a_worker_is_inside_fn() -> None:
    it = ProcessPrefetch(slow, range(10), num_workers=2, close_timeout=5.0)
    for _ in range(4):
        next(it)
    time.sleep(0.2)  # both workers are now sleeping inside fn
    t0 = time.monotonic()
    it.close()
    assert time.monotonic() - t0 < 1.0  # the watch thread ends them; no 5 s wait
    # Their watch thread killed their process group (them and anything fn started).
    assert [p.returncode for p in testing.workers(it)] == [-signal.SIGKILL] * 2


def test_dropping_the_loader_stops_its_workers() -> None:
    it = ProcessPrefetch(make, range(1000), num_workers=2, buffer_size=2)
    kept = next(it)
    pids = _pids(it)
    ref = weakref.ref(it)
    del it
    assert ref() is None  # no cycle: freed by refcount at once
    assert local.flush(10)  # its finalizer ran on the reaper thread
    assert not any(_alive(p) for p in pids)
    assert kept[0] == 0


# -- the three failures that must not exist -------------------------------------------


def test_each_descriptor_closed_once_with_cyclic_collection() -> None:
    # Grain 0.2.18 closes a segment's fd twice when the collector finalizes an array
    # and its segment in one pass; the second close can hit an unrelated file that
    # reused the number. Record every os.close, put canary files on the numbers just
    # freed, and tear everything down inside one cyclic collection.
    closed: list[int] = []
    real_close = os.close

    def recording_close(fd: int) -> None:
        closed.append(fd)
        real_close(fd)

    was = gc.isenabled()
    gc.disable()
    os.close = recording_close
    try:
        it = ProcessPrefetch(make, range(30), num_workers=2, buffer_size=4)
        elements = [next(it) for _ in range(10)]
        canaries = [os.open(os.devnull, os.O_RDONLY) for _ in range(8)]
        during_run = len(closed)
        # One garbage cycle holding the loader and live arrays of every slot.
        cycle: list[Any] = [it, elements]
        cycle.append(cycle)
        del it, elements
        del cycle
        assert gc.collect() > 0
        assert local.flush(10)
        for fd in canaries:
            os.fstat(fd)  # still open: nobody closed a reused number
        teardown = closed[during_run:]
        assert not set(canaries) & set(teardown)
        assert len(teardown) == len(set(teardown)), teardown
        for fd in canaries:
            real_close(fd)
    finally:
        os.close = real_close
        if was:
            gc.enable()


def test_no_segment_unmapped_under_a_live_array() -> None:
    it = ProcessPrefetch(make, range(20), num_workers=2)
    keep = [e for i, e in enumerate(it) if i % 7 == 0]
    del it
    _settle()
    for e, i in zip(keep, (0, 7, 14)):
        assert e[0] == i and e[-1] == i  # would segfault if unmapped
    before = mapped_segments()
    del keep, e
    _settle()
    assert mapped_segments() < before


def _loop(refs: list[weakref.ref[Any]], fn: Any = make) -> ProcessPrefetch[Any]:
    loader = ProcessPrefetch(fn, range(6), num_workers=2)
    for e in loader:
        refs.append(weakref.ref(e))
    return loader


def test_no_cycles_keep_the_last_element() -> None:
    with GcOff():
        # After a function that loops over a loader returns, its last element is freed
        # (Grain 0.2.18: alive until gc.collect()).
        refs: list[weakref.ref[Any]] = []
        loader_ref = weakref.ref(_loop(refs))
        assert len(refs) == 6 and all(r() is None for r in refs)
        assert loader_ref() is None

        # An error in fn: the caller keeps the error, not the last element.
        it = ProcessPrefetch(fail_at_3, range(6), num_workers=2)
        last = [next(it) for _ in range(3)][-1]
        last_ref, it_ref = weakref.ref(last), weakref.ref(it)
        try:
            next(it)
        except ValueError as exc:
            kept_error = exc
        del last, it
        assert last_ref() is None and it_ref() is None
        assert "cannot load 3" in str(kept_error)
        del kept_error

        # A worker that dies: the same.
        it = ProcessPrefetch(crash_at_2, range(6), num_workers=3)
        last = [next(it), next(it)][-1]
        last_ref, it_ref = weakref.ref(last), weakref.ref(it)
        with pytest.raises(WorkerError):
            next(it)
        del last, it
        assert last_ref() is None and it_ref() is None
        assert not testing.live_leases()


def test_debug_saveall_finds_no_loader_garbage() -> None:
    def run() -> None:
        refs: list[weakref.ref[Any]] = []
        _loop(refs).close()
        try:
            _loop(refs, fail_at_3)
        except ValueError:
            pass
        with ProcessPrefetch(make_nested, range(5), num_workers=2) as it:
            next(it)

    gc.collect()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        with GcOff():
            run()
        gc.collect()
        garbage = list(gc.garbage)
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
    ours = (*testing.internal_types(), np.ndarray, BaseException, types.TracebackType)
    data_dir = os.path.dirname(collective_gc.data.__file__)
    bad: list[object] = [o for o in garbage if isinstance(o, ours)]
    bad += [
        o
        for o in garbage
        if isinstance(o, types.FrameType) and o.f_code.co_filename.startswith(data_dir)
    ]
    assert not bad, bad[:5]
    del garbage


# -- workers and MPI ----------------------------------------------------------------


def test_workers_never_initialize_mpi() -> None:
    # The parent has imported and initialized mpi4py (conftest); under mpiexec it
    # is a rank with OMPI_*/PMIX_* in its environment.
    from mpi4py import MPI

    assert MPI.Is_initialized()
    from data_scripts.probe import report

    with ProcessPrefetch(report, range(4), num_workers=2) as it:
        reports = list(it)
    for r in reports:
        assert r["mpi_initialized"] is False
        assert r["env"] == []
        assert r["ppid"] == os.getpid()
        # Only the worker side of the loader: no pool, prefetcher or thread code.
        assert r["data_modules"] == sorted(testing.WORKER_MODULES)
    assert len({r["pid"] for r in reports}) == 2


_EXIT_SCRIPT = """
import sys, mpi4py
mpi4py.rc.initialize = False  # no MPI singleton (and its daemon): this is about the loader
sys.path.insert(0, {tests!r})
from collective_gc.data import ProcessPrefetch, testing
from data_scripts.fns import make

if __name__ == "__main__":
    done = list(ProcessPrefetch(make, range(6), num_workers=2))      # finished
    it = ProcessPrefetch(make, range(100), num_workers=2)            # left open
    kept = next(it)
    other = ProcessPrefetch(make, range(100), num_workers=2, buffer_size=2)
    held = [next(other) for _ in range(3)]                           # open, elements held
    print("pids", *[p.pid for x in (it, other) for p in testing.workers(x)])
"""


def test_nothing_printed_at_exit(tmp_path: Any) -> None:
    # No resource_tracker warning, no exception from a finalizer, no leaked
    # segment or worker: with every warning shown.
    script = tmp_path / "exit_script.py"
    script.write_text(_EXIT_SCRIPT.format(tests=os.path.dirname(__file__)))
    shm_before = os.listdir("/dev/shm")
    # No MPI launcher's variables: the script must not take itself for a rank.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMIX_", "PMI_"))}
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    proc = subprocess.run(
        [sys.executable, "-W", "default", "-X", "dev", str(script)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    lines = proc.stdout.splitlines()
    assert len(lines) == 1 and lines[0].startswith("pids")
    pids = [int(p) for p in lines[0].split()[1:]]
    deadline = time.monotonic() + 5
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_alive(p) for p in pids)
    assert _not_mpi(os.listdir("/dev/shm")) <= _not_mpi(shm_before)


def _not_mpi(names: Any) -> set[str]:
    # Ours never have a name at all (memfd); what a Python loader would leave
    # has these prefixes (SharedMemory, multiprocessing's semaphores). MPI's
    # segments (the script's singleton, other jobs meanwhile) are not ours.
    return {n for n in names if n.startswith(("psm_", "sem.mp-", "wnsm_", "collective_gc"))}


def test_a_start_up_cut_short_by_descriptor_exhaustion_is_silent_and_explained() -> None:
    """Issue 24, defect 5: a worker spawned by a start-up that then failed
    (EMFILE on a later worker) printed ``EOFError: Ran out of input`` from
    its ``pickle.load(boot)`` on the user's stderr when it was stopped."""
    result = subprocess.run(
        [sys.executable, os.path.join(SCRIPTS, "exhaust.py")],
        capture_output=True,
        text=True,
        env=script_env(),
        timeout=120,
    )
    lines = result.stdout.splitlines()
    assert result.returncode == 0 and lines[-1] == "ok", result.stdout + result.stderr
    assert result.stderr == "", "a worker stopped at start-up wrote on stderr"
    errors = [line for line in lines if line.startswith("error")]
    # Some start-ups failed after spawning a worker: the case that printed.
    assert any("failed starting worker 1 of 3" in line for line in errors), lines
    for line in errors:
        assert line.startswith("error OSError 24 ") and "RLIMIT_NOFILE" in line, line
