"""Helpers shared by the kernel tests: fresh random inputs, device copies, poisoned outputs, error checks, and the
real models' shapes (GPU only)."""

import math
import os

import numpy as np
import pytest

from course_lib.kernels import SIMULATOR, cuda
from course_lib.model.config import LLAMA_32_1B, SMOLLM2_135M

SEED = int(os.environ.get("KERNEL_TEST_SEED", "20261129"))
U32 = 2.0**-24  # unit roundoff of float32: a rounded operation errs by at most U32 * |exact result|

real_shapes = pytest.mark.skipif(SIMULATOR, reason="real shapes need a GPU")
REAL_MODELS = [pytest.param(SMOLLM2_135M, id="SmolLM2-135M"), pytest.param(LLAMA_32_1B, id="Llama-3.2-1B")]


def randn(rng, *shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def dev(x):
    return cuda.to_device(np.ascontiguousarray(x))


def poison(dtype):
    """What an unwritten element holds: NaN (float), 0xFFFF (uint16, bf16 bits: a NaN) or -7 (other integers)."""
    dtype = np.dtype(dtype)
    return np.nan if dtype.kind == "f" else 0xFFFF if dtype == np.uint16 else -7


def poisoned(shape, dtype=np.float32):
    """A device array full of poison(dtype): unwritten elements show up."""
    return dev(np.full(shape, poison(dtype), dtype))


def check(got, want, tol, what=""):
    """No NaN, and |got - want| <= tol elementwise (tol may be a scalar or an array); `what` prefixes failures."""
    got, what = np.asarray(got), f"{what}: " if what else ""
    assert not np.isnan(got).any(), f"{what}{np.isnan(got).sum()} NaN in the output (unwritten elements?)"
    err = np.abs(got.astype(np.float64) - want)
    excess = err - tol
    worst = np.unravel_index(np.argmax(excess), excess.shape)
    limit = np.broadcast_to(tol, err.shape)[worst]
    assert (excess <= 0).all(), f"{what}error {err[worst]:.3g} > tolerance {limit:.3g} at {worst}"


def logit_tolerance(config, max_abs_logit: float) -> float:
    """Two float32 forward passes of the same model that differ only in summation order: a dot product of length
    K rounded in float32 errs by about sqrt(K) u relatively (errors of random sign), and a pass chains 2 L + 1 such
    stages (attention and MLP of each layer, then the logits), each adding its own: sqrt(2L + 1) sqrt(K_max) u on
    the logit scale max|logit|. We allow 8 times that."""
    k_max = max(config.d_model, config.d_ff)
    return 8 * math.sqrt(2 * config.n_layers + 1) * math.sqrt(k_max) * U32 * max_abs_logit


def as_computed(model, weights: str):
    """The model whose reference run is the exact counterpart of a GPU run with `weights` ("f32", or "bf16": the
    reference on the weights rounded to bf16, as the GPU stores them)."""
    import dataclasses

    from course_lib.model.weights import round_to_bf16

    return model if weights == "f32" else dataclasses.replace(model, weights=round_to_bf16(model.weights))
