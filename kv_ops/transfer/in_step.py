"""In-step transfers: the one registry of names the step's ops carry, the one per-layer wait (``torch.ops.kv_ops.wait_layer``), and the memory a captured step keeps reading.

Three objects move bytes that a compiled, captured step reads. They answer the same question
(these bytes are in before the layer that reads them runs) and differ in who issues the copies:

* :class:`~kv_ops.LayerwiseLoads`: the host issues every layer's copies at ``start()``, before
  the step, on the engine's load stream, outside the step's graph. Layer i waits on its landed
  flag: one stream wait eagerly, the layer-wise wait kernel in a capture. The blocks are free
  once the engine reports the load done.
* :class:`~kv_ops.transfer.slot_loads.SlotLoads` (the transformers cache): the step issues a
  layer's load at an earlier layer (``prefetch_layer``), on a load stream forked from the step
  (nodes of its graph when captured). The layer waits on the load's event (an edge of the
  graph). The slot is free at the event the issuing layer records. With ``load_ahead`` the step
  before also queues the first layers' loads, from the host between its CUDA graphs, and the
  step's first layer waits for them: each load claims its slot on the GPU, so whichever of the
  two runs first moves the bytes.
* :class:`~kv_ops.StepTransfers`: the step issues its stores and loads first thing
  (``step_transfers``), on its own stream. No layer waits: stream order puts every layer after
  them. The id words are free once the host sees the counts back at zero.

The first two wait layer by layer, through :func:`wait_layer`: it resolves ``name`` here and
calls the object's ``wait(layer, caches)``. StepTransfers has no per-layer wait (its copies
come first on the step's stream) but its name lives here too: one namespace for every name an
op carries, so an AOT-loaded step resolves each the same way. Why issuing stays in three
places, not one: a load the host issues before the step cannot depend on what the step
computes (the sequence length of a growing cache), and a load inside a captured step must end
with it; docs/design.md weighs them.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import torch

from ..cuda import arguments
from ..cuda.registration import check_new_name, find_named, register_op
from ..validation import check_fake_values
from .closed import ClosedError

# name -> the live object an op's name resolves to in this process (an AOT-loaded step carries
# only the name). Strong references for what the user closes (LayerwiseLoads, StepTransfers: an
# object goes only with its close(), which first lets its copies in flight land); weak ones for
# what lives as long as its owner (a transformers cache, dropped without a close()).
_live: dict[str, object] = {}
# Device and page-locked memory a captured step reads (flags, id words, id blocks), kept for the
# life of the process: a replay after close() must still read memory that is its own.
_kept: list[torch.Tensor] = []


def _get(name: str):
    """The live object called ``name``, or None."""
    found = _live.get(name)
    return found() if isinstance(found, weakref.ref) else found


def _find(name: str, op: str, kind: str, hint: str = ""):
    """The live object called ``name``, else ``find_named``'s ``ValueError`` naming the live ones
    (``hint`` after them, its ``{kind}`` filled in: only then, so a call that finds pays nothing)."""
    found = _get(name)
    return found if found is not None else find_named(_names(), name, op, kind, hint.format(kind=kind))


def _names() -> dict[str, object]:
    """The live names and their objects, dead weak references dropped."""
    for name in [n for n, v in _live.items() if isinstance(v, weakref.ref) and v() is None]:
        del _live[name]
    return {n: v() if isinstance(v, weakref.ref) else v for n, v in _live.items()}


def check_name(owner: str, name) -> None:
    """A ``ValueError`` from ``owner`` unless ``name`` is a non-empty string no live object has."""
    check_new_name(_names(), owner, name)


def register(name: str, obj, weak: bool = False) -> None:
    """Make ``obj`` what ops carrying ``name`` resolve to (after :func:`check_name`); with
    ``weak``, only while something else keeps ``obj`` alive."""
    _live[name] = weakref.ref(obj) if weak else obj


def unregister(obj) -> bool:
    """Drop ``obj``'s name if it still holds it; whether it did."""
    if is_live(obj):
        del _live[obj.name]
        return True
    return False


def is_taken(name: str) -> bool:
    """Whether a live object holds ``name``."""
    return _get(name) is not None


def is_live(obj) -> bool:
    """Whether ``obj`` holds its name (it was not closed)."""
    return _get(obj.name) is obj


def check_live(obj, op: str) -> None:
    """A :class:`ClosedError` from ``op`` unless ``obj`` holds its name: the one message of a
    closed :class:`~kv_ops.LayerwiseLoads` or :class:`~kv_ops.StepTransfers`."""
    if not is_live(obj):
        kind = type(obj).__name__
        raise ClosedError(f"{op}: {obj.name!r} was closed (close() was called); make a new {kind}")


# The hint of a lookup for an object the user makes from an engine and a name before the step.
MADE_BEFORE_STEP = "; make it (kv_ops.{kind}(engine, name)) before running the step"


def lookup(name: str, op: str, kind: type, hint: str = ""):
    """The live ``kind`` called ``name``, else a ``ValueError`` from ``op`` naming what is live,
    then ``hint`` (such as :data:`MADE_BEFORE_STEP`)."""
    found = _find(name, op, kind.__name__, hint)
    if not isinstance(found, kind):
        raise ValueError(f"{op}: {name!r} is a {type(found).__name__}, not a {kind.__name__}")
    return found


def check_caches(name: str, layer: int, caches: Sequence[torch.Tensor], device: torch.device) -> None:
    """A ``ValueError`` from :func:`wait_layer` unless every one of layer ``layer``'s ``caches`` is
    on ``device``, where ``name`` loads.

    Not checked: that they are the very tensors the loads write. A functionalizing backend
    (aot_eager, opcheck) hands the op clones of what it mutates, so an address check would refuse
    correct programs; the compile tests' node order is the guard."""
    for c in caches:
        if c.device != device:
            raise ValueError(
                f"kv_ops.wait_layer: a cache of layer {layer} is on {c.device}, but {name!r} loads into {device}"
            )


def keep(*tensors: torch.Tensor) -> None:
    """Keep memory a captured step reads for the life of the process."""
    _kept.extend(tensors)


# --- wait_layer ----------------------------------------------------------------------------------


def _wait_condition(caches, layer) -> bool:
    """What the fake can check, and the eager op with it (the rest needs the named object)."""
    return len(caches) > 0 and layer >= 0


def _wait_message(caches, layer) -> str:
    return (
        f"kv_ops.wait_layer: needs at least one cache tensor and a layer >= 0, got {len(caches)} caches, layer {layer}"
    )


def _wait_layer_fake(caches, dep, name, layer):
    check_fake_values("kv_ops.wait_layer", caches=caches, dep=dep)
    torch._check(_wait_condition(caches, layer), lambda: _wait_message(caches, layer))


def _wait_layer_impl(caches, dep, name, layer) -> None:
    if not _wait_condition(caches, layer):
        raise ValueError(_wait_message(caches, layer))
    found = _find(name, "kv_ops.wait_layer", "LayerwiseLoads or HostOffloadedCache")
    if not hasattr(found, "wait"):
        raise ValueError(f"kv_ops.wait_layer: {name!r} is a {type(found).__name__}, which has no per-layer wait")
    found.wait(layer, caches)


register_op(
    "kv_ops",
    "wait_layer(Tensor(a!)[] caches, Tensor dep, str name, int layer) -> ()",
    fake=_wait_layer_fake,
    cpu=_wait_layer_impl,
)


def wait_layer(dep: torch.Tensor, name: str, layer: int, caches: Sequence[torch.Tensor]) -> torch.Tensor:
    """Make the current stream wait until layer ``layer``'s bytes of ``name`` have landed.

    Place it in the model before the layer reads its cache. It takes the layer's input ``dep``
    (so the compiler cannot move it above the previous layer) and declares ``caches`` mutated
    (so no reader of the cache moves above it), and returns ``dep`` unchanged, for
    ``h = wait_layer(h, ...)``. Compile, CUDA-graph capture and AOT reload keep it: the name is
    resolved when the op runs.

    Parameters
    ----------
    dep : Tensor
        The layer's input.
    name : str
        A live :class:`kv_ops.LayerwiseLoads` (or a transformers ``HostOffloadedCache``'s loads).
    layer : int
        The layer, ``0 <= layer < num_layers``.
    caches : sequence of Tensor
        The layer's cache tensors (the ones holding its regions), e.g. ``[k_cache, v_cache]``.

    Raises
    ------
    ValueError
        No object of that name, a name that is not a string, a layer that is not an integer >= 0
        or is out of range, ``caches`` that is not a list of tensors (a single tensor), no caches
        or caches on another device.
        Passing tensors other than the layer's caches is not detected, and leaves the layer's
        readers free to be placed above the wait.
    """
    op = "kv_ops.wait_layer"
    if not isinstance(dep, torch.Tensor):
        raise ValueError(f"{op}: dep must be a tensor (the layer's input), got {dep!r}")
    caches = arguments.tensor_list(op, "caches", caches)
    torch.ops.kv_ops.wait_layer(caches, dep, arguments.text(op, "name", name), arguments.index(op, "layer", layer))
    return dep


__all__ = [
    "check_caches",
    "wait_layer",
    "check_name",
    "register",
    "unregister",
    "is_live",
    "is_taken",
    "lookup",
    "MADE_BEFORE_STEP",
    "keep",
]
