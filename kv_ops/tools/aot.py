"""Ahead-of-time compilation of a model's step that uses these ops: compile and save in one
process, load and run in another.

The recipe, and why each part is there:

* **The model is the step's first argument**, never a global or a closure. Dynamo then reads
  every parameter and buffer through the argument, so they become inputs of the compiled
  graph and the loading process passes its own model. A module reached as a global is pickled
  into the artifact: saving fails ("mark these as external data"), and passing it as external
  data fails at load on torch 2.13 (``'_Missing' object has no attribute '_modules'``).
* **The ops carry names and counts, not addresses** (:mod:`ple_ops.registry`, region tensors),
  so the loaded graph reaches the loading process's flags, slots and caches.
* ``torch._dynamo.config.enable_aot_compile`` is switched on where it exists (torch <= 2.11
  needs it).
* **Inference mode**: compile and run under ``torch.no_grad()``; a graph traced with autograd
  on would be an autograd graph, and its guards would reject a call made without it.
* The loading process must import the op packages the graph calls (``kv_ops``, ``ple_ops``)
  before :func:`load_step`, as for any ``torch.library`` op.
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..cuda.arguments import path as path_argument
from ..cuda.torch_internals import enable_aot_compile

# An artifact is a pickle (torch's AOTCompiledFunction.serialize): the protocol opcode, then a
# protocol number. Reading them first tells a file that is no artifact from one that fails to
# load for a reason of its own (an op package not imported), which must keep its own error.
_PICKLE_PROTOCOLS = range(2, pickle.HIGHEST_PROTOCOL + 1)


def compile_step(step: Callable[..., Any], model: nn.Module, *example_args: Any) -> Callable[..., Any]:
    """AOT-compile ``step(model, *args)`` with ``fullgraph=True`` for these example arguments.

    Parameters
    ----------
    step : callable
        A module-level function whose first parameter is the model; it may call the model and
        any op of ``kv_ops`` and ``ple_ops``.
    model : nn.Module
        The model, already on its device, in ``eval()`` mode.
    *example_args
        The other arguments, with the shapes and dtypes every later call will use (the graph
        is static: compile once per batch size).

    Returns
    -------
    callable
        ``compiled(model, *args)``. It runs in this process as it is, and
        ``compiled.save_compiled_function(path)`` writes the artifact that :func:`load_step` reads.

    Examples
    --------
    >>> def decode_step(model, tokens, positions):
    ...     return model(tokens, positions)
    >>> with torch.no_grad():
    ...     compiled = kv_ops.tools.aot.compile_step(decode_step, model, tokens, positions)
    >>> compiled.save_compiled_function("step.aot")
    """
    if not callable(step):
        raise ValueError(f"compile_step: step must be a function taking the model first, got {step!r}")
    if not isinstance(model, nn.Module):
        raise ValueError(f"compile_step: model must be an nn.Module, got {type(model).__name__}")
    enable_aot_compile()
    return torch.compile(step, fullgraph=True).aot_compile(((model, *example_args), {}))


def load_step(path: str) -> Callable[..., Any]:
    """Load a step saved from :func:`compile_step`'s result; call it as ``loaded(model, *args)``.

    ``model`` is this process's own instance of the same class (same parameter and buffer
    shapes, same layer names). Import every op package the step uses first.

    ``path`` must be a ``str`` or ``os.PathLike``: anything else (an int, ``True``, ``None``) is a
    ``ValueError`` before anything is opened, as are a directory and a file that is no artifact.

    Examples
    --------
    >>> import kv_ops, ple_ops
    >>> loaded = kv_ops.tools.aot.load_step("step.aot")
    >>> with torch.no_grad():
    ...     logits = loaded(model, tokens, positions)
    """
    name = path_argument("load_step", "path", path)
    if os.path.isdir(name):
        raise ValueError(f"load_step: path {name!r} is a directory, not an artifact saved by compile_step")
    enable_aot_compile()
    with open(name, "rb") as f:
        head = f.read(2)
        if len(head) < 2 or head[0] != pickle.PROTO[0] or head[1] not in _PICKLE_PROTOCOLS:
            raise _not_an_artifact(name, f"it starts with {head!r}")
        f.seek(0)
        try:
            return torch.compiler.load_compiled_function(f)
        except (pickle.UnpicklingError, EOFError) as error:  # a truncated or damaged pickle
            raise _not_an_artifact(name, f"{type(error).__name__}: {error}") from error


def _not_an_artifact(name: str, why: str) -> ValueError:
    return ValueError(
        f"load_step: path {name!r} is not an artifact saved by compile_step(...).save_compiled_function ({why})"
    )


__all__ = ["compile_step", "load_step"]
