"""pinned_empty and device_view: exact sizes, real page-locking, and zero-copy aliasing."""

import subprocess
import sys
import warnings

import pytest
import torch

import kv_ops
from kv_ops.cuda import host_memory
from kv_ops.cuda.driver import driver as cuda_driver

gpu = pytest.mark.gpu


@pytest.mark.parametrize(
    "shape, dtype",
    [((3, 5000), torch.uint8), ((7,), torch.float32), ((0, 4), torch.uint8)],
    ids=["bytes-2d", "float-1d", "empty"],
)
def test_pinned_empty_has_exactly_the_requested_bytes(shape, dtype):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        t = kv_ops.pinned_empty(shape, dtype)
    assert tuple(t.shape) == shape and t.dtype == dtype and t.is_contiguous()
    assert t.untyped_storage().nbytes() == t.numel() * t.element_size()
    fill = torch.randint(0, 100, shape).to(dtype)
    t.copy_(fill)
    assert torch.equal(t, fill)


def test_pinned_empty_rejects_negative_sizes():
    with pytest.raises(ValueError, match=r"negative dimension in size \(4, -1\)"):
        kv_ops.pinned_empty((4, -1))


@pytest.mark.parametrize(
    "size, dtype, message",
    [
        ((True, 4), torch.uint8, r"size must be an integer or a sequence of integers, got \(True, 4\)"),
        ("abc", torch.uint8, "size must be an integer or a sequence of integers, got 'abc'"),
        (None, torch.uint8, "size must be an integer or a sequence of integers, got None"),
        (((2, 3),), torch.uint8, r"size must be an integer or a sequence of integers, got \(\(2, 3\),\)"),
        ((2, 3), "float32", r"dtype must be a torch.dtype \(e.g. torch.uint8\), got 'float32'"),
        ((2, 3), None, r"dtype must be a torch.dtype \(e.g. torch.uint8\), got None"),
    ],
    ids=["bool-dim", "string", "none", "nested", "dtype-name", "dtype-none"],
)
def test_pinned_empty_refuses_a_bad_size_or_dtype_naming_the_argument(size, dtype, message, monkeypatch):
    # Refused before anything is mapped: no mmap may be made.
    monkeypatch.setattr(host_memory.mmap, "mmap", lambda *a, **k: pytest.fail("mapped memory for a refused call"))
    with pytest.raises(ValueError, match=f"^pinned_empty: {message}$"):
        kv_ops.pinned_empty(size, dtype)


GIB = 1 << 30


def test_check_host_bytes_names_owner_argument_bytes_and_the_machine(monkeypatch):
    monkeypatch.setattr(host_memory, "host_memory_bytes", lambda: (3 * GIB, 8 * GIB))
    host_memory.check_host_bytes("OffloadEngine", "capacity_bytes", 3 * GIB)  # exactly what is there
    with pytest.raises(ValueError) as info:
        host_memory.check_host_bytes("OffloadEngine", "capacity_bytes", 5 * GIB)
    text = str(info.value)
    assert text.startswith("OffloadEngine: capacity_bytes asks for 5368709120 bytes (5.00 GiB)")
    assert "3221225472 bytes (3.00 GiB) available of 8589934592 bytes (8.00 GiB)" in text


@pytest.mark.parametrize("nbytes", [-1, True, 2.0, "8"])
def test_check_host_bytes_refuses_what_is_not_a_byte_count(nbytes):
    with pytest.raises(ValueError, match=r"OffloadEngine: capacity_bytes must be a byte count >= 0, got"):
        host_memory.check_host_bytes("OffloadEngine", "capacity_bytes", nbytes)


def test_host_memory_bytes_reads_meminfo_and_falls_back_to_sysconf(monkeypatch):
    available, total = host_memory.host_memory_bytes()
    assert 0 < available <= total

    def no_meminfo(*args, **kwargs):
        raise FileNotFoundError("/proc/meminfo")

    monkeypatch.setattr(host_memory, "open", no_meminfo, raising=False)
    pages = {"SC_PAGE_SIZE": 4096, "SC_AVPHYS_PAGES": 1000, "SC_PHYS_PAGES": 3000}
    monkeypatch.setattr(host_memory.os, "sysconf", pages.__getitem__)
    assert host_memory.host_memory_bytes() == (1000 * 4096, 3000 * 4096)


def test_pinned_empty_refuses_more_than_the_machine_has_before_mapping_anything(monkeypatch):
    monkeypatch.setattr(host_memory, "host_memory_bytes", lambda: (GIB, 2 * GIB))

    def no_mmap(*args):
        raise AssertionError("mapped memory after the size check should have refused it")

    monkeypatch.setattr(host_memory.mmap, "mmap", no_mmap)
    with pytest.raises(ValueError, match=r"pinned_empty: size \(100, 1073741824\) asks for 107374182400 bytes"):
        kv_ops.pinned_empty((100, GIB))


def test_pinned_empty_turns_a_refused_mapping_into_the_same_value_error(monkeypatch):
    # MemAvailable can promise more than a cgroup or the overcommit rules let one mmap take.
    monkeypatch.setattr(host_memory, "host_memory_bytes", lambda: (64 * GIB, 64 * GIB))

    def refused(*args):
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(host_memory.mmap, "mmap", refused)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ValueError, match=r"pinned_empty: size \(4, 1073741824\) asks .*Cannot allocate memory"):
            kv_ops.pinned_empty((4, GIB))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA fallback")
def test_without_cuda_pinned_empty_warns_once_and_returns_plain_memory(monkeypatch):
    monkeypatch.setattr(host_memory, "warned_no_cuda", False)
    with pytest.warns(RuntimeWarning, match="CUDA is not available"):
        a = kv_ops.pinned_empty(16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a second warning would raise here
        b = kv_ops.pinned_empty(16)
    assert a.device.type == b.device.type == "cpu" and not a.is_pinned()


def test_device_view_refuses_a_device_that_is_not_cuda_naming_it():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        host = kv_ops.pinned_empty(16)
    with pytest.raises(ValueError, match=r"^device_view: device must be a CUDA device, got 'cpu'"):
        kv_ops.device_view(host, "cpu")
    with pytest.raises(ValueError, match=r"^device_view: device must be a torch.device, a string or a CUDA index"):
        kv_ops.device_view(host, 1.5)


@pytest.mark.parametrize("kind", ["dict", "list"])
def test_device_view_of_several_tensors_says_it_takes_one_per_call(kind):
    host = torch.randint(0, 256, (4, 64), dtype=torch.uint8)
    value = {"layer0.0": host} if kind == "dict" else [host]
    with pytest.raises(
        ValueError, match=rf"^device_view takes one tensor \(host\), got {kind} with 1 entry; call it once per tensor"
    ):
        kv_ops.device_view(value)
    with pytest.raises(ValueError, match=r"^device_view takes one tensor \(host\), got None$"):
        kv_ops.device_view(None)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
def test_device_view_without_cuda_says_so_before_touching_the_driver():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        host = kv_ops.pinned_empty(16)
    with pytest.raises(ValueError, match=r"^device_view: device defaults to the current CUDA device, but this machine"):
        kv_ops.device_view(host)


@gpu
def test_pinned_empty_is_page_locked_and_not_rounded_up():
    nbytes = 100 * 4096 + 123  # far from a power of two
    t = kv_ops.pinned_empty(nbytes)
    assert t.is_pinned()
    assert t.untyped_storage().nbytes() == nbytes
    assert t.data_ptr() % 4096 == 0


@gpu
def test_device_view_aliases_host_memory_both_ways():
    host = kv_ops.pinned_empty((64, 1024))
    host.copy_(torch.randint(0, 256, host.shape, dtype=torch.uint8))
    view = kv_ops.device_view(host)
    assert view.device.type == "cuda" and view.shape == host.shape
    assert torch.equal(view.cpu(), host)  # the GPU reads host bytes
    fresh = torch.randint(0, 256, host.shape, dtype=torch.uint8, device="cuda")
    view.copy_(fresh)  # a GPU kernel writes through the view
    torch.cuda.synchronize()
    assert torch.equal(host, fresh.cpu())


@gpu
def test_memory_is_unregistered_when_the_last_view_dies():
    driver = cuda_driver()
    t = kv_ops.pinned_empty(1 << 20)
    view = t[10:20]
    address = t.data_ptr()
    del t
    assert view.is_pinned()  # a view keeps the registration alive
    del view
    import gc

    gc.collect()
    err, _ = driver.cuPointerGetAttribute(driver.CUpointer_attribute.CU_POINTER_ATTRIBUTE_DEVICE_POINTER, address)
    assert err != driver.CUresult.CUDA_SUCCESS


@gpu
def test_registration_in_chunks_serves_copies_across_chunk_boundaries(monkeypatch):
    # Shrink the chunk so that a small buffer needs six registrations, then move blocks that
    # straddle the chunk boundaries with the zero-copy kernel.
    monkeypatch.setattr(host_memory, "REGISTER_CHUNK_BYTES", 1 << 20)
    host = kv_ops.pinned_empty((11, 512 * 1024))  # 5.5 MiB: six pieces
    assert host.is_pinned() and host[-1].is_pinned()
    gpu_region = torch.randint(0, 256, (11, 512 * 1024), dtype=torch.uint8, device="cuda")
    ids = torch.arange(11, device="cuda")
    kv_ops.copy_blocks([gpu_region], [host], ids, ids.flip(0))
    torch.cuda.synchronize()
    assert torch.equal(host, gpu_region.flip(0).cpu())


@gpu
def test_memory_freed_while_a_graph_is_captured_is_released_later_never_left_registered():
    # A finalizer may run at any moment, a global-mode capture included, where the driver may
    # refuse the unregistration. The mapping must then stay (an unmapped, still registered range
    # makes the next allocation at that address fail "already registered") and be released by
    # a later pinned_empty. In a process of its own: a capture the driver invalidates leaves
    # torch's default CUDA generator in capture mode for the rest of the process (capture_end
    # raises before the generator's epilogue), and every later CUDA random draw would fail.
    code = """
import torch, kv_ops
from kv_ops.cuda import host_memory
kv_ops.pinned_empty(16)  # warm
doomed = kv_ops.pinned_empty(1 << 20)
doomed.fill_(7)
graph, side = torch.cuda.CUDAGraph(), torch.cuda.Stream()
with torch.cuda.stream(side):
    graph.capture_begin()  # global mode: unsafe calls from any thread are refused
    try:
        del doomed  # the last view: the finalizer unregisters, inside the capture
    finally:
        try:
            graph.capture_end()
        except RuntimeError:
            pass  # the refused call invalidated the (empty) capture
torch.cuda.synchronize()
fresh = [kv_ops.pinned_empty(1 << 20) for _ in range(16)]  # would reuse the freed addresses
assert host_memory._unreleased == [], host_memory._unreleased
for t in fresh:
    t.fill_(3)
    assert t.is_pinned()
    assert torch.equal(t.cuda().cpu(), t)
print("OK")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-4000:]
    assert out.stdout.strip().endswith("OK")


def exits_quietly(code: str) -> None:
    """``code`` run in a fresh interpreter prints OK, exits 0, and its shutdown prints nothing."""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "OK", out.stderr[-4000:]
    assert "Exception ignored" not in out.stderr and "Traceback" not in out.stderr, out.stderr[-4000:]


@gpu
def test_memory_alive_at_exit_leaves_the_process_quietly():
    # Real registrations still referenced at interpreter shutdown (a global, a reference cycle):
    # the process exits cleanly. These orders did not reach a finalizer with torn-down bindings
    # even before the shutdown guard; the order that does is the CPU test below.
    exits_quietly("""
import kv_ops
held = kv_ops.pinned_empty(1 << 20)
held.fill_(5)
cycle = [kv_ops.pinned_empty(4096)]
cycle.append(cycle)
print("OK")
""")


def test_a_registration_collected_after_the_modules_at_exit_leaves_the_process_quietly():
    # At exit the modules still alive have their globals cleared, the last imported first: this
    # module's ``sys`` and the driver bindings' functions are None by the time a registration
    # held by a module imported before them (here ``holder``) is collected. The registration
    # stands for one made on a GPU (one piece registered; the bindings as shutdown leaves them).
    exits_quietly("""
import sys, types
holder = types.ModuleType("holder")
sys.modules["holder"] = holder
from kv_ops.cuda import host_memory
reg = host_memory.HostRegistration(0, 0, register=False)
reg.registered, reg.drv = [1 << 21], types.SimpleNamespace(cuMemHostUnregister=None)
holder.reg = reg
del reg
sys.keep = (holder, host_memory)  # both alive until sys's own globals go, after every module's
print("OK")
""")
