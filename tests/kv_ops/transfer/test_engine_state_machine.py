"""A hypothesis state machine drives OffloadEngine on the CPU: random sequences of store, load,
poll, flush, close and writes by "compute", with valid and invalid ids, the mirror (on the
kernel, staged or dma path; the staged ring of 1 or 2 rows per slot) or the disk tier, checked
against a plain model of what every GPU block and host block (file slot) holds.

Invariants:

* after flush or close, the cache and the mirror (or the file, read back) equal the model, byte
  for byte; loads read the host side back through the engine throughout;
* every transfer id is reported exactly once, in issue order per direction, and ids are issued
  consecutively (an id used up by a refused call would show as a gap);
* an engine counts every accepted transfer on its own path (``path_counts``; the disk tier's is
  ``"disk"``), a refused one on none;
* an invalid call raises ValueError naming the argument and changes nothing: no byte of the
  cache or the host side, no transfer id, no report;
* after close every call raises EngineClosedError, and a second close does nothing.

The cache holds random bytes (float16 and bfloat16 views of them, NaN patterns included), never
zeros, so a block copied from the wrong place shows.
"""

import os
import shutil
import tempfile
import warnings

import pytest
import torch
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, precondition, rule

import kv_ops
from kv_ops.transfer.engine import EngineClosedError
from kv_ops.transfer.paths import RING_SLOTS

NUM_BLOCKS = 6
HOST_BLOCKS = 5
KINDS = ("store", "load")
PATHS = ("kernel", "staged", "dma")
DEFECTS = ("gpu_range", "host_range", "negative", "repeated_destination", "lengths", "float", "bool", "meta")


def as_form(ids: list, form: str):
    """The same ids as a list, an int64 tensor or an int32 tensor (all accepted)."""
    if form == "list":
        return list(ids)
    return torch.tensor(ids, dtype=torch.int64 if form == "int64" else torch.int32)


def ids_of(limit: int, n: int, unique: bool):
    return st.lists(st.integers(0, limit - 1), min_size=n, max_size=n, unique=unique)


class EngineMachine(RuleBasedStateMachine):
    """The mirror engine; :class:`DiskEngineMachine` runs the same rules on the disk tier."""

    DISK = False

    @initialize(
        direct=st.booleans(),
        staging_blocks=st.integers(1, 3),
        seed=st.integers(0, 2**32 - 1),
        path=st.sampled_from(PATHS),
        ring_rows=st.integers(1, 2),
    )
    def start(self, direct, staging_blocks, seed, path, ring_rows):
        disk = self.DISK
        self.path, self.ring_rows = path, ring_rows
        if not disk:
            event(f"path {path}, ring of {ring_rows} rows per slot")
        self.gen = torch.Generator().manual_seed(seed)
        self.kv = {
            "attn0": self.random((2, NUM_BLOCKS, 2, 2, 16)).view(torch.float16),  # K/V-first: 2 regions of 64 B
            "mla1": self.random((NUM_BLOCKS, 2, 32)).view(torch.bfloat16),  # 1 region of 64 B
        }
        self.dir = tempfile.mkdtemp(prefix="kv_sm_") if disk else None
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # no CUDA: pinned_empty warns that it returns plain memory
            try:
                self.engine = self.open(disk, page_cache=not direct, staging_blocks=staging_blocks)
            except OSError as e:  # a temporary directory on a file system without O_DIRECT
                assert "does not support O_DIRECT" in str(e)
                self.engine = self.open(disk, page_cache=True, staging_blocks=staging_blocks)
        engine = self.engine
        self.width = engine.block_bytes
        assert self.width == 3 * 64 and engine.num_host_blocks == HOST_BLOCKS
        self.reader = None
        if disk:
            assert os.listdir(self.dir) == []
            # The file's own descriptor may be O_DIRECT; a second, buffered description of the
            # same (nameless) file reads it back, also after close().
            self.reader = os.open(f"/proc/self/fd/{engine.disk.file.fd}", os.O_RDONLY | os.O_CLOEXEC)
            slots = kv_ops.pinned_empty((HOST_BLOCKS, engine.disk.file.slot_stride))
            slots.copy_(self.random(slots.shape))
            engine.disk.file.write(list(range(HOST_BLOCKS)), slots)  # the file starts random, too
        else:
            engine.mirror.copy_(self.random(engine.mirror.shape))
        self.mirror = engine.mirror  # kept: close() drops the engine's reference, not the memory
        self.gpu = list(self.read_cache())  # the model: bytes of each GPU block...
        self.host = list(self.read_host())  # ...and of each host block
        self.next_tid = 0
        self.issued = {k: [] for k in KINDS}
        self.reported = {k: [] for k in KINDS}
        self.closed = False
        self.steps = 0  # transfers tried while open; close() waits for a few, so that runs say something

    def open(self, disk, page_cache, staging_blocks):
        if disk:
            return kv_ops.OffloadEngine(
                self.kv,
                NUM_BLOCKS,
                HOST_BLOCKS * 4096 + 4095,
                disk_dir=self.dir,
                page_cache=page_cache,
                staging_blocks=staging_blocks,
            )
        # The mirror on one of the three paths; the staged path with a ring of 1 or 2 rows per
        # slot, so transfers cross chunk boundaries and slots are reused across calls.
        return kv_ops.OffloadEngine(
            self.kv, NUM_BLOCKS, HOST_BLOCKS * 192 + 191, path=self.path, ring_bytes=RING_SLOTS * self.ring_rows * 192
        )

    def teardown(self):
        engine = getattr(self, "engine", None)
        if engine is None:
            return
        try:
            event(f"{'closed by the close rule' if self.closed else 'closed at teardown'}")
            if not self.closed:
                self.close()
        finally:
            if self.reader is not None:
                os.close(self.reader)
            if self.dir is not None:
                leftovers = os.listdir(self.dir)
                shutil.rmtree(self.dir)
                assert leftovers == [], leftovers

    # --- reading the real state ------------------------------------------------------------------

    def random(self, shape):
        return torch.randint(0, 256, tuple(shape), dtype=torch.uint8, generator=self.gen)

    def read_cache(self) -> torch.Tensor:
        return torch.cat([r for r in self.engine.regions.values()], dim=1).clone()

    def read_host(self) -> torch.Tensor:
        if self.mirror is not None:
            return self.mirror.clone()
        stride = 4096
        raw = os.pread(self.reader, HOST_BLOCKS * stride, 0)
        assert len(raw) == HOST_BLOCKS * stride
        return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(HOST_BLOCKS, stride)[:, : self.width].clone()

    def quiet(self) -> bool:
        """Nothing can change the bytes behind our back: the mirror path copies on the caller's
        thread; the disk tier's I/O thread is idle once every transfer has been reported."""
        return self.engine.disk is None or all(len(self.issued[k]) == len(self.reported[k]) for k in KINDS)

    def check_bytes(self):
        assert torch.equal(self.read_cache(), torch.stack(self.gpu)), "the cache differs from the model"
        assert torch.equal(self.read_host(), torch.stack(self.host)), "the host side differs from the model"

    def record(self, done: kv_ops.Completed, everything: bool):
        assert done.failed == {}, done.failed
        for kind, ids in (("store", done.stores), ("load", done.loads)):
            self.reported[kind] += ids
            # A prefix of the issued ids: each reported once, in issue order, none invented.
            assert self.reported[kind] == self.issued[kind][: len(self.reported[kind])], (
                kind,
                self.reported,
                self.issued,
            )
        if everything:
            assert self.reported == self.issued
        issued = sum(len(ids) for ids in self.issued.values())
        counted = "disk" if self.DISK else self.path
        names = (*PATHS, "disk") if self.DISK else PATHS
        assert self.engine.path_counts == {p: issued * (p == counted) for p in names}, self.engine.path_counts

    # --- rules ---------------------------------------------------------------------------------

    def valid_ids(self, data, kind):
        n = data.draw(st.integers(0, min(HOST_BLOCKS, NUM_BLOCKS) - 1), label="n")
        # Sources may repeat; destinations (host ids of a store, GPU ids of a load) may not.
        gpu = data.draw(ids_of(NUM_BLOCKS, n, unique=kind == "load"), label="gpu_ids")
        host = data.draw(ids_of(HOST_BLOCKS, n, unique=kind == "store"), label="host_ids")
        return gpu, host

    def call(self, kind, gpu, host):
        return self.engine.store(gpu, host) if kind == "store" else self.engine.load(host, gpu)

    @precondition(lambda self: not self.closed)
    @rule(data=st.data(), kind=st.sampled_from(KINDS), form=st.sampled_from(["list", "int64", "int32"]))
    def transfer(self, data, kind, form):
        gpu, host = self.valid_ids(data, kind)
        tid = self.call(kind, as_form(gpu, form), as_form(host, form))
        assert tid == self.next_tid  # consecutive: no refused call used one up
        self.next_tid += 1
        self.steps += 1
        self.issued[kind].append(tid)
        # The engine runs transfers in issue order (the mirror path at once, the disk tier on one
        # thread), so the model applies them now.
        for g, h in zip(gpu, host):
            if kind == "store":
                self.host[h] = self.gpu[g].clone()
            else:
                self.gpu[g] = self.host[h].clone()

    @precondition(lambda self: not self.closed)
    @rule(data=st.data(), kind=st.sampled_from(KINDS), defect=st.sampled_from(DEFECTS))
    def invalid_transfer(self, data, kind, defect):
        gpu, host = (list(ids) for ids in self.valid_ids(data, kind))
        n = len(gpu)
        # One more valid pair, for defects that add a bad id to one side: destinations stay
        # distinct, so that only the intended defect is wrong.
        spare_gpu = next(g for g in range(NUM_BLOCKS) if g not in gpu)
        spare_host = next(h for h in range(HOST_BLOCKS) if h not in host)
        if defect == "gpu_range":
            gpu, host = gpu + [NUM_BLOCKS], host + [spare_host]
            message = rf"gpu_ids\[{n}\] = {NUM_BLOCKS} is outside \[0, {NUM_BLOCKS}\)"
        elif defect == "host_range":
            gpu, host = gpu + [spare_gpu], host + [HOST_BLOCKS]
            message = rf"host_ids\[{n}\] = {HOST_BLOCKS} is outside \[0, {HOST_BLOCKS}\)"
        elif defect == "negative":
            gpu, host = [-1] + gpu, [spare_host] + host
            message = r"gpu_ids\[0\] = -1 is outside"
        elif defect == "repeated_destination":
            dest, src = (host, gpu) if kind == "store" else (gpu, host)
            dest = [dest[0], dest[0]] + dest[2:] if dest else [1, 1]  # sources may repeat, so pad them with 0
            src = src + [0] * (len(dest) - len(src))
            gpu, host = (src, dest) if kind == "store" else (dest, src)
            message = rf"{'host_ids' if kind == 'store' else 'gpu_ids'} names block {dest[0]} more than once"
        elif defect == "lengths":
            host = host + [spare_host]
            message = rf"{n} gpu_ids but {n + 1} host_ids"
        elif defect == "float":
            # A float dtype is refused even with integral values; 0.5 ids would be truncated.
            as_tensor = data.draw(st.booleans(), label="float tensor")
            gpu = torch.tensor(gpu or [0], dtype=torch.float64) if as_tensor else [g + 0.5 for g in gpu] or [0.7]
            message = (
                r"gpu_ids must be a 1-D int32 or int64 tensor, got torch.float64"
                if as_tensor
                else r"gpu_ids must be integer block ids, got a list of float64"
            )
        elif defect == "bool":
            gpu = torch.ones(max(n, 1), dtype=torch.bool)
            message = r"gpu_ids must be a 1-D int32 or int64 tensor, got torch.bool"
        else:  # meta: a tensor with no values to check
            host = torch.tensor(host, dtype=torch.int64, device="meta")
            message = "host_ids is a meta tensor"
        self.steps += 1
        safe = self.quiet()
        before = (self.read_cache(), self.read_host()) if safe else None
        with pytest.raises(ValueError, match=message) as raised:
            self.call(kind, gpu, host)
        assert str(raised.value).startswith(f"OffloadEngine.{kind}: "), str(raised.value)
        if safe:  # nothing moved (with transfers in flight, the next flush checks it instead)
            assert torch.equal(self.read_cache(), before[0]) and torch.equal(self.read_host(), before[1])

    @precondition(lambda self: not self.closed)
    @rule()
    def poll(self):
        self.record(self.engine.poll(), everything=False)

    @precondition(lambda self: not self.closed)
    @rule()
    def flush(self):
        self.record(self.engine.flush(), everything=True)
        self.check_bytes()

    @precondition(lambda self: not self.closed)
    @rule(data=st.data())
    def compute_writes(self, data):
        """The model's forward pass overwrites some GPU blocks. On the CPU the disk tier's thread
        has no stream to order it after this write, so first wait for what is in flight, as a
        caller that reuses blocks must. (Not a precondition: whether the thread has finished is
        timing, and hypothesis needs the same choices on every replay.)"""
        if not self.quiet():
            self.record(self.engine.flush(), everything=True)
        blocks = data.draw(
            st.lists(st.integers(0, NUM_BLOCKS - 1), min_size=1, max_size=3, unique=True), label="blocks"
        )
        fresh = self.random((len(blocks), self.width))
        col = 0
        for r in self.engine.regions.values():
            r[blocks] = fresh[:, col : col + r.shape[1]]
            col += r.shape[1]
        for i, b in enumerate(blocks):
            self.gpu[b] = fresh[i].clone()

    @precondition(lambda self: self.steps >= 6)
    @rule()
    def close(self):
        if self.closed:
            assert self.engine.close() == kv_ops.Completed()  # idempotent
            return
        event(f"closed after {self.steps // 5 * 5}+ transfers")
        self.record(self.engine.close(), everything=True)
        self.closed = True
        assert self.engine.mirror is None and self.engine.disk is None
        self.check_bytes()  # through the references kept at the start
        if self.dir is not None:
            assert os.listdir(self.dir) == []

    @precondition(lambda self: self.closed)
    @rule(call=st.sampled_from(["store", "load", "poll", "flush", "store-invalid"]))
    def call_after_close(self, call):
        engine = self.engine
        calls = {
            "store": lambda: engine.store([0], [0]),
            "load": lambda: engine.load([0], [0]),
            "poll": engine.poll,
            "flush": engine.flush,
            "store-invalid": lambda: engine.store([0.5], [HOST_BLOCKS]),
        }
        try:
            calls[call]()
        except EngineClosedError as e:
            assert f"OffloadEngine.{call.split('-')[0]}: the engine is closed" in str(e)
        else:
            raise AssertionError(f"{call} after close() was accepted")


class DiskEngineMachine(EngineMachine):
    DISK = True


SETTINGS = settings(max_examples=30, stateful_step_count=50, deadline=None)
TestMirrorEngine = EngineMachine.TestCase
TestMirrorEngine.settings = SETTINGS
TestDiskEngine = DiskEngineMachine.TestCase
TestDiskEngine.settings = SETTINGS
