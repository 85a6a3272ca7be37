"""kv_ops.cuda.arguments: the count and device rules every entry point of both packages shares."""

import numpy as np
import pytest
import torch

from kv_ops.cuda import arguments

NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
gpu = pytest.mark.gpu


@pytest.mark.parametrize("value", [1, 7, np.int64(3), np.int32(1 << 20)], ids=["1", "7", "int64", "int32"])
def test_positive_int_returns_a_plain_int(value):
    got = arguments.positive_int("OffloadEngine", "num_blocks", value)
    assert type(got) is int and got == int(value)


@pytest.mark.parametrize("value", [True, False, 2.0, 0, -1, "3", None, np.float64(2.0)])
def test_positive_int_refuses_what_is_not_a_count_naming_owner_argument_and_value(value):
    with pytest.raises(ValueError) as info:
        arguments.positive_int("OffloadEngine", "num_blocks", value)
    assert str(info.value) == f"OffloadEngine: num_blocks must be a positive integer, got {value!r}"


def test_device_cpu_and_none_without_cuda():
    assert arguments.device("op", "cpu") == torch.device("cpu")
    assert arguments.device("op", torch.device("cpu")) == torch.device("cpu")
    expected = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    assert arguments.device("op", None) == expected


@NO_CUDA
@pytest.mark.parametrize("value", ["cuda", "cuda:0", torch.device("cuda"), 0])
def test_device_refuses_cuda_where_there_is_none_naming_owner_and_value(value):
    with pytest.raises(ValueError) as info:
        arguments.device("kv_ops.error_counter", value)
    text = str(info.value)
    assert text.startswith(f"kv_ops.error_counter: device is {value!r}, but this machine has no CUDA device")


@pytest.mark.parametrize("value", ["gpu0", "cuda:x", ""])
def test_device_refuses_a_string_that_is_no_device(value):
    with pytest.raises(ValueError, match=rf"^pin_mapping: host {value!r} is not a device"):
        arguments.device("pin_mapping", value, "host")


@pytest.mark.parametrize("value", [True, 1.0, [0], object()], ids=["bool", "float", "list", "object"])
def test_device_refuses_other_types(value):
    with pytest.raises(ValueError, match=r"^op: device must be a torch.device, a string or a CUDA index, got"):
        arguments.device("op", value)


@NO_CUDA
def test_cuda_device_without_cuda_refuses_none_and_cpu():
    with pytest.raises(ValueError, match=r"^device_view: device defaults to the current CUDA device, but this machine"):
        arguments.cuda_device("device_view", None)
    with pytest.raises(ValueError, match=r"^device_view: device is 'cuda', but this machine has no CUDA device"):
        arguments.cuda_device("device_view", "cuda")
    with pytest.raises(ValueError, match=r"^device_view: device must be a CUDA device, got 'cpu'"):
        arguments.cuda_device("device_view", "cpu")


@gpu
def test_cuda_device_resolves_the_index_and_refuses_one_past_the_last():
    current = torch.cuda.current_device()
    assert arguments.cuda_device("op", None) == torch.device("cuda", current)
    assert arguments.cuda_device("op", "cuda") == torch.device("cuda", current)
    assert arguments.cuda_device("op", 0) == torch.device("cuda", 0)
    assert arguments.device("op", torch.device("cuda", 0)) == torch.device("cuda", 0)
    count = torch.cuda.device_count()
    with pytest.raises(ValueError, match=rf"^op: device is {count}, but this machine has {count} CUDA device"):
        arguments.cuda_device("op", count)
    with pytest.raises(ValueError, match=r"^op: device must be a CUDA device, got 'cpu'"):
        arguments.cuda_device("op", "cpu")


def test_error_counter_takes_its_device_through_the_shared_rule():
    import kv_ops

    cpu = kv_ops.error_counter("cpu")
    assert kv_ops.error_counter(torch.device("cpu")) is cpu
    if not torch.cuda.is_available():
        assert kv_ops.error_counter(None) is cpu
        with pytest.raises(ValueError, match=r"^kv_ops.error_counter: device is 'cuda', but this machine has no CUDA"):
            kv_ops.error_counter("cuda")
    with pytest.raises(ValueError, match=r"^kv_ops.error_counter: device 'tpu:x' is not a device"):
        kv_ops.error_counter("tpu:x")
