"""The block-copy operators ``torch.ops.kv_ops.*``: schema, fake, CPU and CUDA implementations.

Registration pattern, used for every op in this project: ``torch.library.custom_op`` on the CPU
implementation, ``register_fake`` right under it, then ``register_kernel("cuda")``, then a public
wrapper with the docstring. Why this one: the schema is inferred from type hints and
``mutates_args`` in one place, so the declared mutation cannot drift from the Python signature;
``torch.compile`` treats the op as opaque and keeps it because it mutates an input; and
``opcheck`` exercises exactly what we registered. Mixed-device calls (GPU regions with host
regions) dispatch to the CUDA kernel, because the dispatcher picks the highest-priority backend
among all tensor arguments.

Ops carry tensors and counts only. Addresses (including the device address of page-locked host
memory) are resolved inside the implementation at call time, so nothing process-specific is
baked into a compiled artifact.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from . import kernels, reference
from . import validation as V

Regions = Sequence[torch.Tensor] | Mapping[str, torch.Tensor]


def _kernel_device(*groups: Sequence[torch.Tensor]) -> torch.device:
    """The CUDA device the kernel runs on: that of the first CUDA tensor among the arguments."""
    for group in groups:
        for t in group:
            if t.device.type == "cuda":
                return t.device
    raise AssertionError("CUDA kernel dispatched without a CUDA tensor")


def _region_list(regions: Regions) -> list[torch.Tensor]:
    return list(regions.values()) if isinstance(regions, Mapping) else list(regions)


# The fakes' contract, in the eager checks' words (kv_ops.validation): shapes may be symbolic
# here, so each condition goes through torch._check.


def _check_fake_region(op: str, what: str, i: int, region: torch.Tensor) -> None:
    torch._check(region.dim() == 2 and region.dtype == torch.uint8, lambda: V.region_message(op, what, i, region))


def _check_fake_ids(op: str, what: str, ids: torch.Tensor) -> None:
    torch._check(ids.dim() == 1 and ids.dtype in (torch.int32, torch.int64), lambda: V.ids_message(op, what, ids))


def _check_fake_packed(op: str, regions, ids: torch.Tensor, what: str, packed: torch.Tensor) -> None:
    for i, r in enumerate(regions):
        _check_fake_region(op, "regions", i, r)
    _check_fake_ids(op, "ids", ids)
    width = sum(r.shape[1] for r in regions)
    torch._check(
        packed.dim() == 2 and packed.dtype == torch.uint8,
        lambda: V.packed_message(op, what, packed, ids.shape[0], width),
    )
    torch._check(packed.shape[0] == ids.shape[0], lambda: V.packed_message(op, what, packed, ids.shape[0], width))
    torch._check(packed.shape[1] == width, lambda: V.packed_message(op, what, packed, ids.shape[0], width))


# --- copy_blocks ---------------------------------------------------------------------------------


def _check_copy(src, dst, src_ids, dst_ids, device: torch.device) -> None:
    op = "kv_ops.copy_blocks"
    V.check_regions(op, "src", src)
    V.check_regions(op, "dst", dst)
    V.check_widths(op, src, dst)
    V.check_ids_meta(op, "src_ids", src_ids)
    V.check_ids_meta(op, "dst_ids", dst_ids, src_ids.shape[0])
    V.check_devices(
        op,
        device,
        ids=[("src_ids", src_ids), ("dst_ids", dst_ids)],
        data=[(f"src[{i}]", t) for i, t in enumerate(src)] + [(f"dst[{i}]", t) for i, t in enumerate(dst)],
    )
    if V.should_check_ids(device):
        V.check_ids_values(op, "src_ids", src_ids, reference.num_blocks(src))
        V.check_ids_values(op, "dst_ids", dst_ids, reference.num_blocks(dst), unique=True)
        if any(a.data_ptr() == b.data_ptr() and a.device == b.device for a, b in zip(src, dst)):
            V.check_disjoint_ids(op, src_ids, dst_ids)


@torch.library.custom_op("kv_ops::copy_blocks", mutates_args=("dst",), device_types="cpu")
def _copy_blocks(
    src: list[torch.Tensor], dst: list[torch.Tensor], src_ids: torch.Tensor, dst_ids: torch.Tensor
) -> None:
    device = torch.device("cpu")
    _check_copy(src, dst, src_ids, dst_ids, device)
    skipped = reference.copy_blocks(src, dst, src_ids, dst_ids)
    if skipped:
        V.error_counter(device).add_(skipped)


@_copy_blocks.register_fake
def _(src, dst, src_ids, dst_ids):
    op = "kv_ops.copy_blocks"
    torch._check(len(src) == len(dst), lambda: V.region_count_message(op, len(src), len(dst)))
    for i, (a, b) in enumerate(zip(src, dst)):
        _check_fake_region(op, "src", i, a)
        _check_fake_region(op, "dst", i, b)
        torch._check(a.shape[1] == b.shape[1], lambda i=i, a=a, b=b: V.width_message(op, i, a.shape[1], b.shape[1]))
    _check_fake_ids(op, "src_ids", src_ids)
    _check_fake_ids(op, "dst_ids", dst_ids)
    torch._check(
        dst_ids.shape[0] == src_ids.shape[0],
        lambda: V.ids_length_message(op, "dst_ids", dst_ids.shape[0], src_ids.shape[0]),
    )


@_copy_blocks.register_kernel("cuda")
def _(src, dst, src_ids, dst_ids):
    device = _kernel_device([src_ids, dst_ids], src, dst)
    _check_copy(src, dst, src_ids, dst_ids, device)
    kernels.block_copy(src, dst, src_ids, dst_ids, src_ids.shape[0], V.error_counter(device))


def copy_blocks(src: Regions, dst: Regions, src_ids: torch.Tensor, dst_ids: torch.Tensor) -> None:
    """Copy blocks between two sets of regions: ``dst[r][dst_ids[i]] = src[r][src_ids[i]]``.

    Every region pair moves in one kernel launch. Works GPU->GPU, GPU<->page-locked host memory
    (zero-copy: the kernel reaches host memory through its device address) and CPU->CPU.

    Parameters
    ----------
    src, dst : sequence of Tensor, or mapping of str to Tensor
        uint8 regions ``[num_blocks, block_bytes]`` (from :func:`kv_ops.resolve_regions`);
        ``src[r]`` and ``dst[r]`` have equal ``block_bytes`` but may differ in ``num_blocks``.
        Two mappings are paired by key and must have the same keys.
    src_ids, dst_ids : Tensor
        1-D int32/int64 of equal length ``n``, on the kernel's device (the GPU, if any region is
        on the GPU).

    Raises
    ------
    ValueError
        In eager mode, before any byte moves: an id outside ``[0, num_blocks)``, a repeated
        destination id, mismatched block sizes, a wrong dtype or device. Id checks can be turned
        off with :func:`kv_ops.set_id_checks`; then, and inside captured graphs, a pair with an
        out-of-range id is skipped and counted in :func:`kv_ops.error_count`.

    Examples
    --------
    >>> gpu = kv_ops.infer_regions(kv_caches, num_blocks)
    >>> host = {k: kv_ops.pinned_empty((num_host_blocks, r.shape[1])) for k, r in gpu.items()}
    >>> kv_ops.copy_blocks(gpu, host, gpu_ids, host_ids)      # store: GPU -> host
    """
    if isinstance(src, Mapping) and isinstance(dst, Mapping):
        if set(src) != set(dst):
            raise ValueError(f"kv_ops.copy_blocks: src and dst name different regions: {sorted(src)} vs {sorted(dst)}")
        dst = {name: dst[name] for name in src}  # paired by name, whatever order each was built in
    torch.ops.kv_ops.copy_blocks(_region_list(src), _region_list(dst), src_ids, dst_ids)


# --- gather_blocks -------------------------------------------------------------------------------


def _check_gather(regions, ids, out, device: torch.device) -> None:
    op = "kv_ops.gather_blocks"
    V.check_regions(op, "regions", regions)
    V.check_ids_meta(op, "ids", ids)
    V.check_packed(op, "out", out, ids.shape[0], sum(r.shape[1] for r in regions))
    V.check_devices(
        op, device, ids=[("ids", ids)], data=[("out", out)] + [(f"regions[{i}]", t) for i, t in enumerate(regions)]
    )
    if V.should_check_ids(device):
        V.check_ids_values(op, "ids", ids, reference.num_blocks(regions))


@torch.library.custom_op("kv_ops::gather_blocks", mutates_args=("out",), device_types="cpu")
def _gather_blocks(regions: list[torch.Tensor], ids: torch.Tensor, out: torch.Tensor) -> None:
    device = torch.device("cpu")
    _check_gather(regions, ids, out, device)
    skipped = reference.gather_blocks(regions, ids, out)
    if skipped:
        V.error_counter(device).add_(skipped)


@_gather_blocks.register_fake
def _(regions, ids, out):
    _check_fake_packed("kv_ops.gather_blocks", regions, ids, "out", out)


@_gather_blocks.register_kernel("cuda")
def _(regions, ids, out):
    device = _kernel_device([ids, out], regions)
    _check_gather(regions, ids, out, device)
    kernels.block_copy(regions, out, ids, None, ids.shape[0], V.error_counter(device))


def gather_blocks(regions: Regions, ids: torch.Tensor, out: torch.Tensor) -> None:
    """Pack the chosen blocks of all regions into one contiguous buffer, for disk or network.

    ``out[i] = concat(regions[0][ids[i]], regions[1][ids[i]], ...)``.

    Parameters
    ----------
    regions : sequence of Tensor, or mapping of str to Tensor
        uint8 regions ``[num_blocks_r, block_bytes_r]``.
    ids : Tensor
        1-D int32/int64 ``[n]``.
    out : Tensor
        uint8 ``[n, sum(block_bytes_r)]`` with contiguous rows; GPU or page-locked host memory.
        Rows of skipped (out-of-range) ids are left unwritten.

    Examples
    --------
    >>> staging = kv_ops.pinned_empty((len(ids), kv_ops.block_bytes(regions)))
    >>> kv_ops.gather_blocks(regions, ids, staging)       # GPU regions -> one host buffer
    """
    torch.ops.kv_ops.gather_blocks(_region_list(regions), ids, out)


# --- scatter_blocks ------------------------------------------------------------------------------


def _check_scatter(packed, ids, regions, device: torch.device) -> None:
    op = "kv_ops.scatter_blocks"
    V.check_regions(op, "regions", regions)
    V.check_ids_meta(op, "ids", ids)
    V.check_packed(op, "packed", packed, ids.shape[0], sum(r.shape[1] for r in regions))
    V.check_devices(
        op,
        device,
        ids=[("ids", ids)],
        data=[("packed", packed)] + [(f"regions[{i}]", t) for i, t in enumerate(regions)],
    )
    if V.should_check_ids(device):
        V.check_ids_values(op, "ids", ids, reference.num_blocks(regions), unique=True)


@torch.library.custom_op("kv_ops::scatter_blocks", mutates_args=("regions",), device_types="cpu")
def _scatter_blocks(packed: torch.Tensor, ids: torch.Tensor, regions: list[torch.Tensor]) -> None:
    device = torch.device("cpu")
    _check_scatter(packed, ids, regions, device)
    skipped = reference.scatter_blocks(packed, ids, regions)
    if skipped:
        V.error_counter(device).add_(skipped)


@_scatter_blocks.register_fake
def _(packed, ids, regions):
    _check_fake_packed("kv_ops.scatter_blocks", regions, ids, "packed", packed)


@_scatter_blocks.register_kernel("cuda")
def _(packed, ids, regions):
    device = _kernel_device([ids, packed], regions)
    _check_scatter(packed, ids, regions, device)
    kernels.block_copy(packed, regions, None, ids, ids.shape[0], V.error_counter(device))


def scatter_blocks(packed: torch.Tensor, ids: torch.Tensor, regions: Regions) -> None:
    """Unpack a buffer made by :func:`gather_blocks` into the chosen blocks of all regions.

    ``regions[r][ids[i]] = packed[i, col_r : col_r + block_bytes_r]``, ``col_r`` the sum of the
    block bytes of the regions before r.

    Parameters
    ----------
    packed : Tensor
        uint8 ``[n, sum(block_bytes_r)]`` with contiguous rows; GPU or page-locked host memory.
    ids : Tensor
        1-D int32/int64 ``[n]``, no id twice.
    regions : sequence of Tensor, or mapping of str to Tensor
        uint8 regions ``[num_blocks_r, block_bytes_r]``, written.

    Examples
    --------
    >>> kv_ops.scatter_blocks(staging, new_ids, regions)  # one host buffer -> GPU regions
    """
    torch.ops.kv_ops.scatter_blocks(packed, ids, _region_list(regions))


__all__ = ["copy_blocks", "gather_blocks", "scatter_blocks"]
