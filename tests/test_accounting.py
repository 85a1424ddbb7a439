"""The FLOP and byte accounting (course_lib.measure.accounting) against closed forms and the worked problems of
the transformer-anatomy chapter."""

import pytest

from course_lib.measure import accounting as acc
from course_lib.model.config import LLAMA_31_8B, SMOLLM2_135M, ModelConfig

LLAMA_70B = ModelConfig("llama", 128256, 8192, 80, 64, 8, 28672, 131072, 500000.0, 1e-5, False, False, "Llama-70B")


@pytest.mark.parametrize("c", [SMOLLM2_135M, LLAMA_31_8B], ids=lambda c: c.name)
def test_layer_costs_add_up_to_the_model(c):
    """The projections of a layer read the layer's matmul weights once; T tokens cost 2 T FLOPs per weight."""
    costs = acc.layer_costs(c, tokens=5, context=0, weight_bytes=2)
    weights = sum(cost.flops for name, cost in costs.items() if name != "attention") / (2 * 5)
    assert c.n_layers * weights + c.vocab_size * c.d_model == acc.matmul_params(c)
    assert costs["attention"].flops == 4 * c.d_model * (1 + 2 + 3 + 4 + 5)  # causal: token t sees t keys
    step = acc.layer_costs(c, tokens=1, context=99)
    assert step["attention"].flops == 4 * c.d_model * 100
    assert step["attention"].bytes == 100 * 2 * c.d_kv * 4 + 2 * c.d_model * 4


def test_attention_share_closed_forms():
    """Attention against the attention projections over the full square: 4 S^2 d / (4 S^2 d + 2 S (2 d^2 + 2 d
    d_kv)), the headline figures (about 10% at 512 tokens, 44% at 4k, 96% at 128k for d = 4096 and 8 KV heads of
    32); causal with the MLP counted, far lower (1% at 512, 7% at 4k)."""
    c, d, dkv, f = LLAMA_31_8B, LLAMA_31_8B.d_model, LLAMA_31_8B.d_kv, LLAMA_31_8B.d_ff
    for S in (512, 4096, 32768, 131072):
        headline = 4 * S * S * d / (4 * S * S * d + 2 * S * (2 * d * d + 2 * d * dkv))
        assert acc.attention_share(c, S, causal=False, mlp=False) == pytest.approx(headline, rel=1e-12)
        causal = 2 * d * S * (S + 1) / (2 * d * S * (S + 1) + 2 * S * (2 * d * d + 2 * d * dkv + 3 * d * f))
        assert acc.attention_share(c, S) == pytest.approx(causal, rel=1e-12)
    assert [round(100 * acc.attention_share(c, S, False, False)) for S in (512, 4096, 131072)] == [9, 44, 96]
    assert [round(100 * acc.attention_share(c, S)) for S in (512, 4096)] == [1, 7]


def test_70b_decoding_at_batch_32_is_memory_bound():
    """The chapter's problem: 70B in bf16, batch 32, context 8,192, bf16 cache: 139 GB of weights (the chapter
    rounds to 140) and 86 GB of
    cache per step for 4.5 TFLOP of matmuls (5.1 with attention): an intensity of about 20 to 23, far below the
    H100's ridge (~296): memory-bound despite the batch."""
    cost = acc.decode_cost(LLAMA_70B, 8192, weight_bytes=2, kv_bytes=2, batch=32)
    cache = 32 * 8193 * LLAMA_70B.kv_bytes_per_position(2)
    assert cache == pytest.approx(86e9, rel=0.01)
    assert cost.bytes - cache == pytest.approx(139e9, rel=0.01)
    matmuls = 2 * acc.matmul_params(LLAMA_70B) * 32
    assert matmuls / cost.bytes == pytest.approx(19.8, rel=0.01)  # the chapter: "about 20"
    assert 20 < cost.intensity < 25 < 296


def test_batch_raises_the_intensity_until_the_caches_dominate():
    c = SMOLLM2_135M
    short = [acc.decode_cost(c, 64, batch=b).intensity for b in (1, 8, 64)]
    assert short[0] < short[1] < short[2]
    one = acc.decode_cost(c, 0, batch=1)  # the new token's own keys and values are written (float32 cache)
    assert one.bytes == acc.weight_bytes_per_token(c, 2) + c.kv_bytes_per_position(4)
    assert one.flops == 2 * acc.matmul_params(c)
