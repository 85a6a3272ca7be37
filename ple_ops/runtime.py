"""OffloadRuntime: the CPU offload process, the shared buffers, and the per-step transaction."""

from __future__ import annotations

import multiprocessing
import os
import threading
import time
import traceback
from collections.abc import Callable

import torch
from torch import nn

from . import layer as layer_mod
from . import reference, registry
from .semaphore import RESET, CpuGpuSemaphore, ProducerFailed, release_fence, spin_wait
from .shared_memory import SharedHandle, SharedHostBuffer

# Control block in shared memory, int64 words: the GPU process writes REQUEST (a step counter,
# bumped last), NUM_TOKENS, COMMAND and the ids; the worker writes SERVED when a step is done.
_REQUEST, _NUM_TOKENS, _COMMAND, _SERVED = 0, 1, 2, 3
_IDS_OFFSET = 64  # bytes; the ids follow the header on their own cache line
_STEP, _STOP = 0, 1
_FLAG_SPACING = 64  # bytes between flags: one cache line each, no false sharing


class OffloadError(ProducerFailed):
    """The offload process died, failed, or missed a step's deadline; the runtime is unusable."""


def _open_control(handle: SharedHandle, max_tokens: int) -> tuple[SharedHostBuffer, torch.Tensor, torch.Tensor]:
    buf = SharedHostBuffer.attach(handle)
    return buf, buf.view(0, (8,), torch.int64), buf.view(_IDS_OFFSET, (max_tokens,), torch.int64)


def _ple_layers(model: nn.Module) -> list[tuple[str, layer_mod.PleOffloadLayer]]:
    return [(name, m) for name, m in model.named_modules() if isinstance(m, layer_mod.PleOffloadLayer)]


def _worker_main(model_factory: Callable[[], nn.Module], conn, parent_pid: int) -> None:
    """The offload process: builds the model, then serves steps until told to stop."""
    # No CUDA here, by construction: anything that tries fails loudly instead of making a context.
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    try:
        layer_mod.mark_offload_worker()
        model = model_factory().eval()
        layers = _ple_layers(model)
        specs = []
        with torch.no_grad():
            for name, m in layers:
                probe = m.forward_impl(torch.zeros(1, dtype=torch.long))
                specs.append((name, probe.shape[-1], probe.dtype))
        conn.send(("layers", specs))
        _, control_handle, flags_handle, slot_handles, max_tokens = conn.recv()
        _, header, ids = _open_control(control_handle, max_tokens)
        flags_buf = SharedHostBuffer.attach(flags_handle)
        flags = [
            CpuGpuSemaphore.in_host_memory(flags_buf.view(i * _FLAG_SPACING, (1,), torch.int32), map_for_gpu=False)
            for i in range(len(layers))
        ]
        slots = [SharedHostBuffer.attach(h).view(0, (max_tokens, h.nbytes // max_tokens), torch.uint8) for h in slot_handles]
        conn.send(("ready",))

        def parent_alive() -> None:
            if os.getppid() != parent_pid:
                raise SystemExit("offload worker: the GPU process is gone")

        served = 0
        while True:
            # Spin up to 5 ms before backing off: a decode step follows the last one closely,
            # and this process exists to answer fast.
            spin_wait(lambda: int(header[_REQUEST]), served + 1, "offload worker", parent_alive, spin=5e-3)
            if int(header[_COMMAND]) == _STOP:
                return
            n = int(header[_NUM_TOKENS])
            step_ids = ids[:n].clone()
            with torch.no_grad():
                for (name, m), flag, slot, (_, dim, dtype) in zip(layers, flags, slots, specs):
                    # The GPU may still be pulling the previous step's rows until it resets the flag.
                    flag.host_wait(RESET, parent_alive, spin=5e-3)
                    rows = m.forward_impl(step_ids)
                    if tuple(rows.shape) != (n, dim) or rows.dtype != dtype:
                        raise ValueError(f"{name}.forward_impl returned {tuple(rows.shape)} {rows.dtype}, expected ({n}, {dim}) {dtype}")
                    slot[:n].copy_(rows.contiguous().view(torch.uint8).view(n, -1))
                    flag.host_signal()  # release fence, then flag = DONE
            served += 1
            header[_SERVED] = served
    except BaseException:
        try:
            conn.send(("error", traceback.format_exc()))
        finally:
            raise


class OffloadRuntime:
    """Runs a model's PLE layers in a CPU process and serves their rows to the GPU each step.

    The constructor starts the offload process (spawn; no CUDA there), which builds the full
    model with ``model_factory`` and reports each PLE layer's row size. The GPU process builds
    the same model with PLE layers as placeholders (no tables), allocates one shared
    page-locked slot ``[max_tokens, row_bytes]`` and one host-mapped flag per layer, a GPU
    output buffer per layer, and arms the registry. Each step:

    1. :meth:`prepare` hands the step's ``input_ids`` to the offload process, which computes
       every layer's rows, stores them, fences, and raises the layer's flag;
    2. the model's forward (eager, compiled, or a CUDA-graph replay) waits on each flag and
       pulls the rows;
    3. :meth:`release` enqueues the flag resets after the forward.

    No new step may be prepared before the previous release is enqueued: otherwise a wait could
    see the old step's raised flag and pull stale rows. A watchdog thread watches the offload
    process; if it dies, fails, or misses ``step_timeout``, the watchdog poisons every slot
    (0xFF: NaN rows), raises every flag so that no GPU stream stays blocked, and every later
    call raises :class:`OffloadError`.

    Parameters
    ----------
    model_factory : callable
        A picklable, argument-free callable (a module-level function) that builds the model.
    max_tokens : int
        Most tokens per step.
    device : str or torch.device
        Where the model runs in this process: ``"cuda"`` (default when available) or ``"cpu"``
        (the ops then spin on the host flags and memcpy).
    step_timeout : float
        Seconds a prepared step may wait for the offload process before the runtime fails.

    Examples
    --------
    >>> with OffloadRuntime(make_model, max_tokens=256) as rt:
    ...     model = torch.compile(rt.model, fullgraph=True)
    ...     rt.prepare(input_ids)
    ...     logits = model(hidden, input_ids)
    ...     rt.release()
    """

    def __init__(
        self,
        model_factory: Callable[[], nn.Module],
        max_tokens: int,
        device: str | torch.device | None = None,
        step_timeout: float = 30.0,
        start_timeout: float = 300.0,
    ):
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.max_tokens = int(max_tokens)
        self.step_timeout = step_timeout
        self._failure: OffloadError | None = None
        self._lock = threading.Lock()
        self._open = False
        self._prepared_at = 0.0
        self._names: list[str] = []
        self._closed = False

        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_worker_main, args=(model_factory, child, os.getpid()), daemon=True)
        self.process.start()
        child.close()
        self._shared: list[SharedHostBuffer] = []
        try:
            _, specs = self._receive("layers", start_timeout)
            self._build(model_factory, specs)
            self._receive("ready", start_timeout)
        except BaseException:
            self._stop_process()
            raise
        finally:
            # Both processes have mapped the files (or never will): remove the names now, so that
            # nothing is left in /dev/shm however either process ends. The mappings stay valid.
            for buf in self._shared:
                buf.unlink()
        self._watchdog = threading.Thread(target=self._watch, name="ple-offload-watchdog", daemon=True)
        self._watchdog.start()

    # --- set-up ------------------------------------------------------------------------------

    def _receive(self, kind: str, timeout: float):
        deadline = time.monotonic() + timeout
        while not self._conn.poll(0.05):
            if not self.process.is_alive():
                raise OffloadError(f"the offload process exited with code {self.process.exitcode} during start-up")
            if time.monotonic() > deadline:
                raise OffloadError(f"the offload process did not answer within {timeout} s")
        message = self._conn.recv()
        if message[0] == "error":
            raise OffloadError(f"the offload process failed:\n{message[1]}")
        if message[0] != kind:
            raise OffloadError(f"unexpected message from the offload process: {message[0]!r}")
        return message

    def _build(self, model_factory, specs) -> None:
        with layer_mod.building_placeholders():
            self.model = model_factory().to(self.device).eval()
        layers = _ple_layers(self.model)
        if [name for name, _ in layers] != [name for name, _, _ in specs]:
            raise OffloadError(f"the two processes built different PLE layers: {[n for n, _ in layers]} vs {[n for n, _, _ in specs]}")
        self._control = SharedHostBuffer(_IDS_OFFSET + 8 * self.max_tokens)
        self._header = self._control.view(0, (8,), torch.int64)
        self._ids = self._control.view(_IDS_OFFSET, (self.max_tokens,), torch.int64)
        self._header.zero_()
        self._flags_buf = SharedHostBuffer(_FLAG_SPACING * max(1, len(layers)))
        self._flags_buf.bytes.zero_()
        self._slot_bufs, self._armed = [], []
        self._shared += [self._control, self._flags_buf]
        for i, ((name, module), (_, dim, dtype)) in enumerate(zip(layers, specs)):
            row_bytes = dim * dtype.itemsize
            slot_buf = SharedHostBuffer(self.max_tokens * row_bytes)
            flag = CpuGpuSemaphore.in_host_memory(
                self._flags_buf.view(i * _FLAG_SPACING, (1,), torch.int32), map_for_gpu=self.device.type == "cuda"
            )
            out = torch.zeros(self.max_tokens, dim, dtype=dtype, device=self.device)
            slot = slot_buf.view(0, (self.max_tokens, row_bytes), torch.uint8)
            armed = registry.ArmedLayer(name, flag, slot, self.check, out)
            registry.arm(armed)
            self._names.append(name)
            module.attach_offload(name, out)
            self._slot_bufs.append(slot_buf)
            self._shared.append(slot_buf)
            self._armed.append((module, armed))
        self._conn.send(
            ("attach", self._control.handle, self._flags_buf.handle, [b.handle for b in self._slot_bufs], self.max_tokens)
        )

    # --- the step transaction ----------------------------------------------------------------

    def check(self) -> None:
        """Raise :class:`OffloadError` if the offload process has failed."""
        if self._failure is not None:
            raise self._failure

    def prepare(self, input_ids: torch.Tensor) -> None:
        """Hand this step's token ids to the offload process (host ids avoid a device sync)."""
        self.check()
        if self._closed:
            raise OffloadError("the runtime is closed")
        if self._open:
            raise OffloadError("prepare() before the previous step's release(): its flags are still raised")
        n = int(input_ids.shape[0])
        if input_ids.dim() != 1 or not 0 < n <= self.max_tokens:
            raise ValueError(f"prepare: input_ids must be 1-D with 1..{self.max_tokens} ids, got shape {tuple(input_ids.shape)}")
        self._ids[:n].copy_(input_ids.detach().to("cpu", torch.int64))
        self._header[_NUM_TOKENS] = n
        self._header[_COMMAND] = _STEP
        with self._lock:
            self._open = True
            self._prepared_at = time.monotonic()
        release_fence()  # ids and count before the request number
        self._header[_REQUEST] += 1

    def release(self, enqueue: bool = True) -> None:
        """End the step: enqueue every layer's flag reset on the current stream.

        Call it after the forward has been enqueued. ``enqueue=False`` closes the step without
        enqueuing, for a CUDA-graph replay that already contains the resets (capture a call to
        ``release()`` inside the graph).
        """
        if enqueue:
            for module, _ in self._armed:
                module.release_offloaded()
        with self._lock:
            self._open = False
        self.check()

    def served_steps(self) -> int:
        """Steps the offload process has finished writing."""
        return int(self._header[_SERVED])

    # --- failure handling --------------------------------------------------------------------

    def _watch(self) -> None:
        while not self._closed and self._failure is None:
            time.sleep(0.005)
            try:
                reason = self._failure_reason()
            except Exception as exc:  # never let the watchdog die silently
                reason = f"the offload watchdog failed: {exc!r}"
            if reason is not None:
                self._fail(reason)

    def _failure_reason(self) -> str | None:
        try:
            if self._conn.poll():
                kind, *rest = self._conn.recv()
                if kind == "error":
                    return f"the offload process failed:\n{rest[0]}"
        except (EOFError, OSError):
            pass  # the pipe closes when the process dies: reported just below
        if not self.process.is_alive():
            return f"the offload process died (exit code {self.process.exitcode})"
        with self._lock:
            overdue = self._open and time.monotonic() - self._prepared_at > self.step_timeout
        if overdue and int(self._header[_SERVED]) < int(self._header[_REQUEST]):
            return f"the offload process did not serve a step within {self.step_timeout} s"
        return None

    def _fail(self, reason: str) -> None:
        """Stop the producer, poison every slot, raise every flag: no stream stays blocked."""
        if self.process.is_alive():
            self.process.kill()
            self.process.join(1.0)
        for _, armed in self._armed:
            reference.poison_rows(armed.slot)
        for _, armed in self._armed:
            armed.flag.host_signal()
        self._failure = OffloadError(reason)

    # --- shutdown ----------------------------------------------------------------------------

    def _stop_process(self) -> None:
        if self.process.is_alive() and hasattr(self, "_header"):
            self._header[_COMMAND] = _STOP
            release_fence()
            self._header[_REQUEST] += 1
            self.process.join(5.0)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5.0)

    def close(self) -> None:
        """Stop the offload process, unblock any pending step, disarm the layers."""
        if self._closed:
            return
        if self._open and self._failure is None:
            self._fail("the runtime was closed with a prepared step")
        self._closed = True
        self._watchdog.join(1.0)
        self._stop_process()
        for name in self._names:
            registry.disarm(name)

    def __enter__(self) -> "OffloadRuntime":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


__all__ = ["OffloadRuntime", "OffloadError"]
