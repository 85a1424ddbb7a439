"""The tolerance the backends are held to (checks.logit_tolerance) is tight enough to catch real bugs.

Each fault below is one a GPU forward pass could plausibly have; it is injected into the NumPy reference, and the
faulty logits must differ from the right ones by more than the tolerance that test_cuda_backend allows the kernels
(the old bound, 1e-3 of the largest logit, let the RMSNorm epsilon fault through).
"""

import dataclasses

import numpy as np
import pytest
from checks import logit_tolerance

from course_lib import reference as R


def last_logits(model, ids, config=None, rope_swap=False, drop=None, skip_position=False):
    """Logits [V] of the last of ids: a prefill of ids[:-1], then one decode step, with one fault injected."""
    config = config or model.config
    cache, (cos, sin) = R.KVCache(config, len(ids) + 1), R.rope_tables(config, len(ids) + 1)
    if rope_swap:  # the decode step pairs one rotation frequency with the next one's angle
        cos, sin = cos.copy(), sin.copy()
        cos[:, [1, 2]], sin[:, [1, 2]] = cos[:, [2, 1]], sin[:, [2, 1]]
    R.forward(model.weights, config, ids[:-1], cache, R.rope_tables(config, len(ids) + 1))
    if skip_position:  # the new token written one row too far, at position p + 1, seeing an empty row at p
        cache.length += 1
    original = attention = R.attention
    if drop is not None:  # flash-decoding's merge forgetting one chunk of keys
        def attention(q, k, v, positions):
            keep = np.ones(k.shape[0], bool)
            keep[drop] = False
            return original(q, k[keep], v[keep], positions - (~keep[:positions[0] + 1]).sum())
    R.attention = attention
    try:
        return R.forward(model.weights, config, ids[-1:], cache, (cos, sin))
    finally:
        R.attention = original


@pytest.mark.parametrize("fault", ["rms_eps x3", "rope pair swapped", "position off by one", "a chunk dropped"])
@pytest.mark.parametrize("flavour", ["tiny", "tiny_qwen"])
def test_injected_faults_exceed_the_tolerance(request, flavour, fault):
    model = request.getfixturevalue(flavour)
    c = model.config
    ids = np.random.default_rng(5).integers(0, c.vocab_size, 40)
    good = last_logits(model, ids)
    kw = {"rms_eps x3": dict(config=dataclasses.replace(c, rms_eps=3 * c.rms_eps)),
          "rope pair swapped": dict(rope_swap=True), "position off by one": dict(skip_position=True),
          "a chunk dropped": dict(drop=slice(16, 32))}[fault]
    bad = last_logits(model, ids, **kw)
    assert np.abs(bad - good).max() > logit_tolerance(c, np.abs(good).max())
