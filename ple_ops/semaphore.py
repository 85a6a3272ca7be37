"""CpuGpuSemaphore: a 32-bit flag that GPU streams wait on and write, in device or shared host memory."""

from __future__ import annotations

import ctypes
import functools
import numbers
import threading
import time
from collections.abc import Callable

import torch

from kv_ops.cuda.arguments import cuda_device, positive_int, seconds, shown
from kv_ops.cuda.driver import check_driver, device_pointer, driver
from kv_ops.cuda.host_memory import device_view
from kv_ops.cuda.torch_internals import current_raw_stream_reader

RESET = 0
DONE = 1
# Values of a layer's stream-is-waiting word (ple_ops.runtime.control), written by the same stream
# operations and kernels as the flag.
IDLE = 0
WAITING = 1

# The values a flag can hold (a 32-bit signed word): a wait for any other never ends.
INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
_INF = float("inf")

_fence_lock = threading.Lock()


def release_fence() -> None:
    """Order every store this thread made before the next one (the flag), for other agents.

    A lock's acquire/release pair is built on atomic read-modify-write instructions with
    acquire/release semantics, so taking and dropping one is a full store barrier on every
    architecture CPython runs on. Arm needs it. x86-64 orders ordinary stores without it, but
    not non-temporal ones, which a large ``memcpy`` or a library kernel may use to write the
    rows; its locked instruction orders those too, for a fraction of a microsecond.
    """
    with _fence_lock:
        pass


class ProducerFailed(RuntimeError):
    """The process that raises a flag died, failed or missed its deadline."""


# How often spin_wait asks whether the other side is gone: often enough that a death ends a wait
# long before any step timeout, rarely enough that the check's system calls cost nothing.
CHECK_EVERY_S = 0.01


def spin_wait(
    read: Callable[[], int],
    value: int,
    what: str,
    check: Callable[[], None] | None = None,
    timeout: float | None = None,
    spin: float = 50e-6,
) -> None:
    """Wait on the host until ``read() == value``.

    Spins for the first ``spin`` seconds (the other side is usually close), then sleeps with
    exponential backoff up to 1 ms so that a long wait does not burn a core. ``check`` runs
    about every :data:`CHECK_EVERY_S` and raises if the other side is gone; ``timeout`` (seconds,
    ``None`` for no bound) bounds it. A ``timeout`` that is not a finite number of seconds > 0, or a
    ``check`` that cannot be called, is a ``ValueError`` from ``what`` before the first read.
    """
    if timeout is not None and not (type(timeout) is float and 0 < timeout < _INF):  # the common case, cheap
        timeout = seconds(what, "timeout", timeout)
    if check is not None and not callable(check):
        raise ValueError(f"{what}: check must be a callable or None, got {check!r}")
    start = time.perf_counter()
    next_check = start + CHECK_EVERY_S
    delay = 0.0
    while read() != value:
        now = time.perf_counter()
        if timeout is not None and now - start > timeout:
            raise TimeoutError(f"{what}: flag did not become {value} within {timeout:.3f} s")
        if now >= next_check:
            if check is not None:
                check()
            next_check = now + CHECK_EVERY_S
        if now - start > spin:
            delay = min(1e-3, max(delay * 2, 1e-5))
            time.sleep(delay)


class BoundDriver:
    """The driver calls of the stream operations, looked up once per process (:func:`bound_driver`).

    The ops enqueue two to four stream operations per call; looking up the bindings, building
    each handle and formatting each call's error text on every call cost more host time than the
    calls themselves. Here each function and constant is bound once, the current stream's handle
    is built once per stream, and an error text is formatted only when a call fails.
    """

    MAX_STREAMS = 64  # handles kept; past that the table starts again (a handle is a plain wrapper)

    def __init__(self):
        drv = driver()
        self.success = drv.CUresult.CUDA_SUCCESS
        self.write_value32 = drv.cuStreamWriteValue32
        self.wait_value32 = drv.cuStreamWaitValue32
        self.wait_eq = drv.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_EQ
        self.memcpy_htod = drv.cuMemcpyHtoDAsync
        self.CUdeviceptr = drv.CUdeviceptr
        self._CUstream = drv.CUstream
        # Raw stream handle -> its driver handle, built once; public, with raw_stream, so that tests
        # check the table without a GPU.
        self.streams: dict[int, object] = {}
        # The current stream's raw handle without building a torch.cuda.Stream (what Inductor's
        # generated code calls); torch.cuda.current_stream() where this torch lacks the readers.
        self.raw_stream = current_raw_stream_reader()

    def current_stream(self):
        """The driver handle of the current device's current stream, as it is at this call."""
        raw = self.raw_stream()
        stream = self.streams.get(raw)
        if stream is None:
            if len(self.streams) >= self.MAX_STREAMS:
                self.streams.clear()
            stream = self.streams[raw] = self._CUstream(raw)
        return stream


@functools.cache
def bound_driver() -> BoundDriver:
    """This process's :class:`BoundDriver` (made on the first GPU stream operation)."""
    return BoundDriver()


class CpuGpuSemaphore:
    """A 32-bit flag between a GPU stream and a CPU (or GPU) producer.

    Two forms:

    * :meth:`in_device_memory`: an int32 CUDA tensor, shareable with another CUDA process over
      CUDA IPC (``torch.multiprocessing`` pickles it as an IPC handle).
    * :meth:`in_host_memory`: an int32 inside page-locked *shared* host memory. The GPU reaches
      it through its device address; a process with no CUDA context signals it with a plain
      store after :func:`release_fence` (:meth:`host_signal`).

    Stream operations (:meth:`signal`, :meth:`reset`, :meth:`wait_done`) are
    enqueued on the caller's current stream at call time (``torch.cuda.graph`` captures on a
    stream of its own) and are capturable into CUDA graphs; :meth:`write_on` and :meth:`wait_on`
    take the stream's driver handle from a caller that enqueues several (the ops look the
    current stream up once per call). The flag's address is held here, in the process that made
    or attached it, never in an op argument; its driver handle is built once, on first use.

    Examples
    --------
    >>> buf = SharedHostBuffer(64)
    >>> sem = CpuGpuSemaphore.in_host_memory(buf.view(0, (1,), torch.int32))
    >>> sem.wait_done()          # the GPU stream waits until the producer stores 1
    """

    def __init__(self, flag: torch.Tensor, device_address: int | None):
        if not isinstance(flag, torch.Tensor):
            raise ValueError(f"CpuGpuSemaphore: flag must be a one-element int32 tensor, got {flag!r}")
        if flag.dtype != torch.int32 or flag.numel() != 1 or flag.device.type not in ("cpu", "cuda"):
            raise ValueError(
                f"CpuGpuSemaphore: flag must be one int32 on the CPU or a CUDA device, got {flag.dtype} "
                f"{tuple(flag.shape)} on {flag.device}"
            )
        if device_address is not None:
            device_address = positive_int("CpuGpuSemaphore", "device_address", device_address)
        self.flag = flag
        self._device_address = device_address
        self._cu_address = None  # the driver handle of device_address, bound on first stream op
        self._device_word: torch.Tensor | None = None  # the flag as a CUDA tensor, bound on first kernel use
        self._host_word = ctypes.c_int32.from_address(flag.data_ptr()) if flag.device.type == "cpu" else None

    @classmethod
    def in_device_memory(cls, device: torch.device | str | None = None) -> "CpuGpuSemaphore":
        """A flag in device memory (reset), for a producer that has a CUDA context (``None``: the current GPU)."""
        device = cuda_device("CpuGpuSemaphore.in_device_memory", device)
        flag = torch.zeros(1, dtype=torch.int32, device=device)
        return cls(flag, flag.data_ptr())

    @classmethod
    def from_ipc_tensor(cls, flag: torch.Tensor) -> "CpuGpuSemaphore":
        """The same device flag, received in another process through CUDA IPC."""
        return cls(flag, flag.data_ptr())

    @classmethod
    def in_host_memory(cls, flag: torch.Tensor, map_for_gpu: bool | None = None) -> "CpuGpuSemaphore":
        """A flag in shared host memory. ``flag`` is a one-element int32 view of it.

        In the GPU process (``map_for_gpu``, default: CUDA available) the memory must be
        page-locked (``SharedHostBuffer`` registers it) and the device address is resolved
        here; the CUDA-free producer attaches the same bytes and only uses the host methods.
        """
        owner = "CpuGpuSemaphore.in_host_memory"
        if not isinstance(flag, torch.Tensor) or flag.device.type != "cpu":
            raise ValueError(f"{owner}: flag must be a one-element int32 view of host memory, got {shown(flag)}")
        if map_for_gpu is not None and not isinstance(map_for_gpu, bool):
            raise ValueError(f"{owner}: map_for_gpu must be True, False or None, got {map_for_gpu!r}")
        if map_for_gpu and not torch.cuda.is_available():
            raise ValueError(f"{owner}: map_for_gpu is True, but this machine has no CUDA device to map the flag for")
        map_for_gpu = torch.cuda.is_available() if map_for_gpu is None else map_for_gpu
        return cls(flag, device_pointer(flag) if map_for_gpu else None)

    # --- GPU stream operations ---------------------------------------------------------------

    @property
    def device_address(self) -> int:
        if self._device_address is None:
            raise self._no_device_address("device_address")
        return self._device_address

    def _no_device_address(self, op: str) -> ValueError:
        """The error of a stream operation ``op`` on a flag with no device address in this process."""
        why = (
            "this machine has no CUDA device (torch.cuda.is_available() is False)"
            if not torch.cuda.is_available()
            else "it was made or attached without mapping it for the GPU (map_for_gpu=False)"
        )
        return ValueError(
            f"CpuGpuSemaphore.{op}: stream operations need CUDA and the flag's device address in this "
            f"process, and this semaphore has none: {why}; host_signal, host_reset and host_wait serve it "
            "from the CPU"
        )

    def _current_stream(self, op: str):
        """The current stream's driver handle for stream operation ``op``, once the flag is known to
        have a device address (without one, the stream lookup would fail first, on torch's terms)."""
        if self._device_address is None:
            raise self._no_device_address(op)
        return bound_driver().current_stream()

    def _address(self):
        """The flag's device address as a driver handle, built on first use and kept."""
        address = self._cu_address
        if address is None:
            address = self._cu_address = bound_driver().CUdeviceptr(self.device_address)
        return address

    def device_word(self) -> torch.Tensor:
        """The flag as a one-element int32 CUDA tensor, for kernels that wait on or write it (bound once).

        A device flag is its own tensor; a host flag gets a device view of its bytes (zero-copy,
        :func:`kv_ops.device_view`). Binding enqueues nothing, so it may happen during a capture.
        """
        word = self._device_word
        if word is None:
            word = self._device_word = self.flag if self.flag.is_cuda else device_view(self.flag)
        return word

    def write_on(self, stream, value: int) -> None:
        """Enqueue ``flag = value`` on ``stream``, a driver handle from :meth:`BoundDriver.current_stream`."""
        d = bound_driver()
        result = d.write_value32(stream, self._address(), value, 0)
        if result[0] != d.success:
            check_driver(result, f"cuStreamWriteValue32({value})")

    def wait_on(self, stream, value: int = DONE) -> None:
        """Enqueue a wait until ``flag == value`` on ``stream`` (a driver handle, as for :meth:`write_on`)."""
        d = bound_driver()
        result = d.wait_value32(stream, self._address(), value, d.wait_eq)
        if result[0] != d.success:
            check_driver(result, f"cuStreamWaitValue32(== {value})")

    def write(self, value: int) -> None:
        """Enqueue ``flag = value`` on the current stream (any 32-bit value, e.g. a status word)."""
        self.write_on(self._current_stream("write"), value)

    def signal(self) -> None:
        """Enqueue ``flag = DONE`` on the current stream."""
        self.write_on(self._current_stream("signal"), DONE)

    def reset(self) -> None:
        """Enqueue ``flag = RESET`` on the current stream."""
        self.write_on(self._current_stream("reset"), RESET)

    def wait_done(self) -> None:
        """Enqueue a wait until ``flag == DONE`` on the current stream."""
        self.wait_on(self._current_stream("wait_done"), DONE)

    # --- host operations (host form only; no CUDA) --------------------------------------------

    def _word(self) -> ctypes.c_int32:
        if self._host_word is None:
            raise RuntimeError("host operations need the flag in host memory")
        return self._host_word

    def host_value(self) -> int:
        return self._word().value

    def host_signal(self) -> None:
        """Publish: every store made before this call is visible before the flag reads DONE."""
        release_fence()
        self._word().value = DONE

    def host_reset(self) -> None:
        self._word().value = RESET

    def host_wait(
        self, value: int, check: Callable[[], None] | None = None, timeout: float | None = None, spin: float = 50e-6
    ) -> None:
        """Wait on the host until the flag equals ``value`` (see :func:`spin_wait`); a ``value`` the
        32-bit flag cannot hold is a ``ValueError``, as are the arguments :func:`spin_wait` refuses."""
        if type(value) is not int or not INT32_MIN <= value <= INT32_MAX:  # the common case: one type check
            if (
                isinstance(value, bool)
                or not isinstance(value, numbers.Integral)
                or not INT32_MIN <= value <= INT32_MAX
            ):
                raise ValueError(
                    f"CpuGpuSemaphore.host_wait: value must be an integer a 32-bit flag holds, got {value!r}"
                )
            value = int(value)
        word = self._word()
        spin_wait(lambda: word.value, value, "CpuGpuSemaphore.host_wait", check, timeout, spin)


__all__ = [
    "CpuGpuSemaphore",
    "BoundDriver",
    "bound_driver",
    "ProducerFailed",
    "release_fence",
    "spin_wait",
    "CHECK_EVERY_S",
    "DONE",
    "RESET",
    "IDLE",
    "WAITING",
]
