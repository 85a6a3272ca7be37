"""host_embedding: nn.Embedding (or Gemma 3n's and Gemma 4's scaled ones) served from page-locked host memory."""

from __future__ import annotations

import torch
from torch import nn

from kv_ops.cuda.torch_internals import CastGuard, has_forward_hooks

from ..ops import gather_rows
from .host_rows import TableInStateDict, check_pinnable, pin_rows

# Subclasses of nn.Embedding whose forward is known: (module, qualified name). Gemma 3n's and
# Gemma 4's forwards are both ``F.embedding(ids, weight) * self.embed_scale.to(self.weight.dtype)``
# (transformers 5.16 to 5.25): each row times one scalar, cast to the weight's dtype first (the
# buffer is made in the default dtype and may differ from the weight's). HostEmbedding gathers the
# rows as stored and multiplies them in its forward, outside the gather op, as the stock forward
# does after its lookup: Inductor then fuses the product into the ops after it exactly as it does
# in the stock model (it keeps a fused kernel's bf16 intermediates in fp32, so a table stored
# pre-scaled, rounded to bf16 once, gives other greedy tokens at Gemma 4 E2B's widths). Gemma 4's
# per-layer table is scaled by sqrt(hidden_size_per_layer_input) and pads with
# config.pad_token_id, which may be None; the padding row only matters to gradients.
# ``host_embedding`` also checks each conversion against the original forward on a sample of ids,
# so a forward changed in another release is refused.
_SCALED = {
    ("transformers.models.gemma3n.modeling_gemma3n", "Gemma3nTextScaledWordEmbedding"),
    ("transformers.models.gemma4.modeling_gemma4", "Gemma4TextScaledWordEmbedding"),
}

_SAMPLE_IDS = 64  # ids compared against the original forward at conversion


class HostEmbedding(CastGuard):
    """An embedding whose table lives in page-locked host memory; rows are gathered zero-copy.

    Made by :func:`host_embedding`; it holds no parameter. ``host_rows`` is uint8
    ``[num_embeddings, row_bytes]``: a CUDA device view of the page-locked bytes (rows land on
    the GPU) or, on the CPU, the page-locked tensor itself. A cast of the model after the
    conversion (``model.half()``, ``model.to(dtype)``) casts the rows into a new page-locked
    table, as it would have cast the original weight (cheaper: cast first). A scaled
    embedding's ``scale`` is a buffer, like the original's ``embed_scale``: a Python number there
    makes Inductor fuse the product otherwise than the original's, off by a bf16 rounding.
    """

    def __init__(
        self,
        host_rows: torch.Tensor,
        embedding_dim: int,
        dtype: torch.dtype,
        source: str,
        scale: torch.Tensor | None = None,
    ):
        super().__init__()
        self.num_embeddings = host_rows.shape[0]
        self.embedding_dim = embedding_dim
        self.dtype = dtype
        self.source = source
        self.register_buffer("host_rows", host_rows, persistent=False)
        # The rows are its state as the weight was the original's: saved and loaded as "weight".
        TableInStateDict("weight", "host_rows", "dtype").attach(self)
        # The scaled embeddings' factor (a scalar in the rows' dtype, on their device), or None.
        self.register_buffer("scale", scale, persistent=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        # As nn.Embedding: ids are a tensor on the rows' device (a list would fail deep in the
        # gather with an AttributeError that names neither the module nor the argument).
        if not isinstance(input_ids, torch.Tensor):
            raise ValueError(
                f"HostEmbedding: input_ids must be an integer tensor, as for nn.Embedding, got {type(input_ids).__name__}"
            )
        if input_ids.device != self.host_rows.device:
            raise ValueError(
                f"HostEmbedding: input_ids are on {input_ids.device}, but this embedding's rows land on "
                f"{self.host_rows.device}: move the ids there"
            )
        rows = gather_rows(self.host_rows, input_ids.reshape(-1), self.dtype)
        rows = rows.view(*input_ids.shape, self.embedding_dim)
        return rows if self.scale is None else rows * self.scale

    def before_apply(self, fn) -> None:
        # A cast (model.half(), .to(dtype)) reaches the scale, a buffer, but not the rows: uint8
        # bytes in host memory. So the rows are cast here, into a new page-locked table, as the
        # original's weight would be: what ``fn`` does to a tensor of the rows' dtype says whether
        # it casts, and to what. Moves are the buffer's (a CPU table moved to CUDA is copied there).
        cast = fn(torch.empty(0, dtype=self.dtype, device=self.host_rows.device)).dtype
        if cast != self.dtype:
            rows = self.host_rows
            self.host_rows = pin_rows(rows.view(self.dtype), rows.device, cast)
            self.dtype = cast

    def extra_repr(self) -> str:
        return (
            f"{self.num_embeddings}, {self.embedding_dim}, dtype={self.dtype}, "
            f"device={self.host_rows.device}, from={self.source}"
        )


def _scale_of(module: nn.Embedding) -> torch.Tensor | None:
    """The factor ``module``'s forward multiplies the looked-up rows by (None: none), or raise."""
    cls = type(module)
    if cls is nn.Embedding:
        return None
    if (cls.__module__, cls.__qualname__) in _SCALED:
        # Exactly the forward's factor, on the rows' device.
        return module.embed_scale.detach().to(module.weight.dtype).to(module.weight.device).clone()
    raise ValueError(
        f"host_embedding: {cls.__module__}.{cls.__qualname__} is a subclass of nn.Embedding whose forward "
        "is not known to be a plain row lookup (or a known elementwise scaling of one); refusing to replace it"
    )


def host_embedding(module: nn.Embedding) -> HostEmbedding:
    """Move an embedding's table into page-locked host memory; return a module that gathers rows.

    The table is copied into :func:`kv_ops.pinned_empty` memory and the returned
    :class:`HostEmbedding` gathers the rows a forward needs with one zero-copy kernel
    (:func:`kv_ops.gather_blocks`, the mechanism of :func:`ple_ops.gather_from_host`) that
    reads them over PCIe. It is an ordinary op, kept by ``torch.compile(fullgraph=True)`` and by
    CUDA-graph capture (``mode="reduce-overhead"`` included).

    Outputs are bitwise what ``module(ids)`` gives, in the weight's dtype. For transformers'
    ``Gemma3nTextScaledWordEmbedding`` and ``Gemma4TextScaledWordEmbedding`` (rows times
    ``embed_scale`` cast to the weight's dtype) the forward multiplies the gathered rows by the
    same factor, after the gather, as theirs does after the lookup, so a compiled model fuses it
    as it fuses theirs. Every conversion is also checked against ``module``'s own forward on a
    sample of ids and refused if any bit differs.

    Parameters
    ----------
    module : nn.Embedding
        A stock ``nn.Embedding``, ``Gemma3nTextScaledWordEmbedding`` or
        ``Gemma4TextScaledWordEmbedding``, on a CUDA device or the CPU. ``padding_idx`` (None
        included), ``scale_grad_by_freq`` and ``sparse`` only concern gradients and are accepted;
        ``max_norm`` (which renormalises rows in the forward), other subclasses, forward hooks and
        patched forwards are refused. ``module`` itself is left unchanged.

    Returns
    -------
    HostEmbedding
        No parameters and no GPU memory of its own. On CUDA its rows land on the weight's device;
        on the CPU they are plain CPU rows. The GPU copy of the table is freed once ``module`` is
        no longer referenced (replacing it in the model, as below, does that). Ids must lie in
        ``[0, num_embeddings)``: eager calls check them (``ValueError``); inside graphs an
        out-of-range id is skipped and counted (``kv_ops.error_count``), its row left
        unwritten. No gradient reaches the table. Convert after the model is on its device: a
        later ``.to("cuda")`` of a module converted on the CPU copies the rows onto the GPU.
        Its ``state_dict`` holds the table as ``weight``, the original's key, in its dtype (the
        rows themselves, not a copy), so ``save_pretrained`` or ``torch.save`` of a converted
        model writes the whole model, and ``load_state_dict`` writes new weights into the host
        rows in place.

    Raises
    ------
    ValueError
        For anything whose forward is not proven to be a (scaled) row lookup, naming the class,
        and for a weight with no rows or no columns (nothing to gather).

    Examples
    --------
    >>> model = transformers.Gemma3nForCausalLM(config).cuda()  # or Gemma4ForCausalLM, Gemma4ForConditionalGeneration
    >>> model.set_per_layer_input_embeddings(ple_ops.host_embedding(model.get_per_layer_input_embeddings()))
    """
    if not isinstance(module, nn.Embedding):
        raise ValueError(f"host_embedding: expected an nn.Embedding, got {type(module).__qualname__}")
    name = f"{type(module).__module__}.{type(module).__qualname__}"
    scale = _scale_of(module)
    if module.max_norm is not None:
        raise ValueError(f"host_embedding: {name} has max_norm={module.max_norm}, which renormalises rows in forward")
    if "forward" in module.__dict__ or has_forward_hooks(module):
        raise ValueError(f"host_embedding: {name} has a patched forward or forward hooks, which change its output")
    weight = module.weight
    if weight.dim() != 2:
        raise ValueError(f"host_embedding: {name}'s weight must be [num_embeddings, dim], got {tuple(weight.shape)}")
    check_pinnable("host_embedding", f"{name}'s weight", weight)
    device = weight.device
    if device.type not in ("cuda", "cpu"):
        raise ValueError(f"host_embedding: {name}'s weight is on {device}; only CUDA and CPU are supported")
    table = weight.detach().contiguous()
    out = HostEmbedding(pin_rows(table, device), table.shape[1], table.dtype, type(module).__qualname__, scale)
    del table
    _check_against(module, out, name)
    return out


def _check_against(module: nn.Embedding, out: HostEmbedding, name: str) -> None:
    vocab = out.num_embeddings
    ids = torch.linspace(0, vocab - 1, steps=min(vocab, _SAMPLE_IDS)).long()
    if module.padding_idx is not None:
        ids = torch.cat([ids, torch.tensor([module.padding_idx])])
    ids = ids.to(module.weight.device)
    with torch.no_grad():
        want, got = module(ids), out(ids)
    if want.dtype != got.dtype or not torch.equal(want.view(torch.uint8), got.view(torch.uint8)):
        raise ValueError(f"host_embedding: {name}'s forward does not equal a lookup of its table; refused")


__all__ = ["HostEmbedding", "host_embedding"]
