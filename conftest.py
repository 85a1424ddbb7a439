"""The `gpu` marker: the tests that run the kernels, and the notebooks (`python -m pytest -m gpu`, the README's GPU
suite). Without a GPU the same tests run in the simulator, on tiny shapes. The notebooks and the slowest test files
are collected first: with one file per worker at a time (`--dist loadfile`), the longest start first and the short
ones fill in around them. On a GPU too: the kernels a file's tests share compile once, in its worker (spread test by
test, every worker compiles them again: data/h200_kernel_notes.md)."""

import pathlib

import pytest

GPU_SUITE = {"test_kernels.py", "test_paged.py", "test_cuda_backend.py", "test_paged_backend.py", "test_recipes.py",
             "test_tolerances.py", "test_generate.py", "test_kernel_cache.py", "test_cache_equality.py",
             "test_batch.py", "test_fused.py", "test_row_dot.py", "test_megakernel_kernel.py"}
# longest first, by their time in the simulator on CI's two cores (2026-12-07: test_kernels.py 9.8 minutes, its
# sm_90 compile 3.9 of them; test_megakernel_kernel.py 5.9, test_cuda_backend.py 5.2, test_recipes.py 3.1; the rest 2
# or less; 40 in all). pytest-xdist (--dist loadfile) gives a worker the next file of this order as the one it runs
# nears its end: the longest first, so that no long file starts late and ends alone
LONGEST_FIRST = ["test_kernels.py", "test_megakernel_kernel.py", "test_cuda_backend.py", "test_recipes.py",
                 "test_cache_equality.py", "test_batch.py", "02_narrow_matrices.ipynb", "test_hf_parity.py",
                 "07_many_sequences.ipynb", "06_launches.ipynb", "03_a_cache_that_no_longer_grows.ipynb",
                 "test_fused.py", "test_megakernel.py", "05_fused_operations.ipynb", "01_where_the_time_goes.ipynb",
                 "test_paged.py", "test_paged_backend.py", "test_tokenizer.py", "test_row_dot.py",
                 "04_flash_decoding.ipynb"]


def pytest_collection_modifyitems(items):
    for item in items:
        path = pathlib.Path(str(item.fspath))
        if path.suffix == ".ipynb" or path.name in GPU_SUITE:
            item.add_marker(pytest.mark.gpu)

    def rank(item):
        name = pathlib.Path(str(item.fspath)).name
        return LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST)

    items.sort(key=rank)  # stable: the order within a file is kept
