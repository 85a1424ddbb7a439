"""16-byte loads: one instruction brings four 32-bit words (eight bf16 weights, or four float32).

Numba emits one load instruction per array element it reads and never merges neighbours into a wider load. A
warp whose 32 lanes each read 4 bytes moves 128 bytes per instruction; with 16 bytes per lane it moves 512, and
the memory system needs four times fewer instructions to stream the same weights. `load16` emits PTX's
`ld.global.nc.v4.u32` (read-only, non-coherent path) through an intrinsic with inline assembly.

`load16(words, i)` -> (w0, w1, w2, w3) = words[4 i : 4 i + 4], words a C-contiguous uint32 array of any number of
dimensions (indexed as flat). The address must be 16-byte aligned: the array starts on a 16-byte boundary (device
allocations start on 256) and i counts 16-byte steps. Read-only: nobody may write `words` while the kernel runs.
In the simulator it is four plain reads of a flat array.

`bf16x8(words, i)` and `f32x8(words, i)`: the 8 elements 8 i .. 8 i + 7 of a bf16 (uint16) or float32 array seen
as uint32 words, widened to float32: one 16-byte load for bf16, two for float32.
"""

import numpy as np
from numba import uint32

from course_lib.kernels import SIMULATOR, bf16_weight, cached_view, cuda


def aligned16(arr) -> bool:
    """arr is C-contiguous and starts on a 16-byte boundary (always true of the simulator's arrays)."""
    return arr.is_c_contiguous() and (SIMULATOR or arr.device_ctypes_pointer.value % 16 == 0)


def words(arr):
    """The flat uint32 view of a C-contiguous device array whose size in bytes is a multiple of 4, made once per
    array (cached_view): the weights and KV tables are viewed at every launch, about a thousand views per decode
    step of SmolLM2."""
    return cached_view(arr, "words", lambda a: a.view(np.uint32).reshape(a.size * a.dtype.itemsize // 4))


if SIMULATOR:
    def load16(words, i):
        return words[4 * i], words[4 * i + 1], words[4 * i + 2], words[4 * i + 3]
else:
    from llvmlite import ir
    from numba.cuda import types
    from numba.cuda.extending import intrinsic

    _I32, _I64 = ir.IntType(32), ir.IntType(64)
    _PTX = "{ .reg .u64 p; cvta.to.global.u64 p, $4; ld.global.nc.v4.u32 {$0, $1, $2, $3}, [p]; }"

    @intrinsic
    def load16(typingctx, words, i):
        if not (isinstance(words, types.Array) and words.dtype == types.uint32 and isinstance(i, types.Integer)):
            return None
        result = types.UniTuple(types.uint32, 4)

        def codegen(context, builder, signature, args):
            array = context.make_array(signature.args[0])(context, builder, value=args[0])
            index = builder.sext(args[1], _I64) if args[1].type.width < 64 else args[1]
            address = builder.add(builder.ptrtoint(array.data, _I64), builder.mul(index, ir.Constant(_I64, 16)))
            asm = ir.InlineAsm(ir.FunctionType(ir.LiteralStructType([_I32] * 4), [_I64]), _PTX,
                               "=r,=r,=r,=r,l", side_effect=False)
            words4 = builder.call(asm, [address])
            return context.make_tuple(builder, result, [builder.extract_value(words4, j) for j in range(4)])

        return result(words, i), codegen


@cuda.jit(device=True)
def bf16_high(w):
    """The float32 value of the bf16 in the high half of w (the second of the two uint16)."""
    return cuda.libdevice.int_as_float(w & uint32(0xFFFF0000))


@cuda.jit(device=True)
def bf16x8(words, i):
    """The 8 float32 values of the bf16 elements 8 i .. 8 i + 7 of an array seen as uint32 `words`: one load."""
    w0, w1, w2, w3 = load16(words, i)
    return (bf16_weight(w0), bf16_high(w0), bf16_weight(w1), bf16_high(w1),  # bf16_weight: the low half
            bf16_weight(w2), bf16_high(w2), bf16_weight(w3), bf16_high(w3))


@cuda.jit(device=True)
def f32x8(words, i):
    """The float32 elements 8 i .. 8 i + 7 of an array seen as uint32 `words`: two loads."""
    w0, w1, w2, w3 = load16(words, 2 * i)
    w4, w5, w6, w7 = load16(words, 2 * i + 1)
    f = cuda.libdevice.int_as_float
    return f(w0), f(w1), f(w2), f(w3), f(w4), f(w5), f(w6), f(w7)
