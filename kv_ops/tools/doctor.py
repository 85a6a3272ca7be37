"""``python -m kv_ops.tools.doctor``: the machine checks kv_ops and ple_ops depend on, each with its fix, and ``measure_link``.

One section per check: its function, what only it uses, and the ``REPORT`` line that puts it in
the report. A new check is a new section.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import mmap
import os
import re
import secrets
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..driver import check_driver, device_pointer, driver, driver_context
from ..host_memory import device_view, pinned_empty

NO_CUDA = "no CUDA device (torch.cuda.is_available() is False)"
CUDA_CHECKS = ("driver", "stream memory ops", "host register", "batched copy", "PCIe link")

# O_DIRECT needs the buffer, the offset and the length aligned to the device's logical block
# size; 4 KiB is what kv_ops.transfer.disk uses, so it is what must work.
ALIGN = 4096


@dataclass(frozen=True)
class CheckResult:
    """One line of the report: ``status`` is ``"ok"``, ``"warn"``, ``"fail"`` or ``"skip"``."""

    name: str
    status: str
    detail: str
    fix: str | None = None


@dataclass(frozen=True)
class Options:
    """What the report was asked to check, as :func:`run_checks` took it; each check reads its part."""

    device: torch.device | str | int | None
    ple_bytes: int
    dirs: tuple[str, ...]
    seconds: float


@dataclass(frozen=True)
class ReportLine:
    """A check's place in the report: the line's ``name`` and ``run``, which calls the check.

    ``run`` takes the :class:`Options`; with ``each_dir`` the check reports one line per directory
    asked for instead, ``name`` is formatted with ``dir`` and ``run`` takes the directory.
    """

    name: str
    run: Callable[..., CheckResult]
    each_dir: bool = False


# The report's lines in order: each check's section appends its own. Each ``run`` looks its check
# up by name when it runs (a lambda, not the function itself), so a patched check is the one that runs.
REPORT: list[ReportLine] = []


# --- helpers shared by several checks ------------------------------------------------------------


def _cuda_device(device: torch.device | str | int | None) -> torch.device:
    if device is None:
        return torch.device("cuda", torch.cuda.current_device())
    device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"expected a CUDA device, got {device}")
    return torch.device("cuda", torch.cuda.current_device()) if device.index is None else device


def _skip_no_cuda(name: str, fix: str | None = None) -> CheckResult:
    return CheckResult(name, "skip", NO_CUDA, fix)


def _cuda_version(v: int) -> str:
    return f"{v // 1000}.{v % 1000 // 10}"


def _fmt_bytes(n: float) -> str:
    for unit, shift in (("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.1f} {unit}"
    return f"{int(n)} B"


def _attribute(drv, name: str, ordinal: int) -> int | None:
    # cuda-bindings renames attributes between major versions (the V1/V2 stream-memory-op
    # attributes, for one), so look each one up by name and tolerate its absence.
    attr = getattr(drv.CUdevice_attribute, name, None)
    if attr is None:
        return None
    err, value = drv.cuDeviceGetAttribute(attr, ordinal)
    return int(value) if err == drv.CUresult.CUDA_SUCCESS else None


# --- check: driver -------------------------------------------------------------------------------


def _nvidia_kernel_module_version() -> str | None:
    try:
        with open("/proc/driver/nvidia/version") as f:
            match = re.search(r"\s(\d+\.\d+(?:\.\d+)?)\s", f.readline())
    except OSError:
        return None
    return match.group(1) if match else None


def check_driver_version(device: torch.device | str | int | None = None) -> CheckResult:
    """Driver CUDA version, torch's CUDA version and the device's name.

    Parameters
    ----------
    device : device, optional
        The CUDA device to check; the current one by default.

    Returns
    -------
    CheckResult
        ``warn`` on a driver older than CUDA 12.8 (no ``cuMemcpyBatchAsync``).
    """
    if not torch.cuda.is_available():
        if torch.version.cuda is None:
            fix = f"torch {torch.__version__} is a CPU-only build: install a CUDA build of torch"
        else:
            fix = "torch has CUDA but sees no device: check nvidia-smi and CUDA_VISIBLE_DEVICES"
        return _skip_no_cuda("driver", fix)
    drv = driver()

    device = _cuda_device(device)
    with driver_context(device):
        (version,) = check_driver(drv.cuDriverGetVersion(), "cuDriverGetVersion")
    module = _nvidia_kernel_module_version()
    try:
        from importlib.metadata import version as package_version

        bindings = package_version("cuda-bindings")
    except Exception:  # an unusual install (source tree, vendored) has no metadata; not worth failing over
        bindings = "unknown"
    detail = (
        f"{torch.cuda.get_device_name(device)} ({device}); driver {module or '?'} supports CUDA {_cuda_version(version)}; "
        f"torch {torch.__version__} built for CUDA {torch.version.cuda}; cuda-bindings {bindings}"
    )
    if version < 12080:
        return CheckResult(
            "driver",
            "warn",
            detail + "; no cuMemcpyBatchAsync before CUDA 12.8",
            "install an NVIDIA driver of the R570 series or newer (CUDA 12.8+)",
        )
    return CheckResult("driver", "ok", detail)


REPORT.append(ReportLine("driver", lambda o: check_driver_version(o.device)))


# --- check: stream memory ops --------------------------------------------------------------------


_kept_alive: list[torch.Tensor] = []


def _wait_event(event: torch.cuda.Event, timeout: float) -> bool:
    deadline = time.perf_counter() + timeout
    while not event.query():
        if time.perf_counter() > deadline:
            return False
        time.sleep(1e-3)
    return True


def check_stream_memory_ops(device: torch.device | str | int | None = None) -> CheckResult:
    """Whether the stream can write and wait on a 32-bit flag in host-mapped memory.

    This is what ple_ops does every step (``cuStreamWriteValue32`` / ``cuStreamWaitValue32`` on a
    flag in page-locked host memory). The device attributes are reported, but the verdict comes
    from doing it: the legacy V1 attribute reads 0 on most healthy machines, because CUDA 12 and
    later route these calls to the V2 operations, which every driver enables.

    Parameters
    ----------
    device : device, optional
        The CUDA device to check; the current one by default.

    Returns
    -------
    CheckResult
        ``fail`` with the driver error if the write or the wait does not work.
    """
    if not torch.cuda.is_available():
        return _skip_no_cuda("stream memory ops")
    drv = driver()

    device = _cuda_device(device)
    attrs = {}
    for label, name in (
        ("wait NOR", "CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_WAIT_VALUE_NOR"),
        ("64-bit", "CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS"),
        ("legacy V1", "CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_MEM_OPS_V1"),
    ):
        value = _attribute(drv, name, device.index)
        if value is not None:
            attrs[label] = value
    with driver_context(device):
        (version,) = check_driver(drv.cuDriverGetVersion(), "cuDriverGetVersion")
    if version < 12000:
        fix = "update to a CUDA 12+ driver, or enable the legacy operations: modprobe nvidia NVreg_EnableStreamMemOPs=1"
    else:
        fix = "update the NVIDIA driver; ple_ops cannot wait on its flags without these operations"
    shown = (
        ", ".join(f"{k}={v}" for k, v in attrs.items()) or "none of the known attributes exist in this cuda-bindings"
    )
    with torch.cuda.device(device):
        flag = pinned_empty(1, torch.int32)
    flag.zero_()
    stream = torch.cuda.Stream(device)
    handle = drv.CUstream(stream.cuda_stream)
    try:
        with driver_context(device):
            address = drv.CUdeviceptr(device_pointer(flag))
            check_driver(drv.cuStreamWriteValue32(handle, address, 1, 0), "cuStreamWriteValue32")
            stream.synchronize()
            if int(flag.item()) != 1:
                return CheckResult(
                    "stream memory ops",
                    "fail",
                    f"cuStreamWriteValue32 did not reach host memory (attributes: {shown})",
                    fix,
                )
            # The flag already holds the value, so this wait is satisfied at once; a stream that
            # stays blocked means the operation does not work here.
            check_driver(
                drv.cuStreamWaitValue32(handle, address, 1, drv.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_EQ),
                "cuStreamWaitValue32",
            )
            done = torch.cuda.Event()
            done.record(stream)
            if not _wait_event(done, 1.0):
                # The stream still reads the flag: unregistering it now would pull the memory out
                # from under the GPU, so it stays registered until the process ends.
                _kept_alive.append(flag)
                return CheckResult(
                    "stream memory ops",
                    "fail",
                    f"cuStreamWaitValue32 on a raised flag still blocks after 1 s (attributes: {shown})",
                    fix,
                )
    except RuntimeError as e:
        return CheckResult("stream memory ops", "fail", f"{e} (attributes: {shown})", fix)
    return CheckResult(
        "stream memory ops",
        "ok",
        f"cuStreamWriteValue32 and cuStreamWaitValue32 on a host-mapped flag work (attributes: {shown})",
    )


REPORT.append(ReportLine("stream memory ops", lambda o: check_stream_memory_ops(o.device)))


# --- check: host register ------------------------------------------------------------------------


def check_host_register(device: torch.device | str | int | None = None) -> CheckResult:
    """Whether ``cuMemHostRegister`` pins mmap'd memory as portable, device-mapped memory.

    Registers a small buffer through :func:`kv_ops.host_memory.pinned_empty`, resolves its device
    address and has a GPU kernel write it through that address.

    Parameters
    ----------
    device : device, optional
        The CUDA device to check; the current one by default.

    Returns
    -------
    CheckResult
        ``fail`` with the driver error if registration or mapping fails.
    """
    name = "host register"
    if not torch.cuda.is_available():
        return _skip_no_cuda(name)
    drv = driver()

    device = _cuda_device(device)
    supported = _attribute(drv, "CU_DEVICE_ATTRIBUTE_HOST_REGISTER_SUPPORTED", device.index)
    same_address = _attribute(drv, "CU_DEVICE_ATTRIBUTE_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM", device.index)
    nbytes = 64 << 10
    try:
        with torch.cuda.device(device):
            host = pinned_empty(nbytes)
        host.zero_()
        with driver_context(device):
            address = device_pointer(host)
    except (RuntimeError, ValueError) as e:
        fix = (
            "this platform does not support cuMemHostRegister (some vGPU and confidential-computing setups)"
            if supported == 0
            else None
        )
        return CheckResult(name, "fail", str(e), fix)
    view = device_view(host, device)
    view.fill_(0xA5)
    torch.cuda.synchronize(device)
    if not bool((host == 0xA5).all()):
        return CheckResult(
            name,
            "fail",
            f"registered {_fmt_bytes(nbytes)} at device address 0x{address:x}, but a GPU write did not reach it",
        )
    where = "the host address" if address == host.data_ptr() else f"0x{address:x} (host 0x{host.data_ptr():x})"
    detail = f"{_fmt_bytes(nbytes)} registered portable and device-mapped, device address {where}, GPU writes arrive"
    if same_address == 0:
        return CheckResult(
            name,
            "warn",
            detail + "; the device does not use host addresses for registered memory",
            "keep each pinned_empty allocation at or below 64 GiB (larger ones need several registrations at one address)",
        )
    return CheckResult(name, "ok", detail)


REPORT.append(ReportLine("host register", lambda o: check_host_register(o.device)))


# --- check: batched copy -------------------------------------------------------------------------


def check_batched_copy(device: torch.device | str | int | None = None) -> CheckResult:
    """Whether ``cuMemcpyBatchAsync`` resolves and moves bytes, through :mod:`kv_ops.dma` itself.

    Four blocks go GPU to host in a shuffled order (four copies) and back in one merged copy.

    Parameters
    ----------
    device : device, optional
        The CUDA device to check; the current one by default.

    Returns
    -------
    CheckResult
        ``warn`` if the driver lacks the batched call (the DMA path then issues one
        ``cuMemcpyAsync`` per copy), ``fail`` if the copies go wrong.
    """
    name = "batched copy"
    if not torch.cuda.is_available():
        return _skip_no_cuda(name)
    from ..transfer import dma

    device = _cuda_device(device)
    with driver_context(device):
        abi = dma.batched_copy_abi()
    gpu = torch.randint(0, 256, (4, ALIGN), dtype=torch.uint8, device=device)
    back = torch.zeros_like(gpu)
    with torch.cuda.device(device):
        host = pinned_empty((4, ALIGN))
    host.zero_()
    order = torch.tensor([3, 0, 2, 1])
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    dma.enqueue_copies([gpu], [host], order, torch.arange(4), stream)
    dma.enqueue_copies([host], [back], torch.arange(4), torch.arange(4), stream)
    stream.synchronize()
    if not (torch.equal(host, gpu.cpu()[order]) and torch.equal(back.cpu(), host)):
        return CheckResult(name, "fail", "block copies through kv_ops.dma moved the wrong bytes")
    if not abi:
        return CheckResult(
            name,
            "warn",
            "no cuMemcpyBatchAsync in this driver: the DMA path issues one cuMemcpyAsync per copy (bytes check out)",
            "install an NVIDIA driver of the R570 series or newer (CUDA 12.8+)",
        )
    return CheckResult(
        name, "ok", f"cuMemcpyBatchAsync (CUDA {_cuda_version(abi)} signature) moved blocks both ways, bytes check out"
    )


REPORT.append(ReportLine("batched copy", lambda o: check_batched_copy(o.device)))


# --- check: PCIe link (and measure_link) ---------------------------------------------------------


# Below this fraction of the link's nominal rate the measured copies point at a real problem
# (a degraded link, the wrong NUMA node); a healthy H200 at Gen5 x16 measures about 0.87.
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
    :func:`kv_ops.host_memory.pinned_empty`, like every kv_ops host buffer.

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
    device = _cuda_device(device)
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
        return _skip_no_cuda(name)
    drv = driver()

    device = _cuda_device(device)
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


REPORT.append(ReportLine("PCIe link", lambda o: check_pcie_link(o.device, o.seconds)))


# --- check: /dev/shm -----------------------------------------------------------------------------


def check_shm(ple_bytes: int = 0, path: str = "/dev/shm") -> CheckResult:
    """Free space in ``/dev/shm``, where ple_ops puts the buffers it shares with its CPU process.

    Parameters
    ----------
    ple_bytes : int
        Bytes the PLE runtime will place there (slots, flags, control block); 0 only reports.
    path : str
        The tmpfs to check.

    Returns
    -------
    CheckResult
        ``fail`` with the command that grows it if ``ple_bytes`` exceeds the free space.
    """
    name = path
    if ple_bytes < 0:
        raise ValueError(f"check_shm: ple_bytes must be >= 0, got {ple_bytes}")
    if not os.path.isdir(path):
        return CheckResult(
            name,
            "warn",
            f"{path} does not exist: ple_ops puts its shared buffers in {tempfile.gettempdir()} instead",
            "mount a tmpfs there: mount -t tmpfs -o size=8G tmpfs /dev/shm",
        )
    st = os.statvfs(path)
    free, size = st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize
    have = f"{_fmt_bytes(free)} free of {_fmt_bytes(size)}"
    if ple_bytes == 0:
        return CheckResult(name, "ok", f"{have} (pass --ple-bytes to check a plan against it)")
    if ple_bytes > free:
        # What is in use stays in use; the new size must hold it and the plan.
        need_gib = -(-(size - free + ple_bytes) // (1 << 30))
        return CheckResult(
            name,
            "fail",
            f"PLE needs {_fmt_bytes(ple_bytes)} but {path} has {have}",
            f"grow it to at least {need_gib} GiB: docker run --shm-size={need_gib}g ..., or "
            f"sudo mount -o remount,size={need_gib}G {path} (Kubernetes: an emptyDir volume with medium: Memory)",
        )
    return CheckResult(name, "ok", f"PLE needs {_fmt_bytes(ple_bytes)}; {have}")


REPORT.append(ReportLine("/dev/shm", lambda o: check_shm(o.ple_bytes)))


# --- check: O_DIRECT, one line per --dir ---------------------------------------------------------


def check_o_direct(directory: str) -> CheckResult:
    """Whether files in ``directory`` take O_DIRECT I/O, which the disk tier's ``BlockFile`` uses.

    Creates a private file (``O_EXCL | O_NOFOLLOW``, mode 0600) with ``O_DIRECT``, unlinks it at
    once, then writes 4 KiB from a page-aligned buffer and reads it back. (``BlockFile`` itself
    prefers an unnamed ``O_TMPFILE`` and sets ``O_DIRECT`` after; the file system's answer is
    the same.) Nothing is left behind, whatever fails.

    Parameters
    ----------
    directory : str
        A candidate ``disk_dir`` for :class:`kv_ops.OffloadEngine`.

    Returns
    -------
    CheckResult
        ``warn`` if the file system refuses O_DIRECT (``EINVAL``: use ``page_cache=True``),
        ``fail`` if no file can be made or written there.
    """
    name = f"O_DIRECT {directory}"
    if not hasattr(os, "O_DIRECT"):
        return CheckResult(name, "skip", "this platform has no O_DIRECT", "pass page_cache=True to OffloadEngine")
    path = os.path.join(directory, f".kv_ops-doctor.{os.getpid()}.{secrets.token_hex(8)}")
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_DIRECT
    try:
        fd = os.open(path, flags, 0o600)
    except OSError as e:
        return _o_direct_error(name, directory, "create a file", e)
    unlinked = False
    try:
        os.unlink(path)
        unlinked = True
        with mmap.mmap(-1, ALIGN) as out, mmap.mmap(-1, ALIGN) as back:
            pattern = secrets.token_bytes(ALIGN)
            out[:] = pattern
            written = os.pwrite(fd, out, 0)
            if written != ALIGN:
                return CheckResult(name, "fail", f"short O_DIRECT write: {written} of {ALIGN} bytes")
            read = os.preadv(fd, [back], 0)
            if read != ALIGN or back[:] != pattern:
                return CheckResult(
                    name, "fail", f"O_DIRECT read back {read} bytes that differ from the {ALIGN} written"
                )
    except OSError as e:
        return _o_direct_error(name, directory, "write and read 4 KiB", e)
    finally:
        os.close(fd)
        if not unlinked:
            with contextlib.suppress(OSError):
                os.unlink(path)
    st = os.statvfs(directory)
    return CheckResult(
        name, "ok", f"4 KiB aligned O_DIRECT write and read back; {_fmt_bytes(st.f_bavail * st.f_frsize)} free"
    )


def _o_direct_error(name: str, directory: str, what: str, e: OSError) -> CheckResult:
    if e.errno == errno.EINVAL:
        return CheckResult(
            name,
            "warn",
            "no O_DIRECT here: pass page_cache=True to OffloadEngine",
            f"OffloadEngine(..., disk_dir={directory!r}, page_cache=True), or a directory on a local ext4/xfs disk",
        )
    if e.errno == errno.ENOENT and not os.path.isdir(directory):
        return CheckResult(
            name, "fail", f"{directory} does not exist", f"mkdir -p {directory}, or pass an existing directory"
        )
    if e.errno == errno.ENOTDIR:
        return CheckResult(name, "fail", f"{directory} is not a directory", "pass a directory")
    if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return CheckResult(
            name, "fail", f"cannot {what} in {directory}: {e.strerror}", "pass a directory this user can write"
        )
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return CheckResult(
            name, "fail", f"cannot {what} in {directory}: {e.strerror}", "free space there, or pass another directory"
        )
    return CheckResult(name, "fail", f"cannot {what} in {directory}: {e.strerror or e}")


REPORT.append(ReportLine("O_DIRECT {dir}", lambda d: check_o_direct(d), each_dir=True))


# --- running and reporting -----------------------------------------------------------------------


def _guarded(name: str, check, *args) -> CheckResult:
    # One broken check must not hide the others, and the report never shows a traceback.
    try:
        return check(*args)
    except ImportError as e:
        fix = "pip install cuda-bindings" if (getattr(e, "name", None) or "").startswith("cuda") else None
        return CheckResult(name, "fail", f"{type(e).__name__}: {e}", fix)
    except Exception as e:
        return CheckResult(name, "fail", f"{type(e).__name__}: {e}")


def run_checks(
    device: torch.device | str | int | None = None,
    ple_bytes: int = 0,
    dirs: list[str] | tuple[str, ...] = (),
    seconds: float = 1.0,
) -> list[CheckResult]:
    """Run every check, in report order; exceptions become ``fail`` results.

    Parameters
    ----------
    device : device, optional
        The CUDA device to check; the current one by default.
    ple_bytes : int
        Bytes the PLE runtime will need in ``/dev/shm``; 0 only reports the free space.
    dirs : sequence of str
        Candidate disk-tier directories, each checked for O_DIRECT.
    seconds : float
        Time for the link bandwidth measurement.

    Returns
    -------
    list of CheckResult
    """
    options = Options(device, ple_bytes, tuple(dirs), seconds)
    results = []
    for line in REPORT:
        if line.each_dir:
            results += [_guarded(line.name.format(dir=d), line.run, d) for d in options.dirs]
        else:
            results.append(_guarded(line.name, line.run, options))
    return results


def format_report(results: list[CheckResult]) -> str:
    """The aligned summary table that :func:`main` prints.

    Parameters
    ----------
    results : list of CheckResult

    Returns
    -------
    str
        One line per check, a ``fix:`` line under each check that has one, and a count by status.
    """
    width = max([len("check")] + [len(r.name) for r in results])
    indent = " " * (width + 2 + 6 + 2)
    lines = [f"{'check':<{width}}  status  detail", f"{'-' * width}  ------  {'-' * 6}"]
    for r in results:
        lines.append(f"{r.name:<{width}}  {r.status:<6}  {r.detail}")
        if r.fix:
            lines.append(f"{indent}fix: {r.fix}")
    counts = {s: sum(r.status == s for r in results) for s in ("ok", "warn", "fail", "skip")}
    lines.append(", ".join(f"{n} {s}" for s, n in counts.items()))
    return "\n".join(lines)


_UNITS = {"": 0, "k": 10, "m": 20, "g": 30, "t": 40}


def parse_bytes(text: str) -> int:
    """A size as ``--ple-bytes`` takes it: bytes, or with a K, M, G or T suffix (powers of 1024;
    ``KiB``/``KB`` alike), fractions allowed (``1.5k``). Raises ``argparse.ArgumentTypeError``.
    """
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?\s*", text, re.IGNORECASE)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (a number of bytes, or with K, M, G or T)")
    return int(float(m.group(1)) * (1 << _UNITS[m.group(2).lower()]))


def main(argv: list[str] | None = None) -> int:
    """Command line: print the report; return 1 if any check failed, else 0.

    Parameters
    ----------
    argv : list of str, optional
        Arguments (``sys.argv[1:]`` by default): ``--ple-bytes N``, ``--dir DIR ...``, ``--device``.

    Returns
    -------
    int
        The exit status: warnings and skips are not failures.
    """
    parser = argparse.ArgumentParser(
        prog="python -m kv_ops.tools.doctor",
        description="Check that this machine can run kv_ops and ple_ops, with a fix for each problem found.",
    )
    parser.add_argument(
        "--ple-bytes",
        type=parse_bytes,
        default=0,
        metavar="N",
        help="bytes the PLE runtime will need in /dev/shm (K, M, G, T suffixes: powers of 1024); default 0: just report",
    )
    parser.add_argument(
        "--dir",
        dest="dirs",
        action="extend",
        nargs="+",
        default=[],
        metavar="DIR",
        help="disk-tier directory to check for O_DIRECT",
    )
    parser.add_argument("--device", default=None, help="CUDA device to check (default: the current one)")
    args = parser.parse_args(argv)
    try:
        results = run_checks(args.device, args.ple_bytes, args.dirs)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    print(format_report(results))
    return 1 if any(r.status == "fail" for r in results) else 0


__all__ = [
    "CheckResult",
    "LinkBandwidth",
    "measure_link",
    "check_driver_version",
    "check_stream_memory_ops",
    "check_host_register",
    "check_batched_copy",
    "check_pcie_link",
    "check_shm",
    "check_o_direct",
    "run_checks",
    "format_report",
    "parse_bytes",
    "REPORT",
    "ReportLine",
    "Options",
    "main",
    "NO_CUDA",
    "CUDA_CHECKS",
]


if __name__ == "__main__":
    sys.exit(main())
