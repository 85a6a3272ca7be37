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


@pytest.mark.parametrize("value", [-3, 0, 5, np.int64(-2)], ids=["-3", "0", "5", "int64"])
def test_integer_takes_either_sign_as_a_plain_int(value):
    got = arguments.integer("Owner", "n", value)
    assert got == int(value) and type(got) is int


@pytest.mark.parametrize(
    "value", [True, -2.0, "-2", None, torch.tensor(-2)], ids=["bool", "float", "str", "None", "tensor"]
)
def test_integer_refuses_what_is_not_an_integer_naming_owner_argument_and_value(value):
    with pytest.raises(ValueError, match=r"Owner: n must be an integer, got "):
        arguments.integer("Owner", "n", value)


@pytest.mark.parametrize("value", [[2, 0, 1], [1, 1, 1]], ids=["permutation", "repeats"])
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_rows_takes_a_1d_int32_or_int64_tensor_of_indices_within_the_count(value, dtype):
    tensor = torch.tensor(value, dtype=dtype)
    assert arguments.rows("Owner", "beam_idx", tensor, 3) is tensor


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (torch.tensor([0, 3, 1]), r"holds rows 0 to 3, outside \[0, 3\)$"),
        (torch.tensor([0, -2, 1]), r"holds rows -2 to 1, outside \[0, 3\)$"),
        (
            torch.tensor([0, 1]),
            r"1-D int32 or int64 tensor of 3 row indices, got a torch.int64 tensor of shape \(2,\) on cpu$",
        ),
        (torch.tensor([[0, 1, 2]]), r"got a torch.int64 tensor of shape \(1, 3\)"),
        (torch.tensor([0.0, 1.0, 2.0]), r"got a torch.float32 tensor"),
        (torch.tensor([0, 1, 2], dtype=torch.complex64), r"got a torch.complex64 tensor"),
        (torch.tensor([True, False, True]), r"got a torch.bool tensor"),
        (torch.tensor([0, 1, 2], dtype=torch.uint8), r"got a torch.uint8 tensor"),
        (torch.tensor([0, 1, 2], dtype=torch.int16), r"got a torch.int16 tensor"),
        ([0, 1, 2], r"got list with 3 entries$"),
        (np.array([0, 1, 2]), r"got array\(\[0, 1, 2\]\)$"),
    ],
    ids=["past", "negative", "short", "2-D", "float", "complex", "bool", "uint8", "int16", "list", "numpy"],
)
def test_rows_refuses_anything_else_naming_owner_and_argument(value, message):
    with pytest.raises(ValueError, match=rf"^Owner: beam_idx .*{message}"):
        arguments.rows("Owner", "beam_idx", value, 3)


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


@pytest.mark.parametrize("value", [[1], {"cpu": 0}, {1}], ids=["list", "dict", "set"])
def test_error_counter_refuses_an_unhashable_device_naming_it(value):
    import kv_ops

    # The fast path looks the device up in a dict first: an unhashable value was a TypeError there.
    with pytest.raises(ValueError, match=r"^kv_ops.error_counter: device must be a torch.device, a string or a CUDA"):
        kv_ops.error_counter(value)


# --- shapes, dtypes, file name parts and regions ----------------------------------------------------


@pytest.mark.parametrize(
    "value, expected",
    [(4, (4,)), (np.int64(3), (3,)), ((2, 5), (2, 5)), ([0, 7], (0, 7)), (torch.Size([6]), (6,))],
    ids=["int", "numpy-int", "tuple", "list", "size"],
)
def test_shape_takes_an_integer_or_a_sequence_of_integers(value, expected):
    got = arguments.shape("pinned_empty", "size", value)
    assert got == expected and all(type(d) is int for d in got)


@pytest.mark.parametrize("value", [(True, 4), True, "abc", None, ((2, 3),), 2.0, (2, 3.0), torch.tensor(3)])
def test_shape_refuses_what_is_not_a_shape_naming_owner_argument_and_value(value):
    with pytest.raises(ValueError) as info:
        arguments.shape("pinned_empty", "size", value)
    assert str(info.value) == f"pinned_empty: size must be an integer or a sequence of integers, got {value!r}"


def test_shape_refuses_a_negative_dimension():
    with pytest.raises(ValueError, match=r"^op: negative dimension in size \(4, -1\)$"):
        arguments.shape("op", "size", (4, -1))


@pytest.mark.parametrize("value", ["float32", None, np.float32, 4])
def test_dtype_refuses_what_is_not_a_torch_dtype(value):
    assert arguments.dtype("pinned_empty", "dtype", torch.bfloat16) is torch.bfloat16
    with pytest.raises(ValueError) as info:
        arguments.dtype("pinned_empty", "dtype", value)
    assert str(info.value) == f"pinned_empty: dtype must be a torch.dtype (e.g. torch.uint8), got {value!r}"


@pytest.mark.parametrize(
    "value, message",
    [
        (5, "disk_tag must be a non-empty string, got 5"),
        ("", "disk_tag must be a non-empty string, got ''"),
        ("a\0b", r"disk_tag goes into a file name and must not contain '\\x00', got 'a\\x00b'"),
        ("sub/dir", "disk_tag goes into a file name and must not contain '/', got 'sub/dir'"),
        ("../../up", "disk_tag goes into a file name and must not contain '/', got '../../up'"),
    ],
    ids=["int", "empty", "nul", "slash", "escape"],
)
def test_file_name_part_refuses_what_cannot_stand_inside_one_file_name(value, message):
    assert arguments.file_name_part("OffloadEngine", "disk_tag", "rank0.cuda1") == "rank0.cuda1"
    with pytest.raises(ValueError, match=f"^OffloadEngine: {message}$"):
        arguments.file_name_part("OffloadEngine", "disk_tag", value)


def test_byte_regions_takes_a_list_or_a_mapping_of_uint8_regions_in_order():
    gen = torch.Generator().manual_seed(11)
    a, b = (torch.randint(0, 256, (4, w), dtype=torch.uint8, generator=gen) for w in (48, 16))
    assert arguments.byte_regions("op", "regions", {"b": b, "a": a}) == [b, a]
    got = arguments.byte_regions("op", "regions", (a, b))
    assert len(got) == 2 and got[0] is a and got[1] is b


@pytest.mark.parametrize(
    "value, message",
    [
        (
            {"l0": torch.randn(2, 8, 4, 2, 8)},
            r"regions\['l0'\] must be a 2-D uint8 region .*got torch.float32 \(2, 8, 4, 2, 8\)",
        ),
        (
            [torch.randint(0, 256, (4,), dtype=torch.uint8)],
            r"regions\[0\] must be a 2-D uint8 region .*got torch.uint8 \(4,\)",
        ),
        ({"a": torch.randn(3, 4)}, r"regions\['a'\] must be a 2-D uint8 region .*got torch.float32 \(3, 4\)"),
        (
            [torch.randint(0, 256, (4, 8), dtype=torch.uint8), "x"],
            r"regions\[1\] must be a 2-D uint8 region tensor, got str",
        ),
        ([], r"regions must hold at least one region, got \[\]"),
        (None, "regions must be a list or mapping of uint8 regions, got None"),
        ("x", "regions must be a list or mapping of uint8 regions, got 'x'"),
        (
            torch.randint(0, 256, (8, 256), dtype=torch.uint8),
            r"regions must be a list or mapping of uint8 regions, got a torch.uint8 tensor of shape \(8, 256\) on cpu",
        ),
    ],
    ids=["caches", "1-d", "float-2d", "not-a-tensor", "empty", "none", "string", "one-tensor"],
)
def test_byte_regions_refuses_what_is_not_regions_naming_the_entry(value, message):
    with pytest.raises(ValueError, match=f"^kv_ops.block_bytes: {message}"):
        arguments.byte_regions("kv_ops.block_bytes", "regions", value)


def test_tensor_list_names_a_wrong_value_by_its_type_never_by_a_tensors_values():
    caches = {f"layer{i}": torch.randn(2, 16, 4, 2, 8).bfloat16() for i in range(2)}
    cases = [
        (caches, r"got dict with 2 entries; pass its tensors, list\(caches.values\(\)\)$"),
        ([caches["layer0"], None], r"got caches\[1\] = None$"),
        ([caches["layer0"], list(caches.values())], r"got caches\[1\] = list with 2 entries$"),
        (caches["layer0"], r"got a torch.bfloat16 tensor of shape \(2, 16, 4, 2, 8\) on cpu$"),
        (None, "got None$"),
    ]
    for value, message in cases:
        with pytest.raises(ValueError, match=f"^op: caches must be a list of tensors, {message}") as info:
            arguments.tensor_list("op", "caches", value)
        assert "tensor(" not in str(info.value)
    assert arguments.tensor_list("op", "caches", tuple(caches.values())) == list(caches.values())


@pytest.mark.parametrize("value", [True, False, np.bool_(True), np.bool_(False)], ids=repr)
def test_flag_takes_python_and_numpy_bools_as_bools(value):
    got = arguments.flag("op", "page_cache", value)
    assert type(got) is bool and got == bool(value)


@pytest.mark.parametrize("value", ["no", 1, 0, None, np.int64(1), torch.tensor(True)], ids=repr)
def test_flag_refuses_what_is_not_a_bool_naming_owner_argument_and_value(value):
    with pytest.raises(ValueError, match=r"^op: page_cache must be True or False, got "):
        arguments.flag("op", "page_cache", value)


@pytest.mark.parametrize("value", [torch.device("meta"), "meta"])
def test_error_count_refuses_a_device_without_a_counter_naming_it(value):
    import kv_ops

    for call in (kv_ops.error_count, kv_ops.error_counter, kv_ops.reset_error_count):
        owner = f"kv_ops.{call.__name__}"
        with pytest.raises(
            ValueError, match=f"^{owner}: device meta has no error counter; pass a CUDA device or the CPU"
        ):
            call(value)
    kv_ops.reset_error_count("cpu")
    assert kv_ops.error_count("cpu") == 0  # the CPU's counter still reads and resets


def test_path_takes_a_str_or_a_path_like_as_a_str(tmp_path):
    assert arguments.path("op", "path", str(tmp_path)) == str(tmp_path)
    got = arguments.path("op", "path", tmp_path / "x.aot")
    assert type(got) is str and got == str(tmp_path / "x.aot")


@pytest.mark.parametrize("value", [True, 0, 3, None, 1.5, b"x.aot", "", "a\0b"], ids=repr)
def test_path_refuses_what_is_not_a_path_naming_owner_argument_and_value(value):
    # An int would reach open() as a file descriptor: True is stdout.
    with pytest.raises(ValueError) as info:
        arguments.path("load_step", "path", value)
    assert str(info.value) == f"load_step: path must be a path (a non-empty str or os.PathLike), got {value!r}"
