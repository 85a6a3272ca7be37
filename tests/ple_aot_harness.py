"""AOT save -> fresh-process load, for compile_tests/ple_ops/test_aot.py.

    python -m ple_aot_harness save PATH DESIGN DEVICE   # process A: aot_compile the decode step, save
    python -m ple_aot_harness load PATH DESIGN DEVICE   # process B: new offload process, load, compare

(from the repository root, with the root and tests/ on PYTHONPATH)

DESIGN is "name" (the ops resolve pointers by layer name: the product) or "raw" (a test-only op
that takes the slot address and row size as Python ints, as the reference once did). Process B
prints "MATCH" when the loaded artifact gives the eager result.
"""

import sys

import torch
from ple_models import make_model

import ple_ops
from ple_ops import registry

# --- the raw-pointer design, for contrast only -------------------------------------------------


@torch.library.custom_op("ple_test::wait_copy_raw", mutates_args=("out",), device_types="cpu")
def wait_copy_raw(out: torch.Tensor, dep: torch.Tensor, num_tokens: int, slot_address: int, row_bytes: int) -> None:
    # Refuse an address that is not a slot armed in *this* process instead of reading it: in a
    # process that loaded someone else's artifact it points at nothing (or at anything).
    live = {registry.lookup(n).slot.data_ptr() for n in registry.armed_names()}
    if slot_address not in live:
        raise RuntimeError(f"wait_copy_raw: slot address {slot_address:#x} is not armed in this process")
    layer = next(
        registry.lookup(n) for n in registry.armed_names() if registry.lookup(n).slot.data_ptr() == slot_address
    )
    layer.flag.host_wait(1, layer.check)
    out[:num_tokens].view(torch.uint8).copy_(layer.slot[:num_tokens])


@wait_copy_raw.register_fake
def _(out, dep, num_tokens, slot_address, row_bytes):
    pass


# --- the harness ---------------------------------------------------------------------------------

NAMES = [f"blocks.{i}.ple" for i in range(3)]


def step_by_name(hidden, input_ids, out0, out1, out2):
    """A decode step over the three PLE layers' buffers; the ops carry layer names."""
    for name, out in zip(NAMES, (out0, out1, out2)):
        hidden = torch.tanh(hidden + ple_ops.wait_copy(out, hidden, input_ids.shape[0], name))
    return hidden


# Python ints, as the reference kept them on its layers: (slot address, row bytes) per layer.
ADDRESSES: dict[str, tuple[int, int]] = {}


def step_by_address(hidden, input_ids, out0, out1, out2):
    """The same step with the slot address passed to the op as a Python int."""
    for name, out in zip(NAMES, (out0, out1, out2)):
        address, row_bytes = ADDRESSES[name]
        n = input_ids.shape[0]
        torch.ops.ple_test.wait_copy_raw(out, hidden, n, address, row_bytes)
        hidden = torch.tanh(hidden + out[:n])
    return hidden


def inputs(device):
    gen = torch.Generator().manual_seed(42)
    ids = torch.randint(0, 1000, (6,), generator=gen)
    return torch.randn(6, 64, generator=gen).to(device), ids.to(device)


def main(mode: str, path: str, design: str, device: str) -> None:
    if hasattr(torch._dynamo.config, "enable_aot_compile"):
        torch._dynamo.config.enable_aot_compile = True  # needed on torch <= 2.11
    step = step_by_name if design == "name" else step_by_address
    if mode == "load":
        shift = ple_ops.SharedHostBuffer(1 << 22)  # B's slots must not land where A's were, ASLR or not
        shift.unlink()
    with ple_ops.OffloadRuntime(make_model, max_tokens=16, device=device) as rt:
        hidden, ids = inputs(device)
        outs = [block.ple.ple_out for block in rt.model.blocks]
        ADDRESSES.update({n: (ple_ops.lookup(n).slot.data_ptr(), ple_ops.lookup(n).row_bytes) for n in NAMES})
        print("slot addresses:", [hex(ple_ops.lookup(n).slot.data_ptr()) for n in NAMES], flush=True)
        if mode == "save":
            compiled = torch.compile(step, fullgraph=True).aot_compile(((hidden, ids, *outs), {}))
            compiled.save_compiled_function(path)
            return
        with open(path, "rb") as f:
            loaded = torch.compiler.load_compiled_function(f)
        rt.prepare(ids)
        want = step(hidden, ids, *outs).clone()  # eager, in this process
        rt.release()
        for out in outs:
            out.fill_(float("nan"))  # poison: the loaded step must write them again
        rt.prepare(ids)
        got = loaded(hidden, ids, *outs)
        rt.release()
        if device == "cuda":
            torch.cuda.synchronize()
        print("MATCH" if torch.allclose(got, want, rtol=1e-5, atol=1e-5) else "MISMATCH", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:5])
