"""OffloadRuntime: starts the offload process, and the GPU side of the PLE step transaction and its layers."""

from __future__ import annotations

import contextlib
import ctypes
import math
import multiprocessing
import os
import pickle
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from kv_ops.capture import capturing, refuse_capture

from . import layer as layer_mod
from . import reference, registry, worker
from .control import (
    Attach,
    ControlBlock,
    LayersReport,
    Ready,
    StepFailed,
    Word,
    WorkerFailed,
)
from .semaphore import DONE, ProducerFailed, release_fence, spin_wait
from .shared_memory import SharedHostBuffer
from .watchdog import Watchdog

# Header words as plain ints, for the hot paths' direct loads and stores (ControlBlock.words).
_REQUEST, _NUM_TOKENS, _TAKEN, _FAILED = int(Word.REQUEST), int(Word.NUM_TOKENS), int(Word.TAKEN), int(Word.FAILED)


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
class _Layer:
    """One PLE layer as this process serves it, and what this step did to it eagerly."""

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

    def __post_init__(self) -> None:
        self.flag = self.armed.flag  # read on every wait and release


class _Guard:
    """The runtime as the ops see it through the registry (:class:`ple_ops.registry.StepGuard`):
    its methods, bound once."""

    def __init__(self, runtime: "OffloadRuntime"):
        self.host_wait = runtime._host_wait
        self.host_release = runtime._host_release
        self.before_stream_wait = runtime._before_stream_wait
        self.before_stream_release = runtime._before_stream_release


def _capture_replays_at_once() -> bool:
    """Whether the capture under way is a recording of inductor's CUDA-graph trees.

    ``mode="reduce-overhead"`` records a graph and replays it before the call returns, so the
    prepared step is consumed by that replay: not the stale-rows case that a plain
    ``torch.cuda.graph`` capture with a prepared step is. Recognised by the trees' recording
    frame on this thread's stack, not by the capture stream: ``torch.cuda.Stream()`` hands out
    a pool of streams round-robin, so the trees' stream and ``torch.cuda.graph``'s default
    capture stream can be the same CUDA stream (the GPU suite met that, and a user's capture
    was let through). Only asked during a capture, never per call.
    """
    # Never import Inductor here: a first import during a capture makes CUDA calls that
    # invalidate it. Trees that were never imported are not recording.
    cudagraph_trees = sys.modules.get("torch._inductor.cudagraph_trees")
    if cudagraph_trees is None:
        return False
    record = cudagraph_trees.CUDAGraphNode._record.__code__
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is record:
            return True
        frame = frame.f_back
    return False


class OffloadRuntime:
    """Runs a model's PLE layers in a CPU process and serves their rows to the GPU each step.

    The constructor starts the offload process (spawn; no CUDA there), which builds the full
    model with ``model_factory`` and reports each PLE layer's row size. The GPU process builds
    the same model with PLE layers as placeholders (no tables), allocates a shared control
    block (flags, step ids), one shared page-locked slot ``[max_tokens, row_bytes]`` and one GPU
    output buffer per layer, and arms the registry. Each step:

    1. :meth:`prepare` hands the step's ``input_ids`` to the offload process, which computes
       each layer's rows, waits until the previous step's rows of that layer are released,
       stores the new ones, fences, and raises the layer's flag;
    2. the model's forward (eager, compiled, or a CUDA-graph replay) waits on each flag and
       pulls the rows;
    3. :meth:`release` enqueues the flag resets after the forward.

    Rules, each enforced (never a hang, never an older step's rows):

    * ``prepare`` is refused until the previous step's ``release``, also after a forward that
      raised; a forward with no prepared step raises at once (eager or compiled), and so does
      a layer's own release op (``release_offloaded``), while :meth:`release` with no prepared
      step does nothing (a serving loop may call it unconditionally). A CUDA-graph replay with no
      prepared step (or a second replay after one ``prepare``) is caught by the watchdog: its
      rows are poisoned, the stream goes on, and the runtime fails (fatal).
    * Capture with no step prepared: a capture that records a wait while a step is prepared,
      and ``prepare`` during a capture, raise. (``mode="reduce-overhead"`` is exempt: it replays
      each recording at once.)
    * A forward must have the prepared step's token count.
    * A failed step (an exception in ``forward_impl``) raises at its ``release`` or the next
      call, with the offload process's traceback; its rows are poisoned; later steps are served.
    * The watchdog fails the runtime when the offload process dies or fails outside a step,
      or a step is not served within ``step_timeout``: every slot is poisoned (0xFF: NaN
      rows), every flag raised so that no stream stays blocked, and every later call raises.

    Parameters
    ----------
    model_factory : callable
        A picklable, argument-free callable (a module-level function) that builds the model.
    max_tokens : int
        Most tokens per step (>= 1).
    device : str or torch.device
        Where the model runs in this process: ``"cuda"`` (default when available) or ``"cpu"``
        (the ops then wait on the host flags and memcpy).
    step_timeout : float
        Seconds (> 0) a prepared step may take to be served before the runtime fails.
    start_timeout : float
        Seconds (> 0) the offload process may take to build the model and attach.
    worker_threads : int
        Intra-op threads of the offload process (>= 1). One by default: a step's rows are a few
        KiB of lookups, too little for a thread pool to pay off, and an idle pool may spin
        between steps on cores this process's launching thread needs.

    Raises
    ------
    ValueError
        Before anything starts: a bad ``max_tokens``, ``worker_threads``, timeout or ``device``
        (a CUDA device where torch has no CUDA, or neither CUDA nor CPU).
    TypeError
        ``model_factory`` is not a picklable callable.
    OffloadError
        If the offload process fails to start (with its traceback, or with the likely cause).
        A failed start leaves no process, no armed layer and no file in ``/dev/shm``.

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
        worker_threads: int = 1,
    ):
        if not callable(model_factory) or isinstance(model_factory, nn.Module):
            raise TypeError(
                "OffloadRuntime: model_factory must be a callable that builds the model (each process "
                f"builds its own), got {type(model_factory).__name__}"
            )
        if isinstance(max_tokens, bool) or int(max_tokens) != max_tokens or max_tokens < 1:
            raise ValueError(f"OffloadRuntime: max_tokens must be an integer >= 1, got {max_tokens!r}")
        if isinstance(worker_threads, bool) or int(worker_threads) != worker_threads or worker_threads < 1:
            raise ValueError(f"OffloadRuntime: worker_threads must be an integer >= 1, got {worker_threads!r}")
        for what, value in (("step_timeout", step_timeout), ("start_timeout", start_timeout)):
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"OffloadRuntime: {what} must be a finite number of seconds > 0, got {value!r}")
        try:
            self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        except (RuntimeError, TypeError):
            raise ValueError(f"OffloadRuntime: device must be 'cuda' or 'cpu', got {device!r}") from None
        if self.device.type not in ("cuda", "cpu"):
            raise ValueError(f"OffloadRuntime: device must be 'cuda' or 'cpu', got {device!r}")
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(
                f"OffloadRuntime: device {device!r} is CUDA, but torch.cuda.is_available() is False here; "
                "pass device='cpu'"
            )
        self.max_tokens = int(max_tokens)
        self.step_timeout = float(step_timeout)
        # Whether the step transaction takes its GPU branches (the device is CUDA). Public so that
        # tests can set it on a CPU runtime and run those branches without a GPU; nothing else writes it.
        self.on_gpu = self.device.type == "cuda"

        # The step transaction (main thread): the number of the last prepared step, and whether
        # it is open (prepared, not released).
        self._step = 0
        self._open = False
        self._num_tokens = 0
        self._prepared_at = 0.0
        # Executed (not captured) waits and first releases of the open step: release(enqueue=False)
        # after a replay, where none executed, then looks at no layer.
        self._waits = 0
        self._releases = 0
        # Failed steps, from the pipe (watchdog and callers both drain it, under _pipe_lock).
        self._pipe_lock = threading.Lock()
        self._step_failures: dict[int, StepFailed] = {}
        self._reported: set[int] = set()
        self._failed_seen = 0
        self._worker_failed: str | None = None
        # Fatal failure and shutdown.
        self._fail_lock = threading.Lock()
        self._failure: OffloadError | None = None
        self._closed = False
        self._layers: list[_Layer] = []
        self._by_name: dict[str, _Layer] = {}
        self._guard = _Guard(self)

        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.process = ctx.Process(
            target=worker.worker_main, args=(model_factory, child, os.getpid(), int(worker_threads)), daemon=True
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
        shared: list[SharedHostBuffer] = []
        try:
            report = self._receive(LayersReport, start_timeout, first=True)
            self._build(model_factory, report, shared)
            self._receive(Ready, start_timeout, first=False)
        except BaseException:
            self._abort_start()
            raise
        finally:
            # Both processes have mapped the files (or never will): remove the names now, so that
            # nothing is left in /dev/shm however either process ends. The mappings stay valid.
            for buf in shared:
                buf.unlink()
        # Public so that tests can stop it and see what the runtime notices without it.
        self.watchdog = Watchdog(self)
        self.watchdog.start()

    # --- set-up ------------------------------------------------------------------------------

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

    def _build(self, model_factory, report: LayersReport, shared: list[SharedHostBuffer]) -> None:
        with layer_mod.building_placeholders():
            self.model = model_factory().to(self.device).eval()
        modules = layer_mod.ple_layers(self.model)
        if [name for name, _ in modules] != [spec.name for spec in report.layers]:
            raise OffloadError(
                f"the two processes built different PLE layers: {[n for n, _ in modules]} vs "
                f"{[s.name for s in report.layers]}",
                fatal=True,
            )
        self._control = ControlBlock.create(self.max_tokens, len(modules), map_for_gpu=self.on_gpu)
        self._words = self._control.words
        self._ids_address = self._control.ids.data_ptr()
        shared.append(self._control.buffer)
        for i, ((name, module), spec) in enumerate(zip(modules, report.layers)):
            slot_buffer = SharedHostBuffer(self.max_tokens * spec.row_bytes, register=self.on_gpu)
            shared.append(slot_buffer)
            slot = slot_buffer.view(0, (self.max_tokens, spec.row_bytes), torch.uint8)
            reference.poison_rows(slot)  # rows no step wrote are poison, never zeros (worker.ServedLayer)
            out = torch.zeros(self.max_tokens, spec.dim, dtype=spec.dtype, device=self.device)
            armed = registry.ArmedLayer(
                name,
                self._control.flags[i],
                slot,
                self._check_usable,
                out,
                waiting=self._control.waiting[i],
                guard=self._guard,
            )
            registry.arm(armed)
            layer = _Layer(i, name, module, slot_buffer, armed)
            self._layers.append(layer)
            self._by_name[name] = layer
            module.attach_offload(name, out)
        self._conn.send(Attach(self._control.handle, tuple(layer.slot_buffer.handle for layer in self._layers)))

    def _abort_start(self) -> None:
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5.0)
        for layer in self._layers:
            registry.disarm(layer.name)
        with contextlib.suppress(OSError):
            self._conn.close()

    # --- the step transaction ----------------------------------------------------------------

    def check(self) -> None:
        """Raise :class:`OffloadError` if the runtime cannot serve, or an earlier step failed unreported.

        Raises
        ------
        OffloadError
            Fatal (closed, offload process dead or late, a stream waited with no step), or the
            error of a released step whose failure no call has raised yet (raised once).
        """
        self._check_usable()
        self._raise_unreported(self._step - 1 if self._open else self._step)

    def prepare(self, input_ids: torch.Tensor) -> None:
        """Hand this step's token ids to the offload process (host ids avoid a device sync).

        It returns at once unless the offload process has not yet taken the previous step's ids
        (a GPU caller running ahead): it then waits for that, at most ``step_timeout``.

        Parameters
        ----------
        input_ids : Tensor
            1-D, integer dtype, 1..``max_tokens`` ids; the forward must have as many tokens.

        Raises
        ------
        TypeError, ValueError
            Ids of a floating (or bool) dtype, or of a bad shape: nothing is prepared.
        OffloadError
            The previous step is not released; prepare was called during a CUDA-graph capture;
            an earlier step failed and its error was not raised yet; or the runtime is dead.
        """
        # No system call here: the watchdog asks whether the offload process lives every
        # watchdog.POLL seconds and fails the runtime (freeing any stream that waits) when it
        # does not; _check_failed reads that verdict. is_alive cost 1.4 us of prepare's 9 on the
        # H200's host, and 3 after a pause, as in a serving loop.
        self._check_failed()
        if self._open:
            raise OffloadError(
                f"prepare() before the previous step's release(): step {self._step} is still open (its flags "
                "are still raised). Call release() to end it first, also after a forward that raised (an error "
                "in forward_impl, for one): release() resets the flags, and the next prepare() is served"
            )
        self._raise_unreported(self._step)
        if self.on_gpu:
            refuse_capture(
                "prepare()",
                "refused during CUDA-graph capture (nothing runs while a graph is captured, so the step's rows "
                "would never be consumed and every later replay would pull the step before)",
                "capture with no step prepared, and prepare() before each replay",
                error=OffloadError,
            )
        ids = self._checked_ids(input_ids)
        n = ids.shape[0]
        words = self._words
        if words[_TAKEN] != self._step:
            # A GPU step is released when its resets are enqueued, so the caller may come back
            # before the offload process has even read the previous step's ids. Overwriting them
            # would serve that step other ids' rows, and its request number would be skipped.
            # Wait (bounded: the watchdog fails a step late past step_timeout): the caller is
            # never more than one step ahead of the offload process.
            try:
                spin_wait(
                    lambda: words[_TAKEN],
                    self._step,
                    "prepare",
                    self._check_usable,
                    timeout=self.step_timeout + 1.0,
                )
            except TimeoutError:
                self._fail(
                    f"the offload process did not take step {self._step} within step_timeout {self.step_timeout} s"
                )
                self._check_usable()
        if ids.is_contiguous():
            ctypes.memmove(self._ids_address, ids.data_ptr(), 8 * n)  # CPU int64 (_checked_ids)
        else:
            self._control.ids[:n].copy_(ids)
        words[_NUM_TOKENS] = n
        self._step += 1
        self._waits = self._releases = 0
        self._num_tokens = n
        self._prepared_at = time.monotonic()  # before the request: the watchdog reads them in the other order
        self._open = True
        release_fence()  # ids and count before the request number
        words[_REQUEST] = self._step

    def _checked_ids(self, input_ids) -> torch.Tensor:
        """The ids as a CPU int64 tensor (``input_ids`` itself when it is one), checked."""
        if not isinstance(input_ids, torch.Tensor):
            raise TypeError(f"prepare: input_ids must be a tensor, got {type(input_ids).__name__}")
        dtype = input_ids.dtype
        # int64 first: a serving loop's ids skip the other dtype tests (0.33 us for the whole
        # check on the CPU box, against 0.40 testing every dtype kind first).
        if dtype is not torch.int64 and (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool):
            raise TypeError(f"prepare: input_ids must have an integer dtype, got {dtype} (ids are never rounded)")
        if input_ids.dim() != 1 or not 0 < input_ids.shape[0] <= self.max_tokens:
            raise ValueError(
                f"prepare: input_ids must be 1-D with 1..{self.max_tokens} ids, got shape {tuple(input_ids.shape)}"
            )
        if dtype is torch.int64 and input_ids.is_cpu:
            return input_ids
        return input_ids.detach().to("cpu", torch.int64)

    def release(self, enqueue: bool = True) -> None:
        """End the step: enqueue every layer's flag reset on the current stream.

        Call it after the forward has been enqueued. ``enqueue=False`` closes the step without
        enqueuing, for a CUDA-graph replay (or compiled step) that already contains the resets.
        Inside a capture, ``release()`` records the resets into the graph and touches no step.
        With no step prepared it does nothing (beyond raising an unreported step error).

        Raises
        ------
        OffloadError
            The step failed (the offload process's traceback; its rows are poisoned); on the
            executed paths, ``enqueue=False`` although the forward reset nothing (the runtime
            resets the flags, so later steps are served); or the runtime is dead.
        """
        self._check_failed()
        if self.on_gpu and capturing():
            if self._open:
                raise self._captured_while_prepared("release()")
            for layer in self._layers:
                layer.module.release_offloaded()
            return
        if not self._open:
            self._raise_unreported(self._step)
            return
        missing: list[_Layer] = []
        try:
            if enqueue:
                for layer in self._layers:
                    self._release_layer(layer)
            else:
                # What executed here (not captured) shows whether the resets ran. On the CPU
                # every op executes; on the GPU a wait that executed without its release shows an
                # eager forward, while a replay shows nothing and is trusted.
                step = self._step
                if not self.on_gpu:
                    if self._releases < len(self._layers):
                        missing = [layer for layer in self._layers if layer.released_step != step]
                elif self._waits:
                    missing = [layer for layer in self._layers if layer.waited_step == step != layer.released_step]
                for layer in missing:
                    self._release_layer(layer)
        finally:
            self._open = False
        if missing:
            step_error = self._take_unreported(self._step)
            raise OffloadError(
                f"release(enqueue=False), but the forward did not release {[layer.name for layer in missing]}: "
                "enqueue=False is for a step whose graph contains the releases. The runtime released them now."
                + (f"\nThis step also failed: {step_error}" if step_error else "")
            )
        self._raise_unreported(self._step)

    def _release_layer(self, layer: _Layer) -> None:
        if layer.released_step != self._step:
            layer.module.release_offloaded()  # the op marks its own flag wait as waiting

    def served_steps(self) -> int:
        """Steps the offload process has finished writing (failed steps included)."""
        self._check_usable()
        return self._control.get(Word.SERVED)

    # --- seams for tests and tools -----------------------------------------------------------

    @property
    def control(self) -> ControlBlock:
        """The shared control block (steps, flags, waiting words) both processes use.

        Exists for tests and tools: they read its words, and write a waiting word as a GPU stream
        would. Serving never needs it.
        """
        return self._control

    @property
    def failure(self) -> OffloadError | None:
        """The fatal error once the runtime failed, else ``None``.

        Exists for tests: unlike :meth:`check` it notices nothing itself (asks no process), so a
        test sees what the watchdog or an earlier call noticed.
        """
        return self._failure

    def shared_paths(self) -> list[str]:
        """The ``/dev/shm`` paths of the control block and of each layer's slot, in that order.

        Exists for tests: the files are removed when start-up ends, so none of them exists.
        """
        return [self._control.buffer.handle.path] + [layer.slot_buffer.handle.path for layer in self._layers]

    # --- what the ops ask (registry.StepGuard) -----------------------------------------------

    def _before_wait(self, name: str, num_tokens: int | None) -> _Layer:
        """The checks of an executed wait, CPU or GPU."""
        layer = self._by_name[name]
        self._check_failed()
        if not self._open:
            raise OffloadError(
                f"layer {name!r} waited for its rows with no step prepared: prepare() was missing "
                "(call prepare(input_ids) before each forward, release() after it)"
            )
        if layer.released_step == self._step:
            raise OffloadError(
                f"layer {name!r} waited for rows it already released in this step (a second forward of a "
                "step whose graph contains the releases?): prepare() the next step first"
            )
        if num_tokens is not None and num_tokens != self._num_tokens:
            raise OffloadError(
                f"layer {name!r}: the forward has {num_tokens} tokens but the prepared step has "
                f"{self._num_tokens}: prepare() the ids the forward uses"
            )
        layer.waited_step = self._step
        self._waits += 1
        return layer

    def _host_wait(self, name: str, num_tokens: int | None) -> None:
        layer = self._before_wait(name, num_tokens)
        self._await_published(layer)
        if self._words[_FAILED] == self._step:
            raise self._step_error(self._step, report=True)

    def _await_published(self, layer: _Layer) -> None:
        """CPU path: until the worker published this step's rows of ``layer`` (bounded)."""
        control, flag, i, step = self._control, layer.flag, layer.index, self._step
        if flag.host_value() == DONE and control.delivered(i) == step:
            return  # the usual case: the offload process is ahead

        def published() -> int:
            return int(flag.host_value() == DONE and control.delivered(i) == step)

        try:
            # The watchdog fails a step that is late past step_timeout, and _check_usable raises
            # then; the timeout here is a second line of defence.
            spin_wait(published, 1, f"layer {layer.name!r}", self._check_usable, timeout=self.step_timeout + 1.0)
        except TimeoutError:
            self._fail(f"layer {layer.name!r}'s rows were not published within step_timeout {self.step_timeout} s")
            self._check_usable()

    def _host_release(self, name: str) -> None:
        layer = self._by_name[name]
        self._check_failed()
        if not self._open:
            raise OffloadError(f"layer {name!r} was released with no step prepared: prepare() was missing")
        if layer.released_step == self._step:
            return
        # Wait for the raise this reset answers: resetting first would leave this step's late
        # flag raised over its rows for the next step's wait.
        self._await_published(layer)
        layer.flag.host_reset()
        layer.released_step = self._step
        self._releases += 1

    def _before_stream_wait(self, name: str, num_tokens: int | None, captured: bool) -> None:
        if captured:
            self._check_usable()
            if self._open and not _capture_replays_at_once():
                raise self._captured_while_prepared(f"layer {name!r}'s wait")
            return
        self._before_wait(name, num_tokens)

    def _before_stream_release(self, name: str, captured: bool) -> bool:
        layer = self._by_name[name]
        if captured:
            self._check_usable()
            if self._open and not _capture_replays_at_once():
                raise self._captured_while_prepared(f"layer {name!r}'s release")
            return True
        self._check_failed()
        if not self._open:
            raise OffloadError(f"layer {name!r} was released with no step prepared: prepare() was missing")
        if layer.released_step == self._step:
            return False
        layer.released_step = self._step
        self._releases += 1
        return True

    def _captured_while_prepared(self, what: str) -> OffloadError:
        return OffloadError(
            f"a CUDA-graph capture reached {what} while step {self._step} is prepared (nothing of it was "
            "recorded): nothing runs during capture, so that step's raised flags would stay unconsumed and "
            "every replay would pull the rows of the step before (stale). Capture with no step prepared: "
            "release() the step, then capture; prepare() before each replay."
        )

    # --- step failures -----------------------------------------------------------------------

    def _collect(self) -> None:
        """Move the pipe's messages into this object (watchdog and callers; the lock serialises)."""
        with self._pipe_lock:
            try:
                while self._conn.poll():
                    message = self._conn.recv()
                    if isinstance(message, StepFailed):
                        self._step_failures[message.step] = message
                    elif isinstance(message, WorkerFailed):
                        self._worker_failed = message.traceback
            except (EOFError, OSError):
                pass  # the pipe closes when the process dies: the liveness check reports that

    def _step_error(self, step: int, report: bool) -> OffloadError:
        failure = self._step_failures.get(step)
        if failure is None:
            self._collect()  # the worker sends the message before it marks the step failed
            failure = self._step_failures.get(step)
        if report:
            self._reported.add(step)
        where = f" in layer {failure.layer!r}" if failure else ""
        text = failure.traceback if failure else "(no traceback arrived)"
        return OffloadError(
            f"step {step} failed{where} of the offload process; its rows are poisoned (NaN) and the runtime "
            f"keeps serving. The offload process's traceback:\n{text}"
        )

    def _take_unreported(self, up_to: int) -> OffloadError | None:
        """The error of the earliest failed step <= ``up_to`` that no call has raised, marked raised."""
        failed = self._words[_FAILED]  # one load on the hot path; the pipe only when it moved
        if failed != self._failed_seen:
            self._collect()
            self._failed_seen = failed
        if not self._step_failures:
            return None
        pending = [s for s in self._step_failures if s <= up_to and s not in self._reported]
        if not pending:
            return None
        error = self._step_error(min(pending), report=True)
        # Raised errors of steps before the current one are never asked for again.
        for s in [s for s in self._step_failures if s in self._reported and s < self._step]:
            del self._step_failures[s]
            self._reported.discard(s)
        return error

    def _raise_unreported(self, up_to: int) -> None:
        error = self._take_unreported(up_to)
        if error is not None:
            raise error

    # --- failure handling --------------------------------------------------------------------

    def _check_usable(self) -> None:
        """Raise if closed or failed (fatal); notice a dead offload process at once.

        Asks the kernel whether the process lives (``is_alive``: two system calls). Called by the
        entry points that are not per step (``check``, ``served_steps``, a waiting ``prepare``'s
        spin); ``prepare`` itself and the ops, several calls per layer and step, use
        :meth:`_check_failed`.
        """
        if self._closed:
            raise self._closed_error()
        if self._failure is None and not self.process.is_alive():
            self._fail(self._death_reason())
        if self._failure is not None:
            raise self._failure

    def _check_failed(self) -> None:
        """:meth:`_check_usable` without the system calls, for the per-layer checks and ``release``.

        A death is noticed here once the process's exit status was collected: by the watchdog,
        which asks every ``watchdog.POLL`` seconds (and then fails the runtime itself), by
        ``check()``, or by a join. Nothing can hang on the difference: a CPU wait checks
        fully while it spins, and the watchdog frees a GPU stream that waits on a dead process.
        """
        if self._closed:
            raise self._closed_error()
        if self._failure is None and self._reaped():
            self._fail(self._death_reason())
        if self._failure is not None:
            raise self._failure

    def _reaped(self) -> bool:
        """Whether the offload process's exit status was collected (an attribute read, no system call)."""
        popen = self.process._popen  # multiprocessing's: returncode stays None until a wait saw the exit
        return popen is not None and getattr(popen, "returncode", None) is not None

    def _closed_error(self) -> OffloadError:
        after = f" (it had failed: {self._failure})" if self._failure is not None else ""
        return OffloadError(f"the OffloadRuntime is closed{after}: build a new one to serve more steps", fatal=True)

    def _death_reason(self) -> str:
        self._collect()
        if self._worker_failed is not None:
            return f"the offload process failed:\n{self._worker_failed}"
        return f"the offload process died (exit code {self.process.exitcode})"

    def _fail(self, reason: str) -> None:
        """Stop the producer, poison every slot, raise every flag: no stream stays blocked."""
        with self._fail_lock:
            if self._failure is not None:
                return
            if self.process.is_alive():
                self.process.kill()
                self.process.join(1.0)
            # Nobody writes the slots any more: poison them, then raise the flags over the poison.
            for layer in self._layers:
                reference.poison_rows(layer.armed.slot)
            release_fence()
            for layer in self._layers:
                layer.flag.host_signal()
            self._failure = OffloadError(reason, fatal=True)

    # --- shutdown ----------------------------------------------------------------------------

    def _stop_worker(self) -> None:
        if self.process.is_alive():
            self._control.set(Word.STOP, 1)  # the worker looks at least every 10 ms while it waits
            self.process.join(min(2.0, self.step_timeout))
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5.0)

    def close(self) -> None:
        """Stop the offload process, unblock any pending step, disarm the layers. Idempotent.

        A step the offload process had not finished gets poisoned rows (its waits end); on CUDA
        the device is synchronized, so that pulls already enqueued read their rows before the
        slots are poisoned for good. Every later call raises :class:`OffloadError`.
        """
        with self._fail_lock:
            if self._closed:
                return
            self._closed = True
        try:
            self._stop_worker()
            request = self._control.get(Word.REQUEST)
            owed = [layer for layer in self._layers if self._control.delivered(layer.index) < request]
            for layer in owed:
                reference.poison_rows(layer.armed.slot)
            release_fence()
            for layer in owed:
                layer.flag.host_signal()
            if self.on_gpu:
                # The watchdog keeps freeing streams that wait on a flag meanwhile.
                with contextlib.suppress(Exception):
                    torch.cuda.synchronize(self.device)
        finally:
            self.watchdog.stop(1.0)
            # A stray replay after close gets NaN rows and goes on instead of waiting forever.
            for layer in self._layers:
                reference.poison_rows(layer.armed.slot)
            release_fence()
            message = str(self._closed_error())  # not the runtime itself: the registry outlives it
            for layer in self._layers:
                layer.flag.host_signal()
                registry.disarm(layer.name, lambda: OffloadError(message, fatal=True))
            self._open = False
            with contextlib.suppress(OSError):
                self._conn.close()

    def __enter__(self) -> "OffloadRuntime":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


__all__ = ["OffloadRuntime", "OffloadError"]
