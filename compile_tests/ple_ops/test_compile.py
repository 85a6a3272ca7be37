"""PLE models under torch.compile(fullgraph=True) with a real offload process: no graph break,
the rows arrive (the result equals the local model's), and the flags are reset after release."""

import pytest
import torch
from ple_models import DecodeStep, make_model

import ple_ops
from ple_ops.semaphore import DONE, RESET


def flags(rt):
    return [ple_ops.lookup(name).flag.host_value() for name in ple_ops.armed_names()]


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("release_in_graph", [False, True], ids=["release-after", "release-in-graph"])
def test_compiled_steps_pull_the_rows_and_reset_the_flags(backend, release_in_graph):
    torch._dynamo.reset()
    local = make_model()
    with ple_ops.OffloadRuntime(make_model, max_tokens=32, device="cpu") as rt:
        fn = DecodeStep(rt.model) if release_in_graph else rt.model
        compiled = torch.compile(fn, backend=backend, fullgraph=True, dynamic=True)
        gen = torch.Generator().manual_seed(1)
        for n in (5, 9, 2, 17):
            ids = torch.randint(0, 1000, (n,), generator=gen)
            hidden = torch.randn(n, 64, generator=gen)
            rt.prepare(ids)
            out = compiled(hidden, ids)
            # Every layer's rows were waited for; a graph that holds the releases also reset them.
            assert flags(rt) == [RESET if release_in_graph else DONE] * 3
            rt.release(enqueue=not release_in_graph)
            assert flags(rt) == [RESET] * 3
            torch.testing.assert_close(out, local(hidden, ids), rtol=1e-5, atol=1e-5)
