"""OffloadRuntime under random call sequences, on the CPU: never a hang, never wrong rows.

Rules: prepare (valid ids, out-of-vocabulary ids that fail in the offload process, invalid ids),
forward (eager ``rt.model``; a compiled step whose graph also holds the releases; with the
prepared token count or another), release, ``release(enqueue=False)``, a forward with no
prepare, check, close, and SIGKILL of the offload process; and whole transactions (prepare, a
chosen forward, a chosen release), so that few examples still reach deep sequences. The model's
layers take a millisecond each, like real ones: the offload process is slower than the caller.

Invariants: every call returns within ``step_timeout``; a forward returns exactly the local
model's rows (a local model from the same factory) or raises ``OffloadError``; what a call must
do is predicted from the model state below, and after a fatal event (kill, close) every call
raises.
"""

import os
import signal
import time
from contextlib import contextmanager
from dataclasses import dataclass

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, precondition, rule
from ple_models import DIM, LAYERS, VOCAB, make_model, make_sleepy_model

import ple_ops

TIMEOUT = 2.0  # the runtime's step_timeout, and the most any call may take
MAX_TOKENS = 8
NAMES = [f"blocks.{i}.ple" for i in range(LAYERS)]
LOCAL = make_model()


def ple_step(hidden, input_ids, out0, out1, out2):
    """A decode step over the PLE layers whose graph also releases them (what a captured step holds)."""
    n = input_ids.shape[0]
    outs = (out0, out1, out2)
    for name, out in zip(NAMES, outs):
        hidden = torch.tanh(hidden + ple_ops.wait_copy(out, hidden, n, name))
    for name, out in zip(NAMES, outs):
        ple_ops.release(out, name)
    return hidden


def ple_step_oracle(hidden, input_ids):
    for block in LOCAL.blocks:
        hidden = torch.tanh(hidden + block.ple.forward_impl(input_ids))
    return hidden


COMPILED = torch.compile(ple_step, fullgraph=True, backend="aot_eager", dynamic=True)


@pytest.fixture(scope="module", autouse=True)
def compiled_once():
    """Compile the step before the machine runs (against layers armed by hand, raised flags), for
    one token (specialised) and several (symbolic): no rule ever waits for a compilation."""
    layers = []
    for name in NAMES:
        flag = ple_ops.CpuGpuSemaphore.in_host_memory(torch.zeros(1, dtype=torch.int32), map_for_gpu=False)
        layers.append(ple_ops.ArmedLayer(name, flag, torch.zeros(MAX_TOKENS, DIM * 4, dtype=torch.uint8)))
        ple_ops.arm(layers[-1])
    try:
        outs = [torch.zeros(MAX_TOKENS, DIM) for _ in NAMES]
        for n in (1, 3):
            for layer in layers:
                layer.flag.host_signal()
            COMPILED(torch.zeros(n, DIM), torch.zeros(n, dtype=torch.long), *outs)
    finally:
        for name in NAMES:
            ple_ops.disarm(name)
    yield


ids_lists = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=MAX_TOKENS)
bad_ids_lists = st.lists(st.integers(0, VOCAB + 40), min_size=1, max_size=MAX_TOKENS).filter(
    lambda ids: max(ids) >= VOCAB
)


def invalid_ids(kind: str, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return {
        "float": torch.rand(3, generator=gen) * 10,
        "bool": torch.rand(4, generator=gen) > 0.5,
        "2-d": torch.randint(0, VOCAB, (2, 2), generator=gen),
        "empty": torch.zeros(0, dtype=torch.long),
        "too-many": torch.randint(0, VOCAB, (MAX_TOKENS + 1,), generator=gen),
    }[kind]


@dataclass
class Step:
    ids: torch.Tensor
    bad: bool  # an out-of-vocabulary id: the offload process fails the step
    reported: bool = False  # its error was raised by a forward already
    graph_released: bool = False  # a compiled step (whose graph releases) ran to the end


class RuntimeMachine(RuleBasedStateMachine):
    """Each rule is one call or a whole transaction; ``self.step`` predicts what a call must do."""

    def __init__(self):
        super().__init__()
        self.rt = ple_ops.OffloadRuntime(make_sleepy_model, max_tokens=MAX_TOKENS, device="cpu", step_timeout=TIMEOUT)
        self.dead = False
        self.step: Step | None = None
        self.calls = 0

    def teardown(self):
        self.rt.close()

    @contextmanager
    def bounded(self, limit: float = TIMEOUT):
        self.calls += 1
        start = time.monotonic()
        yield
        elapsed = time.monotonic() - start
        assert elapsed < limit, f"a call took {elapsed:.2f} s (limit {limit} s)"

    def raises(self, **match):
        return pytest.raises(ple_ops.OffloadError, **match)

    # --- the calls, each with its predicted outcome ----------------------------------------------

    def do_prepare(self, ids: list[int]) -> None:
        t = torch.tensor(ids)
        with self.bounded():
            if self.dead or self.step is not None:
                with self.raises():
                    self.rt.prepare(t)
                return
            self.rt.prepare(t)
        self.step = Step(t, bad=max(ids) >= VOCAB)

    def forward_inputs(self, seed: int, delta: int):
        gen = torch.Generator().manual_seed(seed)
        n = len(self.step.ids) if self.step is not None else 1 + seed % MAX_TOKENS
        m = min(max(n + delta, 1), MAX_TOKENS)
        if self.step is not None and m == n:
            ids = self.step.ids
        else:
            ids = torch.randint(0, VOCAB, (m,), generator=gen)
        return ids, torch.randn(m, DIM, generator=gen), m != n

    def expect_forward_error(self, other_count: bool) -> bool:
        s = self.step
        return self.dead or s is None or s.graph_released or other_count or s.bad

    def after_forward_error(self, error, other_count: bool) -> None:
        s = self.step
        if self.dead:
            assert error.fatal
        elif s is None:
            assert "prepare() was missing" in str(error) and not error.fatal
        elif s.graph_released:
            assert "already released" in str(error) and not error.fatal
        elif other_count:
            assert "tokens but the prepared step has" in str(error) and not error.fatal
        else:
            assert "out of bounds" in str(error) and not error.fatal
            s.reported = True

    def do_forward_eager(self, seed: int, delta: int = 0) -> None:
        ids, hidden, other_count = self.forward_inputs(seed, delta)
        with self.bounded():
            if self.expect_forward_error(other_count):
                with self.raises() as e:
                    self.rt.model(hidden, ids)
                self.after_forward_error(e.value, other_count)
            else:
                torch.testing.assert_close(self.rt.model(hidden, ids), LOCAL(hidden, ids), rtol=0, atol=0)

    def do_forward_compiled(self, seed: int) -> None:
        ids, hidden, _ = self.forward_inputs(seed, 0)
        outs = [block.ple.ple_out for block in self.rt.model.blocks]
        with self.bounded():
            if self.expect_forward_error(False):
                with self.raises() as e:
                    COMPILED(hidden, ids, *outs)
                self.after_forward_error(e.value, False)
            else:
                torch.testing.assert_close(
                    COMPILED(hidden, ids, *outs), ple_step_oracle(hidden, ids), rtol=1e-6, atol=1e-6
                )
                self.step.graph_released = True

    def do_release(self) -> None:
        s = self.step
        with self.bounded():
            if self.dead or (s is not None and s.bad and not s.reported):
                with self.raises(match="closed|died|out of bounds"):
                    self.rt.release()
            else:
                self.rt.release()
        self.step = None

    def do_release_without_enqueue(self) -> None:
        s = self.step
        with self.bounded():
            if self.dead or (s is not None and not (s.graph_released and not s.bad)):
                with self.raises(match="closed|died|enqueue=False"):
                    self.rt.release(enqueue=False)
            else:
                self.rt.release(enqueue=False)
        self.step = None

    # --- rules -----------------------------------------------------------------------------------

    @rule(
        ids=st.one_of(ids_lists, ids_lists, bad_ids_lists),
        forward=st.sampled_from(["none", "eager", "compiled", "eager+compiled", "other-count+eager", "eager+eager"]),
        release=st.sampled_from(["release", "release", "release(enqueue=False)", "none"]),
        seed=st.integers(0, 2**16),
    )
    def transaction(self, ids, forward, release, seed):
        self.do_prepare(ids)
        for i, what in enumerate(forward.split("+")):
            if what == "eager":
                self.do_forward_eager(seed + i)
            elif what == "compiled":
                self.do_forward_compiled(seed + i)
            elif what == "other-count":
                self.do_forward_eager(seed + i, delta=1 if seed % 2 else -1)
        if release == "release":
            self.do_release()
        elif release == "release(enqueue=False)":
            self.do_release_without_enqueue()

    @rule(ids=st.one_of(ids_lists, bad_ids_lists))
    def prepare(self, ids):
        self.do_prepare(ids)

    @rule(kind=st.sampled_from(["float", "bool", "2-d", "empty", "too-many"]), seed=st.integers(0, 2**16))
    def prepare_invalid(self, kind, seed):
        with self.bounded():
            if self.dead or self.step is not None:
                with self.raises():
                    self.rt.prepare(invalid_ids(kind, seed))
            else:
                with pytest.raises((TypeError, ValueError)):
                    self.rt.prepare(invalid_ids(kind, seed))

    @rule(seed=st.integers(0, 2**16), delta=st.sampled_from([0, 0, 0, -1, 1]))
    def forward_eager(self, seed, delta):
        self.do_forward_eager(seed, delta)

    @rule(seed=st.integers(0, 2**16))
    def forward_compiled(self, seed):
        self.do_forward_compiled(seed)

    @precondition(lambda self: self.step is None)
    @rule(seed=st.integers(0, 2**16))
    def forward_without_prepare(self, seed):
        ids, hidden, _ = self.forward_inputs(seed, 0)
        with self.bounded(0.5), self.raises() as e:
            self.rt.model(hidden, ids)
        assert e.value.fatal == self.dead

    @rule()
    def release(self):
        self.do_release()

    @rule()
    def release_without_enqueue(self):
        self.do_release_without_enqueue()

    @rule()
    def check(self):
        with self.bounded():
            if self.dead:
                with self.raises():
                    self.rt.check()
                with self.raises():
                    self.rt.served_steps()
            else:
                self.rt.check()
                assert self.rt.served_steps() >= 0

    # Fatal events only after a few calls: what comes before them is what they can break.
    @precondition(lambda self: self.calls >= 8)
    @rule()
    def close(self):
        with self.bounded():
            self.rt.close()
            self.rt.close()
        self.dead = True

    @precondition(lambda self: not self.dead and self.calls >= 8)
    @rule()
    def kill(self):
        os.kill(self.rt.process.pid, signal.SIGKILL)
        self.rt.process.join(10)
        self.dead = True


TestRuntimeMachine = RuntimeMachine.TestCase
TestRuntimeMachine.settings = settings(
    max_examples=8,
    stateful_step_count=12,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
