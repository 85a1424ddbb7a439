"""The instruction list of one decode step: what a persistent megakernel interprets, and its NumPy twin runs.

A step is cut into instructions, each a fused operation on a slice of work, with the instructions it waits for
(after Hazy Research's low-latency megakernel). For layer l:

    qkv(l, pairs)       the layer's RMSNorm of x, then x's projection onto RoPE pairs p0 .. p1 - 1 of one head of
                        Q, K or V (pair p: outputs i and i + hd / 2 of head p // (hd / 2), i = p % (hd / 2), the
                        order of kernels/row_dot.paired_qkv) (+ bias), rotated for Q and K, K and V written into the
                        cache at the current position
    attention(l, h)     query head h against its KV head's cache, rows 0 .. position
    o_proj(l, cols)     x[cols] += attn @ Wo[:, cols]          (the residual added in the reduction)
    gate_up(l, cols)    act[cols] = SiLU(norm(x) @ Wg[:, cols]) * (norm(x) @ Wu[:, cols])
    down(l, cols)       x[cols] += act @ Wd[:, cols]

then logits(cols) (the final norm and the output head, by vocabulary slice) and sample (the next token, its
position), after embed (x from the token). Every instruction declares the regions of the named buffers it reads and
writes (`Access`): `check_dependencies` proves that any two instructions touching one region, one of them writing,
are ordered by the dependencies, so that a block may start an instruction as soon as what it waits for is done.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..model.config import ModelConfig


@dataclass(frozen=True)
class Access:
    """Elements start .. stop - 1 of a named buffer. The KV cache is indexed by (layer, KV head, dimension): index
    (layer * n_kv_heads + head) * head_dim + i stands for dimension i of that head in every row of that layer."""

    buffer: str
    start: int
    stop: int

    def overlaps(self, other: Access) -> bool:
        return self.buffer == other.buffer and self.start < other.stop and other.start < self.stop


@dataclass(frozen=True)
class Instruction:
    op: str  # embed, qkv, attention, o_proj, gate_up, down, logits, sample
    layer: int  # -1 outside the layers
    start: int  # the slice of work: RoPE pairs (qkv, over the Q, K, V heads in turn), query heads (attention) or
    stop: int  # output columns (o_proj, gate_up, down, logits)
    deps: tuple[int, ...]  # indices of the instructions this one waits for
    reads: tuple[Access, ...]
    writes: tuple[Access, ...]

    def __str__(self):
        where = f"layer {self.layer}, " if self.layer >= 0 else ""
        return f"{self.op}({where}{self.start}:{self.stop})"


def slices(n: int, width: int) -> list[tuple[int, int]]:
    """[0, n) cut in slices of `width` (the last one may be shorter)."""
    return [(s, min(n, s + width)) for s in range(0, n, width)]


def build_program(config: ModelConfig, cols: int = 64, vocab_cols: int = 4096) -> list[Instruction]:
    """The instructions of one decode step, in an order the dependencies allow. cols: weight rows (outputs of a
    matrix product) per projection instruction: cols columns of x for o_proj and down, cols / 2 of act for gate_up
    (each the product of a gate and an up column), cols / 2 RoPE pairs of a head for qkv (a head's hd / 2 pairs at
    most: a qkv instruction stays inside one head); vocab_cols: per logits instruction."""
    c = config
    H, Hkv, hd = c.n_heads, c.n_kv_heads, c.head_dim
    group, half = H // Hkv, hd // 2
    program: list[Instruction] = []

    def add(op, layer, start, stop, deps, reads, writes) -> int:
        program.append(Instruction(op, layer, start, stop, tuple(deps), tuple(reads), tuple(writes)))
        return len(program) - 1

    x_all = Access("x", 0, c.d_model)
    embed = add("embed", -1, 0, c.d_model, [], [Access("token", 0, 1)], [x_all])
    before = [embed]  # what the next layer's first instructions wait for: every writer of x
    for layer in range(c.n_layers):
        kv = layer * Hkv
        heads = {}  # head -> its qkv instructions
        for h in range(H + 2 * Hkv):  # Q heads, then K heads, then V heads
            if h < H:
                out, at = "q", h * hd
            else:
                out, at = ("k_cache", "v_cache")[(h - H) // Hkv], (kv + (h - H) % Hkv) * hd
            heads[h] = [add("qkv", layer, h * half + s, h * half + e, before, [x_all, Access("position", 0, 1)],
                            [Access(out, at + s, at + e), Access(out, at + half + s, at + half + e)])
                        for s, e in slices(half, max(1, cols // 2))]
        attention = []
        for h in range(H):  # each waits for its query head, its KV head's key and value
            g = h // group
            waits = heads[h] + heads[H + g] + heads[H + Hkv + g]
            head, cache = (h * hd, (h + 1) * hd), ((kv + g) * hd, (kv + g + 1) * hd)
            attention.append(add("attention", layer, h, h + 1, waits,
                                 [Access("q", *head), Access("k_cache", *cache), Access("v_cache", *cache),
                                  Access("position", 0, 1)],
                                 [Access("attn", *head)]))
        o_proj = [add("o_proj", layer, s, e, attention, [Access("attn", 0, H * hd), Access("x", s, e)],
                      [Access("x", s, e)]) for s, e in slices(c.d_model, cols)]
        gate_up = [add("gate_up", layer, s, e, o_proj, [x_all], [Access("act", s, e)])
                   for s, e in slices(c.d_ff, max(1, cols // 2))]
        before = [add("down", layer, s, e, gate_up, [Access("act", 0, c.d_ff), Access("x", s, e)],
                      [Access("x", s, e)]) for s, e in slices(c.d_model, cols)]
    logits = [add("logits", -1, s, e, before, [x_all], [Access("logits", s, e)])
              for s, e in slices(c.vocab_size, vocab_cols)]
    add("sample", -1, 0, 1, logits, [Access("logits", 0, c.vocab_size), Access("position", 0, 1)],
        [Access("token", 0, 1), Access("position", 0, 1)])
    return program


def phases(program: list[Instruction]) -> list[int]:
    """The phase of each instruction: runs of consecutive instructions of one op and layer (a layer's qkv heads, its
    attention heads, ...) are phases 0, 1, 2, ... in program order. No instruction waits for one of its own phase
    (raises otherwise): a grid barrier between consecutive phases orders everything the dependencies order."""
    phase, key = [], None
    for i, ins in enumerate(program):
        if (ins.op, ins.layer) != key:
            key = ins.op, ins.layer
            phase.append(phase[-1] + 1 if phase else 0)
        else:
            phase.append(phase[-1])
        if any(phase[d] == phase[i] for d in ins.deps):
            raise ValueError(f"instruction {i} ({ins}) waits for one of its own phase: a barrier cannot order them")
    return phase


def ancestors(program: list[Instruction]) -> list[int]:
    """For each instruction, the set of instructions it waits for, directly or not, as a bit mask."""
    masks = []
    for i, ins in enumerate(program):
        if any(d >= i for d in ins.deps):
            raise ValueError(f"instruction {i} ({ins}) waits for a later one: the list is not in dependency order")
        m = 0
        for d in ins.deps:
            m |= masks[d] | (1 << d)
        masks.append(m)
    return masks


def check_dependencies(program: list[Instruction]) -> list[tuple[int, int, str]]:
    """The pairs (i, j, buffer) of instructions that touch one region, one writing it, with neither waiting for
    the other: empty when the dependencies are complete (any order they allow computes the same step)."""
    masks, missing = ancestors(program), []
    for j, b in enumerate(program):
        unordered = ~masks[j] & ((1 << j) - 1)  # the earlier instructions j does not wait for (its ancestors' bits off)
        while unordered:
            low = unordered & -unordered  # the lowest one left: i in increasing order
            unordered ^= low
            i = low.bit_length() - 1
            a = program[i]
            for x, y in ((a.writes, b.reads + b.writes), (a.reads, b.writes)):
                clash = next((p.buffer for p in x for q in y if p.overlaps(q)), None)
                if clash:
                    missing.append((i, j, clash))
                    break
    return missing
