"""Byte-level helpers shared by the tests (tests/ is on pytest's pythonpath)."""

import torch

import kv_ops


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """The bytes of ``t``'s elements in row-major order of its shape, as a flat uint8 tensor."""
    return t.contiguous().reshape(-1).view(torch.uint8)


def span(region: torch.Tensor) -> tuple[int, int]:
    """[first, last) byte address of a 2-D region."""
    n, width = region.shape
    return region.data_ptr(), region.data_ptr() + (n - 1) * region.stride(0) + width


def assert_inside_and_disjoint(regions: dict, storage_ranges: list[tuple[int, int]]) -> None:
    """Every region lies inside one of the storages and no two regions share a byte."""
    spans = sorted(span(r) for r in regions.values())
    for lo, hi in spans:
        assert any(s <= lo and hi <= e for s, e in storage_ranges), f"region [{lo:#x}, {hi:#x}) outside its storage"
    for (_, a_hi), (b_lo, _) in zip(spans, spans[1:]):
        assert a_hi <= b_lo, "regions overlap"


def storage_range(t: torch.Tensor) -> tuple[int, int]:
    s = t.untyped_storage()
    return s.data_ptr(), s.data_ptr() + s.nbytes()


def random_bytes(shape, device="cpu", generator=None) -> torch.Tensor:
    return torch.randint(0, 256, shape, dtype=torch.uint8, generator=generator).to(device)


def make_regions(widths, num_blocks, device="cpu", strided=False, generator=None) -> list[torch.Tensor]:
    """Random-filled uint8 regions [num_blocks, width]. With ``strided`` they are column slices of
    one wider buffer, so each block stride exceeds its width and the gaps hold bytes that a copy
    must never touch."""
    if strided:
        pad = 3
        total = sum(widths) + pad * len(widths)
        backing = random_bytes((num_blocks, total), device, generator)
        out, col = [], 0
        for w in widths:
            out.append(backing[:, col : col + w])
            col += w + pad
        return out
    return [random_bytes((num_blocks, w), device, generator) for w in widths]


def _raw(t: torch.Tensor) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())


def clone_views(tensors) -> list[torch.Tensor]:
    """The same views over cloned storages (views that shared a storage share its clone), so a
    reference can run on the copy and whole storages, gaps included, can be compared after."""
    clones: dict[int, torch.Tensor] = {}
    out = []
    for t in tensors:
        key = t.untyped_storage().data_ptr()
        if key not in clones:
            clones[key] = _raw(t).clone()
        raw = clones[key]
        out.append(raw.as_strided(t.shape, t.stride(), t.storage_offset()))
    return out


def assert_same_storages(got, want) -> None:
    """Every byte of every storage under ``got`` equals the one under ``want`` (parallel lists)."""
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        ra, rb = _raw(a).cpu(), _raw(b).cpu()
        diff = (ra != rb).nonzero().flatten()
        assert diff.numel() == 0, f"tensor {i}: {diff.numel()} bytes differ, first at storage byte {int(diff[0])}"


def host_regions(widths, num_blocks, generator=None) -> list[torch.Tensor]:
    """Random-filled page-locked host regions: column slices of one ``pinned_empty`` mirror."""
    mirror = kv_ops.pinned_empty((num_blocks, sum(widths)))
    mirror.copy_(random_bytes(mirror.shape, generator=generator))
    out, col = [], 0
    for w in widths:
        out.append(mirror[:, col : col + w])
        col += w
    return out
