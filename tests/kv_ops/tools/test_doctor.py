"""python -m kv_ops.tools.doctor: a clean report without a GPU, the O_DIRECT probe leaves nothing behind,
/dev/shm against a plan, and on a GPU every CUDA check passes with a measured link."""

import argparse
import errno
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kv_ops.tools import doctor

gpu = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[3]


def run_doctor(*args, hide_gpus=False):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    if hide_gpus:
        env["CUDA_VISIBLE_DEVICES"] = ""  # the no-GPU report, on any machine
    return subprocess.run(
        [sys.executable, "-m", "kv_ops.tools.doctor", *map(str, args)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def report_lines(stdout):
    """{check name: (status, detail)} from the printed table."""
    rows = {}
    for line in stdout.splitlines():
        m = re.match(r"^(\S.*?)\s{2,}(ok|warn|fail|skip)\s{2,}(.*)$", line)
        if m:
            rows[m.group(1)] = (m.group(2), m.group(3))
    return rows


def test_without_a_gpu_the_cuda_checks_skip_and_the_host_checks_run(tmp_path):
    out = run_doctor("--dir", tmp_path, "--ple-bytes", "1M", hide_gpus=True)
    assert "Traceback" not in out.stdout + out.stderr
    assert out.returncode == 0, out.stdout + out.stderr
    rows = report_lines(out.stdout)
    for name in doctor.CUDA_CHECKS:
        assert rows[name] == ("skip", "no CUDA device (torch.cuda.is_available() is False)"), out.stdout
    status, detail = rows[f"O_DIRECT {tmp_path}"]
    if status == "ok":
        assert detail.startswith("4 KiB aligned O_DIRECT write and read back"), out.stdout
    else:  # a file system without O_DIRECT
        assert (status, detail) == ("warn", "no O_DIRECT here: pass page_cache=True to OffloadEngine"), out.stdout
    assert rows["/dev/shm"][0] == "ok" and "PLE needs 1.0 MiB" in rows["/dev/shm"][1]
    assert re.search(r"^\d+ ok, \d+ warn, 0 fail, 5 skip$", out.stdout, re.M)
    assert list(tmp_path.iterdir()) == []


def test_a_failed_check_makes_the_exit_status_1_without_a_traceback(tmp_path):
    missing = tmp_path / "missing"
    out = run_doctor("--dir", missing, hide_gpus=True)
    assert out.returncode == 1 and "Traceback" not in out.stdout + out.stderr
    assert report_lines(out.stdout)[f"O_DIRECT {missing}"] == ("fail", f"{missing} does not exist")
    assert f"fix: mkdir -p {missing}" in out.stdout
    assert not missing.exists()


def test_a_bad_size_is_a_usage_error_not_a_traceback():
    out = run_doctor("--ple-bytes", "lots", hide_gpus=True)
    assert out.returncode == 2 and "Traceback" not in out.stderr and "not a size: 'lots'" in out.stderr


@pytest.mark.parametrize(
    "text, value", [("0", 0), ("4096", 4096), ("8G", 8 << 30), ("512MiB", 512 << 20), ("1.5k", 1536)]
)
def test_ple_bytes_accepts_binary_suffixes(text, value):
    assert doctor.parse_bytes(text) == value


@pytest.mark.parametrize("text", ["0.5", "0.0001k", "1.3"])
def test_ple_bytes_refuses_a_fraction_of_a_byte_instead_of_flooring_it(text):
    # 0.5 floored to 0, which the report shows as "no plan passed".
    with pytest.raises(argparse.ArgumentTypeError, match=rf"^not a whole number of bytes: {re.escape(repr(text))}"):
        doctor.parse_bytes(text)


def refused_by_main(argv, monkeypatch, capsys):
    """``main(argv)``'s usage error, with no check run: stderr."""
    monkeypatch.setattr(doctor, "run_checks", lambda *a, **k: pytest.fail("a check ran"))
    with pytest.raises(SystemExit) as info:
        doctor.main(argv)
    out = capsys.readouterr()
    assert info.value.code == 2 and out.out == "" and "Traceback" not in out.err, out
    return out.err


@pytest.mark.parametrize(
    "value, message",
    [
        ("banana", "value 'banana' is not a device ("),
        ("-1", "value -1 is not a device (Device index must not be negative)"),
        ("cpu", "value must be a CUDA device, got 'cpu'"),
    ],
)
def test_a_device_that_is_no_cuda_device_is_a_usage_error(value, message, monkeypatch, capsys):
    assert f"error: argument --device: {message}" in refused_by_main(["--device", value], monkeypatch, capsys)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
@pytest.mark.parametrize("value", ["cuda:0", "0"])
def test_a_cuda_device_on_a_machine_without_one_says_so(value, monkeypatch, capsys):
    err = refused_by_main(["--device", value], monkeypatch, capsys)
    assert "but this machine has no CUDA device (torch.cuda.is_available() is False)" in err
    assert "leave --device out for the report of a machine without CUDA" in err


@pytest.mark.parametrize("argv", [["--ple-bytes", "0.5"], ["--dir", ""], ["--dir", "/tmp", ""]])
def test_a_fractional_size_or_an_empty_directory_is_a_usage_error(argv, monkeypatch, capsys):
    err = refused_by_main(argv, monkeypatch, capsys)
    assert "not a whole number of bytes: '0.5'" in err or "argument --dir: an empty directory name" in err


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"dirs": "/tmp"}, "dirs must be a list of directories, got '/tmp' (one directory: ['/tmp'])"),
        ({"dirs": ["/tmp", ""]}, "dirs[1] must be a path (a non-empty str or os.PathLike), got ''"),
        ({"dirs": [None]}, "dirs[0] must be a path (a non-empty str or os.PathLike), got None"),
        ({"ple_bytes": True}, "ple_bytes must be an integer >= 0, got True"),
        ({"ple_bytes": 1.5}, "ple_bytes must be an integer >= 0, got 1.5"),
        ({"ple_bytes": "1G"}, "ple_bytes must be an integer >= 0, got '1G'"),
        ({"ple_bytes": -5}, "ple_bytes must be an integer >= 0, got -5"),
        ({"seconds": -1}, "seconds must be a finite number of seconds > 0, got -1"),
        ({"device": "banana"}, "device 'banana' is not a device ("),
        ({"device": "cpu"}, "device must be a CUDA device, got 'cpu'"),
    ],
    ids=repr,
)
def test_run_checks_refuses_a_bad_argument_before_any_check_runs(kwargs, message, monkeypatch):
    # A string for dirs was read as its characters: "/" among them, where the probe file went.
    ran = []
    monkeypatch.setattr(doctor, "check_shm", lambda *a: ran.append("shm"))
    monkeypatch.setattr(doctor, "check_o_direct", lambda *a: ran.append("o_direct"))
    with pytest.raises(ValueError) as info:
        doctor.run_checks(**kwargs)
    assert str(info.value).startswith(f"run_checks: {message}") and ran == []


def test_run_checks_takes_path_like_directories(tmp_path):
    results = doctor.run_checks(dirs=[tmp_path])
    assert [r.name for r in results if r.name.startswith("O_DIRECT")] == [f"O_DIRECT {tmp_path}"]
    assert list(tmp_path.iterdir()) == []


def test_the_storage_checks_refuse_an_empty_directory_and_a_size_that_is_no_integer():
    # An empty directory name put the probe file in the working directory.
    with pytest.raises(ValueError, match=r"^check_o_direct: directory must be a path .*got ''$"):
        doctor.check_o_direct("")
    with pytest.raises(ValueError, match=r"^check_shm: ple_bytes must be an integer >= 0, got True$"):
        doctor.check_shm(True)


def test_o_direct_check_writes_reads_and_removes_its_file(tmp_path):
    (tmp_path / "keep").write_bytes(b"x")  # a file already there stays, and is the only one
    r = doctor.check_o_direct(str(tmp_path))
    assert r.name == f"O_DIRECT {tmp_path}"
    if r.status == "ok":
        assert r.detail.startswith("4 KiB aligned O_DIRECT write and read back") and r.fix is None
    else:  # a file system without O_DIRECT (older tmpfs) must say how to proceed
        assert (r.status, r.detail) == ("warn", "no O_DIRECT here: pass page_cache=True to OffloadEngine")
        assert "page_cache=True" in r.fix
    assert [p.name for p in tmp_path.iterdir()] == ["keep"]


def test_o_direct_check_reports_a_missing_directory_clearly(tmp_path):
    missing = tmp_path / "no" / "such"
    r = doctor.check_o_direct(str(missing))
    assert (r.status, r.detail) == ("fail", f"{missing} does not exist")
    assert r.fix.startswith(f"mkdir -p {missing}")
    assert not missing.exists()


@pytest.mark.parametrize("where", ["open", "pwrite"])
def test_einval_means_no_o_direct_and_leaves_no_file(tmp_path, monkeypatch, where):
    real = getattr(os, where)
    calls = []

    def refuse(*args, **kwargs):
        calls.append(args)
        if where == "open" and not args[1] & os.O_DIRECT:
            return real(*args, **kwargs)
        raise OSError(errno.EINVAL, "Invalid argument")

    monkeypatch.setattr(os, where, refuse)
    r = doctor.check_o_direct(str(tmp_path))
    monkeypatch.undo()
    assert calls, "the probe never reached the patched call"
    assert (r.status, r.detail) == ("warn", "no O_DIRECT here: pass page_cache=True to OffloadEngine")
    assert f"disk_dir={str(tmp_path)!r}, page_cache=True" in r.fix
    assert list(tmp_path.iterdir()) == []


def test_ple_bytes_beyond_the_free_space_of_dev_shm_fail_with_the_fix():
    st = os.statvfs("/dev/shm")
    free = st.f_bavail * st.f_frsize
    r = doctor.check_shm(free + (1 << 30))
    assert r.status == "fail" and r.name == "/dev/shm"
    assert r.detail.startswith("PLE needs ") and "free of" in r.detail
    assert "docker run --shm-size=" in r.fix and "mount -o remount,size=" in r.fix
    need = int(re.search(r"at least (\d+) GiB", r.fix).group(1))
    assert need << 30 >= free + (1 << 30)  # the suggested size holds the plan


def test_ple_bytes_that_fit_are_ok_and_zero_only_reports(tmp_path):
    assert doctor.check_shm(4096, str(tmp_path)).status == "ok"
    r = doctor.check_shm(0)
    assert r.status == "ok" and "free of" in r.detail and r.fix is None
    missing = doctor.check_shm(0, str(tmp_path / "nope"))
    assert missing.status == "warn" and "mount -t tmpfs" in missing.fix


def test_a_check_that_raises_becomes_a_fail_line(monkeypatch):
    def broken(ple_bytes):
        raise OSError(errno.EIO, "statvfs exploded")

    monkeypatch.setattr(doctor, "check_shm", broken)
    results = doctor.run_checks(ple_bytes=0, dirs=[])
    shm = [r for r in results if r.name == "/dev/shm"]
    assert shm == [doctor.CheckResult("/dev/shm", "fail", "OSError: [Errno 5] statvfs exploded")]
    report = doctor.format_report(results)
    assert "Traceback" not in report and re.search(r"^/dev/shm\s+fail\s+OSError", report, re.M)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA path of measure_link")
def test_measure_link_without_cuda_raises_a_clear_error():
    with pytest.raises(RuntimeError, match=r"measure_link: no CUDA device"):
        doctor.measure_link()


@gpu
def test_on_a_gpu_every_cuda_check_passes_and_the_link_moves_bytes(tmp_path):
    out = run_doctor("--dir", tmp_path)
    assert "Traceback" not in out.stdout + out.stderr
    assert out.returncode == 0, out.stdout + out.stderr
    rows = report_lines(out.stdout)
    for name in doctor.CUDA_CHECKS:
        assert rows[name][0] == "ok", out.stdout
    m = re.search(r"host to GPU ([\d.]+) GB/s, GPU to host ([\d.]+) GB/s", rows["PCIe link"][1])
    assert m and float(m.group(1)) > 1 and float(m.group(2)) > 1, out.stdout
    assert list(tmp_path.iterdir()) == []
    link = doctor.measure_link(seconds=0.2)
    assert link.h2d_gbps > 1 and link.d2h_gbps > 1
