"""``ClosedError``: what every object of the engine floor raises once it is closed."""

from __future__ import annotations


class ClosedError(ValueError, RuntimeError):
    """A call on an object after its ``close()``: an :class:`OffloadEngine`, a
    :class:`kv_ops.LayerwiseLoads`, a :class:`kv_ops.StepTransfers`, or what is built on them.

    One type for every such object, so that one ``except`` clause covers them all. It is both a
    ``ValueError`` and a ``RuntimeError``, so that an ``except`` clause for either catches it too.
    """


# The engine's own name for it: the very same class, so either name catches it.
EngineClosedError = ClosedError


__all__ = ["ClosedError", "EngineClosedError"]
