"""Small PLE models and child-process targets, importable by spawned processes (tests/ is on the path)."""

import torch
from torch import nn

import ple_ops

VOCAB, DIM, LAYERS = 1000, 64, 3


class TablePle(ple_ops.PleOffloadLayer):
    """A per-layer embedding table: rows are table[input_ids]."""

    def __init__(self, layer: int, dim: int = DIM, dtype: torch.dtype = torch.float32):
        super().__init__()
        gen = torch.Generator().manual_seed(1000 + layer)
        self.table = nn.Parameter(torch.randn(VOCAB, dim, generator=gen).to(dtype), requires_grad=False)

    def forward_impl(self, input_ids):
        return self.table[input_ids.to(self.table.device)]


class LookupPle(TablePle):
    """The same table, declared a pure lookup: the offload process gathers its rows itself, and
    running forward_impl there for a step (beyond the handshake's probe) fails that step."""

    def lookup_table(self):
        return self.table

    def forward_impl(self, input_ids):
        if ple_ops.layer.role() == "worker":
            self.worker_calls = getattr(self, "worker_calls", 0) + 1
            if self.worker_calls > 1:
                raise AssertionError("the offload process ran forward_impl of a pure lookup")
        return super().forward_impl(input_ids)


class Block(nn.Module):
    def __init__(self, layer: int, dtype: torch.dtype, lookup: bool = False):
        super().__init__()
        gen = torch.Generator().manual_seed(layer)
        self.proj = nn.Linear(DIM, DIM, dtype=dtype)
        with torch.no_grad():
            self.proj.weight.copy_(torch.randn(DIM, DIM, generator=gen) / DIM**0.5)
            self.proj.bias.zero_()
        self.ple = (LookupPle if lookup else TablePle)(layer, dtype=dtype)

    def forward(self, hidden, input_ids):
        return torch.tanh(self.proj(hidden) + self.ple(hidden, input_ids))


class TinyModel(nn.Module):
    """Three blocks, each adding its layer's PLE rows to the hidden state."""

    def __init__(self, dtype: torch.dtype = torch.float32, lookup: bool = False):
        super().__init__()
        self.blocks = nn.ModuleList(Block(i, dtype, lookup) for i in range(LAYERS))

    def forward(self, hidden, input_ids):
        for block in self.blocks:
            hidden = block(hidden, input_ids)
        return hidden

    def release_offloaded(self):
        for block in self.blocks:
            block.ple.release_offloaded()


class DecodeStep(nn.Module):
    """A decode step whose graph also holds the flag resets (what a captured step looks like)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, hidden, input_ids):
        out = self.model(hidden, input_ids)
        self.model.release_offloaded()
        return out


def make_model():
    return TinyModel()


def make_bf16_model():
    return TinyModel(torch.bfloat16)


def make_lookup_model():
    return TinyModel(lookup=True)


def make_bf16_lookup_model():
    return TinyModel(torch.bfloat16, lookup=True)


def make_failing_model():
    """Builds, then fails on the first step with more than 5 tokens (forward_impl raises)."""
    model = TinyModel()

    def bad(input_ids, original=model.blocks[1].ple.forward_impl):
        if input_ids.shape[0] > 5:
            raise RuntimeError("table shard unavailable")
        return original(input_ids)

    model.blocks[1].ple.forward_impl = bad
    return model


def make_unbuildable_model():
    """Fails to build in the offload process (its weights are not there), so the start fails."""
    if ple_ops.layer.role() == "worker":
        raise FileNotFoundError("ple_shard_0.bin")
    return TinyModel()


def make_nothing():
    """A factory that forgot its return."""


def make_sleepy_model():
    """Every PLE layer takes about a millisecond, as a real one does: the offload process is then
    slower than the caller, and a call that does not wait for its rows shows it."""
    import time

    model = TinyModel()
    for block in model.blocks:

        def sleepy(input_ids, original=block.ple.forward_impl):
            time.sleep(1e-3)
            return original(input_ids)

        block.ple.forward_impl = sleepy
    return model


def make_slow_model():
    """Layer 1 takes 3 s on steps of more than 5 tokens: a window in which to kill the process."""
    import time

    model = TinyModel()

    def slow(input_ids, original=model.blocks[1].ple.forward_impl):
        if input_ids.shape[0] > 5:
            time.sleep(3)
        return original(input_ids)

    model.blocks[1].ple.forward_impl = slow
    return model


WIDE = 1 << 16  # floats per row of WidePle: rows so wide that few of them fill /dev/shm


class WidePle(ple_ops.PleOffloadLayer):
    """Wide rows computed from the ids, no table: a slot of many rows costs the worker nothing."""

    def forward_impl(self, input_ids):
        return input_ids.to(torch.float32)[:, None].expand(-1, WIDE).contiguous()


class WideModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.ple = WidePle()

    def forward(self, hidden, input_ids):
        return hidden + self.ple(hidden, input_ids)


def make_wide_model():
    return WideModel()


def signal_over_ipc(inbox, outbox):
    """Child of the CUDA-IPC test: receive a device flag, raise it from this process's stream."""
    flag = inbox.get()
    sem = ple_ops.CpuGpuSemaphore.from_ipc_tensor(flag)
    import time

    time.sleep(0.3)
    sem.signal()
    torch.cuda.synchronize()
    outbox.put("signalled")
    inbox.get()  # keep the CUDA IPC mapping until the parent is done
