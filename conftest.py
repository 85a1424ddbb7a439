"""The `gpu` marker: the tests that run the kernels, and the notebooks (`python -m pytest -m gpu`, the README's GPU
suite). Without a GPU the same tests run in the simulator, on tiny shapes."""

import pathlib

import pytest

GPU_SUITE = {"test_kernels.py", "test_paged.py", "test_cuda_backend.py", "test_paged_backend.py", "test_recipes.py",
             "test_tolerances.py", "test_generate.py", "test_kernel_cache.py",
             "test_batch.py", "test_fused.py"}


def pytest_collection_modifyitems(items):
    for item in items:
        path = pathlib.Path(str(item.fspath))
        if path.suffix == ".ipynb" or path.name in GPU_SUITE:
            item.add_marker(pytest.mark.gpu)
