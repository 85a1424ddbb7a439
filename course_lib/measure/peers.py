"""PyTorch peers: a minimal Llama decoder of the same shapes, timed in the same run as the course's recipes.

What a practitioner would write in sixty lines, in the spirit of gpt-fast: bf16 weights (random: only the time
matters), a static KV cache [layers, B, Hkv, max_len, hd] for a batch of B sequences, attention by
scaled_dot_product_attention over the whole cache with a mask of each row's visible positions (fixed shapes), greedy
argmax on the device. Three ways to run a step: eager; one step captured in a torch.cuda.CUDAGraph and replayed;
torch.compile, then captured the same way.
"""

from __future__ import annotations

import math
import time


def decoder(torch, config, max_len: int, dtype=None, batch: int = 1):
    """step(token [B] int64, pos [B] int64) -> the next token [B] int64 of each of the B = batch sequences
    (greedy), writing the cache in place."""
    c, dev = config, "cuda"
    dtype = dtype or torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)

    def mat(n_in, n_out):
        return (torch.randn(n_in, n_out, device=dev, generator=g) / math.sqrt(n_in)).to(dtype)

    d, hd, H, Hkv = c.d_model, c.head_dim, c.n_heads, c.n_kv_heads
    embed = (torch.randn(c.vocab_size, d, device=dev, generator=g)).to(dtype)
    layers = [dict(attn_norm=torch.ones(d, device=dev, dtype=dtype), wqkv=mat(d, (H + 2 * Hkv) * hd),
                   wo=mat(H * hd, d), mlp_norm=torch.ones(d, device=dev, dtype=dtype), w_gate_up=mat(d, 2 * c.d_ff),
                   w_down=mat(c.d_ff, d)) for _ in range(c.n_layers)]
    final_norm = torch.ones(d, device=dev, dtype=dtype)
    k_cache = torch.zeros(c.n_layers, batch, Hkv, max_len, hd, device=dev, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    inv_freq = c.rope_theta ** (-torch.arange(0, hd, 2, device=dev, dtype=torch.float64) / hd)
    angles = torch.arange(max_len, device=dev, dtype=torch.float64)[:, None] * inv_freq[None]
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    span, rows = torch.arange(max_len, device=dev), torch.arange(batch, device=dev)

    def rms(x, w):
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + c.rms_eps)).to(dtype) * w

    def rope(x, pos):  # x [B, heads, 1, hd]; Hugging Face pairing (i, i + hd/2)
        a, b = x[..., : hd // 2], x[..., hd // 2:]
        co, si = cos[pos][:, None, None, :], sin[pos][:, None, None, :]
        return torch.cat([a * co - b * si, a * si + b * co], -1)

    def step(token, pos):
        x = embed[token]  # [B, d]
        visible = (span[None, :] <= pos[:, None])[:, None, None, :]  # [B, 1, 1, max_len]
        for i, lw in enumerate(layers):
            q, k, v = (rms(x, lw["attn_norm"]) @ lw["wqkv"]).split([H * hd, Hkv * hd, Hkv * hd], -1)
            q = rope(q.view(batch, 1, H, hd).transpose(1, 2), pos)
            k = rope(k.view(batch, 1, Hkv, hd).transpose(1, 2), pos)
            k_cache[i][rows, :, pos] = k[:, :, 0]  # row b's key at its position
            v_cache[i][rows, :, pos] = v.view(batch, Hkv, hd)
            a = torch.nn.functional.scaled_dot_product_attention(q, k_cache[i], v_cache[i], attn_mask=visible,
                                                                 enable_gqa=True)
            x = x + a.transpose(1, 2).reshape(batch, H * hd) @ lw["wo"]
            gate, up = (rms(x, lw["mlp_norm"]) @ lw["w_gate_up"]).chunk(2, -1)
            x = x + (torch.nn.functional.silu(gate) * up) @ lw["w_down"]
        logits = rms(x, final_norm) @ embed.T
        return logits.argmax(-1)

    return step


def tokens_per_s(torch, config, steps: int = 200, max_len: int = 512, modes=("eager", "graph", "compile+graph"),
                 context: int = 64, batch: int = 1) -> dict[str, float]:
    """{mode: decode tokens/s}: `steps` greedy steps after position `context`, bf16; with batch B, B sequences
    decoded together and every one of their tokens counted (aggregate throughput)."""
    return {mode: batch * _steps_per_s(torch, config, mode, steps, max_len, context, batch) for mode in modes}


def _steps_per_s(torch, config, mode: str, steps: int, max_len: int, context: int, batch: int) -> float:
    step = decoder(torch, config, max_len, batch=batch)
    if mode.startswith("compile"):
        step = torch.compile(step, fullgraph=True)
    token = torch.zeros(batch, dtype=torch.long, device="cuda")
    pos = torch.full((batch,), context, dtype=torch.long, device="cuda")

    def advance():
        token.copy_(step(token, pos))
        pos.add_(1)

    side = torch.cuda.Stream()
    # the weights, token and position are written on the default stream, and PyTorch's side streams do not wait for
    # it: without this, the warm-up may read them before they are written (a device-side assert in the GPU suite)
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up (compilation, workspaces) off the default stream, as capture wants
        for _ in range(3):
            advance()
    torch.cuda.synchronize()
    run = advance
    if mode.endswith("graph"):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            advance()
        run = graph.replay
    pos.fill_(context)
    run()
    torch.cuda.synchronize()
    pos.fill_(context)
    t0 = time.perf_counter()
    for _ in range(steps):
        run()
    torch.cuda.synchronize()  # the host never reads a token back before the end: the peers' best case
    return steps / (time.perf_counter() - t0)
