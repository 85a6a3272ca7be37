"""StepTransfers and ``torch.ops.kv_ops.step_transfers``: block stores and loads that a compiled,
captured step runs itself, from ids the host wrote into page-locked memory before the step.

A serving loop that preempts a sequence between two steps otherwise calls the engine there, and
waits for the store before the step reuses the blocks: on a host that has just woken from the
last step's sync, that call and its flush cost more than the copy (the decode loop measures it).
Here the host only writes the ids (:meth:`StepTransfers.stage`, a few microseconds), and the step
itself, first thing, copies them in and runs the engine's zero-copy kernel once per direction:
inside a CUDA graph, nodes that replay with the step and cost the host nothing.

The id words, page-locked, are two id blocks ``[n, src ids (n), dst ids (n)]`` of ``capacity``
pairs each, the store's then the load's (the layout :class:`kv_ops.kernels.GraphedCopy` reads).
At each run the op copies them to the GPU, then writes zero over the host's two counts, then
launches the store and the load. So a step run without a new stage moves nothing, and a count
back at zero tells the host that the ids it wrote have been read and the words may be rewritten.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from .. import kernels, reference
from ..cuda import arguments, capture
from ..cuda.arguments import positive_int
from ..cuda.host_memory import lasting_copy, pinned_empty
from ..cuda.registration import register_op
from ..validation import check_fake_values, error_counter
from . import ids as ids_mod
from . import in_step
from .engine import check_engine

# How long stage() waits for the step that reads the last staged ids before it gives up: that
# step was launched but has not run yet (the GPU is behind), or was never launched.
STAGE_TIMEOUT_S = 10.0


def lookup(name: str) -> StepTransfers:
    """The live :class:`StepTransfers` called ``name`` in this process."""
    return in_step.lookup(name, "kv_ops.step_transfers", StepTransfers, in_step.MADE_BEFORE_STEP)


class StepTransfers:
    """Stores and loads of an engine's blocks that the step runs at its start.

    Each step: :meth:`stage` the step's stores (GPU -> host) and loads (host -> GPU), then run
    the step (eagerly, compiled, or a CUDA-graph replay), which calls :func:`kv_ops.step_transfers`
    before it touches the cache. There the stores run, then the loads, on the step's stream,
    each as one launch of the engine's zero-copy kernel: everything the step does after them
    sees the loaded blocks, and may overwrite the stored ones.

    Parameters
    ----------
    engine : OffloadEngine
        A host-memory engine without ``groups`` (not the disk tier): the blocks move between its
        cache and its mirror, every region of a block.
    name : str
        What the op carries; unique among the live instances of this process. A step compiled
        (or AOT-saved) against a name runs against whichever instance has it when it runs; a
        captured graph reads the id words of the instance that had it at the capture.
    capacity : int, optional
        Most pairs per direction in one stage; by default the engine's ``num_blocks``.

    Notes
    -----
    Ordering. :meth:`stage` orders the current stream after every transfer the engine has
    issued so far, so the step's copies never race one of the engine's own; the engine's later
    transfers are ordered after the caller's stream, hence after the step, by default. Stores
    run before loads: a host block stored to and loaded from in one step loads the stored bytes.
    A sequence's host blocks may be reused once the step that loads them has run.

    The kernel counts and skips an out-of-range pair (:func:`kv_ops.error_count`), which
    :meth:`stage`'s checks already refuse. Call :meth:`close` once no step that names this
    instance will run again; a replay afterwards moves nothing.

    Examples
    --------
    >>> transfers = kv_ops.StepTransfers(engine, "step")
    >>> transfers.stage(store=([7, 8], [0, 1]), load=([5], [7]))   # before the replay it feeds
    >>> graph.replay()              # the step begins: kv_ops.step_transfers("step", caches)
    """

    def __init__(self, engine, name: str, capacity: int | None = None):
        check_engine("StepTransfers", engine)
        in_step.check_name("StepTransfers", name)
        capture.refuse_capture(
            "StepTransfers",
            "making one warms its kernel up on the GPU, which the capture would record",
            "make it before capturing the step",
            device=engine.device,
        )
        if engine.disk is not None:
            raise ValueError(
                "StepTransfers: this engine keeps its blocks on disk (disk_dir=); a step's transfers move "
                "blocks between the cache and the host mirror of a memory engine"
            )
        if None not in engine.groups:
            raise ValueError(
                f"StepTransfers: this engine was made with groups ({', '.join(map(repr, engine.groups))}); "
                "a step's transfers move every region of a block: make the engine without groups"
            )
        self.capacity = engine.num_blocks if capacity is None else positive_int("StepTransfers", "capacity", capacity)
        self.engine, self.name, self.device = engine, name, engine.device
        self._load_at = 1 + 2 * self.capacity  # the load's id block follows the store's
        words = 2 * self._load_at
        gpu = list(engine.regions.values())
        host = [engine.mirror_regions[n] for n in engine.regions]
        self._regions = (gpu, host)
        # The caches' addresses as the engine lists them, and sorted: what check_step compares.
        self._caches = engine.cache_addresses
        self._sorted_caches = sorted(self._caches)
        self._twin = pinned_empty(words, dtype=torch.int64)
        self._twin.zero_()
        self._words = self._twin.numpy()
        self.staged = {"store": 0, "load": 0}  # pairs staged so far, per direction
        # Per direction, its id sides as stage() checks them: (name, limit, destinations distinct).
        gpu_side, host_side = ("gpu_ids", engine.num_blocks), ("host_ids", engine.num_host_blocks)
        self._sides = (
            ("store", ((*gpu_side, False), (*host_side, True))),
            ("load", ((*host_side, False), (*gpu_side, True))),
        )
        if self.device.type == "cuda":
            self._block = lasting_copy(torch.zeros(words, dtype=torch.int64), self.device)
            self._zero = lasting_copy(torch.zeros(1, dtype=torch.int64), self.device)
            self._errors = error_counter(self.device)
            self._copies = (kernels.BoundCopy(self.device, gpu, host), kernels.BoundCopy(self.device, host, gpu))
            in_step.keep(self._twin, self._block, self._zero)
            with torch.cuda.device(self.device):
                self.run()  # compiles the kernel outside any capture (both counts are zero)
                torch.cuda.current_stream().synchronize()
        engine.on_close(self._drop)  # a step after the engine's close moves nothing
        in_step.register(name, self)

    # --- host side ---------------------------------------------------------------------------

    def stage(self, store=None, load=None) -> None:
        """Write the next step's transfers: ``store=(gpu_ids, host_ids)`` copies GPU block
        ``gpu_ids[i]`` to host block ``host_ids[i]``, ``load=(host_ids, gpu_ids)`` the reverse.

        Ids as :meth:`OffloadEngine.store` and :meth:`~OffloadEngine.load` take them from the
        host (a list, a 1-D int32/int64 array or CPU tensor): destinations distinct, at most
        ``capacity`` pairs per direction. Call it before the step (or replay) that runs them, on
        the stream that step runs on. If the step that reads the last staged ids has not run
        yet, this waits for it, at most :data:`STAGE_TIMEOUT_S`.

        Raises
        ------
        ValueError
            Bad ids, a length mismatch or more than ``capacity`` pairs, a ``store`` or ``load``
            that is not a pair; before anything is written.
        RuntimeError
            During a CUDA-graph capture; when the last staged ids were not read by a step within
            the timeout (on a CPU engine: at once, as only the step itself could read them).
        ClosedError
            After :meth:`close`, or the engine's.
        """
        op = "StepTransfers.stage"
        in_step.check_live(self, op)
        capture.refuse_capture(
            op,
            "the ids are written on the host before the step, not recorded into a graph",
            "stage before the replay",
            device=self.device,
        )
        engine = self.engine
        engine.check_open("StepTransfers.stage")
        pairs = []
        for (direction, sides), given in zip(self._sides, (store, load)):
            if given is None:
                pairs.append(None)
                continue
            if isinstance(given, (str, bytes)) or not isinstance(given, Sequence) or len(given) != 2:
                raise ValueError(f"{op}: {direction} must be a pair ({sides[0][0]}, {sides[1][0]}), got {given!r}")
            src, dst = (
                self._host_ids(op, f"{direction} {what}", ids, limit, unique)
                for ids, (what, limit, unique) in zip(given, sides)
            )
            if len(src) != len(dst):
                raise ValueError(f"{op}: {direction} has {len(src)} {sides[0][0]} but {len(dst)} {sides[1][0]}")
            if len(src) > self.capacity:
                raise ValueError(f"{op}: {direction} has {len(src)} pairs, more than capacity={self.capacity}")
            pairs.append((src, dst) if len(src) else None)
        if pairs == [None, None]:
            return
        self._wait_read(op)
        words = self._words
        for at, pair in zip((0, self._load_at), pairs):
            if pair is not None:
                src, dst = pair
                n = len(src)
                words[at + 1 : at + 1 + n] = src
                words[at + 1 + n : at + 1 + 2 * n] = dst
                words[at] = n  # last: the count makes the ids live
        self.staged["store"] += 0 if pairs[0] is None else len(pairs[0][0])
        self.staged["load"] += 0 if pairs[1] is None else len(pairs[1][0])
        if self.device.type == "cuda":
            engine.order_after_transfers(torch.cuda.current_stream(self.device))

    def _host_ids(self, op: str, what: str, ids, limit: int, unique: bool):
        taken = ids_mod.take(op, what, ids, limit, unique, self.device)
        if isinstance(taken, torch.Tensor):
            raise ValueError(
                f"{op}: {what} is a {taken.device} tensor; the ids are written on the host: pass a list, "
                "an array or a CPU tensor"
            )
        return taken

    def _wait_read(self, op: str) -> None:
        """Until a step has read the last staged ids (both counts back at zero)."""
        words, load_at = self._words, self._load_at
        if not (words[0] or words[load_at]):
            return
        step = f"run the step, which calls kv_ops.step_transfers({self.name!r}, ...)"
        if self.device.type != "cuda":
            # On the CPU the step reads the ids on the caller's thread, when it runs: nothing
            # else can read them while this waits, so waiting could only end in the timeout.
            raise RuntimeError(
                f"{op}: the transfers staged last were not read by a step yet; a stage is read by the next "
                f"step, so {step}, before staging again"
            )
        deadline = time.monotonic() + STAGE_TIMEOUT_S
        while words[0] or words[load_at]:
            if time.monotonic() >= deadline:
                raise RuntimeError(
                    f"{op}: the transfers staged last were not read by a step within {STAGE_TIMEOUT_S} s (the "
                    f"step was not launched, or the GPU is that far behind): {step} after each stage"
                )
            time.sleep(20e-6)

    def close(self) -> None:
        """Give up the name. Transfers staged and not yet read are dropped; a graph captured
        against this instance may still replay and moves nothing."""
        if in_step.unregister(self):
            self._drop()

    def _drop(self) -> None:
        self._words[0] = self._words[self._load_at] = 0

    def __enter__(self) -> StepTransfers:
        in_step.check_live(self, "StepTransfers")  # as every call after close() does, not at the first one inside
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- the step's side ---------------------------------------------------------------------

    def run(self) -> None:
        """What :func:`step_transfers` does: on the GPU, enqueue (or record into the capture) the id copy, the
        counts' reset, the store and the load; on the CPU, do them."""
        words, load_at = self._words, self._load_at
        if self.device.type != "cuda":
            gpu, host = self._regions
            for at, src, dst in ((0, gpu, host), (load_at, host, gpu)):
                n = int(words[at])
                if n:
                    ids = torch.from_numpy(words[at + 1 : at + 1 + 2 * n].copy())
                    reference.copy_blocks(src, dst, ids[:n], ids[n:])
                    words[at] = 0
            return
        block, twin = self._block, self._twin
        # Stream order is the whole protocol: the ids are in before the counts go back to zero
        # (the host may then rewrite the words), and both are before the copies that read them.
        block.copy_(twin, non_blocking=True)
        twin[0:1].copy_(self._zero, non_blocking=True)
        twin[load_at : load_at + 1].copy_(self._zero, non_blocking=True)
        store, load = self._copies
        store.launch_from_block(None, block[:load_at], self.capacity, self._errors)
        load.launch_from_block(None, block[load_at:], self.capacity, self._errors)

    def check_step(self, caches: Sequence[torch.Tensor]) -> None:
        """A ``ValueError`` unless ``caches`` are the engine's very cache tensors."""
        # The very tensors, by address: the copies write the engine's blocks where they are, so
        # a copy of the caches, which a backend that functionalizes without re-inplacing
        # (aot_eager) hands a mutating op and copies back after it, would undo the loads.
        # (kv_ops.wait_layer only waits, so it takes copies; this op cannot.)
        # Every one, as often as the engine lists it (two layer names may share a tensor), in any
        # order: a cache left out is not declared mutated, so the compiler may read it before
        # the loads. The engine's own order is the common case, compared first.
        given = tuple(c.data_ptr() for c in caches)
        if given == self._caches or sorted(given) == self._sorted_caches:
            return
        count = len(self._caches)
        if len(given) != count:
            why = ""
        elif not set(given) <= set(self._caches):
            why = (
                " of which some are not (copies: compile the step with Inductor, the default backend, "
                "or run it eagerly; aot_eager hands the op copies and would undo its loads)"
            )
        else:
            why = " of which one is passed twice and another left out (each cache once)"
        raise ValueError(
            f"kv_ops.step_transfers: {self.name!r} needs the {count} cache tensors its engine was "
            f"made over, themselves, got {len(caches)} tensors{why}"
        )


# --- step_transfers ------------------------------------------------------------------------------


def _condition(caches) -> bool:
    """What the fake can check, and the eager op with it (the rest needs the named instance)."""
    return len(caches) > 0


def _message(caches) -> str:
    return f"kv_ops.step_transfers: needs the cache tensors the transfers write, got {len(caches)}"


def _step_transfers_fake(caches, name):
    check_fake_values("kv_ops.step_transfers", caches=caches)
    torch._check(_condition(caches), lambda: _message(caches))


def _step_transfers_impl(caches, name) -> None:
    if not _condition(caches):
        raise ValueError(_message(caches))
    found = lookup(name)
    found.check_step(caches)
    found.run()


register_op(
    "kv_ops",
    "step_transfers(Tensor(a!)[] caches, str name) -> ()",
    fake=_step_transfers_fake,
    cpu=_step_transfers_impl,
)


def step_transfers(name: str, caches: Sequence[torch.Tensor]) -> None:
    """Run the transfers staged on :class:`StepTransfers` ``name``: its stores, then its loads.

    Place it at the start of the step, before anything reads or writes the cache. ``caches``
    are the cache tensors the engine was made over (every layer's): the op declares them
    mutated, so that the compiler keeps every reader and writer of the cache after it. On a
    GPU it enqueues on the current stream, and a CUDA graph captures it as nodes that read the
    ids staged before each replay. Raises ``ValueError`` with no caches, ``caches`` not a list of
    tensors, or a ``name`` that is not a live StepTransfers'.
    """
    caches = arguments.tensor_list("kv_ops.step_transfers", "caches", caches)
    if not _condition(caches):  # the dispatcher cannot route an op with no tensor
        raise ValueError(_message(caches))
    torch.ops.kv_ops.step_transfers(caches, arguments.text("kv_ops.step_transfers", "name", name))


__all__ = ["StepTransfers", "step_transfers", "lookup", "STAGE_TIMEOUT_S"]
