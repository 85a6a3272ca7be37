"""The PLE operators ``torch.ops.ple_ops.wait / wait_copy / release`` (schema, fake, CPU, CUDA) and the rows gather.

Each op is registered through :func:`kv_ops.cuda.registration.register_op` with its schema written
out (``Tensor(a0!) out``: the op mutates ``out``; the schemas are the ones ``custom_op`` would
infer, tags included); ``wait_copy`` bumps ``out``'s version counter itself, as torch's in-place
ops do.

Each op mutates ``out``, the layer's output buffer (a module buffer, so a real graph input): that
keeps compile from deleting the op, orders ``wait``/``wait_copy`` before every reader of ``out``
and ``release`` after every reader. ``dep`` is read only; it orders the wait after the work that
produced it.

The ops carry a layer name and counts, never an address: the flag and the host slot are looked
up in :mod:`ple_ops.registry` on every call, in the process that runs the op. A layer armed by a
runtime has a step guard there: the ops ask it first whether the wait or release can end in this
step's rows (it raises otherwise), and on the CPU path it does the waiting, bounded. On the GPU
path the driver handles (flag addresses, the slot's address, the current stream's handle) are
bound once (:class:`ple_ops.semaphore.BoundDriver`), and each op looks up the current stream once.
Under CUDA-graph capture the ops record kernels (:mod:`ple_ops.kernels`) instead of stream memory
operations and memcpys, whose graph nodes make every launch of the graph slow.
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
from collections.abc import Iterator

import torch

from kv_ops.cuda.arguments import index, shown, text
from kv_ops.cuda.capture import capturing
from kv_ops.cuda.driver import check_driver
from kv_ops.cuda.host_memory import device_view
from kv_ops.cuda.registration import register_op
from kv_ops.ops import gather_blocks

from . import kernels, registry
from .semaphore import DONE, IDLE, RESET, WAITING, ProducerFailed, bound_driver

_observation = threading.local()


@contextlib.contextmanager
def observe_copy_geometry() -> Iterator[list[tuple[str, int, int]]]:
    """Record ``(layer, rows, bytes)`` for every wait_copy that executes on this thread.

    During CUDA-graph capture an op executes once, while it is recorded, so this lists exactly
    the copies the graph will replay.

    Examples
    --------
    >>> with ple_ops.observe_copy_geometry() as copies:
    ...     model(hidden, input_ids)
    >>> copies
    [('layers.0.ple', 7, 114688), ('layers.1.ple', 7, 114688)]
    """
    if getattr(_observation, "records", None) is not None:
        raise RuntimeError("observe_copy_geometry cannot be nested")
    records: list[tuple[str, int, int]] = []
    _observation.records = records
    try:
        yield records
    finally:
        _observation.records = None


def _record(name: str, rows: int, row_bytes: int) -> None:
    records = getattr(_observation, "records", None)
    if records is not None:
        records.append((name, rows, rows * row_bytes))


def _check_out(op: str, layer: registry.ArmedLayer, out: torch.Tensor, num_tokens: int | None = None) -> None:
    """``out`` matches the layer's rows; ``num_tokens`` fits both the buffer and the slot."""
    if out.dim() != 2 or not out.is_contiguous():
        raise ValueError(f"{op}: out must be a contiguous 2-D [rows, dim] buffer, got shape {tuple(out.shape)}")
    row_bytes = out.shape[1] * out.element_size()
    if row_bytes != layer.row_bytes:
        raise ValueError(
            f"{op}: out rows hold {row_bytes} bytes ({out.shape[1]} x {out.dtype}) but layer {layer.name!r} "
            f"produces rows of {layer.row_bytes} bytes"
        )
    if num_tokens is not None and not 0 <= num_tokens <= min(out.shape[0], layer.max_tokens):
        raise ValueError(
            f"{op}: num_tokens {num_tokens} for layer {layer.name!r} exceeds the buffer's {out.shape[0]} rows "
            f"or the slot's {layer.max_tokens}"
        )


def _refuse_unserved(op: str, out, name) -> None:
    """``out`` is a tensor and not a meta one, and ``name`` a non-empty string, else a ``ValueError``
    naming it: a meta ``out`` dispatches to the fake, which checks its shape and returns without
    waiting, copying or releasing anything, and a name of another type reaches torch's schema
    check, whose error names neither the op's wrapper nor the rule."""
    # is_meta, not out.device: every call pays this, and a device object is built per read.
    if not isinstance(out, torch.Tensor) or out.is_meta:
        raise ValueError(f"{op}: out must be the layer's buffer on the CPU or a CUDA device, got {shown(out)}")
    text(op, "name", name)


def _refuse_non_tensor_dep(op: str, dep) -> None:
    """``dep`` is a tensor, else a ``ValueError`` naming it: the op takes ``None`` for it, and the
    wait then comes after nothing."""
    if not isinstance(dep, torch.Tensor):
        raise ValueError(f"{op}: dep must be the tensor the wait comes after, got {dep!r}")


def _host_wait(layer: registry.ArmedLayer, num_tokens: int | None) -> None:
    """CPU path: until the layer's rows are in its slot; raises if they never will be."""
    if layer.guard is not None:
        layer.guard.host_wait(layer.name, num_tokens)
        return
    try:
        layer.flag.host_wait(DONE, layer.check, timeout=layer.timeout)
    except TimeoutError:
        raise ProducerFailed(
            f"layer {layer.name!r}: its flag was not raised within its timeout of {layer.timeout} s "
            "(ArmedLayer.timeout): nothing signalled it"
        ) from None
    layer.check()  # a failed producer's flags are raised over poisoned rows: report, don't return them


def _waiting_word(layer: registry.ArmedLayer) -> torch.Tensor | None:
    return None if layer.waiting is None else layer.waiting.device_word()


def _device_slot(layer: registry.ArmedLayer) -> torch.Tensor:
    """The layer's slot as a CUDA tensor over its page-locked bytes, bound once (only captures use it)."""
    if layer.device_slot is None:
        layer.device_slot = device_view(layer.slot)
    return layer.device_slot


def _enqueue_wait(layer: registry.ArmedLayer, num_tokens: int | None, stream, out: torch.Tensor | None = None) -> None:
    """GPU path: enqueue (or record) on ``stream`` (the current one) the wait on the layer's flag,
    then, given ``out``, the copy of the slot's first ``num_tokens`` rows into it."""
    captured = capturing()  # asked once: the guard gets the answer (each ask is a driver query)
    if layer.guard is not None:
        layer.guard.before_stream_wait(layer.name, num_tokens, captured)
    else:
        layer.check()
    nbytes = 0 if out is None else num_tokens * layer.row_bytes
    if captured:
        # Kernel nodes where the stream operations and the copy would be memory-operation and
        # memcpy nodes, which make every launch of the graph slow (ple_ops.kernels); a large
        # copy still goes to the copy engine, which moves it faster than the kernel.
        slot = _device_slot(layer)
        kernel_bytes = nbytes if nbytes < kernels.COPY_ENGINE_FROM else 0
        dst = slot if out is None else out.view(torch.uint8)
        kernels.wait_copy(layer.flag.device_word(), _waiting_word(layer), slot, dst, kernel_bytes)
        nbytes -= kernel_bytes
    else:
        if layer.waiting is not None:
            # In stream order just before the wait: while the stream is parked on the flag, the
            # runtime's watchdog can see that it waits, and free it if no prepared step will
            # raise the flag. The step's release clears the word (ple_ops.runtime.control).
            layer.waiting.write_on(stream, WAITING)
        layer.flag.wait_on(stream, DONE)
    if nbytes:
        # Stream order does the rest: the copy starts only after the GPU has seen the flag, and
        # the producer stored the rows before the flag (release fence), so the DMA reads complete rows.
        d = bound_driver()
        result = d.memcpy_htod(_device_out(layer, out), layer.slot_address, nbytes, stream)
        if result[0] != d.success:
            check_driver(result, f"cuMemcpyHtoDAsync({nbytes} bytes for {layer.name!r})")


def _device_out(layer: registry.ArmedLayer, out: torch.Tensor):
    """The driver handle of ``out``'s address, bound once per layer while ``out`` stays where it is."""
    address = out.data_ptr()
    bound = layer.bound_out
    if bound is None or bound[0] != address:
        bound = layer.bound_out = (address, bound_driver().CUdeviceptr(address))
    return bound[1]


# --- wait ----------------------------------------------------------------------------------------


def _wait_cpu(out: torch.Tensor, dep: torch.Tensor, name: str) -> None:
    layer = registry.lookup(name, "ple_ops.wait")
    _check_out("ple_ops.wait", layer, out)
    _host_wait(layer, None)


def _wait_fake(out, dep, name):
    torch._check(out.dim() == 2, lambda: "ple_ops.wait: out must be 2-D [rows, dim]")


def wait_cuda(out, dep, name):
    """The CUDA implementation of ``ple_ops.wait``: the waiting word, then the flag wait, on the current stream.

    Public so that tests drive it on CPU tensors with a fake driver; everything else calls the op.
    """
    layer = registry.lookup(name, "ple_ops.wait")
    _check_out("ple_ops.wait", layer, out)
    _enqueue_wait(layer, None, bound_driver().current_stream())


register_op(
    "ple_ops", "wait(Tensor(a0!) out, Tensor dep, str name) -> ()", fake=_wait_fake, cpu=_wait_cpu, cuda=wait_cuda
)


def wait(out: torch.Tensor, dep: torch.Tensor, name: str) -> None:
    """Wait until the producer of layer ``name`` has raised its flag; the rows are not copied.

    On CUDA this enqueues ``cuStreamWaitValue32(flag == 1)`` on the current stream (under
    capture, a one-program kernel that does the same); on CPU it spins (with backoff) on the host
    flag and raises if the producer died. With a runtime, it raises at once when no step is prepared.

    Parameters
    ----------
    out : Tensor
        The layer's output buffer ``[max_tokens, dim]`` (declared mutated, to order readers after).
    dep : Tensor
        Any tensor the wait must come after (e.g. the hidden states).
    name : str
        An armed layer name (:mod:`ple_ops.registry`).
    """
    _refuse_unserved("ple_ops.wait", out, name)
    _refuse_non_tensor_dep("ple_ops.wait", dep)
    torch.ops.ple_ops.wait(out, dep, name)


# --- wait_copy -----------------------------------------------------------------------------------


def _wait_copy_cpu(out: torch.Tensor, dep: torch.Tensor, num_tokens: int, name: str) -> None:
    layer = registry.lookup(name, "ple_ops.wait_copy")
    _check_out("ple_ops.wait_copy", layer, out, num_tokens)
    _record(name, num_tokens, layer.row_bytes)
    _host_wait(layer, num_tokens)
    if num_tokens:
        # The first rows of the slot into out, byte for byte (what reference.pull_rows does, in
        # one call: out is contiguous and its rows are the slot's width, as checked above).
        ctypes.memmove(out.data_ptr(), layer.slot_address, num_tokens * layer.row_bytes)
        torch.autograd.graph.increment_version(out)


def _wait_copy_fake(out, dep, num_tokens, name):
    torch._check(out.dim() == 2, lambda: "ple_ops.wait_copy: out must be 2-D [rows, dim]")
    torch._check(num_tokens >= 0, lambda: "ple_ops.wait_copy: num_tokens must be >= 0")
    torch._check(num_tokens <= out.shape[0], lambda: "ple_ops.wait_copy: num_tokens exceeds out's rows")


def wait_copy_cuda(out, dep, num_tokens, name):
    """The CUDA implementation of ``ple_ops.wait_copy``: the wait, then the rows' copy, on the current stream.

    Public so that tests drive it on CPU tensors with a fake driver; everything else calls the op.
    """
    layer = registry.lookup(name, "ple_ops.wait_copy")
    _check_out("ple_ops.wait_copy", layer, out, num_tokens)
    _enqueue_wait(layer, num_tokens, bound_driver().current_stream(), out)
    _record(name, num_tokens, layer.row_bytes)
    if num_tokens:
        torch.autograd.graph.increment_version(out)


register_op(
    "ple_ops",
    "wait_copy(Tensor(a0!) out, Tensor dep, SymInt num_tokens, str name) -> ()",
    fake=_wait_copy_fake,
    cpu=_wait_copy_cpu,
    cuda=wait_copy_cuda,
)


def wait_copy(out: torch.Tensor, dep: torch.Tensor, num_tokens: int, name: str) -> torch.Tensor:
    """Wait for layer ``name``'s rows, then copy the first ``num_tokens`` into ``out``.

    On CUDA: ``cuStreamWaitValue32(flag == 1)`` then ``cuMemcpyHtoDAsync`` from the page-locked
    shared slot, both on the current stream; under capture, a wait kernel and a zero-copy copy
    kernel instead (:mod:`ple_ops.kernels`). On CPU: a host spin-wait and a memcpy. The flag stays raised until :func:`release`. With a runtime, a wait that cannot end
    in this step's rows raises ``OffloadError`` instead (no step prepared, a token count other
    than the prepared one, a capture that begins while a step is prepared).

    Parameters
    ----------
    out : Tensor
        ``[max_tokens, dim]`` contiguous, on the CPU or a CUDA device (a meta ``out`` is a
        ``ValueError``: it would wait for and copy nothing); ``dim * itemsize`` must equal the
        layer's row bytes.
    dep : Tensor
        Any tensor the wait must come after.
    num_tokens : int
        Rows to copy, ``0 <= num_tokens <= min(out.shape[0], max_tokens)`` (else ``ValueError``).
    name : str
        An armed layer name.

    Returns
    -------
    Tensor
        ``out[:num_tokens]``.
    """
    # The common case costs one type check. A SymInt (compiled, dynamic) is the fake's to check.
    if (type(num_tokens) is not int or num_tokens < 0) and not isinstance(num_tokens, torch.SymInt):
        num_tokens = index("ple_ops.wait_copy", "num_tokens", num_tokens)  # True would be 1 row, -1 past the buffer
    _refuse_unserved("ple_ops.wait_copy", out, name)
    _refuse_non_tensor_dep("ple_ops.wait_copy", dep)
    torch.ops.ple_ops.wait_copy(out, dep, num_tokens, name)
    return out[:num_tokens]


# --- release -------------------------------------------------------------------------------------


def _release_cpu(out: torch.Tensor, name: str) -> None:
    layer = registry.lookup(name, "ple_ops.release")
    if layer.guard is not None:
        layer.guard.host_release(name)
    else:
        layer.flag.host_reset()


def _release_fake(out, name):
    torch._check(out.dim() == 2, lambda: "ple_ops.release: out must be 2-D [rows, dim]")


def release_cuda(out, name):
    """The CUDA implementation of ``ple_ops.release``: the waits and writes of a reset, on the current stream.

    Public so that tests drive it on CPU tensors with a fake driver; everything else calls the op.
    """
    layer = registry.lookup(name, "ple_ops.release")
    captured = capturing()
    if layer.guard is not None and not layer.guard.before_stream_release(name, captured):
        return  # this step already released the layer (eagerly): a second reset would clear the next step
    if captured:
        kernels.release(layer.flag.device_word(), _waiting_word(layer))  # the same steps, as a kernel node
        return
    stream = bound_driver().current_stream()
    if layer.waiting is not None:
        # Never reset a flag before the raise it answers: a release enqueued without the step's
        # wait (no forward) would run at once, the worker's raise would come after it, and the
        # next step would find a raised flag over this step's rows. Waiting first makes the
        # reset consume exactly this step's raise; after a forward the wait passes at once.
        # Marked waiting in stream order, as every wait is, so that the watchdog also frees a
        # replay of a graph that holds the releases alone (a forward's wait marked it already).
        layer.waiting.write_on(stream, WAITING)
        layer.flag.wait_on(stream, DONE)
        # Cleared before the reset: "waiting on a reset flag" then never shows a finished wait.
        layer.waiting.write_on(stream, IDLE)
    layer.flag.write_on(stream, RESET)


register_op(
    "ple_ops", "release(Tensor(a0!) out, str name) -> ()", fake=_release_fake, cpu=_release_cpu, cuda=release_cuda
)


def release(out: torch.Tensor, name: str) -> None:
    """Reset layer ``name``'s flag once every reader of ``out`` is done with the rows.

    On CUDA this enqueues ``cuStreamWriteValue32(flag = 0)`` on the current stream (under
    capture, a one-program kernel that does the same); the producer
    waits for that reset before it overwrites the slot with the next step's rows. For a layer
    armed by a runtime the stream first waits for the flag (so the reset answers this step's
    raise even with no forward before it) and clears the layer's waiting word; the CPU path waits
    on the host likewise, and a second release in the same step does nothing.
    """
    _refuse_unserved("ple_ops.release", out, name)
    torch.ops.ple_ops.release(out, name)


# --- the gather transport ----------------------------------------------------------------------


def gather_rows(host_rows: torch.Tensor, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows ``host_rows[ids]`` as ``dtype`` ``[len(ids), dim]``: one zero-copy gather kernel.

    The gather transport's op (``host_rows`` uint8 ``[vocab, row_bytes]`` in page-locked host
    memory, :mod:`ple_ops.gather`): what a gathering ``PleOffloadLayer`` and ``HostEmbedding`` call.
    """
    rows = torch.empty(ids.shape[0], host_rows.shape[1], dtype=torch.uint8, device=host_rows.device)
    gather_blocks([host_rows], ids, rows)
    return rows.view(dtype)


__all__ = ["wait", "wait_copy", "release", "observe_copy_geometry", "gather_rows"]
