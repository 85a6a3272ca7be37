"""Every CUDA driver call kv_ops and ple_ops make goes through here: the lazily imported bindings, checked."""

from __future__ import annotations

import ctypes
import functools
import threading
from types import ModuleType

import torch

from .torch_internals import current_raw_stream


def driver() -> ModuleType:
    """The ``cuda.bindings.driver`` module, imported on first use.

    Imported lazily because cuda-bindings is absent on CPU-only installs and loads libcuda when
    first used, which fails where no driver exists; importing kv_ops must work on both.

    Returns
    -------
    module
        ``cuda.bindings.driver``.

    Raises
    ------
    ImportError
        Where cuda-bindings is not installed (its ``name`` starts with ``"cuda"``).

    Examples
    --------
    >>> drv = driver()
    >>> (version,) = check_driver(drv.cuDriverGetVersion(), "cuDriverGetVersion")
    """
    from cuda.bindings import driver as drv

    return drv


def check_driver(result: tuple, what: str) -> tuple:
    """Raise on a cuda-bindings driver error code; return the call's remaining outputs.

    Parameters
    ----------
    result : tuple
        What a ``cuda.bindings.driver`` call returned: a ``CUresult`` first, then its outputs.
    what : str
        The call, for the error message.

    Returns
    -------
    tuple
        ``result[1:]``, the call's outputs.

    Raises
    ------
    RuntimeError
        If the ``CUresult`` is not ``CUDA_SUCCESS``; the message names the call and the error.

    Examples
    --------
    >>> (count,) = check_driver(driver().cuDeviceGetCount(), "cuDeviceGetCount")
    """
    drv = driver()
    err = result[0]
    if err != drv.CUresult.CUDA_SUCCESS:
        _, text = drv.cuGetErrorString(err)
        text = text.decode() if isinstance(text, bytes) else text
        raise RuntimeError(f"{what} failed: {err.name} ({int(err)}): {text}")
    return result[1:]


class driver_context:
    """Bind ``device``'s primary context to this thread for driver calls, then restore.

    The driver API acts on the calling thread's current context, which torch creates lazily; a
    one-element allocation is the cheapest way to make torch create and bind it. A class, not a
    generator: the copy paths enter it once per transfer, and when the device is already bound
    and current that costs well under a microsecond.

    Parameters
    ----------
    device : torch.device
        The CUDA device whose primary context the calls inside the block use.

    Examples
    --------
    >>> with driver_context(torch.device("cuda", 0)):
    ...     address = device_pointer(host)
    """

    __slots__ = ("device", "_switch")

    def __init__(self, device: torch.device):
        self.device = device if isinstance(device, torch.device) else torch.device(device)
        self._switch = None

    def __enter__(self) -> None:
        device = self.device
        bound = _bound.__dict__.setdefault("devices", set())
        index = device.index
        if device in bound and (index is None or torch.cuda.current_device() == index):
            return  # bound before and current: the common case, kept cheap
        self._switch = torch.cuda.device(device)
        self._switch.__enter__()
        if device not in bound:  # once per thread and device
            torch.empty(1, device=device)  # torch creates the primary context (once per process)
            _bind_primary_context(torch.cuda.current_device() if index is None else index)
            bound.add(device)

    def __exit__(self, *exc) -> None:
        switch, self._switch = self._switch, None
        if switch is not None:
            switch.__exit__(*exc)


# Per thread: the devices whose primary context torch has created and bound here.
_bound = threading.local()


@functools.cache
def _primary_context(index: int) -> int:
    # Retained once per process and never released: torch keeps the primary context alive for
    # the process anyway, so the reference only spares a driver call per thread.
    drv = driver()
    (dev,) = check_driver(drv.cuDeviceGet(index), "cuDeviceGet")
    (ctx,) = check_driver(drv.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
    return int(ctx)


def _bind_primary_context(index: int) -> None:
    """Make device ``index``'s primary context current on this thread for the driver API.

    On a fresh thread whose runtime device already is ``index`` (device 0, by default), torch
    never calls ``cudaSetDevice`` and the runtime binds its context only inside runtime calls:
    the thread's driver context stays null, and a driver call that resolves addresses through it
    fails (``cuMemcpyBatchAsync`` returns ``CUDA_ERROR_INVALID_VALUE``).
    """
    drv = driver()
    (current,) = check_driver(drv.cuCtxGetCurrent(), "cuCtxGetCurrent")
    primary = _primary_context(index)
    if int(current) != primary:
        check_driver(drv.cuCtxSetCurrent(drv.CUcontext(primary)), "cuCtxSetCurrent")


def stream_is_capturing(stream: torch.cuda.Stream) -> bool:
    """Whether ``stream`` is being captured into a CUDA graph, whichever stream is current.

    ``torch.cuda.is_current_stream_capturing`` answers only for the current stream; a transfer
    ordered after another stream must know about that one.

    Examples
    --------
    >>> if stream_is_capturing(side):
    ...     raise RuntimeError("cannot order a transfer after a stream being captured")
    """
    drv = driver()
    with driver_context(stream.device):
        (status,) = check_driver(drv.cuStreamIsCapturing(drv.CUstream(stream.cuda_stream)), "cuStreamIsCapturing")
    return status != drv.CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_NONE


@functools.cache
def c_function(name: str, cuda_version: int, *argtypes):
    """The driver's entry point ``name`` (as of ``cuda_version``) as a ctypes function returning
    ``CUresult`` as an int, or None where this driver lacks it.

    For the hot paths: a ctypes call costs about a microsecond, several times less than the
    same call through cuda-bindings' objects. Arguments are plain ints (addresses, handles,
    sizes); the caller checks the result with :func:`check_code`.

    Examples
    --------
    >>> launch = c_function("cuGraphLaunch", 12000, ctypes.c_void_p, ctypes.c_void_p)
    >>> check_code(launch(graph_exec, stream.cuda_stream), "cuGraphLaunch")
    """
    drv = driver()
    flags = drv.CUdriverProcAddress_flags.CU_GET_PROC_ADDRESS_DEFAULT
    err, pfn, _status = drv.cuGetProcAddress(name.encode(), cuda_version, flags)
    if err != drv.CUresult.CUDA_SUCCESS or not int(pfn):
        return None
    return ctypes.CFUNCTYPE(ctypes.c_int, *argtypes)(int(pfn))


@functools.cache
def _event_calls():
    record = c_function("cuEventRecord", 12000, ctypes.c_void_p, ctypes.c_void_p)
    wait = c_function("cuStreamWaitEvent", 12000, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint)
    return record, wait


def record_event(event: torch.cuda.Event, stream: int) -> None:
    """Record ``event`` (a torch event already recorded once, so that it exists) on the raw
    ``stream`` handle: one driver call, a few microseconds less than ``event.record``."""
    check_code(_event_calls()[0](event.cuda_event, stream), "cuEventRecord")


def wait_event(stream: int, event: torch.cuda.Event) -> None:
    """Make the raw ``stream`` wait for ``event``'s last record (a no-op for an event never
    recorded, as ``Stream.wait_event`` is)."""
    handle = event.cuda_event
    if handle:
        check_code(_event_calls()[1](stream, handle, 0), "cuStreamWaitEvent")


@functools.cache
def _graph_launch_call():
    return c_function("cuGraphLaunch", 12000, ctypes.c_void_p, ctypes.c_void_p)


def graph_launch(graph_exec: int, stream: int) -> None:
    """Launch an instantiated CUDA graph (``CUDAGraph.raw_cuda_graph_exec()``) on the raw ``stream``
    handle: one driver call, the cheapest way to replay work bound once."""
    check_code(_graph_launch_call()(graph_exec, stream), "cuGraphLaunch")


@functools.cache
def copy_calls():
    """``cuMemcpyAsync(dst, src, bytes, stream)`` and ``cuStreamSynchronize(stream)`` as ctypes
    functions (:func:`c_function`), bound once per process: the DMA path's per-copy fallback and
    the eager id check's copies of GPU ids to the host use them."""
    memcpy = c_function("cuMemcpyAsync", 12000, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p)
    return memcpy, c_function("cuStreamSynchronize", 12000, ctypes.c_void_p)


@functools.cache
def _value_calls():
    write = c_function("cuStreamWriteValue32", 12000, ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint)
    wait = c_function("cuStreamWaitValue32", 12000, ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint)
    return write, wait


# cuStreamWaitValue32's flag: wait until (int32_t)(*address - value) >= 0, which holds across
# the counter's wrap-around (a generation count compared with the one it waits for).
CU_STREAM_WAIT_VALUE_GEQ = 0x0


def write_value(stream: int, address: int, value: int) -> None:
    """Write the 32-bit ``value`` at device ``address`` once the raw ``stream``'s earlier work is
    done. Without ``CU_STREAM_WRITE_VALUE_NO_MEMORY_BARRIER`` the driver fences first, so a
    reader that sees the value sees every write of that earlier work too."""
    check_code(_value_calls()[0](stream, address, value & 0xFFFFFFFF, 0), "cuStreamWriteValue32")


def wait_value_reached(stream: int, address: int, value: int) -> None:
    """Make the raw ``stream`` wait until the 32-bit counter at ``address`` has reached ``value``
    (wrap-safe, as ``CU_STREAM_WAIT_VALUE_GEQ`` compares)."""
    check_code(_value_calls()[1](stream, address, value & 0xFFFFFFFF, CU_STREAM_WAIT_VALUE_GEQ), "cuStreamWaitValue32")


# The raw handle of this thread's current stream on device ``index`` (no Stream object): torch's
# own reader, named here, without a Python call of ours around it on every launch.
current_stream_handle = current_raw_stream


def check_code(code: int, what: str) -> None:
    """Raise, as :func:`check_driver` does, if a raw ``CUresult`` (an int) is not success."""
    if code:
        drv = driver()
        check_driver((drv.CUresult(code),), what)


def device_pointer(host: torch.Tensor) -> int:
    """The device address at which the GPU reaches a page-locked host tensor's first byte.

    Parameters
    ----------
    host : torch.Tensor
        A CPU tensor in page-locked memory mapped for the device (``kv_ops.pinned_empty``,
        ``pin_memory=True``, or ``ple_ops.SharedHostBuffer``).

    Returns
    -------
    int
        The device address of ``host.data_ptr()``.

    Raises
    ------
    ValueError
        If the memory is not page-locked and mapped for the device.

    Examples
    --------
    >>> address = device_pointer(kv_ops.pinned_empty(4096))
    """
    drv = driver()
    attr = drv.CUpointer_attribute.CU_POINTER_ATTRIBUTE_DEVICE_POINTER
    err, ptr = drv.cuPointerGetAttribute(attr, host.data_ptr())
    if err != drv.CUresult.CUDA_SUCCESS:
        raise ValueError(
            "host tensor at 0x%x is not page-locked memory mapped for the GPU (%s); allocate it "
            "with kv_ops.pinned_empty or torch.empty(..., pin_memory=True)" % (host.data_ptr(), err.name)
        )
    return int(ptr)


__all__ = [
    "driver",
    "check_driver",
    "driver_context",
    "device_pointer",
    "stream_is_capturing",
    "c_function",
    "check_code",
    "copy_calls",
    "record_event",
    "wait_event",
    "graph_launch",
    "write_value",
    "wait_value_reached",
    "current_stream_handle",
]
