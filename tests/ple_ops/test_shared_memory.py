"""SharedHostBuffer: a buffer that fails to come into being leaves no file in /dev/shm."""

import os

import pytest
import torch

import ple_ops


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no /dev/shm here")
@pytest.mark.skipif(torch.cuda.is_available(), reason="registration works where CUDA is")
def test_a_buffer_whose_registration_fails_leaves_no_file():
    # Page-locking needs CUDA: here it fails after the file was created, as a failed start of an
    # OffloadRuntime on a GPU device can, and the file must go with the failure.
    before = set(os.listdir("/dev/shm"))
    with pytest.raises((ValueError, RuntimeError)):
        ple_ops.SharedHostBuffer(4096, register=True)
    assert set(os.listdir("/dev/shm")) == before
