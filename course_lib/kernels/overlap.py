"""Programmatic dependent launch: a kernel that starts while the one before it is still finishing.

Inside a CUDA graph a decode step is still a chain of kernels, each waiting for the whole of the one before: the last
blocks of kernel n run on a few SMs while the others idle, then kernel n + 1 is scheduled, ramps up, and only then
asks memory for its first weights, a microsecond away. On Hopper a launch can be marked *programmatic* (the launch
attribute "programmatic stream serialization", kept by stream capture as a programmatic edge of the graph): the
kernel may then start as soon as every block of the previous kernel has said `allow_next()`, and it must call
`wait_for_inputs()` before it touches anything an earlier kernel writes or reads. That call returns when the previous
kernel has finished and its writes are visible; since that kernel had itself waited for its own predecessor, all
earlier kernels have finished too.

So a kernel launched this way is written in three parts:
1. work on what no kernel of the step writes: asking the L2 cache to fetch its first weights (`prefetch_l2`: no
   register holds them, nothing waits for them), or loading them into registers (kernels/row_dot);
2. `wait_for_inputs()`, then `allow_next()` (the next kernel's blocks may take the SMs this kernel's blocks leave);
3. the kernel's own work, unchanged: the same instructions in the same order, so the same bits.

`waits_for_inputs(kernel)` marks a kernel written this way; a Runtime asked to overlap launches gives the attribute
to marked kernels only (an unmarked kernel is launched as before: it waits for the whole of the previous one).

Outside a programmatic launch both calls do nothing (`griddepcontrol` is then a no-op), so a marked kernel launched
normally, by the dispatcher or in a megakernel's body, behaves as it always did. In the simulator they are no-ops,
and so they are on GPUs older than Hopper, which have neither the instructions nor the launch attribute (`supported`).
PTX: `griddepcontrol.wait`, `griddepcontrol.launch_dependents` (sm_90, PTX ISA 7.8), `prefetch.global.L2`.
"""

import functools

from course_lib.kernels import SIMULATOR, cuda


@functools.cache
def supported() -> bool:
    """The GPU can launch kernels programmatically: compute capability 9.0 or more (also True where kernels are only
    compiled, with no GPU to ask: for sm_90)."""
    if SIMULATOR:
        return False
    try:
        return cuda.get_current_device().compute_capability >= (9, 0)
    except Exception:
        return True


def waits_for_inputs(kernel):
    """Mark `kernel` (a CUDA dispatcher) as calling wait_for_inputs() before it reads or writes any buffer of the
    step: a Runtime with overlap may launch it programmatically. Returns it."""
    kernel.waits_for_inputs = True
    return kernel


if SIMULATOR:  # blocks run one after another, launches one after another: nothing to overlap
    def _griddepcontrol_wait():
        pass

    def _griddepcontrol_launch_dependents():
        pass

    def prefetch_l2(words, i):
        pass
else:
    from llvmlite import ir
    from numba.cuda import types
    from numba.cuda.extending import intrinsic

    from course_lib.kernels import ptx_statement

    _griddepcontrol_wait = ptx_statement("griddepcontrol.wait;", emitted=supported)  # (before Hopper: nothing)
    _griddepcontrol_launch_dependents = ptx_statement("griddepcontrol.launch_dependents;", emitted=supported)

    _PREFETCH = "{ .reg .u64 p; cvta.to.global.u64 p, $0; prefetch.global.L2 [p]; }"

    @intrinsic
    def prefetch_l2(typingctx, words, i):
        """Ask the L2 cache for the 16 bytes words[4 i : 4 i + 4] (words: a uint32 array, as vector.load16): the
        line arrives while the thread goes on; nothing is read into registers."""
        if not (isinstance(words, types.Array) and words.dtype == types.uint32 and isinstance(i, types.Integer)):
            return None

        def codegen(context, builder, signature, args):
            array = context.make_array(signature.args[0])(context, builder, value=args[0])
            index = builder.sext(args[1], ir.IntType(64)) if args[1].type.width < 64 else args[1]
            address = builder.add(builder.ptrtoint(array.data, ir.IntType(64)),
                                  builder.mul(index, ir.Constant(ir.IntType(64), 16)))
            asm = ir.InlineAsm(ir.FunctionType(ir.VoidType(), [ir.IntType(64)]), _PREFETCH, "l", side_effect=True)
            builder.call(asm, [address])
            return context.get_dummy_value()

        return types.void(words, i), codegen


@cuda.jit(device=True)
def wait_for_inputs():
    """Return once the kernels this launch depends on have finished and their writes are visible (at once when the
    launch is not programmatic). Every thread that touches the step's buffers calls it first."""
    _griddepcontrol_wait()


@cuda.jit(device=True)
def allow_next():
    """Let the next kernel's launch begin once every block of this one has called this (or ended)."""
    _griddepcontrol_launch_dependents()


@cuda.jit(device=True)
def inputs_ready():
    """wait_for_inputs() then allow_next(): the top of a marked kernel with nothing to fetch first."""
    wait_for_inputs()
    allow_next()


@cuda.jit(device=True)
def launched_inputs(ready):
    """inputs_ready() as the `wait(ready)` of a device body shared with the megakernel (row_dot.pair_sums_for,
    paged_attention.chunk_block_for): a launched kernel waits for the kernel before it; `ready` is unused (the
    megakernel's wait reads its counters from it)."""
    inputs_ready()
