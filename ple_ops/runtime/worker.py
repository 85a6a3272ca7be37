"""The offload process: build the model, attach the shared memory (handshake), then serve steps.

It has no CUDA context (``CUDA_VISIBLE_DEVICES`` is emptied before anything can make one). It
talks to the runtime through the :class:`~ple_ops.runtime.control.ControlBlock` (steps, flags, progress)
and the pipe (the handshake, and the tracebacks of failed steps and of its own death).
"""

from __future__ import annotations

import os
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from .. import layer as layer_mod
from .. import reference
from ..semaphore import CHECK_EVERY_S, RESET, CpuGpuSemaphore, release_fence, spin_wait
from .control import Attach, ControlBlock, LayerSpec, LayersReport, Phase, Ready, StepFailed, Word, WorkerFailed
from .shared_memory import SharedHostBuffer, remove_files_of

# A decode step follows the last one closely and this process exists to answer fast: spin this
# long on a flag or a request before backing off to sleeps.
_SPIN = 5e-3
# How long a broken pipe may come before the re-parenting that shows the GPU process died (the
# kernel closes a dying process's files first): far longer than that gap ever is.
_REPARENT_S = 1.0
_TRACEBACK_CHARS = 16000  # a failed step's traceback on the pipe: its tail, where the error is
_ORPHAN_POLL_S = 0.2  # how often the orphan watch looks for its parent
# Held by whoever says that the GPU process died: the line is written once.
_said_gone = threading.Lock()


class StopServing(Exception):
    """The runtime asked the worker to exit (``Word.STOP``)."""


class ParentDied(Exception):
    """The GPU process that started this worker is gone (this process was re-parented)."""


@dataclass
class ServedLayer:
    """One PLE layer in the worker: its module, its flag and slot, and how much of the slot holds rows.

    Slot rows at and past ``written`` hold 0xFF poison (the runtime poisons new slots), so a pull
    of more rows than the step has (a graph captured for more tokens) reads NaN, never an older
    step's rows.

    ``lookup`` is the layer's table as uint8 rows ``[vocab, row_bytes]`` where the layer is a pure
    lookup (:meth:`~ple_ops.PleOffloadLayer.lookup_table`, whose contract is that
    ``forward_impl(ids)`` is exactly ``table[ids]``): then a step's rows are gathered by numpy
    straight into the slot, one call, instead of ``forward_impl`` and a copy (a handful of torch
    operations, each microseconds of the step's critical path: the GPU waits for these rows).
    """

    index: int
    spec: LayerSpec
    module: layer_mod.PleOffloadLayer
    flag: CpuGpuSemaphore
    slot: torch.Tensor  # uint8 [max_tokens, row_bytes]
    written: int = 0
    lookup: np.ndarray | None = None

    def __post_init__(self):
        self.slot_bytes = self.slot.numpy()  # the gather's destination, viewed once

    def compute(self, ids: torch.Tensor) -> torch.Tensor | np.ndarray:
        """What :meth:`store` writes for this step: the rows, checked against the layer's
        reported shape and dtype; for a pure lookup, the ids as an array, checked against the
        table (the gather itself waits for the slot to be free)."""
        if self.lookup is not None:
            values = ids.numpy()
            vocab = self.lookup.shape[0]
            if values.size and (values.min() < 0 or values.max() >= vocab):
                bad = int(values[(values < 0) | (values >= vocab)][0])
                raise IndexError(f"{self.spec.name}: index {bad} is out of bounds for its table of {vocab} rows")
            return values
        rows = self.module.forward_impl(ids)
        n, dim, dtype = ids.shape[0], self.spec.dim, self.spec.dtype
        if tuple(rows.shape) != (n, dim) or rows.dtype != dtype:
            raise ValueError(
                f"{self.spec.name}.forward_impl returned {tuple(rows.shape)} {rows.dtype}, expected ({n}, {dim}) {dtype}"
            )
        return rows

    def store(self, computed: torch.Tensor | np.ndarray | None, n: int) -> None:
        """Write a step's ``n`` rows into the slot from what :meth:`compute` returned (``None``:
        the step failed, poison instead)."""
        if computed is None:
            reference.poison_rows(self.slot[: max(n, self.written)])
            self.written = 0
            return
        if self.lookup is not None:
            # Ids checked in compute: "clip" never clips, and unlike "raise" writes unbuffered.
            np.take(self.lookup, computed, axis=0, out=self.slot_bytes[:n], mode="clip")
        else:
            self.slot[:n].copy_(computed.contiguous().view(torch.uint8).view(n, -1))
        if self.written > n:
            reference.poison_rows(self.slot[n : self.written])  # the previous step's tail
        self.written = n


def lookup_rows(module: layer_mod.PleOffloadLayer, spec: LayerSpec) -> np.ndarray | None:
    """The layer's table as uint8 rows ``[vocab, row_bytes]`` for the gather in :meth:`ServedLayer.store`,
    or None where the layer is not a pure lookup as far as the worker can tell: no table, one
    not contiguous on the CPU, rows of another shape or dtype than the layer reported, or a
    ``forward_impl`` replaced on the instance (which the table would bypass)."""
    if "forward_impl" in vars(module):
        return None
    table = module.lookup_table()
    if (
        not isinstance(table, torch.Tensor)
        or table.device.type != "cpu"
        or table.dim() != 2
        or not table.is_contiguous()
        or table.shape[1] != spec.dim
        or table.dtype != spec.dtype
    ):
        return None
    return table.detach().view(torch.uint8).numpy()


def worker_main(model_factory: Callable[[], nn.Module], conn, parent_pid: int, tag: str, threads: int = 1) -> None:
    """Entry point of the offload process (``multiprocessing`` spawn target); ``tag`` is the word
    in the file names of the runtime that spawned it."""
    # No CUDA here, by construction: anything that tries fails loudly instead of making a context.
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    # A step's rows are small: too little work for a pool of intra-op threads, which may spin
    # between steps on the cores the GPU process's launching thread needs.
    torch.set_num_threads(threads)
    gone = f"offload worker: the GPU process (pid {parent_pid}) died; exiting"
    threading.Thread(
        target=_exit_when_orphaned, args=(parent_pid, tag, gone), name="ple-offload-orphan-watch", daemon=True
    ).start()
    try:
        control, layers = handshake(model_factory, conn)

        def orphaned() -> None:
            if os.getppid() != parent_pid:
                raise ParentDied(gone)

        serve(control, layers, conn.send, orphaned)
    except StopServing:
        return
    except BaseException as error:
        # A pipe that broke during the handshake is the GPU process's death as well.
        broke = isinstance(error, (EOFError, BrokenPipeError, ConnectionResetError))
        if isinstance(error, ParentDied) or parent_gone(parent_pid, broke):
            # Nobody reads the pipe any more: a traceback there (or of the failed send) tells no
            # one anything, so one line on stderr, then a non-zero exit.
            _say_gone(gone)
            sys.exit(1)
        try:
            conn.send(WorkerFailed(traceback.format_exc()))
        finally:
            raise
    finally:
        if parent_gone(parent_pid, False):
            # Killed before start-up ended, the GPU process could not remove the files it made
            # for this process: nobody else knows their names.
            remove_files_of(parent_pid, tag)


def _say_gone(gone: str) -> bool:
    """Write the line that says the GPU process died, once per process; whether this call did."""
    if not _said_gone.acquire(blocking=False):
        return False
    print(gone, file=sys.stderr, flush=True)
    return True


def _exit_when_orphaned(parent_pid: int, tag: str, gone: str) -> None:
    """On a thread of its own: end this process once the GPU process is gone, whatever the main
    thread is doing. The main thread notices only between steps and while it waits, so a model
    still being built or a ``forward_impl`` that runs long (or never returns) would otherwise
    outlive its parent, holding its files."""
    while os.getppid() == parent_pid:
        time.sleep(_ORPHAN_POLL_S)
    remove_files_of(parent_pid, tag)
    if _say_gone(gone):
        os._exit(1)  # the main thread may be anywhere (inside forward_impl): no clean-up to wait for


def parent_gone(parent_pid: int, pipe_broke: bool) -> bool:
    """Whether the GPU process is gone (this process was re-parented). A dying process closes its
    pipes a moment before its children are re-parented: after a broken pipe, wait for that."""
    deadline = time.monotonic() + (_REPARENT_S if pipe_broke else 0.0)
    while os.getppid() == parent_pid:
        if time.monotonic() >= deadline:
            return False
        time.sleep(CHECK_EVERY_S)
    return True


def handshake(model_factory: Callable[[], nn.Module], conn) -> tuple[ControlBlock, list[ServedLayer]]:
    """Build the model, report its PLE layers, attach what the runtime made for them, say ready."""
    layer_mod.mark_offload_worker()
    model = model_factory()
    if not isinstance(model, nn.Module):  # else an AttributeError from .eval(), naming neither
        raise TypeError(
            f"OffloadRuntime: model_factory must return the model (an nn.Module), got {type(model).__name__}"
        )
    model = model.eval()
    modules = layer_mod.ple_layers(model)
    specs, lookups = [], []
    with torch.no_grad():
        for name, module in modules:
            probe = module.forward_impl(torch.zeros(1, dtype=torch.long))
            lookup = lookup_rows(module, LayerSpec(name, probe.shape[-1], probe.dtype))
            lookups.append(lookup)
            # A gathered layer's table size goes in the report: the runtime then refuses an id
            # outside it in prepare(), before the step is sent, instead of this process failing it.
            rows = None if lookup is None else lookup.shape[0]
            specs.append(LayerSpec(name, probe.shape[-1], probe.dtype, rows))
    conn.send(LayersReport(tuple(specs)))
    attach = conn.recv()
    if not isinstance(attach, Attach):
        raise RuntimeError(f"offload worker: expected Attach from the runtime, got {attach!r}")
    control = ControlBlock.attach(attach.control)
    layers = []
    for i, ((_, module), spec, lookup, handle) in enumerate(zip(modules, specs, lookups, attach.slots)):
        slot = SharedHostBuffer.attach(handle).view(0, (control.max_tokens, spec.row_bytes), torch.uint8)
        layers.append(ServedLayer(i, spec, module, control.flags[i], slot, lookup=lookup))
    conn.send(Ready())
    return control, layers


def serve(
    control: ControlBlock,
    layers: list[ServedLayer],
    report: Callable[[StepFailed], None],
    check: Callable[[], None] = lambda: None,
) -> None:
    """Serve requested steps until ``Word.STOP`` (raises :class:`StopServing`).

    Per layer: compute the rows first, *then* wait for the consumer's reset of the previous
    step's flag, store, fence, raise. The computation thus overlaps the GPU's pulls of the
    previous step, and the slot changes only once nobody reads it. An exception in
    ``forward_impl`` fails this step only: it is reported (``report``, then ``Word.FAILED``),
    and this and every later layer of the step publishes poison (0xFF) instead of rows, so that
    every wait of the step ends. ``check`` runs about every 10 ms while waiting and may raise.
    """

    def check_stop() -> None:
        if control.get(Word.STOP):
            raise StopServing()
        check()

    step = control.get(Word.SERVED)
    with torch.no_grad():
        while True:
            control.set(Word.WORKER_PHASE, Phase.IDLE)
            spin_wait(lambda: control.get(Word.REQUEST), step + 1, "offload worker", check_stop, spin=_SPIN)
            step += 1
            n = control.get(Word.NUM_TOKENS)
            ids = control.ids[:n].clone()
            release_fence()  # the copy completes before TAKEN is seen (Arm may reorder a load after a store)
            control.set(Word.TAKEN, step)  # the runtime may write the next step's ids now
            failed = False
            for layer in layers:
                control.set(Word.WORKER_LAYER, layer.index)
                rows = None
                if not failed:
                    control.set(Word.WORKER_PHASE, Phase.COMPUTING)
                    try:
                        rows = layer.compute(ids)
                    except Exception:
                        failed = True
                        report(StepFailed(step, layer.spec.name, traceback.format_exc()[-_TRACEBACK_CHARS:]))
                        control.set(Word.FAILED, step)  # after the message: who sees this finds it
                control.set(Word.WORKER_PHASE, Phase.AWAITING_RESET)
                layer.flag.host_wait(RESET, check_stop, spin=_SPIN)
                control.set(Word.WORKER_PHASE, Phase.PUBLISHING)
                layer.store(rows, n)
                layer.flag.host_signal()  # release fence, then flag = DONE
                # After the flag: "delivered == REQUEST while the flag is reset" must only ever
                # mean that the rows were published and consumed (the watchdog's stuck test).
                control.set_delivered(layer.index, step)
            control.set(Word.SERVED, step)


__all__ = ["worker_main", "handshake", "serve", "parent_gone", "ServedLayer", "StopServing", "ParentDied"]
