"""Build step for the one optional C extension; all metadata is in setup.cfg.

``collective_gc._speedups`` runs the two per-object hot spots in C: the weak-
reference callback of every registration, and a sync point's PETSc destroys.
It needs only Python's headers (PETSc's functions are found at run time), and
it is optional: without a C compiler the package installs without it and does
the same from Python, more slowly.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "collective_gc._speedups",
            ["collective_gc/_speedups.c"],
            optional=True,
            extra_compile_args=["-O2", "-Wall", "-Wextra", "-Wno-unused-parameter"],
        )
    ]
)
