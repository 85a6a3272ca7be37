"""PleOffloadLayer: one model class that runs locally, in the offload process, or as a wait+pull."""

from __future__ import annotations

import contextlib
import functools
from abc import ABC, abstractmethod

import torch
from torch import nn

from kv_ops.cuda.arguments import shown
from kv_ops.cuda.torch_internals import CastGuard

from . import ops
from .ops import gather_rows

# Which role this process plays. "local": offload off, layers are ordinary modules.
# "placeholder": the GPU process with offload on, while it builds the model: PLE layers skip
# their constructors, so their tables are never allocated. "worker": the offload process.
_role = "local"


@contextlib.contextmanager
def building_placeholders():
    """Build a model whose PLE layers allocate nothing (the GPU side of an offloaded model)."""
    global _role
    previous, _role = _role, "placeholder"
    try:
        yield
    finally:
        _role = previous


def role() -> str:
    """Which role this process plays now: ``"local"``, ``"placeholder"`` or ``"worker"``.

    For model factories and tests that must tell the offload process from the GPU process (a
    factory that loads weights present only where the worker runs, say); the layers read it too.
    """
    return _role


def mark_offload_worker() -> None:
    """Declare this process the offload worker: PLE layers build their weights and compute."""
    global _role
    _role = "worker"


class PleOffloadLayer(CastGuard, ABC):
    """Base class of per-layer-embedding layers that can live in a CPU offload process.

    Subclasses write ``__init__`` (building their tables) and :meth:`forward_impl`. Model code
    calls ``layer(hidden_states, input_ids)`` in every mode:

    * offload off: ``forward_impl(input_ids)`` runs here;
    * GPU process, offload on: the constructor did nothing; the runtime attached an output
      buffer and a name, and forward is ``ple_ops.wait_copy`` + ``out[:num_tokens]``;
    * offload process: the full layer is built and the runtime calls ``forward_impl``.

    Examples
    --------
    >>> class Ple(PleOffloadLayer):
    ...     def __init__(self, vocab, dim):
    ...         super().__init__()
    ...         self.table = nn.Embedding(vocab, dim)
    ...     def forward_impl(self, input_ids):
    ...         return self.table(input_ids)
    """

    ple_name: str | None = None
    ple_placeholder = False
    ple_gathers = False  # gather transport: rows come from the ple_host_table buffer

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        init = cls.__dict__.get("__init__")
        if init is None:
            return

        @functools.wraps(init)
        def guarded_init(self, *args, **kw):
            if _role == "placeholder":
                nn.Module.__init__(self)
                self.ple_placeholder = True
                return
            init(self, *args, **kw)

        cls.__init__ = guarded_init

    @abstractmethod
    def forward_impl(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Rows ``[len(input_ids), dim]`` for the given token ids, on this module's device."""

    def lookup_table(self) -> torch.Tensor | None:
        """The table ``[vocab, dim]`` when ``forward_impl(ids)`` is exactly ``table[ids]``, else None.

        Override it in a pure-lookup layer to let :func:`ple_ops.gather_from_host` serve the layer
        from page-locked host memory (the gather transport) instead of an offload process.
        """
        return None

    def attach_host_table(self, table: torch.Tensor, dtype: torch.dtype) -> None:
        """Serve rows by a zero-copy gather from ``table``, uint8 ``[vocab, row_bytes]`` in
        page-locked host memory (a device view of it on CUDA); rows are ``dtype``."""
        self.ple_gathers = True
        self.ple_dtype = dtype
        self.register_buffer("ple_host_table", table, persistent=False)

    def attach_offload(self, name: str, out: torch.Tensor) -> None:
        """Make this (placeholder) layer pull its rows into ``out`` as armed layer ``name``."""
        self.ple_name = name
        self.register_buffer("ple_out", out, persistent=False)

    def forward(self, hidden_states: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        if self.ple_name is not None:
            self._check_ids(input_ids)
            # A view of the layer's buffer: a captured step reads and writes fixed addresses, so
            # the next step overwrites these rows (a caller that keeps them clones them).
            return ops.wait_copy(self.ple_out, hidden_states, input_ids.shape[0], self.ple_name)
        if self.ple_gathers:
            self._check_ids(input_ids)
            # One kernel reads the rows over PCIe (zero-copy) into a graph-owned buffer: no flag,
            # no other process, nothing to wait for.
            return gather_rows(self.ple_host_table, input_ids, self.ple_dtype)
        if self.ple_placeholder:
            raise RuntimeError("a placeholder PleOffloadLayer was called before an offload runtime armed it")
        return self.forward_impl(input_ids)

    def _check_ids(self, input_ids) -> None:
        """Either transport serves one row per id of a 1-D tensor: a 0-d tensor or a list would
        fail inside the op with an ``IndexError`` or ``AttributeError`` that names neither."""
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 1:
            raise ValueError(
                f"{type(self).__name__}: input_ids must be a 1-D tensor of token ids, got {shown(input_ids)}"
            )

    def before_apply(self, fn) -> None:
        # Served rows have the dtype the offload process makes them in (an armed layer's output
        # buffer) or the host table's (a gathering layer): a cast would reach the buffer but not
        # the bytes copied into it (a bf16 row read as fp16, silently) or would leave the rows in
        # their dtype. An armed layer's buffer also stays on the device its flags were made for.
        if self.ple_name is not None:
            held, what = self.ple_out, "the offload process makes its rows in"
        elif self.ple_gathers:
            held, what = self.ple_host_table.view(self.ple_dtype), "its host table holds"
        else:
            return
        probe = fn(torch.empty(0, dtype=held.dtype, device=held.device))
        if probe.dtype != held.dtype:
            change = f"cast to {probe.dtype}"
        elif self.ple_name is not None and probe.device != held.device:
            change = f"moved to {probe.device}"
        else:
            return
        raise ValueError(
            f"{type(self).__name__}: its rows are {held.dtype} on {held.device}, which {what}, so the model "
            f"cannot be {change} once they are attached (the modules before this one may be already): cast "
            "and move the model in its factory, before the runtime or gather_from_host takes it"
        )

    def release_offloaded(self) -> None:
        """Enqueue the reset of this layer's flag (after every reader of its rows)."""
        if self.ple_name is not None:
            ops.release(self.ple_out, self.ple_name)


def ple_layers(model: nn.Module) -> list[tuple[str, PleOffloadLayer]]:
    """The model's PLE layers and their qualified names, in module order (both processes agree on it)."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, PleOffloadLayer)]


__all__ = ["PleOffloadLayer", "building_placeholders", "mark_offload_worker", "ple_layers"]
