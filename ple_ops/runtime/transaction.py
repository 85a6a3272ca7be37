"""StepTransaction: the GPU side of the PLE step transaction (prepare, the ops' guard, release) and its step failures."""

from __future__ import annotations

import ctypes
import time

import torch

from kv_ops.cuda.capture import capturing, refuse_capture
from kv_ops.cuda.torch_internals import cudagraph_trees_recording

from ..semaphore import DONE, release_fence, spin_wait
from .control import StepFailed, Word
from .process import OffloadError, RuntimeLayer, WorkerProcess

# The host's own waits give up this long after step_timeout: the watchdog fails a late step at
# step_timeout, so this is a second line of defence, never the one that normally fires.
BACKSTOP_S = 1.0

# Header words as plain ints, for the hot paths' direct loads and stores (ControlBlock.words).
_REQUEST, _NUM_TOKENS, _TAKEN, _FAILED = int(Word.REQUEST), int(Word.NUM_TOKENS), int(Word.TAKEN), int(Word.FAILED)


def _capture_replays_at_once() -> bool:
    """Whether the capture under way is a recording of inductor's CUDA-graph trees.

    ``mode="reduce-overhead"`` records a graph and replays it before the call returns, so the
    prepared step is consumed by that replay: not the stale-rows case that a plain
    ``torch.cuda.graph`` capture with a prepared step is. Recognised by the trees' recording
    frame on this thread's stack, not by the capture stream: ``torch.cuda.Stream()`` hands out
    a pool of streams round-robin, so the trees' stream and ``torch.cuda.graph``'s default
    capture stream can be the same CUDA stream. Only asked during a capture, never per call.
    """
    return cudagraph_trees_recording()


class StepTransaction:
    """One step at a time: :meth:`prepare` hands the ids over, the ops ask the guard methods
    (:class:`ple_ops.registry.StepGuard`: the registry holds this object), :meth:`release` ends it.

    It serves the steps of ``process`` (a :class:`~ple_ops.runtime.process.WorkerProcess`): its
    shared words, its layers and its failure checks, bound once by :meth:`bind` after the
    handshake. ``on_gpu`` tells whether the GPU branches run (the device is CUDA); tests set it on
    a CPU runtime to run those branches without a GPU.
    """

    def __init__(self, process: WorkerProcess, max_tokens: int, step_timeout: float, on_gpu: bool):
        self.max_tokens = max_tokens
        self.step_timeout = step_timeout
        self.on_gpu = on_gpu
        self._process = process
        # The number of the last prepared step, and whether it is open (prepared, not released).
        self._step = 0
        self._open = False
        self._num_tokens = 0
        # Executed (not captured) waits and first releases of the open step: release(enqueue=False)
        # after a replay, where none executed, then looks at no layer.
        self._waits = 0
        self._releases = 0
        # Failed steps whose error a call raised, and the FAILED word as last seen.
        self._reported: set[int] = set()
        self._failed_seen = 0
        # The process's checks and pipe, bound once: the per-layer calls make them.
        self._check_failed = process.check_failed
        self._check_usable = process.check_usable
        self._fail = process.fail
        self._collect = process.collect
        self._step_failures: dict[int, StepFailed] = process.step_failures

    def bind(self) -> None:
        """Bind the shared words and layers the handshake made (before the first step)."""
        self._control = self._process.control
        self._words = self._control.words
        self._ids_address = self._control.ids.data_ptr()
        self._layers: list[RuntimeLayer] = self._process.layers
        self._by_name = {layer.name: layer for layer in self._layers}
        # The smallest table the offload process gathers from, and its layer: an id outside it
        # would fail the step there, so prepare() refuses it first. None: no layer reported one.
        tables = [(layer.rows, layer.name) for layer in self._layers if layer.rows is not None]
        self._vocab: tuple[int, str] | None = min(tables) if tables else None
        self._bounds = (torch.empty((), dtype=torch.int64), torch.empty((), dtype=torch.int64))  # aminmax's out

    def abandon(self) -> None:
        """Close the open step without releasing it (the runtime is closing)."""
        self._open = False

    def check(self) -> None:
        """Whether the runtime can serve (:meth:`ple_ops.OffloadRuntime.check` documents it, and calls this method)."""
        self._check_usable()
        self._raise_unreported(self._step - 1 if self._open else self._step)

    def prepare(self, input_ids: torch.Tensor) -> None:
        """The step's start (:meth:`ple_ops.OffloadRuntime.prepare` documents it, and is this method)."""
        # No system call here: the watchdog asks whether the offload process lives every
        # watchdog.POLL seconds and fails the runtime (freeing any stream that waits) when it
        # does not; check_failed reads that verdict. is_alive's two system calls would be a sixth of
        # prepare's cost.
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
                    timeout=self.step_timeout + BACKSTOP_S,
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
        self._process.prepared_at = time.monotonic()  # before the request: the watchdog reads them in the other order
        self._open = True
        release_fence()  # ids and count before the request number
        words[_REQUEST] = self._step

    def _checked_ids(self, input_ids) -> torch.Tensor:
        """The ids as a CPU int64 tensor (``input_ids`` itself when it is one), checked."""
        if not isinstance(input_ids, torch.Tensor):
            raise TypeError(f"prepare: input_ids must be a tensor, got {type(input_ids).__name__}")
        dtype = input_ids.dtype
        # int64 first: a serving loop's ids then skip the other dtype tests.
        if dtype is not torch.int64 and (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool):
            raise TypeError(f"prepare: input_ids must have an integer dtype, got {dtype} (ids are never rounded)")
        if input_ids.dim() != 1 or not 0 < input_ids.shape[0] <= self.max_tokens:
            raise ValueError(
                f"prepare: input_ids must be 1-D with 1..{self.max_tokens} ids, got shape {tuple(input_ids.shape)}"
            )
        if dtype is torch.int64 and input_ids.is_cpu:
            ids = input_ids
        elif input_ids.is_meta:
            raise ValueError("prepare: input_ids are on the meta device, which holds no values: pass the step's ids")
        else:
            # GPU ids are copied to the host here, which already waits for them: the range check
            # below reads that copy and adds no device sync of its own.
            ids = input_ids.detach().to("cpu", torch.int64)
        if self._vocab is not None:
            self._check_vocab(ids, *self._vocab)
        return ids

    def _check_vocab(self, ids: torch.Tensor, rows: int, name: str) -> None:
        """Refuse an id outside ``[0, rows)``: one min/max on the host ids per step, into tensors
        bound once; the offending id is looked for only once the step is refused."""
        low, high = torch.aminmax(ids, out=self._bounds)
        if int(low) < 0 or int(high) >= rows:
            bad = int(ids[(ids < 0) | (ids >= rows)][0])
            raise ValueError(
                f"prepare: input_ids holds id {bad}, outside the vocabulary of {rows} rows (the table of "
                f"layer {name!r}): ids must lie in [0, {rows}); nothing was prepared"
            )

    def release(self, enqueue: bool = True) -> None:
        """The step's end (:meth:`ple_ops.OffloadRuntime.release` documents it, and is this method)."""
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
        missing: list[RuntimeLayer] = []
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

    def _release_layer(self, layer: RuntimeLayer) -> None:
        if layer.released_step != self._step:
            layer.module.release_offloaded()  # the op marks its own flag wait as waiting

    # --- what the ops ask (registry.StepGuard) -----------------------------------------------

    def _before_wait(self, name: str, num_tokens: int | None) -> RuntimeLayer:
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

    def host_wait(self, name: str, num_tokens: int | None) -> None:
        layer = self._before_wait(name, num_tokens)
        self._await_published(layer)
        if self._words[_FAILED] == self._step:
            raise self._step_error(self._step, report=True)

    def _await_published(self, layer: RuntimeLayer) -> None:
        """CPU path: until the worker published this step's rows of ``layer`` (bounded)."""
        control, flag, i, step = self._control, layer.flag, layer.index, self._step
        if flag.host_value() == DONE and control.delivered(i) == step:
            return  # the usual case: the offload process is ahead

        def published() -> int:
            return int(flag.host_value() == DONE and control.delivered(i) == step)

        try:
            # The watchdog fails a step that is late past step_timeout, and _check_usable raises
            # then; the timeout here is a second line of defence.
            spin_wait(published, 1, f"layer {layer.name!r}", self._check_usable, timeout=self.step_timeout + BACKSTOP_S)
        except TimeoutError:
            self._fail(f"layer {layer.name!r}'s rows were not published within step_timeout {self.step_timeout} s")
            self._check_usable()

    def host_release(self, name: str) -> None:
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

    def before_stream_wait(self, name: str, num_tokens: int | None, captured: bool) -> None:
        if captured:
            self._check_usable()
            if self._open and not _capture_replays_at_once():
                raise self._captured_while_prepared(f"layer {name!r}'s wait")
            return
        self._before_wait(name, num_tokens)

    def before_stream_release(self, name: str, captured: bool) -> bool:
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


__all__ = ["StepTransaction"]
