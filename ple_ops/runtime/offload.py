"""OffloadRuntime: the public runtime, composing the offload process and the step transaction it serves."""

from __future__ import annotations

import contextlib
import os
import weakref
from collections.abc import Callable

import torch
from torch import nn

from kv_ops.cuda import arguments
from kv_ops.cuda.arguments import positive_int

from ..registry import STEP_TIMEOUT_S
from .control import ControlBlock, Word
from .process import OffloadError, WorkerProcess
from .transaction import StepTransaction
from .watchdog import Watchdog


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
        Seconds (> 0) a prepared step may take to be served before the runtime fails
        (default :data:`ple_ops.registry.STEP_TIMEOUT_S`).
    start_timeout : float
        Seconds (> 0) the offload process may take to build the model and attach.
    worker_threads : int
        Intra-op threads of the offload process, 1 to the CPUs this process may use. One by
        default: a step's rows are a few KiB of lookups, too little for a thread pool to pay
        off, and an idle pool may spin between steps on cores this process's launching thread needs.

    A runtime closes when it is closed (:meth:`close`, or the end of a ``with`` block), dropped
    (collected: its process, watchdog and layer names go with it) or at exit. The layer names
    are armed once per process: a second runtime for the same model fails to start while the
    first is open.

    Raises
    ------
    ValueError
        Before anything starts: a bad ``max_tokens``, ``worker_threads``, timeout (``bool``
        included) or ``device`` (a CUDA device where torch has no CUDA, or neither CUDA nor CPU).
        At start-up, before any row moves: a ``max_tokens`` whose slots ``/dev/shm`` cannot hold.
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
        step_timeout: float = STEP_TIMEOUT_S,
        start_timeout: float = 300.0,
        worker_threads: int = 1,
    ):
        if not callable(model_factory) or isinstance(model_factory, nn.Module):
            raise TypeError(
                "OffloadRuntime: model_factory must be a callable that builds the model (each process "
                f"builds its own), got {type(model_factory).__name__}"
            )
        max_tokens = positive_int("OffloadRuntime", "max_tokens", max_tokens)
        worker_threads = positive_int("OffloadRuntime", "worker_threads", worker_threads)
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        if worker_threads > cpus:  # more threads than CPUs only contend (and too many exhaust the OS)
            raise ValueError(
                f"OffloadRuntime: worker_threads {worker_threads} is more than the {cpus} CPUs this process may use"
            )
        step_timeout = arguments.seconds("OffloadRuntime", "step_timeout", step_timeout)
        start_timeout = arguments.seconds("OffloadRuntime", "start_timeout", start_timeout)
        self.device = arguments.device("OffloadRuntime", device)
        if self.device.type not in ("cuda", "cpu"):
            raise ValueError(f"OffloadRuntime: device must be 'cuda' or 'cpu', got {device!r}")
        self.max_tokens = max_tokens
        self.step_timeout = float(step_timeout)
        self._process = WorkerProcess(model_factory, worker_threads, self.step_timeout)
        self._transaction = StepTransaction(
            self._process, self.max_tokens, self.step_timeout, self.device.type == "cuda"
        )
        # Public so that tests can kill it and watch what the runtime notices.
        self.process = self._process.process
        self.model = self._process.handshake(
            model_factory, self.device, self.max_tokens, self._transaction, start_timeout
        )
        self._transaction.bind()
        # The serving loop's two calls per step, bound once (the methods below document them).
        self.prepare = self._transaction.prepare
        self.release = self._transaction.release
        # Public so that tests can stop it and see what the runtime notices without it.
        self.watchdog = Watchdog(self._process)
        self.watchdog.start()
        # A runtime dropped without close() closes when it is collected (or at exit): its process,
        # watchdog and layer names would otherwise live on, and a new runtime could not arm them.
        self._closer = weakref.finalize(self, _close, self._process, self._transaction, self.watchdog, self.device)

    @property
    def on_gpu(self) -> bool:
        """Whether the step transaction takes its GPU branches (the device is CUDA).

        Settable so that tests can run those branches on a CPU runtime without a GPU; nothing
        else writes it.
        """
        return self._transaction.on_gpu

    @on_gpu.setter
    def on_gpu(self, value: bool) -> None:
        self._transaction.on_gpu = value

    # --- the step transaction ----------------------------------------------------------------

    def check(self) -> None:
        """Raise :class:`OffloadError` if the runtime cannot serve, or an earlier step failed unreported.

        Raises
        ------
        OffloadError
            Fatal (closed, offload process dead or late, a stream waited with no step), or the
            error of a released step whose failure no call has raised yet (raised once).
        """
        self._transaction.check()

    def prepare(self, input_ids: torch.Tensor) -> None:
        """Hand this step's token ids to the offload process (host ids avoid a device sync).

        It returns at once unless the offload process has not yet taken the previous step's ids
        (a GPU caller running ahead): it then waits for that, at most ``step_timeout``.

        Parameters
        ----------
        input_ids : Tensor
            1-D, integer dtype, 1..``max_tokens`` ids; the forward must have as many tokens, and
            serves these ids' rows (the offload process computed them): the ids the forward is
            given set only the count.

        Raises
        ------
        TypeError, ValueError
            Ids of a floating (or bool) dtype, or of a bad shape; or, where the offload process
            gathers a layer's rows from its table (``lookup_table``), an id outside that table
            (the smallest one): nothing is prepared.
        OffloadError
            The previous step is not released; prepare was called during a CUDA-graph capture;
            an earlier step failed and its error was not raised yet; or the runtime is dead.
        """
        self._transaction.prepare(input_ids)

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
        self._transaction.release(enqueue)

    def served_steps(self) -> int:
        """Steps the offload process has finished writing (failed steps included)."""
        self._process.check_usable()
        return self._process.control.get(Word.SERVED)

    # --- seams for tests and tools -----------------------------------------------------------

    @property
    def control(self) -> ControlBlock:
        """The shared control block (steps, flags, waiting words) both processes use.

        Exists for tests and tools: they read its words, and write a waiting word as a GPU stream
        would. Serving never needs it.
        """
        return self._process.control

    @property
    def failure(self) -> OffloadError | None:
        """The fatal error once the runtime failed, else ``None``.

        Exists for tests: unlike :meth:`check` it notices nothing itself (asks no process), so a
        test sees what the watchdog or an earlier call noticed.
        """
        return self._process.failure

    def shared_paths(self) -> list[str]:
        """The ``/dev/shm`` paths of the control block and of each layer's slot, in that order.

        Exists for tests: the files are removed when start-up ends, so none of them exists.
        """
        return self._process.shared_paths()

    # --- shutdown ----------------------------------------------------------------------------

    def close(self) -> None:
        """Stop the offload process, unblock any pending step, disarm the layers. Idempotent.

        A step the offload process had not finished gets poisoned rows (its waits end); on CUDA
        the device is synchronized, so that pulls already enqueued read their rows before the
        slots are poisoned for good. Every later call raises :class:`OffloadError`.
        """
        self._closer()

    def __enter__(self) -> "OffloadRuntime":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _close(process: WorkerProcess, transaction: StepTransaction, watchdog: Watchdog, device: torch.device) -> None:
    """:meth:`OffloadRuntime.close`, holding no reference to the runtime (its finalizer calls it)."""
    if not process.begin_close():
        return
    try:
        process.stop()
        if transaction.on_gpu:
            # The watchdog keeps freeing streams that wait on a flag meanwhile.
            with contextlib.suppress(Exception):
                torch.cuda.synchronize(device)
    finally:
        watchdog.stop(1.0)
        process.disarm()
        transaction.abandon()


__all__ = ["OffloadRuntime", "OffloadError"]
