"""Page-locked host memory for kv_ops and ple_ops: exact-size, registered with the CUDA driver, and device views of it.

Also the long-lived device tensors the ops cache (kept out of CUDA-graph memory pools).
"""

from __future__ import annotations

import ctypes
import math
import mmap
import numbers
import os
import sys
import threading
import warnings
from collections.abc import Mapping, Sequence

import torch

from . import arguments
from .arguments import cuda_device
from .driver import check_driver, device_pointer, driver, driver_context

# cuMemHostRegister pins page by page; very large single registrations have failed on some
# drivers, so we register in pieces of at most 64 GiB (docs/design.md). The pieces are adjacent in
# the virtual address space, and on devices that use the host pointer for registered memory
# (CU_DEVICE_ATTRIBUTE_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM, every x86-64 and Grace system
# we know) the device addresses are adjacent too, so one tensor may span several pieces.
REGISTER_CHUNK_BYTES = 64 << 30

_GIB = 1 << 30


def host_memory_bytes() -> tuple[int, int] | None:
    """``(available, total)`` bytes of host memory: ``MemAvailable`` and ``MemTotal`` from
    ``/proc/meminfo``, else ``os.sysconf``'s available and physical pages; None where neither
    exists."""
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
        # The kernel reports these in kB (KiB).
        return int(fields["MemAvailable"].split()[0]) << 10, int(fields["MemTotal"].split()[0]) << 10
    except (OSError, KeyError, ValueError, IndexError):
        pass
    try:
        page = os.sysconf("SC_PAGE_SIZE")
        return os.sysconf("SC_AVPHYS_PAGES") * page, os.sysconf("SC_PHYS_PAGES") * page
    except (AttributeError, OSError, ValueError):
        return None


def _too_much(owner: str, what: str, nbytes: int, memory: tuple[int, int] | None, why: str) -> ValueError:
    have = (
        "this machine's host memory is unknown"
        if memory is None
        else f"this machine has {memory[0]} bytes ({memory[0] / _GIB:.2f} GiB) available of "
        f"{memory[1]} bytes ({memory[1] / _GIB:.2f} GiB) in all"
    )
    return ValueError(
        f"{owner}: {what} asks for {nbytes} bytes ({nbytes / _GIB:.2f} GiB) of page-locked host memory, but {have}{why}"
    )


def check_host_bytes(owner: str, what: str, nbytes: int) -> None:
    """Raise a ``ValueError`` naming ``owner``, ``what``, the bytes asked and the bytes this machine
    has when ``nbytes`` is more than it can give as page-locked host memory, before anything is
    allocated.

    The bound is ``MemAvailable`` (what the kernel can hand out without swapping): page-locked
    memory cannot be swapped, so asking for more fails in ``mmap`` or in the driver's pinning, or
    succeeds and starves the rest of the machine. The figure can overstate what a cgroup allows, so
    the allocation itself is still checked (:func:`pinned_empty` does).

    Examples
    --------
    >>> check_host_bytes("OffloadEngine", "capacity_bytes", num_host_blocks * block_bytes)
    """
    if isinstance(nbytes, bool) or not isinstance(nbytes, numbers.Integral) or nbytes < 0:
        raise ValueError(f"{owner}: {what} must be a byte count >= 0, got {nbytes!r}")
    memory = host_memory_bytes()
    if memory is not None and nbytes > memory[0]:
        raise _too_much(owner, what, int(nbytes), memory, "")


# Whether pinned_empty has warned that CUDA is missing (once per process); public so that tests
# reset it and see the warning again.
warned_no_cuda = False


class HostRegistration:
    """The driver registrations of ``nbytes`` of host memory at ``address`` (page-locked and
    device-mapped, in pieces of at most 64 GiB); :meth:`release` (or collection) unregisters
    them. It never frees the memory: that is its owner's."""

    def __init__(self, address: int, nbytes: int, register: bool = True):
        self.address = address
        self.registered: list[int] = []
        # The module that registered, kept for the unregistration: a finalizer that runs at
        # interpreter shutdown can no longer import it.
        self.drv = driver() if register else None
        if register:
            self._register(nbytes)

    def _register(self, nbytes: int) -> None:
        drv = self.drv
        flags = drv.CU_MEMHOSTREGISTER_PORTABLE | drv.CU_MEMHOSTREGISTER_DEVICEMAP
        if nbytes > REGISTER_CHUNK_BYTES:
            dev = torch.cuda.current_device()
            attr = drv.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM
            (same,) = check_driver(drv.cuDeviceGetAttribute(attr, dev), "cuDeviceGetAttribute")
            if not same:
                raise RuntimeError(
                    f"pinned_empty: {nbytes} bytes need several registrations, and this device "
                    "does not map registered memory at its host address"
                )
        try:
            for start in range(0, nbytes, REGISTER_CHUNK_BYTES):
                size = min(REGISTER_CHUNK_BYTES, nbytes - start)
                check_driver(
                    drv.cuMemHostRegister(self.address + start, size, flags),
                    f"cuMemHostRegister({size} bytes at offset {start})",
                )
                self.registered.append(self.address + start)
        except BaseException:
            self.release()
            raise

    def release(self) -> bool:
        """Unregister every piece; False if the driver refused one (then this stays alive)."""
        drv = self.drv
        while self.registered:
            (err,) = drv.cuMemHostUnregister(self.registered[-1])
            if err != drv.CUresult.CUDA_SUCCESS:
                # Refused, e.g. in a finalizer that ran while a thread captured a CUDA graph in
                # global mode. Unmapping now would let a new mapping take these addresses, and its
                # registration would fail ("already registered"), so the mapping is kept, mapped
                # and registered, until a later pinned_empty releases it.
                if self not in _unreleased:
                    _unreleased.append(self)
                return False
            self.registered.pop()
        return True

    def __del__(self, _finalizing=sys.is_finalizing):
        # Not at interpreter shutdown: the driver bindings may be torn down by then (a call finds
        # None), and the process's exit releases every registration with its context. The test
        # is bound here, not looked up: shutdown clears this module's globals too (``sys`` is
        # None then) before a registration that another module holds is collected.
        if not _finalizing():
            self.release()


class _Pinned(HostRegistration):
    """Owns one mapping and its driver registrations; unregisters before unmapping.

    The tensor handed to the user holds a ctypes array that references this object, so this
    object dies only after the last tensor view of the memory is gone.
    """

    def __init__(self, mapping: mmap.mmap, nbytes: int, register: bool):
        # An mmap is page-aligned memory that no other allocation shares, so registering it
        # cannot collide with another registration of the same page.
        self.map = mapping
        self.buffer = (ctypes.c_uint8 * nbytes).from_buffer(self.map)
        super().__init__(ctypes.addressof(self.buffer), nbytes, register)


def register_host(owner: str, buffer: torch.Tensor) -> HostRegistration | None:
    """Page-lock a host buffer that the caller allocated (a shared mapping, say) for the GPU's
    copy engines and kernels, and return the registration to release once no copy uses it;
    None where CUDA is absent or the memory is page-locked already (``pinned_empty``'s,
    ``pin_memory=True``: the driver refuses a second registration, and its owner unregisters).
    """
    if not torch.cuda.is_available() or buffer.is_pinned():
        return None
    nbytes = buffer.numel() * buffer.element_size()
    if _unreleased:
        _release_refused()
    with driver_context(cuda_device(owner, None)):
        return HostRegistration(buffer.data_ptr(), nbytes)


# Mappings whose unregistration the driver refused (see _Pinned.release), released again by the
# next pinned_empty: a finalizer cannot raise, and it may run at any moment, a capture included.
_unreleased: list[HostRegistration] = []


def _release_refused() -> None:
    for owner in list(_unreleased):
        if owner.release():
            _unreleased.remove(owner)


def pinned_empty(size: int | Sequence[int], dtype: torch.dtype = torch.uint8) -> torch.Tensor:
    """Allocate uninitialised, page-locked host memory of exactly the requested size.

    Unlike ``torch.empty(..., pin_memory=True)``, whose caching allocator rounds every request up
    to a power of two (100 GB becomes 128 GB), this maps exactly ``numel * itemsize`` bytes
    (rounded to whole pages by the kernel) and registers them with ``cuMemHostRegister`` in
    pieces of at most 64 GiB, as portable and device-mapped memory, checking every driver return
    code. The memory is unregistered when the last tensor viewing it is freed.

    On a machine without CUDA it returns ordinary host memory and warns once.

    Parameters
    ----------
    size : int or sequence of int
        Shape of the tensor.
    dtype : torch.dtype
        Element type; ``torch.uint8`` by default, the type of block regions.

    Returns
    -------
    torch.Tensor
        A contiguous CPU tensor; ``is_pinned()`` is True where CUDA exists.

    Raises
    ------
    ValueError
        A size that is not an integer or a sequence of integers (``bool`` included), a negative
        dimension, a dtype that is not a ``torch.dtype``, or more bytes than the machine can page-lock: refused before
        anything is mapped (:func:`check_host_bytes`), or when the mapping or the pinning itself
        runs out of memory.

    Examples
    --------
    >>> mirror = kv_ops.pinned_empty((num_host_blocks, block_bytes))
    """
    global warned_no_cuda
    shape = arguments.shape("pinned_empty", "size", size)
    dtype = arguments.dtype("pinned_empty", "dtype", dtype)
    itemsize = torch.empty(0, dtype=dtype).element_size()
    nbytes = math.prod(shape) * itemsize
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    check_host_bytes("pinned_empty", f"size {shape}", nbytes)
    if not torch.cuda.is_available() and not warned_no_cuda:
        warned_no_cuda = True
        warnings.warn(
            "kv_ops.pinned_empty: CUDA is not available; returning ordinary (pageable) host memory",
            RuntimeWarning,
            stacklevel=2,
        )
    if _unreleased:
        _release_refused()
    try:
        flat = pin_mapping(mmap.mmap(-1, nbytes), nbytes, register=torch.cuda.is_available())
    except OSError as error:  # mmap's ENOMEM: overcommit rules or a cgroup limit said no
        raise _too_much("pinned_empty", f"size {shape}", nbytes, host_memory_bytes(), f" (mmap: {error})") from None
    except RuntimeError as error:
        # The driver could not pin the pages; any other driver failure is not about size.
        if "OUT_OF_MEMORY" not in str(error):
            raise
        raise _too_much("pinned_empty", f"size {shape}", nbytes, host_memory_bytes(), f" ({error})") from None
    return flat.view(dtype).view(shape)


def pin_mapping(mapping: mmap.mmap, nbytes: int, register: bool) -> torch.Tensor:
    """Wrap the first ``nbytes`` of ``mapping`` as a flat uint8 CPU tensor, page-locking them with
    the driver first if ``register``. The tensor (and its views) own the mapping and the
    registration: both are released, registration first, when the last view dies."""
    if register:
        with driver_context(cuda_device("pin_mapping", None)):
            owner = _Pinned(mapping, nbytes, register=True)
    else:
        owner = _Pinned(mapping, nbytes, register=False)
    # The tensor keeps the ctypes array alive through the buffer protocol; the array keeps the
    # owner alive through this attribute.
    owner.buffer.owner = owner
    flat = torch.frombuffer(owner.buffer, dtype=torch.uint8)
    owner.buffer = None  # break the owner -> array -> owner cycle
    return flat


def _machine() -> str:
    """Which machine (and boot) this process runs on: ranks with the same answer can share memory."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{os.uname().nodename}/{boot}"


def shared_host_buffer(nbytes: int, group=None) -> torch.Tensor:
    """``nbytes`` of host memory shared by the ranks of ``group`` (``torch.distributed``) that run
    on this machine: a flat uint8 tensor over one mapping, the same bytes in each of them.

    A collective: every rank of ``group`` calls it with the same ``nbytes``. The lowest rank of
    each machine makes the memory with ``memfd_create``, which has no name in any file system;
    the others open it through ``/proc/<pid>/fd`` of that rank and map it. Nothing is ever
    created in ``/dev/shm`` or elsewhere, so a rank killed at any moment (SIGKILL included)
    leaves nothing for a restart to trip over: the kernel frees the memory when the last
    process mapping it is gone. It is not page-locked here; the engine that adopts it
    registers it (:func:`register_host`).

    Raises
    ------
    ValueError
        ``nbytes`` not a positive integer, or more than this machine's available memory.
    OSError
        The rank that made the memory is gone before the others opened it.
    """
    import torch.distributed as dist

    if isinstance(nbytes, bool) or not isinstance(nbytes, numbers.Integral) or nbytes < 1:
        raise ValueError(f"shared_host_buffer: nbytes must be a positive integer, got {nbytes!r}")
    check_host_bytes("shared_host_buffer", "nbytes", nbytes)
    nbytes, me, world = int(nbytes), dist.get_rank(group), dist.get_world_size(group)
    machine = _machine()
    fd = None
    peers: list = [None] * world
    dist.all_gather_object(peers, machine, group=group)
    leader = peers.index(machine)  # the lowest rank on this machine
    if me == leader:
        fd = os.memfd_create("kv_ops-shared-host-buffer", os.MFD_CLOEXEC)
        os.ftruncate(fd, nbytes)
    made: list = [None] * world
    dist.all_gather_object(made, (os.getpid(), fd), group=group)
    try:
        if me != leader:
            pid, number = made[leader]
            fd = os.open(f"/proc/{pid}/fd/{number}", os.O_RDWR | os.O_CLOEXEC)
            if os.fstat(fd).st_size != nbytes:
                raise ValueError(
                    f"shared_host_buffer: rank {leader} made {os.fstat(fd).st_size} bytes, this rank asks "
                    f"for nbytes={nbytes}: every rank must ask for the same"
                )
        mapping = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        if fd is not None and me != leader:
            os.close(fd)  # the mapping keeps the memory
    # The leader's descriptor is how the others reach the memory: closed once every rank has mapped it.
    dist.barrier(group=group)
    if me == leader:
        os.close(fd)
    return pin_mapping(mapping, nbytes, register=False)


def lasting_copy(values: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A copy of ``values`` on ``device`` that may live for the whole process.

    The ops cache a few small device tensors on first use (region tables, the skipped-pair
    counter) and keep them forever, because captured graphs hold their addresses. A first use
    can happen inside ``mode="reduce-overhead"``'s warm-up, where CUDA-graph trees route every
    allocation made by the calling thread into the graph's private pool; a tensor that outlives
    the call there makes the tree refuse the graph ("tensor(s) in the cudagraph pool not tracked
    as outputs"). So the copy is allocated and made by a short-lived thread of its own, whose
    allocations come from the ordinary pool, and is complete when this returns.
    """
    if device.type != "cuda":
        return values.to(device, copy=True)
    made: list[torch.Tensor] = []
    failed: list[BaseException] = []

    def make() -> None:
        try:
            with torch.cuda.device(device):
                copy = values.to(device, copy=True)
                # A copy from pageable memory may still be in flight when .to returns; the
                # caller's streams must find it complete.
                torch.cuda.current_stream(device).synchronize()
                made.append(copy)
        except BaseException as e:  # re-raised in the caller's thread
            failed.append(e)

    thread = threading.Thread(target=make, name="kv_ops-lasting-copy")
    thread.start()
    thread.join()
    if failed:
        raise failed[0]
    return made[0]


class _CudaArrayInterface:
    """Describes ``nbytes`` at a device address as a flat uint8 array; holds ``owner`` alive."""

    def __init__(self, owner: torch.Tensor, address: int, nbytes: int):
        self.owner = owner
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (address, False),
            "version": 3,
            "strides": None,
        }


def bytes_at(owner: torch.Tensor, address: int, nbytes: int, device: torch.device) -> torch.Tensor:
    """A flat uint8 tensor over ``nbytes`` at ``address`` (a device address on CUDA, a host
    address on the CPU), with a storage of its own that keeps ``owner`` alive.

    Parameters
    ----------
    owner : Tensor
        What the bytes belong to; the result holds a reference to it.
    address : int
        The first byte.
    nbytes : int
        How many bytes (> 0).
    device : torch.device
        Where the address lives: ``cuda`` or ``cpu``.
    """
    if device.type == "cuda":
        return torch.as_tensor(_CudaArrayInterface(owner, address, nbytes), device=device)
    if device.type == "cpu":
        array = (ctypes.c_uint8 * nbytes).from_address(address)
        array.owner = owner  # the tensor holds the array through the buffer protocol
        return torch.frombuffer(array, dtype=torch.uint8)
    raise ValueError(f"bytes_at: unsupported device {device}")


def device_view(host: torch.Tensor, device: torch.device | str | int | None = None) -> torch.Tensor:
    """A CUDA tensor that aliases a page-locked host tensor (zero-copy).

    Kernels that read or write the view go over PCIe to host memory. Graph machinery sees an
    ordinary CUDA tensor, which is what ``mode="reduce-overhead"`` needs: CUDA-graph trees skip
    any graph that has a CPU tensor among its inputs.

    Parameters
    ----------
    host : torch.Tensor
        A contiguous, page-locked CPU tensor (``pinned_empty`` or ``pin_memory=True``).
    device : device, optional
        The CUDA device that will access it; the current device by default.

    Returns
    -------
    torch.Tensor
        Same shape and dtype as ``host``, on ``device``. It keeps ``host`` alive.

    Raises
    ------
    ValueError
        ``host`` is not one contiguous CPU tensor (a mapping or list of them: call it per tensor),
        or ``device`` is not a CUDA device of this machine.

    Examples
    --------
    >>> host = kv_ops.pinned_empty((1024, 4096))
    >>> view = kv_ops.device_view(host)       # torch.device("cuda:0"), bytes live in host RAM
    """
    if not isinstance(host, torch.Tensor):
        # A mapping or list of host regions is the likely slip: one view per tensor is what aliases them.
        per_tensor = "; call it once per tensor" if isinstance(host, (Mapping, list, tuple)) else ""
        raise ValueError(f"device_view takes one tensor (host), got {arguments.shown(host)}{per_tensor}")
    if host.device.type != "cpu" or not host.is_contiguous():
        raise ValueError(f"device_view needs a contiguous CPU tensor, got {host.device} stride {host.stride()}")
    device = cuda_device("device_view", device)
    nbytes = host.numel() * host.element_size()
    if nbytes == 0:
        return torch.empty(host.shape, dtype=host.dtype, device=device)
    with driver_context(device):
        iface = _CudaArrayInterface(host, device_pointer(host), nbytes)
    flat = torch.as_tensor(iface, device=device)
    return flat.view(host.dtype).view(host.shape)


__all__ = [
    "check_host_bytes",
    "host_memory_bytes",
    "pinned_empty",
    "pin_mapping",
    "register_host",
    "HostRegistration",
    "shared_host_buffer",
    "device_view",
    "lasting_copy",
    "bytes_at",
    "REGISTER_CHUNK_BYTES",
]
