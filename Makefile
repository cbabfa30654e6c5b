# collective_gc: `make demo` runs the main job on 4 ranks, `make test` the tests.
# Both set up everything first (Debian packages when root, then a virtual
# environment in .venv that sees Debian's mpi4py, petsc4py and numpy).

PYTHON ?= /usr/bin/python3
VENV ?= .venv
PY := $(VENV)/bin/python
NP ?= 4

# Debian's petsc4py is found only with PETSC_DIR set; on this Debian stack the
# PETSc tests must run, not skip (tests/conftest.py: import_petsc).
export PETSC_DIR ?= /usr/lib/petscdir/petsc3.18/x86_64-linux-gnu-real
export CGC_REQUIRE_PETSC := 1
# The extension is built with mpicc and mpi4py's headers here (tools/
# install-system-deps.sh; --no-build-isolation): the tests check that the
# sync point's steady state runs in C (tests/test_steady.py).
export CGC_REQUIRE_STEADY := 1

# tools/mpirun NP TIMEOUT: mpiexec spelled for the MPI on PATH (Open MPI 4 or 5,
# MPICH): 4 ranks on a 2-core machine, possibly as root, yielding when idle, and
# killed after TIMEOUT seconds if everything else hangs. `python -m mpi4py`
# turns an uncaught exception on one rank into MPI_Abort.
MPIEXEC ?= tools/mpirun $(NP) 900
MPIRUN := $(MPIEXEC) $(PY) -m mpi4py
PYTEST_FLAGS ?= -q -x --color=no

.PHONY: all install test test-serial test-mpi test-pure test-clients test-clients-debian12 test-clients-debian13 bench-dolfinx test-plugin-mpipytest test-stacks demo demo-resources demo-naive bench bench-loader stress lint docs clean

all: test

$(VENV)/.installed: setup.cfg setup.py pyproject.toml collective_gc/_speedups.c tools/install-system-deps.sh
	bash tools/install-system-deps.sh
	$(PYTHON) -m venv --system-site-packages $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check --no-build-isolation -e '.[dev]'
	$(PY) -c "import mpi4py, numpy, pytest_mpi; from petsc4py import PETSc" \
	    || { echo "collective_gc: the environment in $(VENV) is incomplete" >&2; exit 1; }
	touch $@

install: $(VENV)/.installed

test: test-serial test-mpi test-pure

test-serial: install
	$(PY) -m pytest $(PYTEST_FLAGS) -m "not mpi" --ignore=tests/clients tests

test-mpi: install
	$(MPIRUN) -m pytest $(PYTEST_FLAGS) --with-mpi -m "not launcher" --ignore=tests/clients tests

# The whole suite once more in processes that run the Python twins
# (COLLECTIVE_GC_PURE_PYTHON=1 blocks the extension at import, as CPython's
# test_heapq runs without _heapq) and agree through a new Iallreduce each time
# instead of MPI-4's persistent one (COLLECTIVE_GC_PERSISTENT=0): the other
# legs run the C versions and the persistent path. Tests of the C functions
# themselves skip here, saying why.
PURE_ENV := COLLECTIVE_GC_PURE_PYTHON=1 COLLECTIVE_GC_PERSISTENT=0

test-pure: install
	$(PURE_ENV) $(PY) -m pytest $(PYTEST_FLAGS) -m "not mpi" --ignore=tests/clients tests
	$(PURE_ENV) $(MPIRUN) -m pytest $(PYTEST_FLAGS) --with-mpi -m "not launcher" --ignore=tests/clients tests

# Real clients (issues 22, 33, 41), installed only here so that `make test`
# does not need them, on two stacks, one leg each (tools/stacks/clients.sh
# runs a leg: its first line names the versions, its last the wall time):
# - debian12, this machine: DOLFINx 0.5.2 (python3-dolfinx, ~118 packages),
#   h5py 3.7 with HDF5 1.10.8's MPI build (python3-h5py-mpi), slepc4py 3.18;
# - debian13, the chroot of test-stack-debian13 (root only): DOLFINx 0.9.0,
#   slepc4py 3.22, h5py 3.13 with HDF5 1.14 (python3-h5py picks the MPI build).
# Each leg: the clients' tests and the example loops on 4 ranks, 200 steps
# each, every client required (CGC_REQUIRE_*: a missing one fails): DOLFINx
# with XDMF output (RSS <= 40 KiB/step from step 20, nothing left), SLEPc
# eigensolves (RSS <= 20 KiB/step, no PETSc object left by PETSc's log) and a
# parallel HDF5 file per step (every file read back, RSS <= 20 KiB/step, none
# left open). slepc4py imports without SLEPC_DIR on both. The DOLFINx example
# sets SCOTCH_PTHREAD_NUMBER=1 (its tests import it): PT-Scotch's threads hang
# DOLFINx 0.5.2's mesh partitioning now and then (docs/guides/fenicsx.rst).
DEBIAN13_CLIENTS := python3-dolfinx-real python3-slepc4py python3-h5py-mpi python3-h5py
CLIENTS_LEG = NP=$(NP) PY=$(PY) PYTEST_FLAGS="$(PYTEST_FLAGS)" bash tools/stacks/clients.sh

test-clients: test-clients-debian12 test-clients-debian13

test-clients-debian12: install test-plugin-mpipytest
	bash tools/install-system-deps.sh python3-dolfinx python3-h5py-mpi python3-slepc4py
	$(CLIENTS_LEG) debian12

# The chroot script installs what is missing of DEBIAN13_CLIENTS (~210
# packages the first time; a no-op after).
test-clients-debian13: .stacks/debian13/.installed
	bash tools/stacks/debian13-chroot.sh .stacks/debian13 $(DEBIAN13_CLIENTS)
	$(CLIENTS_LEG) debian13

# Issue 22's figures: every mode of the DOLFINx loop in one 4-rank job, and
# where collective_gc's sync points spend their time (not in `make bench`,
# which needs no DOLFINx).
bench-dolfinx: install
	bash tools/install-system-deps.sh python3-dolfinx
	$(MPIRUN) bench/bench_dolfinx.py --steps 200 --profile

# Our pytest plugin under Firedrake's mpi-pytest (issue 22): a Firedrake-style
# suite on 4 ranks with the leak check on. mpi-pytest lives in a venv of its
# own: it and pytest-mpi (the main venv's) both install a top-level pytest_mpi.
MPIPYTEST_VENV := .venv-mpipytest

$(MPIPYTEST_VENV)/.installed: setup.cfg setup.py pyproject.toml collective_gc/_speedups.c | $(VENV)/.installed
	$(PYTHON) -m venv --system-site-packages $(MPIPYTEST_VENV)
	$(MPIPYTEST_VENV)/bin/pip install -q --disable-pip-version-check mpi-pytest pytest-timeout
	$(MPIPYTEST_VENV)/bin/pip install -q --disable-pip-version-check --no-build-isolation --no-deps -e .
	$(MPIPYTEST_VENV)/bin/python -c "import pytest_mpi.plugin, collective_gc.pytest_plugin" \
	    || { echo "collective_gc: the environment in $(MPIPYTEST_VENV) is incomplete" >&2; exit 1; }
	touch $@

# The runner runs in the main venv; it starts mpi-pytest's Python under tools/mpirun.
test-plugin-mpipytest: install $(MPIPYTEST_VENV)/.installed
	CGC_MPIPYTEST_PYTHON=$(abspath $(MPIPYTEST_VENV))/bin/python \
	    $(PY) -m pytest $(PYTEST_FLAGS) -rs tests/test_plugin_mpi_pytest.py

# The same two suites on the stacks users have (issue 12), one leg at a time,
# each built once under .stacks/ (tools/stack-setup; tools/stack-run describes
# them): Python 3.12 + Open MPI 5 and Python 3.13 + MPICH from PyPI wheels, no
# petsc4py; Debian 13 (petsc4py 3.22, Open MPI 5) in a chroot (root only).
# The serial suite runs to the end there, to see every failure at once.
STACKS ?= py312-openmpi py313-mpich debian13
STACK_PYTEST_FLAGS ?= -q --color=no --continue-on-collection-errors --ignore=tests/clients
STACK_DEPS := setup.cfg setup.py pyproject.toml collective_gc/_speedups.c \
    tools/stack-setup tools/stacks/debian13-chroot.sh

test-stacks: $(STACKS:%=test-stack-%)

# Kept: make would delete them as intermediate files otherwise.
.PRECIOUS: .stacks/%/.installed

# The host's venv first: its pip fetches the wheels the Debian 13 chroot needs.
.stacks/%/.installed: $(STACK_DEPS) | $(VENV)/.installed
	CGC_HOST_PYTHON=$(PY) bash tools/stack-setup $*
	touch $@

# Both suites run even if the first fails; the leg fails if either did. Its
# last line says which speedups it ran (collective_gc._switch.speedups(): every
# leg requires "c+mpi", tools/stack-run), each suite's exit and the wall time.
STACK_SPEEDUPS := python -c "import collective_gc._switch as s; print(s.speedups())"
test-stack-%: .stacks/%/.installed
	@start=$$(date +%s); \
	speedups=$$(tools/stack-run $* $(STACK_SPEEDUPS)) || speedups="(none: collective_gc does not import)"; \
	echo "stack $*: speedups $$speedups"; \
	tools/stack-run $* python -m pytest $(STACK_PYTEST_FLAGS) -m "not mpi" tests; serial=$$?; \
	tools/stack-run $* tools/mpirun $(NP) 900 python -m mpi4py -m pytest $(STACK_PYTEST_FLAGS) -x \
	    --with-mpi -m "not launcher" tests; ranks=$$?; \
	echo "stack $*: speedups $$speedups, serial suite exit $$serial, 4-rank suite exit $$ranks," \
	    "$$(($$(date +%s) - start)) s"; \
	[ $$serial = 0 ] && [ $$ranks = 0 ]

# The main job: a PETSc solver loop with per-step objects in reference cycles.
demo: install
	$(MPIRUN) examples/solver_loop.py

# Thousands of MPI windows and communicators in cycles (no PETSc).
demo-resources: install
	$(MPIRUN) examples/demo.py

# The same solver loop destroying in __del__: it hangs; a watchdog ends it.
demo-naive: install
	-$(MPIEXEC) $(PY) examples/naive_deadlock.py || echo "the naive loop hung, as expected"

bench: install bench-loader
	$(MPIRUN) bench/bench_core.py
	tools/mpirun 2 900 $(PY) -m mpi4py bench/bench_core.py
	$(MPIRUN) bench/bench_petsc.py
	tools/mpirun 2 900 $(PY) -m mpi4py bench/bench_petsc.py
	$(MPIRUN) bench/bench_petsc.py --python-destroys
	$(MPIRUN) bench/bench_step.py
	tools/mpirun 2 900 $(PY) -m mpi4py bench/bench_step.py
	$(MPIRUN) bench/bench_backoff.py
	tools/mpirun 2 900 $(PY) -m mpi4py bench/bench_backoff.py
	$(MPIRUN) bench/bench_gcpause.py
	$(MPIRUN) bench/bench_trace.py
	tools/mpirun 2 900 $(PY) -m mpi4py bench/bench_trace.py
	$(PY) bench/bench_scale.py  # launches its own jobs of 2-16 ranks
	$(PY) bench/report.py

# Grain 0.2.18, the loader's reference, lives in its own venv: it must not
# change the main venv's numpy (Debian's petsc4py needs Debian's numpy).
.venv-grain/.installed:
	$(PYTHON) -m venv --system-site-packages .venv-grain
	.venv-grain/bin/pip install -q --disable-pip-version-check grain==0.2.18
	touch $@

# PyTorch 2.13 (CPU), the loader's other reference, likewise in its own venv.
.venv-torch/.installed: bench/setup-torch-venv.sh
	bash bench/setup-torch-venv.sh .venv-torch

# The loader's benchmark starts its own processes: not under mpiexec.
bench-loader: install .venv-grain/.installed .venv-torch/.installed
	$(PY) bench/bench_loader.py --grain-python .venv-grain/bin/python \
	    --torch-python .venv-torch/bin/python

# The randomized stress harness on many seeds (CI runs 20 in `make test`).
# Its own job timeout: the sparse episode's report-scale seeds (~40 s each
# on 2 cores) put 200 seeds past the 900 s of MPIEXEC on a busy machine.
SEEDS ?= 200
STRESS_TIMEOUT ?= 3600
stress: install
	tools/mpirun $(NP) $(STRESS_TIMEOUT) $(PY) -m mpi4py tests/stress_harness.py --seeds $(SEEDS)
	@if $(MPIEXEC) $(PY) -m mpi4py tests/stress_harness.py --naive --seeds 1 --deadline 10 \
	        >/dev/null 2>&1; then \
	    echo "the naive version (destroy in __del__) should have deadlocked" >&2; exit 1; \
	else echo "naive version (destroy in __del__): deadlocked, caught by the watchdog, as expected"; fi

docs: install
	$(PY) -m pip install -q --disable-pip-version-check --no-build-isolation -e '.[docs]'
	$(PY) -m sphinx -W -q -b html docs docs/_build/html

lint: install
	$(PY) -m pip install -q --disable-pip-version-check --no-build-isolation -e '.[lint]'
	$(PY) -m ruff check collective_gc tests bench examples
	$(PY) -m ruff format --check collective_gc tests bench examples
	$(PY) -m mypy --strict collective_gc

clean:
	rm -rf $(VENV) $(MPIPYTEST_VENV) build *.egg-info .pytest_cache
