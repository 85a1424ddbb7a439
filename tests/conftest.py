import pytest

import course_lib


@pytest.fixture(scope="session")
def smollm():
    """The real SmolLM2-135M-Instruct (fetched and converted once into the cache)."""
    return course_lib.load_model()


@pytest.fixture(scope="session")
def tiny():
    return course_lib.tiny_model()


@pytest.fixture(scope="session")
def tiny_qwen():
    """Qwen2 flavour: QKV bias, untied output head."""
    return course_lib.tiny_model("qwen2", tied=False, seed=1)
