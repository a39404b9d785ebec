"""pytest set-up for the dsv4 package: run by ctest (python_tests) with PYTHONPATH=<build>/python,
or by hand: PYTHONPATH=build/python /usr/bin/python3 -m pytest tests/python."""
import numpy as np
import pytest

import dsv4


@pytest.fixture(scope="session")
def tiny():
    config = dsv4.Config.preset("tiny-v4.1")
    return config, dsv4.Weights.random(config, seed=1)


@pytest.fixture
def rng():
    return np.random.default_rng(0)


def torch_or_skip():
    return pytest.importorskip("torch", reason="torch is not installed (Debian: python3-torch)")


def cuda_or_skip():
    torch = torch_or_skip()
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    if not dsv4.has_cuda:
        pytest.skip("dsv4 was built without CUDA")
    return torch
