# collective_gc: `make demo` runs the main job on 4 ranks, `make test` the tests.
# Both set up everything first (Debian packages when root, then a virtual
# environment in .venv that sees Debian's mpi4py, petsc4py and numpy).

PYTHON ?= /usr/bin/python3
VENV ?= .venv
PY := $(VENV)/bin/python
NP ?= 4

# Debian's petsc4py is found only with PETSC_DIR set.
export PETSC_DIR ?= /usr/lib/petscdir/petsc3.18/x86_64-linux-gnu-real
# 4 ranks on a 2-core machine, possibly as root: oversubscribe, and yield when
# idle (busy polling made 2,000 barriers take 22.7 s instead of 0.02 s here).
export OMPI_ALLOW_RUN_AS_ROOT := 1
export OMPI_ALLOW_RUN_AS_ROOT_CONFIRM := 1
export OMPI_MCA_rmaps_base_oversubscribe := true
export OMPI_MCA_mpi_yield_when_idle := true

# `python -m mpi4py` turns an uncaught exception on one rank into MPI_Abort;
# mpiexec's own --timeout is the last net if everything else hangs.
MPIEXEC ?= mpiexec -n $(NP) --timeout 900
MPIRUN := $(MPIEXEC) $(PY) -m mpi4py
PYTEST_FLAGS ?= -q -x --color=no

.PHONY: all install test test-serial test-mpi demo demo-resources demo-naive bench bench-loader stress lint docs clean

all: test

$(VENV)/.installed: setup.cfg setup.py pyproject.toml collective_gc/_speedups.c tools/install-system-deps.sh
	bash tools/install-system-deps.sh
	$(PYTHON) -m venv --system-site-packages $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check -e '.[test]'
	$(PY) -c "import mpi4py, numpy, pytest_mpi; from petsc4py import PETSc" \
	    || { echo "collective_gc: the environment in $(VENV) is incomplete" >&2; exit 1; }
	touch $@

install: $(VENV)/.installed

test: test-serial test-mpi

test-serial: install
	$(PY) -m pytest $(PYTEST_FLAGS) -m "not mpi" tests

test-mpi: install
	$(MPIRUN) -m pytest $(PYTEST_FLAGS) --with-mpi -m "not launcher" tests

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
	$(MPIRUN) bench/bench_petsc.py
	$(MPIRUN) bench/bench_petsc.py --python-destroys
	$(MPIRUN) bench/bench_gcpause.py
	$(PY) bench/report.py

# Grain 0.2.18, the loader's reference, lives in its own venv: it must not
# change the main venv's numpy (Debian's petsc4py needs Debian's numpy).
.venv-grain/.installed:
	$(PYTHON) -m venv --system-site-packages .venv-grain
	.venv-grain/bin/pip install -q --disable-pip-version-check grain==0.2.18
	touch $@

# The loader's benchmark starts its own processes: not under mpiexec.
bench-loader: install .venv-grain/.installed
	$(PY) bench/bench_loader.py --grain-python .venv-grain/bin/python

# The randomized stress harness on many seeds (CI runs 20 in `make test`).
SEEDS ?= 200
stress: install
	$(MPIEXEC) $(PY) -m mpi4py tests/stress_harness.py --seeds $(SEEDS)
	@if $(MPIEXEC) $(PY) -m mpi4py tests/stress_harness.py --naive --seeds 1 --deadline 10 \
	        >/dev/null 2>&1; then \
	    echo "the naive version (destroy in __del__) should have deadlocked" >&2; exit 1; \
	else echo "naive version (destroy in __del__): deadlocked, caught by the watchdog, as expected"; fi

docs: install
	$(PY) -m pip install -q --disable-pip-version-check -e '.[docs]'
	$(PY) -m sphinx -W -q -b html docs docs/_build/html

lint: install
	$(PY) -m pip install -q --disable-pip-version-check -e '.[lint]'
	$(PY) -m ruff check collective_gc tests bench examples
	$(PY) -m ruff format --check collective_gc tests bench examples
	$(PY) -m mypy --strict collective_gc

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
