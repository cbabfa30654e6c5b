"""The public surface of the core classes is the documented one.

Everything public on a :class:`~collective_gc.Manager` is in ``docs/api.rst``;
what the library's modules need of it beyond that are functions of
``collective_gc._manager``, so that a newcomer reads the whole surface in
one place.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import collective_gc as cgc

API = Path(__file__).resolve().parent.parent / "docs" / "api.rst"


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
