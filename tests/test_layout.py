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

import pytest

import collective_gc as cgc

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
