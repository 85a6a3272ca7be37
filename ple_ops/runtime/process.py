"""WorkerProcess: the offload process as the GPU process sees it: its start, handshake, liveness, failure and stop."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import pickle
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from .. import layer as layer_mod
from .. import reference, registry
from ..semaphore import ProducerFailed, release_fence
from . import worker
from .control import Attach, ControlBlock, LayersReport, Ready, StepFailed, Word, WorkerFailed
from .multiprocessing_internals import reaped
from .shared_memory import DoesNotFit, SharedHostBuffer


class OffloadError(ProducerFailed):
    """A PLE step could not be served.

    ``fatal`` tells whether the runtime is gone: the offload process died or failed outside a
    step, missed ``step_timeout``, a GPU stream waited with no step prepared, or the runtime was
    closed. Every later call then raises too. A non-fatal error belongs to one step or one call
    (bad ids, a forward without ``prepare``, an exception in ``forward_impl``); the runtime
    keeps serving.
    """

    def __init__(self, message: str, *, fatal: bool = False):
        super().__init__(message)
        self.fatal = fatal


@dataclass
class RuntimeLayer:
    """One PLE layer as this process serves it, and what the open step did to it eagerly."""

    index: int
    name: str
    module: layer_mod.PleOffloadLayer
    slot_buffer: SharedHostBuffer
    armed: registry.ArmedLayer
    # The last step in which a wait of this layer executed (not captured), and the last in which
    # its release did (a second release in that step does nothing). Steps are numbered from 1, so
    # prepare() needs no per-layer reset: a new step number clears both.
    waited_step: int = 0
    released_step: int = 0
    # The layer's table rows where the offload process gathers from its table (LayerSpec.rows).
    rows: int | None = None

    def __post_init__(self) -> None:
        self.flag = self.armed.flag  # read on every wait and release


@contextlib.contextmanager
def _sized_by(max_tokens: int, what: str):
    """Name ``max_tokens`` in the error of a shared buffer it made too large for ``/dev/shm``: the
    caller chose that argument, not the buffer's byte count. (Any other error passes as it is.)"""
    try:
        yield
    except DoesNotFit as error:
        raise ValueError(f"OffloadRuntime: max_tokens {max_tokens} is too large for {what}: {error}") from None


class WorkerProcess:
    """The spawned offload process, its pipe and the shared memory made for it, seen from the GPU process.

    The constructor starts the process; :meth:`handshake` builds the GPU side of the model and the
    shared control block and slots, and arms the layers; then the process serves until
    :meth:`stop`. Liveness and fatal failure live here: :meth:`fail` is the one place that stops
    the producer, poisons every slot and raises every flag, so that no stream stays blocked.

    What the step transaction and the watchdog read (:class:`ple_ops.runtime.watchdog.Watched`):
    ``control``, ``layers``, ``step_timeout``, ``step_failures`` (failed steps, filled by
    :meth:`collect`), and ``prepared_at``, the monotonic time the open step was requested, which
    the transaction writes before it publishes the request.
    """

    def __init__(self, model_factory: Callable[[], nn.Module], worker_threads: int, step_timeout: float):
        self.step_timeout = step_timeout
        self.prepared_at = 0.0
        self.control: ControlBlock | None = None
        self.layers: list[RuntimeLayer] = []
        # Failed steps, from the pipe (watchdog and callers both drain it, under the pipe lock).
        self.step_failures: dict[int, StepFailed] = {}
        self._pipe_lock = threading.Lock()
        self._worker_failed: str | None = None
        # Fatal failure and shutdown.
        self._fail_lock = threading.Lock()
        self._failure: OffloadError | None = None
        self._closed = False

        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        # The word in this runtime's file names, by which the offload process removes them if
        # this process dies before it could (no other process's files share it).
        self._tag = secrets.token_hex(8)
        self.process = ctx.Process(
            target=worker.worker_main,
            args=(model_factory, child, os.getpid(), self._tag, worker_threads),
            daemon=True,
        )
        try:
            self.process.start()
        except (pickle.PicklingError, AttributeError, TypeError) as exc:
            raise TypeError(
                "OffloadRuntime: model_factory must be picklable (a module-level function or a "
                f"functools.partial of one): the offload process is spawned and receives it by pickle ({exc})"
            ) from exc
        finally:
            child.close()

    # --- the handshake -----------------------------------------------------------------------

    def handshake(
        self,
        model_factory: Callable[[], nn.Module],
        device: torch.device,
        max_tokens: int,
        guard: registry.StepGuard,
        start_timeout: float,
    ) -> nn.Module:
        """Build this process's model (PLE layers as placeholders), the control block and one slot per
        layer the offload process reported, arm the layers with ``guard``, and wait until it attached.

        A failure leaves no process, no armed layer and no file in ``/dev/shm``.
        """
        shared: list[SharedHostBuffer] = []
        try:
            report = self._receive(LayersReport, start_timeout, first=True)
            model = self._build(model_factory, device, max_tokens, guard, report, shared)
            self._receive(Ready, start_timeout, first=False)
        except BaseException:
            self._abort_start()
            raise
        finally:
            # Both processes have mapped the files (or never will): remove the names now, so that
            # nothing is left in /dev/shm however either process ends. The mappings stay valid.
            for buf in shared:
                buf.unlink()
        return model

    def _receive(self, kind: type, timeout: float, first: bool):
        deadline = time.monotonic() + timeout
        while True:
            try:
                if self._conn.poll(0.05):
                    message = self._conn.recv()
                    break
            except (EOFError, OSError):
                raise self._start_failure(first) from None
            if not self.process.is_alive() and not self._conn.poll():
                raise self._start_failure(first)
            if time.monotonic() > deadline:
                raise OffloadError(f"the offload process did not answer within {timeout} s of start-up", fatal=True)
        if isinstance(message, WorkerFailed):
            raise OffloadError(f"the offload process failed while starting:\n{message.traceback}", fatal=True)
        if not isinstance(message, kind):
            raise OffloadError(f"unexpected message from the offload process: {message!r}", fatal=True)
        return message

    def _start_failure(self, first: bool) -> OffloadError:
        self.process.join(2.0)
        code = self.process.exitcode
        if not first:
            return OffloadError(f"the offload process exited (exit code {code}) during start-up", fatal=True)
        return OffloadError(
            f"the offload process exited (exit code {code}) before it could build the model: it failed "
            "while bootstrapping, before the worker ran (its own traceback is on its stderr). The spawn "
            "start method re-imports the main module in the child; if your script creates the "
            "OffloadRuntime at module level, the child tries to start one too. Put that code under "
            '`if __name__ == "__main__":`, and pass a model_factory importable from a module.',
            fatal=True,
        )

    def _build(
        self,
        model_factory: Callable[[], nn.Module],
        device: torch.device,
        max_tokens: int,
        guard: registry.StepGuard,
        report: LayersReport,
        shared: list[SharedHostBuffer],
    ) -> nn.Module:
        on_gpu = device.type == "cuda"
        with layer_mod.building_placeholders():
            model = model_factory().to(device).eval()
        modules = layer_mod.ple_layers(model)
        if [name for name, _ in modules] != [spec.name for spec in report.layers]:
            raise OffloadError(
                f"the two processes built different PLE layers: {[n for n, _ in modules]} vs "
                f"{[s.name for s in report.layers]}",
                fatal=True,
            )
        with _sized_by(max_tokens, "the control block"):
            self.control = control = ControlBlock.create(max_tokens, len(modules), map_for_gpu=on_gpu, tag=self._tag)
        shared.append(control.buffer)
        for i, ((name, module), spec) in enumerate(zip(modules, report.layers)):
            with _sized_by(max_tokens, f"the slot of layer {name!r} ({max_tokens} rows of {spec.row_bytes} bytes)"):
                slot_buffer = SharedHostBuffer(max_tokens * spec.row_bytes, register=on_gpu, tag=self._tag)
            shared.append(slot_buffer)
            slot = slot_buffer.view(0, (max_tokens, spec.row_bytes), torch.uint8)
            reference.poison_rows(slot)  # rows no step wrote are poison, never zeros (worker.ServedLayer)
            out = torch.zeros(max_tokens, spec.dim, dtype=spec.dtype, device=device)
            armed = registry.ArmedLayer(
                name,
                control.flags[i],
                slot,
                self.check_usable,
                out,
                waiting=control.waiting[i],
                guard=guard,
                timeout=self.step_timeout,
            )
            registry.arm(armed)
            self.layers.append(RuntimeLayer(i, name, module, slot_buffer, armed, rows=spec.rows))
            module.attach_offload(name, out)
        try:
            self._conn.send(Attach(control.handle, tuple(layer.slot_buffer.handle for layer in self.layers)))
        except OSError:  # BrokenPipeError, ConnectionResetError: the process died after its report
            raise self._start_failure(first=False) from None
        return model

    def _abort_start(self) -> None:
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5.0)
        for layer in self.layers:
            registry.disarm(layer.name)
        with contextlib.suppress(OSError):
            self._conn.close()

    def shared_paths(self) -> list[str]:
        """The ``/dev/shm`` paths of the control block and of each layer's slot, in that order."""
        return [self.control.buffer.handle.path] + [layer.slot_buffer.handle.path for layer in self.layers]

    # --- the pipe ----------------------------------------------------------------------------

    def collect(self) -> None:
        """Move the pipe's messages into this object (watchdog and callers; the lock serialises)."""
        with self._pipe_lock:
            try:
                while self._conn.poll():
                    message = self._conn.recv()
                    if isinstance(message, StepFailed):
                        self.step_failures[message.step] = message
                    elif isinstance(message, WorkerFailed):
                        self._worker_failed = message.traceback
            except (EOFError, OSError):
                pass  # the pipe closes when the process dies: the liveness check reports that

    # --- liveness and failure ----------------------------------------------------------------

    @property
    def failure(self) -> OffloadError | None:
        """The fatal error once the runtime failed, else ``None`` (asks nothing itself)."""
        return self._failure

    def stopped(self) -> bool:
        """Whether the runtime failed (fatally) or is closing: nothing more will be served."""
        return self._failure is not None or self._closed

    def is_alive(self) -> bool:
        """Whether the offload process lives (two system calls: not for the per-step paths)."""
        return self.process.is_alive()

    def gone(self) -> str | None:
        """Why the offload process can serve no more (it reported its failure, or died), else ``None``.

        Asks the kernel whether it lives: the watchdog's question, every ``watchdog.POLL`` seconds.
        """
        if self._worker_failed is not None or not self.process.is_alive():
            return self.death_reason()
        return None

    def check_usable(self) -> None:
        """Raise if closed or failed (fatal); notice a dead offload process at once.

        Asks the kernel whether the process lives (``is_alive``: two system calls). Called by the
        entry points that are not per step (``check``, ``served_steps``, a waiting ``prepare``'s
        spin); ``prepare`` itself and the ops, several calls per layer and step, use
        :meth:`check_failed`.
        """
        if self._closed:
            raise self.closed_error()
        if self._failure is None and not self.process.is_alive():
            self.fail(self.death_reason())
        if self._failure is not None:
            raise self._failure

    def check_failed(self) -> None:
        """:meth:`check_usable` without the system calls, for the per-layer checks and ``release``.

        A death is noticed here once the process's exit status was collected: by the watchdog,
        which asks every ``watchdog.POLL`` seconds (and then fails the runtime itself), by
        ``check()``, or by a join. Nothing can hang on the difference: a CPU wait checks
        fully while it spins, and the watchdog frees a GPU stream that waits on a dead process.
        """
        if self._closed:
            raise self.closed_error()
        if self._failure is None and reaped(self.process):
            self.fail(self.death_reason())
        if self._failure is not None:
            raise self._failure

    def closed_error(self) -> OffloadError:
        after = f" (it had failed: {self._failure})" if self._failure is not None else ""
        return OffloadError(f"the OffloadRuntime is closed{after}: build a new one to serve more steps", fatal=True)

    def death_reason(self) -> str:
        self.collect()
        if self._worker_failed is not None:
            return f"the offload process failed:\n{self._worker_failed}"
        return f"the offload process died (exit code {self.process.exitcode})"

    def fail(self, reason: str) -> None:
        """Stop the producer, poison every slot, raise every flag: no stream stays blocked."""
        with self._fail_lock:
            if self._failure is not None:
                return
            if self.process.is_alive():
                self.process.kill()
                self.process.join(1.0)
            # Nobody writes the slots any more: poison them, then raise the flags over the poison.
            for layer in self.layers:
                reference.poison_rows(layer.armed.slot)
            release_fence()
            for layer in self.layers:
                layer.flag.host_signal()
            self._failure = OffloadError(reason, fatal=True)

    # --- shutdown ----------------------------------------------------------------------------

    def begin_close(self) -> bool:
        """Mark the runtime closed; False when it already was (close is idempotent)."""
        with self._fail_lock:
            if self._closed:
                return False
            self._closed = True
            return True

    def stop(self) -> None:
        """Ask the offload process to exit, then kill it if it has not; every step it owed gets
        poisoned rows under a raised flag, so that its waits end."""
        if self.process.is_alive():
            self.control.set(Word.STOP, 1)  # the worker looks at least every 10 ms while it waits
            self.process.join(min(2.0, self.step_timeout))
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5.0)
        request = self.control.get(Word.REQUEST)
        owed = [layer for layer in self.layers if self.control.delivered(layer.index) < request]
        for layer in owed:
            reference.poison_rows(layer.armed.slot)
        release_fence()
        for layer in owed:
            layer.flag.host_signal()

    def disarm(self) -> None:
        """Poison every slot under a raised flag and disarm the layers (a later lookup raises the
        closed error), then close the pipe: the last step of close."""
        # A stray replay after close gets NaN rows and goes on instead of waiting forever.
        for layer in self.layers:
            reference.poison_rows(layer.armed.slot)
        release_fence()
        message = str(self.closed_error())  # not this object itself: the registry outlives it
        for layer in self.layers:
            layer.flag.host_signal()
            registry.disarm(layer.name, lambda: OffloadError(message, fatal=True))
        with contextlib.suppress(OSError):
            self._conn.close()


__all__ = ["WorkerProcess", "RuntimeLayer", "OffloadError"]
