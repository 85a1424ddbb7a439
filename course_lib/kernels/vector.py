"""16-byte loads and stores: one instruction moves four 32-bit words (eight bf16 weights, or four float32).

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

`shared_load16(arr, i)` -> the float32 arr[4 i : 4 i + 4] of a C-contiguous float32 array (shared memory, indexed
as flat), `store_quad(arr, (i, ..., j), a, b, c, d)`: arr[i, ..., j : j + 4] = a, b, c, d, and `load_quad(arr,
(i, ..., j))` -> arr[i, ..., j : j + 4], for a float32 array of any layout whose last axis is contiguous. They are
vector loads and stores in the compiler's own IR, not inline assembly, so they stay ordered with the barriers and the
other accesses around them, and `load_quad` is a coherent load (it may read what other blocks of the same kernel
wrote before a fence); the address must be 16-byte aligned. The tile kernels (kernels/narrow) read their staged
weights with the first, write their sums with the second and read them back with the third.
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

    def shared_load16(arr, i):
        flat = arr.reshape(arr.size)
        return flat[4 * i], flat[4 * i + 1], flat[4 * i + 2], flat[4 * i + 3]

    def store_quad(arr, index, a, b, c, d):
        row = arr[index[:-1]]
        row[index[-1]], row[index[-1] + 1], row[index[-1] + 2], row[index[-1] + 3] = a, b, c, d

    def load_quad(arr, index):
        row = arr[index[:-1]]
        return row[index[-1]], row[index[-1] + 1], row[index[-1] + 2], row[index[-1] + 3]
else:
    from llvmlite import ir
    from numba.core import cgutils
    from numba.cuda import types
    from numba.cuda.extending import intrinsic

    _I32, _I64 = ir.IntType(32), ir.IntType(64)
    _PTX = "{ .reg .u64 p; cvta.to.global.u64 p, $4; ld.global.nc.v4.u32 {$0, $1, $2, $3}, [p]; }"

    def _indexed(arr, i, dtype) -> bool:
        """arr is an array of dtype and i an integer: the arguments a 16-byte access takes."""
        return isinstance(arr, types.Array) and arr.dtype == dtype and isinstance(i, types.Integer)

    def _array_and_step(context, builder, signature, args):
        """The array of a 16-byte access (args[0]) and its step (args[1]) as a 64-bit integer."""
        array = context.make_array(signature.args[0])(context, builder, value=args[0])
        return array, builder.sext(args[1], _I64) if args[1].type.width < 64 else args[1]

    @intrinsic
    def load16(typingctx, words, i):
        if not _indexed(words, i, types.uint32):
            return None
        result = types.UniTuple(types.uint32, 4)

        def codegen(context, builder, signature, args):
            array, index = _array_and_step(context, builder, signature, args)
            address = builder.add(builder.ptrtoint(array.data, _I64), builder.mul(index, ir.Constant(_I64, 16)))
            asm = ir.InlineAsm(ir.FunctionType(ir.LiteralStructType([_I32] * 4), [_I64]), _PTX,
                               "=r,=r,=r,=r,l", side_effect=False)
            words4 = builder.call(asm, [address])
            return context.make_tuple(builder, result, [builder.extract_value(words4, j) for j in range(4)])

        return result(words, i), codegen

    _F32x4 = ir.VectorType(ir.FloatType(), 4)

    @intrinsic
    def shared_load16(typingctx, arr, i):
        if not _indexed(arr, i, types.float32):
            return None
        result = types.UniTuple(types.float32, 4)

        def codegen(context, builder, signature, args):
            array, index = _array_and_step(context, builder, signature, args)
            first = builder.gep(array.data, [builder.mul(index, ir.Constant(_I64, 4))])  # a float pointer derived
            # from the shared array's: the compiler still knows the address space, and emits ld.shared.v4.f32
            quad = builder.load(builder.bitcast(first, _F32x4.as_pointer(first.type.addrspace)), align=16)
            return context.make_tuple(builder, result, [builder.extract_element(quad, ir.Constant(_I32, j))
                                                        for j in range(4)])

        return result(arr, i), codegen

    def _indexed_quad(arr, index) -> bool:
        """arr is a float32 array and index a tuple of as many integers: the arguments of a quad's access."""
        return (isinstance(arr, types.Array) and arr.dtype == types.float32 and isinstance(index, types.BaseTuple)
                and len(index) == arr.ndim and all(isinstance(t, types.Integer) for t in index))

    def _quad_pointer(context, builder, signature, args):
        """A pointer to the 16 bytes of arr[index] (args[0], args[1]), in the array's address space."""
        array_type, index_types = signature.args[0], signature.args[1].types
        array = context.make_array(array_type)(context, builder, value=args[0])
        at = [context.cast(builder, v, t, types.intp)
              for v, t in zip(cgutils.unpack_tuple(builder, args[1], len(index_types)), index_types, strict=True)]
        first = cgutils.get_item_pointer(context, builder, array_type, array, at, wraparound=False)
        return builder.bitcast(first, _F32x4.as_pointer(first.type.addrspace))

    @intrinsic
    def store_quad(typingctx, arr, index, a, b, c, d):
        if not (_indexed_quad(arr, index) and all(v == types.float32 for v in (a, b, c, d))):
            return None

        def codegen(context, builder, signature, args):
            quad = ir.Constant(_F32x4, ir.Undefined)
            for j, value in enumerate(args[2:]):
                quad = builder.insert_element(quad, value, ir.Constant(_I32, j))
            builder.store(quad, _quad_pointer(context, builder, signature, args), align=16)
            return context.get_dummy_value()

        return types.void(arr, index, a, b, c, d), codegen

    @intrinsic
    def load_quad(typingctx, arr, index):
        if not _indexed_quad(arr, index):
            return None
        result = types.UniTuple(types.float32, 4)

        def codegen(context, builder, signature, args):
            quad = builder.load(_quad_pointer(context, builder, signature, args), align=16)
            return context.make_tuple(builder, result, [builder.extract_element(quad, ir.Constant(_I32, j))
                                                        for j in range(4)])

        return result(arr, index), codegen

@cuda.jit(device=True)
def bf16_high(w):
    """The float32 value of the bf16 in the high half of w (the second of the two uint16)."""
    return cuda.libdevice.int_as_float(w & uint32(0xFFFF0000))


@cuda.jit(device=True)
def weight_of_word(w, e, wide):
    """Element e of a group of 8 weights, from the uint32 word w that holds it: word e of 8 float32 (wide), or word
    e // 2 of 8 bf16 packed two to a word, the low half first. A kernel that stages weights keeps the loaded words
    and widens them only where it stores them: a register holds two bf16 until then, and no instruction waits for
    a load right after issuing it."""
    if wide:
        return cuda.libdevice.int_as_float(w)
    return bf16_weight(w) if e % 2 == 0 else bf16_high(w)


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
