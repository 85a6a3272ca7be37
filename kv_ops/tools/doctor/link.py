"""The doctor's PCIe link check and ``measure_link``, the copy rates it judges the link by."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import threading
from dataclasses import dataclass

import torch

from ...cuda.arguments import cuda_device
from ...cuda.driver import check_driver, driver, driver_context
from ...cuda.host_memory import pinned_empty
from .common import NO_CUDA, CheckResult, skip_no_cuda

# --- check: PCIe link (and measure_link) ---------------------------------------------------------


# Below this fraction of the link's nominal rate the measured copies point at a real problem
# (a degraded link, the wrong NUMA node); a healthy link measures well above it (figures:
# docs/measurements.md).
SLOW_LINK_FRACTION = 0.6

# Per-lane rate in GB/s after line encoding (8b/10b to Gen 2, 128b/130b from Gen 3, FLIT at Gen 6).
_LANE_GBPS = {
    1: 0.25,
    2: 0.5,
    3: 8 * 128 / 130 / 8,
    4: 16 * 128 / 130 / 8,
    5: 32 * 128 / 130 / 8,
    6: 64 * 242 / 256 / 8,
}
_GEN_OF_GTS = {2.5: 1, 5.0: 2, 8.0: 3, 16.0: 4, 32.0: 5, 64.0: 6}


@dataclass(frozen=True)
class LinkBandwidth:
    """Measured contiguous copy rates between page-locked host memory and one GPU, in GB/s (1e9 B/s)."""

    h2d_gbps: float
    d2h_gbps: float


def measure_link(device: torch.device | str | int | None = None, seconds: float = 1.0) -> LinkBandwidth:
    """Measure contiguous copy bandwidth between page-locked host memory and a GPU.

    Copies 64 MiB back and forth on a stream of its own, about ``seconds / 2`` per direction,
    timed with CUDA events after one warm-up copy. The host side comes from
    :func:`kv_ops.cuda.host_memory.pinned_empty`, like every kv_ops host buffer.

    Parameters
    ----------
    device : device, optional
        The CUDA device; the current one by default.
    seconds : float
        Total time to spend measuring (both directions together).

    Returns
    -------
    LinkBandwidth
        ``h2d_gbps`` (host to GPU) and ``d2h_gbps`` (GPU to host), in GB/s (1e9 bytes per second).

    Examples
    --------
    >>> link = measure_link("cuda:0")
    >>> kv_bytes_per_step / (link.d2h_gbps * 1e9)   # seconds of link time per step
    """
    if not torch.cuda.is_available():
        raise RuntimeError(f"measure_link: {NO_CUDA}")
    if seconds <= 0:
        raise ValueError(f"measure_link: seconds must be > 0, got {seconds}")
    device = cuda_device("measure_link", device)
    nbytes = 64 << 20
    with torch.cuda.device(device):
        host = pinned_empty(nbytes)
    gpu = torch.empty(nbytes, dtype=torch.uint8, device=device)
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def rate(dst: torch.Tensor, src: torch.Tensor, budget: float) -> float:
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)  # the first copy pays one-time costs
            start.record(stream)
            dst.copy_(src, non_blocking=True)
            end.record(stream)
            end.synchronize()
            reps = max(2, min(10_000, int(budget / (start.elapsed_time(end) / 1e3))))
            start.record(stream)
            for _ in range(reps):
                dst.copy_(src, non_blocking=True)
            end.record(stream)
            end.synchronize()
        return reps * nbytes / (start.elapsed_time(end) / 1e3) / 1e9

    h2d = rate(gpu, host, seconds / 2)
    d2h = rate(host, gpu, seconds / 2)
    return LinkBandwidth(h2d_gbps=h2d, d2h_gbps=d2h)


class _Link:
    source: str
    gen: int | None
    gen_max: int | None
    width: int | None
    width_max: int | None
    numa_node: int | None


def _bus_tuple(bus_id: str) -> tuple[int, int, int, int] | None:
    m = re.search(r"([0-9a-fA-F]+):([0-9a-fA-F]+):([0-9a-fA-F]+)\.([0-7])", bus_id)
    return tuple(int(g, 16) for g in m.groups()) if m else None


def _int_or_none(text: str) -> int | None:
    text = text.strip()
    return int(text) if text.isdigit() else None


def _link_state(bus_id: str) -> _Link | None:
    """Current and maximum link generation and width, from nvidia-smi, else from sysfs."""
    bus = _bus_tuple(bus_id)
    if bus is None:
        return None
    sysfs = "/sys/bus/pci/devices/%04x:%02x:%02x.%x" % bus
    numa = None
    with contextlib.suppress(OSError, ValueError):
        with open(os.path.join(sysfs, "numa_node")) as f:
            numa = int(f.read())
        numa = None if numa < 0 else numa
    if shutil.which("nvidia-smi"):
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            out = subprocess.run(
                [
                    "nvidia-smi",
                    "--query-gpu=pci.bus_id,pcie.link.gen.current,pcie.link.gen.max,pcie.link.width.current,pcie.link.width.max",
                    "--format=csv,noheader,nounits",
                ],
                capture_output=True,
                text=True,
                timeout=10,
            )
            for line in out.stdout.splitlines():
                fields = line.split(",")
                if len(fields) == 5 and _bus_tuple(fields[0]) == bus:
                    values = [_int_or_none(f) for f in fields[1:]]
                    if any(v is not None for v in values):
                        return _Link("nvidia-smi", *values, numa)

    def read(attr: str) -> str | None:
        try:
            with open(os.path.join(sysfs, attr)) as f:
                return f.read().strip()
        except OSError:
            return None

    def gen(speed: str | None) -> int | None:
        m = re.match(r"([\d.]+)\s*GT/s", speed or "")
        return _GEN_OF_GTS.get(float(m.group(1))) if m else None

    values = (
        gen(read("current_link_speed")),
        gen(read("max_link_speed")),
        read("current_link_width"),
        read("max_link_width"),
    )
    values = values[:2] + tuple(_int_or_none(v) if v else None for v in values[2:])
    if all(v is None for v in values):
        return None
    return _Link("sysfs", *values, numa)


def check_pcie_link(device: torch.device | str | int | None = None, seconds: float = 1.0) -> CheckResult:
    """PCIe generation and width (current and maximum) and the measured link bandwidth.

    Parameters
    ----------
    device : device, optional
        The CUDA device to check; the current one by default.
    seconds : float
        Time for :func:`measure_link`.

    Returns
    -------
    CheckResult
        ``warn`` when the measured copies reach less than ``SLOW_LINK_FRACTION`` of the link's
        nominal rate, with the likely cause (narrow or slow link, NUMA placement).
    """
    name = "PCIe link"
    if not torch.cuda.is_available():
        return skip_no_cuda(name)
    drv = driver()

    device = cuda_device("check_pcie_link", device)
    with driver_context(device):
        (cu_device,) = check_driver(drv.cuDeviceGet(device.index), "cuDeviceGet")
        (raw,) = check_driver(drv.cuDeviceGetPCIBusId(32, cu_device), "cuDeviceGetPCIBusId")
    bus_id = (raw.decode() if isinstance(raw, bytes) else str(raw)).strip("\x00 ")
    # An idle GPU trains its link down to a low generation to save power, so the link is read
    # while the measurement's copies are running.
    found: list[_Link | None] = []

    def sample():
        try:
            found.append(_link_state(bus_id))
        except Exception:  # a missing or odd nvidia-smi/sysfs only loses the link description
            found.append(None)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    bw = measure_link(device, seconds)
    sampler.join(timeout=15)
    link = found[0] if found else None
    measured = f"host to GPU {bw.h2d_gbps:.1f} GB/s, GPU to host {bw.d2h_gbps:.1f} GB/s"
    if link is None:
        return CheckResult(
            name,
            "ok",
            f"{bus_id}: link generation and width unknown (no nvidia-smi answer, no sysfs entry); {measured}",
        )

    def show(gen, width):
        return f"Gen {gen if gen is not None else '?'} x{width if width is not None else '?'}"

    gen_max = link.gen_max or link.gen
    width_max = link.width_max or link.width
    described = f"{bus_id}: {show(link.gen, link.width)} under load, max {show(link.gen_max, link.width_max)} ({link.source}); {measured}"
    if gen_max not in _LANE_GBPS or not width_max:
        return CheckResult(name, "ok", described)
    nominal = _LANE_GBPS[gen_max] * width_max
    ratio = min(bw.h2d_gbps, bw.d2h_gbps) / nominal
    described += f" ({ratio:.2f} of the {show(gen_max, width_max)} link's {nominal:.1f} GB/s)"
    if ratio >= SLOW_LINK_FRACTION:
        return CheckResult(name, "ok", described)
    if link.width is not None and link.width < width_max:
        fix = f"the link trained at x{link.width} of x{width_max}: reseat the GPU or move it to a full-width slot"
    elif link.gen is not None and link.gen < gen_max:
        fix = f"the link runs at Gen {link.gen} of Gen {gen_max}: check the slot's PCIe speed in the BIOS and any riser"
    elif link.numa_node is not None:
        fix = (
            f"run on the GPU's NUMA node: numactl --cpunodebind={link.numa_node} --membind={link.numa_node} python ..."
        )
    else:
        fix = "run on the GPU's NUMA node (numactl --cpunodebind=N --membind=N) and check for other traffic on the link"
    return CheckResult(name, "warn", described, fix)
