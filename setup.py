"""Build step for the one optional C extension; all metadata is in setup.cfg.

``collective_gc._speedups`` runs the per-object steps in C: the weak-reference
callback of every registration, a sync point's pass over its agreed
registrations and the calls of their destroys, and its PETSc destroys.
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
