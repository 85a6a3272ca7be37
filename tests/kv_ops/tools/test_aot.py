"""kv_ops.tools.aot: what compile_step refuses before anything is traced."""

import pytest
import torch

from kv_ops.tools import aot


def _step(model, x):
    return model(x)


@pytest.mark.parametrize("model", [lambda x: x, None, torch.zeros(2)], ids=["function", "None", "tensor"])
def test_compile_step_refuses_a_model_that_is_not_a_module_naming_its_type(model):
    with pytest.raises(ValueError, match=rf"^compile_step: model must be an nn.Module, got {type(model).__name__}$"):
        aot.compile_step(_step, model, torch.zeros(2))
