"""The layout's rules, checked on the source.

- No module of the library reads another module's private names: neither
  ``from ._x import _name`` nor ``_x._name`` on an imported module of ours.
  What modules share is public in the module that owns it.
- Everything public on the core classes is documented in ``docs/api.rst``;
  what the library's modules need of a manager beyond that are functions of
  ``collective_gc._manager``, so that a newcomer reads the whole surface in
  one place.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import pytest

import collective_gc as cgc

from conftest import import_petsc

ROOT = Path(__file__).resolve().parent.parent
API = ROOT / "docs" / "api.rst"
PACKAGE = ROOT / "collective_gc"


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _module_of(path: Path, level: int, module: str | None) -> str:
    """The dotted name ``from <level dots><module> import ...`` refers to in
    ``path`` (level 0: ``path``'s own module)."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    package = parts[:-1]
    if parts[-1] == "__init__":
        parts = package
    if not level:
        return ".".join(parts)
    base = package[: len(package) - (level - 1)]
    return ".".join(base + ([module] if module else []))


def _is_module(dotted: str) -> bool:
    where = ROOT / dotted.replace(".", "/")
    return (
        where.with_suffix(".py").exists()
        or (where / "__init__.py").exists()
        or where.with_suffix(".c").exists()  # the C extension, built or not
    )


def private_reads(path: Path, text: str | None = None) -> list[str]:
    """Where the module at ``path`` (its source ``text``, read from ``path``
    if None) reads a private name of another module of the package."""
    tree = ast.parse(path.read_text() if text is None else text, str(path))
    own = _module_of(path, 0, None)
    ours: dict[str, str] = {}  # local name -> our module it is bound to
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (
            node.level or (node.module or "").startswith("collective_gc")
        ):
            source = _module_of(path, node.level, node.module) if node.level else node.module or ""
            for alias in node.names:
                target = f"{source}.{alias.name}"
                if _is_module(target):
                    ours[alias.asname or alias.name] = target  # a module of ours
                elif _private(alias.name) and source != own:
                    found.append(f"{path.name}:{node.lineno}: from {source} import {alias.name}")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("collective_gc") and alias.asname:
                    ours[alias.asname] = alias.name
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in ours
            and ours[node.value.id] != own
            and _private(node.attr)
        ):
            found.append(f"{path.name}:{node.lineno}: {node.value.id}.{node.attr}")
    return found


def test_no_module_reads_another_modules_private_names() -> None:
    found = [hit for path in sorted(PACKAGE.rglob("*.py")) for hit in private_reads(path)]
    assert not found, "private names read across modules:\n" + "\n".join(found)


def test_the_check_sees_a_private_read() -> None:
    """The scan above finds both kinds of read (it would pass vacuously
    otherwise). The probe is a module's source, never written to disk: under
    ``mpiexec`` every rank runs this test at once."""
    probe = "from ._agree import _filter\nfrom . import _transport\nx = _transport._HELD\n"
    found = private_reads(PACKAGE / "_layout_probe_.py", probe)
    assert len(found) == 2, found


def documented(cls: type) -> set[str]:
    """The members ``docs/api.rst`` documents for ``cls``: its ``:members:``
    list and the ``automethod``/``autoattribute`` entries inside its block."""
    lines = API.read_text().splitlines()
    start = lines.index(f".. autoclass:: {cls.__name__}")
    names: set[str] = set()
    for line in lines[start + 1 :]:
        if line.startswith(".. ") or (line and not line[0].isspace()):
            break  # the next top-level entry or section
        entry = line.strip()
        if entry.startswith(":members:"):
            names |= {m.strip() for m in entry.split(":", 2)[2].split(",")}
        elif entry.startswith((".. automethod::", ".. autoattribute::")):
            names.add(entry.split("::", 1)[1].strip())
    return names


@pytest.mark.parametrize("cls", [cgc.Manager, cgc.Participant, cgc.Registration])
def test_every_public_member_is_documented(cls: type) -> None:
    public = {n for n in vars(cls) if not n.startswith("_")}
    doc = cls.__doc__ or ""
    attributes = doc.split("Attributes:", 1)[1] if "Attributes:" in doc else ""
    listed = {line.split(":")[0].strip() for line in attributes.splitlines() if ":" in line}
    missing = sorted(public - documented(cls) - listed)
    assert not missing, f"public but not in docs/api.rst: {cls.__name__}.{missing}"


def test_parallel_assert_is_a_public_name_of_the_package() -> None:
    """Issue 41, section 3: the README lists ``collective_gc.parallel_assert``,
    which worked but was missing from ``dir(cgc)`` and ``__all__`` (it is
    loaded lazily, to keep pytest out of ``import collective_gc``)."""
    from collective_gc.pytest_plugin import parallel_assert

    assert "parallel_assert" in dir(cgc) and "parallel_assert" in cgc.__all__
    assert cgc.parallel_assert is parallel_assert


def test_help_shows_collect_stats_fields_with_their_types() -> None:
    """Issue 41, section 3: ``help(CollectStats)`` showed ``destroyed:
    ForwardRef('int')`` for every field (the module's string annotations,
    which ``NamedTuple`` wraps unresolved into its ``__new__``). Its signature
    now reads as the class is written."""
    import inspect
    import pydoc

    sig = str(inspect.signature(cgc.CollectStats))
    assert sig == (
        "(destroyed: int, pending: int, cyclic: int, seconds: float, sync: int, "
        "collected: int | None = None, visits: int = 0)"
    ), sig
    assert "ForwardRef" not in pydoc.render_doc(cgc.CollectStats, renderer=pydoc.plaintext)


@pytest.mark.launcher  # a child process that imports mpi4py: from the serial session only
def test_star_import_needs_no_pytest() -> None:
    """Where pytest is not installed, ``from collective_gc import *`` still
    works: ``parallel_assert``, which needs it, is then left out of
    ``__all__`` (simulated with ``sys.modules['pytest'] = None``, which makes
    both the import and importlib's lookup fail, as a missing pytest does)."""
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['pytest'] = None\n"
        "from collective_gc import *\n"
        "import collective_gc\n"
        "assert 'parallel_assert' not in collective_gc.__all__, collective_gc.__all__\n"
        "assert 'pytest' not in [m for m in sys.modules if sys.modules[m] is not None]\n"
        "print('ok')\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT
    )
    assert proc.returncode == 0 and proc.stdout == "ok\n", proc.stdout + proc.stderr


# -- who writes what ------------------------------------------------------------

# The fields of a family's typed state (collective_gc._state.FamilyState; in
# C, declared and read-only from Python): its methods are their one writer.
_STATE_FIELDS = {
    "code", "reason", "seq", "inside", "destroying", "destroyed", "progress", "hold",
    "unreported", "next_key", "order", "cut_key", "cut_order", "thread", "busy", "live",
    "inbox", "stale",
    "comm", "first", "last", "gone",
}  # fmt: skip
# The derived-family tree's fields of a family: collective_gc._tree writes them.
_TREE_FIELDS = {"children", "parent"}


def _writes(path: Path, names: set[str]) -> list[str]:
    """``x.name = ...`` (or +=, or del) of one of ``names`` in the module at
    ``path``, on anything but ``self``: a write of another object's field."""
    tree = ast.parse(path.read_text(), str(path))
    found = []
    for node in ast.walk(tree):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif isinstance(node, ast.Delete):
            targets = node.targets
        for target in targets:
            for t in ast.walk(target):
                if (
                    isinstance(t, ast.Attribute)
                    and t.attr in names
                    and not (isinstance(t.value, ast.Name) and t.value.id == "self")
                ):
                    where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
                    found.append(f"{where}:{t.lineno}: {ast.unparse(t)}")
    return found


def test_a_familys_state_is_written_by_its_own_methods_only() -> None:
    """Issue 38: every field of a family's collective state has one writer,
    the typed state's own methods (seq, inside, destroying, destroyed, the
    registrations' counter and order, the pending keys, usable or not and
    why...); no module assigns one (the C twin would refuse it: its fields
    are read-only from Python)."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name != "_state.py":
            found += [w for w in _writes(path, _STATE_FIELDS) if ".core." in w or "core." in w]
    assert found == [], found


def test_the_derived_family_tree_is_written_by_its_own_module_only() -> None:
    """Issue 38: a family's children and parent are written by
    collective_gc._tree alone (the Collective's own __init__ apart)."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name != "_tree.py":
            found += _writes(path, _TREE_FIELDS)
    assert found == [], found


def test_the_c_twins_have_their_python_twins_fields_and_methods(speedups_c: Any) -> None:
    """Issue 38: each C type offers what its Python twin does, by name (the
    suite runs against both; this says at once which name one of them lacks)."""
    from collective_gc import _state

    twins = {
        "GcState": _state.GcState,
        "RegistrationFields": _state.RegistrationFields,
        "Region": _state.Region,
        "FamilyState": _state.FamilyState,
    }
    for name, c_type in twins.items():
        python = getattr(_state, f"Python{name}")
        assert c_type is not python and c_type.__module__ == "collective_gc._speedups", name
        wanted = {n for n in dir(python) if not n.startswith("_")}
        if name == "RegistrationFields":
            wanted |= set(python.__slots__)  # its private fields are the interface
        missing = sorted(n for n in wanted if not hasattr(c_type, n))
        assert missing == [], (name, missing)


# The fields of collective_gc.petsc's CommState (in C, read-only from Python).
_COMM_STATE_FIELDS = {"failed", "holds", "members", "parallel", "stale"}


def test_petscs_comm_state_is_written_by_its_own_methods_only() -> None:
    """Issue 38: a family's count of failed PETSc destroys, the inner
    communicators it holds and the members its vote reads have one writer,
    CommState's own methods (failure, forgive, hold, vote, set_members)."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        found += [w for w in _writes(path, _COMM_STATE_FIELDS) if "state." in w]
    assert found == [], found


def test_petscs_comm_state_has_a_c_twin_with_its_names(speedups_c: Any) -> None:
    """Issue 38: the C CommState offers every name of its Python twin (the
    suite runs against both: this says which name one of them lacks)."""
    import_petsc()
    from collective_gc.petsc import _destroyers

    python = _destroyers.CommState
    wanted = {n for n in dir(python) if not n.startswith("_")} | set(python.__slots__)
    missing = sorted(n for n in wanted if not hasattr(speedups_c.CommState, n))
    assert missing == [], missing
    if _destroyers.NATIVE is not None:
        assert type(_destroyers.comm_state(True)) is speedups_c.CommState


# A registration's destroy call (with its state: they change together):
# collective_gc._state writes them (new_registration, take_call), for a
# family's registrations and a local owner's alike.
_REGISTRATION_CALL = {"_destroy", "_args"}


def test_a_registrations_destroy_call_is_taken_in_one_place() -> None:
    """Issue 38: a registration leaves the alive state (its destroy call
    taken out, once) in _state.take_call only; a local owner's Ledger and a
    family's state both call it (they kept a copy each before)."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name != "_state.py":
            found += _writes(path, _REGISTRATION_CALL)
    assert found == [], found


def test_the_writes_check_sees_a_write(tmp_path: Path) -> None:
    """The two checks above would pass on anything if they saw nothing."""
    # In the test's own directory, not the package: on 4 ranks another
    # rank's checks walk the package meanwhile, and the ranks shared one
    # file name there (py312-openmpi: one rank's unlink came first).
    src = tmp_path / "probe.py"
    src.write_text(
        "def f(fam, self):\n    fam.core.seq = 1\n    self.seq = 2\n    fam.parent = None\n"
    )
    try:
        assert [w.split(": ", 1)[1] for w in _writes(src, _STATE_FIELDS | _TREE_FIELDS)] == [
            "fam.core.seq",
            "fam.parent",
        ]
    finally:
        src.unlink()
