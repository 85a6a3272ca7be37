"""The one way both packages register an operator: its schema, fake, CPU and CUDA implementations.

Not ``torch.library.custom_op``: its Python dispatch wrappers cost several times a plain library
op's per eager call before the implementation runs, more than an eager copy can afford (figures:
docs/measurements.md, benchmarks/host_cost.py). ``torch.compile`` treats the op as
opaque and keeps it because its schema mutates an input (``Tensor(a!)``); ``opcheck`` checks that
the declared mutations are the real ones.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .arguments import text

# One library per namespace, kept for the life of the process: dropping a Library unregisters its ops.
_libraries: dict[str, torch.library.Library] = {}
# As custom_op gives them: the compiler may trust the schema.
_TAGS = (torch.Tag.pt2_compliant_tag,)


def register_op(
    namespace: str, schema: str, *, fake: Callable, cpu: Callable, cuda: Callable | None = None, tags: tuple = ()
) -> None:
    """Define ``namespace::schema`` with ``fake`` (shape rules, ``torch._check``s built from the same
    conditions as the eager checks), ``cpu`` and ``cuda`` (``cpu`` serves CUDA too when omitted).
    ``tags`` adds to the compliance tag (``torch.Tag.cudagraph_unsafe``: Inductor runs the op
    between CUDA graphs, on the host at every call, instead of capturing it)."""
    lib = _libraries.get(namespace)
    if lib is None:
        lib = _libraries[namespace] = torch.library.Library(namespace, "DEF")
    name = schema.split("(", 1)[0]
    lib.define(schema, tags=(*_TAGS, *tags))
    torch.library.register_fake(f"{namespace}::{name}", fake, lib=lib)
    lib.impl(name, cpu, "CPU")
    lib.impl(name, cpu if cuda is None else cuda, "CUDA")


def find_named(registry: dict, name: str, op: str, kind: str, hint: str = ""):
    """``registry[name]``: the live instance an op's name resolves to in this process, else a
    ``ValueError`` from ``op`` naming the ``kind`` of instance, the live names, and ``hint``."""
    found = registry.get(name)
    if found is None:
        known = ", ".join(map(repr, sorted(registry))) or "none"
        raise ValueError(f"{op}: no {kind} named {name!r} in this process (live: {known}){hint}")
    return found


def check_new_name(registry: dict, owner: str, name) -> None:
    """A ``ValueError`` from ``owner`` unless ``name`` is a non-empty string no live instance has."""
    text(owner, "name", name)
    if name in registry:
        raise ValueError(f"{owner}: the name {name!r} is taken; close() that instance or pick another")


__all__ = ["register_op", "find_named", "check_new_name"]
