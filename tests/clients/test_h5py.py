"""h5py's parallel HDF5 files as a real client (issue 33): run by ``make
test-clients`` on 4 ranks, with Debian 12's python3-h5py-mpi (HDF5 1.10.8),
installed by the Makefile's test-clients. Debian's h5py loads its MPI build
only under mpiexec: elsewhere these tests skip (or fail, with
CGC_REQUIRE_H5PY=1)."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from mpi4py import MPI

from _util import script_env
from conftest import client_unusable, import_client

# make test-clients sets CGC_REQUIRE_H5PY=1: there a missing h5py, or one
# without MPI, fails the run instead of skipping it.
h5py = import_client("h5py", "CGC_REQUIRE_H5PY")
if not h5py.get_config().mpi:
    client_unusable(
        "CGC_REQUIRE_H5PY",
        "this h5py has no MPI driver (Debian's loads its MPI build only under mpiexec)",
    )

import collective_gc as cgc  # noqa: E402
import collective_gc.h5py as ch5  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples"))
from h5py_loop import run  # noqa: E402

WORLD = MPI.COMM_WORLD
N = 8


def open_files() -> int:
    """HDF5 files this process has open, by HDF5's own count. Local."""
    return int(h5py.h5f.get_obj_count(h5py.h5f.OBJ_ALL, h5py.h5f.OBJ_FILE))


@pytest.fixture
def out_dir() -> Iterator[str]:
    """A directory every rank shares, emptied after."""
    path = WORLD.bcast(tempfile.mkdtemp(prefix="cgc-h5py-test-") if WORLD.rank == 0 else "")
    yield path
    WORLD.Barrier()
    if WORLD.rank == 0:
        for name in os.listdir(path):
            os.unlink(os.path.join(path, name))
        os.rmdir(path)


class Step:
    """A step's parallel file, a dataset and a group of it, in a cycle."""

    def __init__(self, path: str, tag: float) -> None:
        self.me = self
        self.file = h5py.File(path, "w", driver="mpio", comm=WORLD)
        self.dset = self.file.create_dataset("u", (WORLD.size, N), dtype="f8")
        self.group = self.file.create_group("g")
        self.attrs = self.group.attrs
        self.attrs["tag"] = tag
        with self.dset.collective:
            self.dset[WORLD.rank] = np.full(N, tag + WORLD.rank)


def readable(path: str, tag: float) -> bool:
    """Whether the file at ``path`` opens and holds what Step wrote. Collective."""
    try:
        with h5py.File(path, "r", driver="mpio", comm=WORLD) as f:
            data = f["u"][...]
            ok = float(f["g"].attrs["tag"]) == tag
    except OSError:
        return False
    want = np.stack([np.full(N, tag + r) for r in range(WORLD.size)])
    return ok and np.array_equal(data, want)


@pytest.mark.mpi(min_size=2)
def test_keep_refuses_h5py_objects_in_either_order(out_dir: str) -> None:
    """Issue 33: ``cgc.keep(self, dset, f)`` reported 200 destroyed and no
    error, and left every file open and unreadable (HDF5 refuses to close a
    file while a dataset of it is open; h5py could only print it), while
    ``keep(self, f, dset)`` worked. keep now refuses h5py objects in either
    order, on every rank, naming what to use; the files are then closed by
    collective_gc.h5py.manage, readable afterwards."""
    with cgc.collective_scope(WORLD, timeout=60) as scope:
        for i, order in enumerate(("dset, file", "file, dset")):
            step = Step(os.path.join(out_dir, f"{i}.h5"), float(i))
            objs = (step.dset, step.file) if order == "dset, file" else (step.file, step.dset)
            with pytest.raises(cgc.RegistrationError, match=r"collective_gc\.h5py\.manage"):
                cgc.keep(step, *objs, comm=WORLD)
            ch5.manage(step, *objs, comm=WORLD)
            del step, objs
            gc.collect()
            scope.sync()
            assert open_files() == 0
            assert readable(os.path.join(out_dir, f"{i}.h5"), float(i)), order


ORDERS = [
    ("dset", "file"),
    ("file", "dset"),
    ("dset",),
    ("group", "dset"),
    ("attrs owner", "file", "group"),
]


@pytest.mark.mpi(min_size=2)
def test_manage_closes_each_file_at_the_sync_point_whatever_the_order(out_dir: str) -> None:
    """Each step's file, with a dataset, a group and its attributes still
    referenced by the step (which dies in a cycle), is closed at the sync
    point after the step died on every rank, whichever of them are given
    and in which order; not before, although one rank collects alone; and
    each file is readable afterwards with what every rank wrote."""
    with cgc.collective_scope(WORLD, timeout=60) as scope:
        for i, order in enumerate(ORDERS):
            path = os.path.join(out_dir, f"{i}.h5")
            step = Step(path, 10.0 * i)
            pick = {"dset": step.dset, "file": step.file, "group": step.group}
            pick["attrs owner"] = step.group  # the attributes' object
            ch5.manage(step, *(pick[k] for k in order), comm=WORLD)
            del step, pick
            if WORLD.rank == 0:
                gc.collect()  # one rank alone: nothing collective runs here
                assert open_files() == 1
            gc.collect()
            scope.sync()
            assert open_files() == 0, order
            assert readable(path, 10.0 * i), order


survivors: list[Any] = []


@pytest.mark.mpi(min_size=2)
def test_a_dataset_that_survives_elsewhere_sees_its_file_closed(out_dir: str) -> None:
    """A Dataset the program still holds when the step dies does not keep
    the file open (with keep, the file's close failed for it): the file is
    closed at the sync point, the survivor becomes invalid, as after any
    File.close, and the file is readable."""
    path = os.path.join(out_dir, "s.h5")
    with cgc.collective_scope(WORLD, timeout=60) as scope:
        step = Step(path, 7.0)
        survivors.append(step.dset)
        ch5.manage(step, step.file, comm=WORLD)
        del step
        gc.collect()
        scope.sync()
    try:
        assert open_files() == 0
        assert not survivors[0].id.valid
        assert readable(path, 7.0)
    finally:
        survivors.clear()


class Phoenix(Step):
    """A step whose ``__del__`` stores it in ``rescued`` once: it lives again."""

    rescued: list[Phoenix] = []

    def __del__(self) -> None:
        if not Phoenix.rescued:
            Phoenix.rescued.append(self)


@pytest.mark.mpi(min_size=2)
def test_a_resurrected_owners_file_stays_open_until_it_really_dies(out_dir: str) -> None:
    """Issue 32, item 2, with a real file: the owner's ``__del__`` resurrects
    it on rank 0 only. No rank closes the file (a collective) while it lives
    again: rank 0 still writes to it, collectively with the others. Once it
    really dies, every rank closes it at the same sync point, the late
    write in it."""
    path = os.path.join(out_dir, "p.h5")
    with cgc.collective_scope(WORLD, timeout=60) as scope:
        step: Any = Phoenix(path, 3.0) if WORLD.rank == 0 else Step(path, 3.0)
        ch5.manage(step, step.file, comm=WORLD)
        if WORLD.rank > 0:
            late = step.file  # the others write too: a collective
        del step
        gc.collect()
        scope.sync()
        scope.sync()
        assert open_files() == 1
        f = Phoenix.rescued[0].file if WORLD.rank == 0 else late
        f.create_dataset("late", data=np.arange(3.0))  # collective: the file is open everywhere
        del f
        if WORLD.rank > 0:
            del late
        Phoenix.rescued.clear()
        gc.collect()
        scope.sync()
        assert open_files() == 0
    with h5py.File(path, "r", driver="mpio", comm=WORLD) as r:
        assert list(r["late"][...]) == [0.0, 1.0, 2.0]


# A close that fails, in a process of its own: HDF5 1.10.8 crashes (SIGSEGV)
# when a file whose close failed is touched again, or at exit when it closes
# what is still open, so this process leaves at once (os._exit) once it has
# printed what the sync point raised.
FAILING_CLOSE = """
import json, os, resource, signal, sys
import numpy as np
import h5py
from mpi4py import MPI
import collective_gc as cgc
import collective_gc.h5py as ch5

path = sys.argv[1]
f = h5py.File(path, "w")
d = f.create_dataset("u", (100_000,), chunks=(1_000,), dtype="f8")
d[:] = np.arange(100_000.0)
del d
for k in range(50):  # metadata that HDF5 writes, past the end, when the file closes
    f.create_group(f"g{k}").attrs["a"] = np.arange(100.0)


class Owner:
    pass


owner = Owner()
ch5.manage(owner, f, comm=MPI.COMM_WORLD, name="the file")
del f
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
hard = resource.getrlimit(resource.RLIMIT_FSIZE)[1]
resource.setrlimit(resource.RLIMIT_FSIZE, (os.path.getsize(path), hard))
del owner
try:
    cgc.collect(MPI.COMM_WORLD)  # the close fails; the next agreement says so
    cgc.collect(MPI.COMM_WORLD)
    print(json.dumps("no error"))
except cgc.DestroyError as err:
    print(json.dumps(err.failures))
sys.stdout.flush()
os._exit(0)
"""


@pytest.mark.mpi(min_size=2)
def test_a_close_that_fails_is_a_destroy_error(out_dir: str) -> None:
    """A close that really fails (the file's last writes go past the
    process's file-size limit: EFBIG) raises DestroyError, naming HDF5's
    OSError; never swallowed. In a process of its own, started by rank 0
    (see FAILING_CLOSE); that the error is raised on every rank together is
    test_keep.py's and test_destroys.py's to show."""
    verdict: Any = None
    if WORLD.rank == 0:
        proc = subprocess.run(
            [sys.executable, "-c", FAILING_CLOSE, os.path.join(out_dir, "big.h5")],
            capture_output=True,
            text=True,
            timeout=120,
            env=script_env(),
        )
        lines = proc.stdout.strip().splitlines()
        verdict = json.loads(lines[-1]) if proc.returncode == 0 and lines else proc.stderr
    verdict = WORLD.bcast(verdict)
    assert isinstance(verdict, list), verdict
    assert [(r, n) for r, _, n, _ in verdict] == [(0, "the file")], verdict
    assert "OSError" in verdict[0][3] and "too large" in verdict[0][3], verdict


class Plain:
    pass


def test_manage_refuses_what_it_cannot_close(out_dir: str) -> None:
    """Refused before anything is registered, with what to do instead:
    nothing to manage, an object that is not h5py's, attributes, a closed
    file, the owner itself among the objects."""
    path = os.path.join(out_dir, f"r{WORLD.rank}.h5")
    f = h5py.File(path, "w")
    before = cgc.manager(WORLD).registered
    owner = Plain()
    cases = [
        ((), "at least one"),
        ((Plain(),), "not a 'Plain'"),
        ((f.attrs,), "AttributeManager"),
        ((f, f), "refers to the owner"),
    ]
    for objs, message in cases:
        with pytest.raises(cgc.RegistrationError, match=message):
            ch5.manage(f if message == "refers to the owner" else owner, *objs, comm=WORLD)
    f.close()
    with pytest.raises(cgc.RegistrationError, match="closed already"):
        ch5.manage(owner, f, comm=WORLD)
    assert cgc.manager(WORLD).registered == before


@pytest.mark.mpi(min_size=2)
def test_the_example_loop_reads_every_file_back() -> None:
    """examples/h5py_loop.py's documented path, 30 steps (make test-clients
    runs 200): every file reads back right, none is left open, nothing is
    pending."""
    summary = run("cgc", 30)
    assert summary["unreadable"] == []
    assert summary["open_files"] == 0
    assert summary["most_open_files"] == 0
    assert summary["pending"] == 0
