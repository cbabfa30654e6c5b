"""Build step for the one optional C extension; all metadata is in setup.cfg.

``collective_gc._speedups`` runs the per-object steps in C: the weak-reference
callback of every registration, a sync point's pass over its agreed
registrations and the calls of their destroys, and its PETSc destroys. It
needs only Python's headers (PETSc's functions are found at run time).

Where the MPI compiler wrapper (``$MPICC``, else ``mpicc`` on the PATH) and
mpi4py's headers (``mpi4py.get_include()``: mpi4py importable at build time,
so ``pip install --no-build-isolation``) are at hand, it is built with them
and also runs the steady state of a sync point through mpi4py's C API. It is
optional: without a C compiler the package installs without it and does the
same from Python, more slowly; without MPI's wrapper it is built without the
steady state, which then runs from Python.
"""

from __future__ import annotations

import os
import shutil
from typing import Any

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext


def _mpi() -> tuple[str, str] | None:
    """(the MPI compiler wrapper, mpi4py's include directory), or None."""
    mpicc = os.environ.get("MPICC") or shutil.which("mpicc")
    if not mpicc:
        return None
    try:
        import mpi4py
    except ImportError:
        return None
    return mpicc, mpi4py.get_include()


class _BuildExt(build_ext):  # type: ignore[misc]
    """Builds with MPI where it can, else without it (then says why)."""

    def build_extension(self, ext: Any) -> None:
        mpi = None if os.environ.get("COLLECTIVE_GC_NO_MPI_BUILD") else _mpi()
        if mpi is not None:
            mpicc, include = mpi
            saved = (list(self.compiler.compiler_so), list(self.compiler.linker_so))
            macros, includes = list(ext.define_macros), list(ext.include_dirs)
            try:
                self.compiler.set_executable("compiler_so", [mpicc, *saved[0][1:]])
                self.compiler.set_executable("linker_so", [mpicc, *saved[1][1:]])
                ext.define_macros = [*macros, ("CGC_HAVE_MPI", "1")]
                ext.include_dirs = [*includes, include]
                super().build_extension(ext)
                return
            except Exception as exc:  # noqa: BLE001 (then the build without MPI)
                print(f"collective_gc: building {ext.name} with {mpicc} failed ({exc}); "
                      "building it without the MPI steady state")
            finally:
                self.compiler.set_executable("compiler_so", saved[0])
                self.compiler.set_executable("linker_so", saved[1])
                ext.define_macros, ext.include_dirs = macros, includes
        else:
            print("collective_gc: no MPI compiler wrapper and mpi4py's headers at build time: "
                  f"{ext.name} is built without the MPI steady state")
        super().build_extension(ext)


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
