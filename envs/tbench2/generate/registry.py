"""The families by name: an explicit table of the family modules, read when asked for (nothing
is registered at import)."""

from __future__ import annotations

from collections.abc import Iterable

from envs.tbench2.generate import (
    files_families,
    lookup_families,
    search_families,
    system_families,
    text_families,
)
from envs.tbench2.generate.family import Family

KINDS = (
    "files", "paths", "text", "counting", "search", "sorting", "permissions", "archives", "scripts", "lookup",
)
_MODULES = (files_families, text_families, search_families, system_families, lookup_families)


def all_families() -> dict[str, Family]:
    """Every family, by name, in a stable order (module, then the order it lists them)."""
    out: dict[str, Family] = {}
    for module in _MODULES:
        for family in module.FAMILIES:
            if family.name in out:
                raise ValueError(f"task family {family.name!r} is defined twice ({module.__name__})")
            if family.kind not in KINDS:
                raise ValueError(f"task family {family.name!r} has kind {family.kind!r}; use one of {KINDS}")
            out[family.name] = family
    return out


def families_named(names: Iterable[str]) -> list[Family]:
    """The named families, in the given order; an unknown name is an error listing the known ones."""
    known = all_families()
    names = list(names)
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"unknown task families {unknown}; known: {', '.join(known)}")
    if len(set(names)) != len(names):
        raise ValueError(f"task families named twice in {names}")
    return [known[n] for n in names]
