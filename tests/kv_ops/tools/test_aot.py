"""kv_ops.tools.aot: what compile_step refuses before anything is traced, and what load_step refuses
before anything is opened or unpickled."""

import os
import pickle
import re

import pytest
import torch

from kv_ops.tools import aot


def _step(model, x):
    return model(x)


@pytest.mark.parametrize("model", [lambda x: x, None, torch.zeros(2)], ids=["function", "None", "tensor"])
def test_compile_step_refuses_a_model_that_is_not_a_module_naming_its_type(model):
    with pytest.raises(ValueError, match=rf"^compile_step: model must be an nn.Module, got {type(model).__name__}$"):
        aot.compile_step(_step, model, torch.zeros(2))


def test_compile_step_refuses_a_step_that_is_not_callable_before_tracing():
    with pytest.raises(ValueError, match=r"^compile_step: step must be a function taking the model first, got 'step'$"):
        aot.compile_step("step", torch.nn.Linear(2, 2), torch.randn(2, 2))


@pytest.mark.parametrize("path", [True, False, 0, 1, 123, None, b"step.aot", ""], ids=repr)
def test_load_step_refuses_what_is_not_a_path_before_opening_anything(path):
    # open() takes an int as a file descriptor: True is fd 1, which the with-block would close.
    with pytest.raises(ValueError) as info:
        aot.load_step(path)
    assert str(info.value) == f"load_step: path must be a path (a non-empty str or os.PathLike), got {path!r}"
    os.fstat(1)  # stdout still open
    os.fstat(0)


def test_load_step_refuses_a_directory_naming_it(tmp_path):
    with pytest.raises(ValueError, match=rf"^load_step: path '{re.escape(str(tmp_path))}' is a directory, not an"):
        aot.load_step(tmp_path)


def test_load_step_refuses_a_file_that_is_no_artifact_naming_it(tmp_path):
    data = bytearray(torch.randint(0, 256, (4096,), dtype=torch.uint8).numpy().tobytes())
    data[0] &= 0x7F  # no pickle protocol opcode: never mistaken for a pickle's start
    garbage = tmp_path / "garbage.aot"
    garbage.write_bytes(bytes(data))
    with pytest.raises(ValueError) as info:
        aot.load_step(str(garbage))
    assert str(info.value).startswith(
        f"load_step: path {str(garbage)!r} is not an artifact saved by compile_step(...).save_compiled_function ("
    )


def test_load_step_refuses_a_truncated_pickle_naming_it(tmp_path):
    whole = pickle.dumps({"compiled_fn": torch.randn(64).tolist()}, protocol=pickle.HIGHEST_PROTOCOL)
    cut = tmp_path / "cut.aot"
    cut.write_bytes(whole[: len(whole) // 2])
    with pytest.raises(ValueError, match=rf"^load_step: path '{re.escape(str(cut))}' is not an artifact saved by"):
        aot.load_step(cut)
