"""Recipes: the course's progression, one named way of running a decode step per notebook, listed in one place.

A recipe chooses a kernel for each stage of a layer (`gpu.backend.OP_CHOICES`) and how the host drives a step:
- "launches": the host launches every kernel of every step from Python and samples on the host from the logits
  it copies back (notebooks 01 to 04);
- "plan": the step recorded once (course_lib.gpu.plan), its launches replayed with pre-flattened arguments, the token,
  position and sampling on the GPU (notebook 06);
- "graph": the same plan captured as a CUDA graph and replayed by one call per `steps_per_launch` tokens;
- "megakernel": no plan and no graph: one persistent kernel runs `steps_per_launch` whole steps (course_lib.megakernel).
The notebooks, `bench`, the command line and the tests all take recipes from RECIPES.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .gpu.backend import BASELINE, FIVE, FUSED, NARROW, PAGED, ROW_DOT


@dataclass(frozen=True)
class Recipe:
    name: str
    notebook: str  # where the recipe is introduced
    summary: str
    ops: dict = field(hash=False)  # a kernel choice per stage (gpu.backend.OP_CHOICES)
    replay: str = "launches"  # "launches", "plan", "graph" or "megakernel"
    steps_per_launch: int = 1  # decode steps per graph or megakernel launch
    overlap: bool = False  # the plan's kernels launched programmatically (kernels/overlap.py: Hopper), each starting
    # while the one before ends

    def check(self, gpu: bool) -> None:
        """Requirements, checked once when an engine is built: a graph needs a GPU, overlapping launches a plan."""
        if self.replay == "graph" and not gpu:
            raise ValueError(f"recipe {self.name!r} replays CUDA graphs, which need a GPU (the simulator has none): "
                             "use recipe 'plan' there")
        if self.overlap and self.replay not in ("plan", "graph"):
            raise ValueError(f"recipe {self.name!r}: overlapping launches are a step plan's (replay 'plan' or 'graph')")


RECIPES = {r.name: r for r in (
    Recipe("baseline", "01", "training-style kernels: 64x64-tile matmuls, a cache grown by copies, a separate bias "
           "kernel, logits through a transpose", BASELINE),
    Recipe("narrow", "02", "split-K matmuls for a few rows, fused bias, logits read from the table in place", NARROW),
    Recipe("paged", "03, 04", "a paged cache written in place, flash-decoding attention", PAGED),
    Recipe("plan", "06", "the paged step recorded once: buffers by name, launches with pre-flattened arguments, "
           "token, position and sampling on the GPU", PAGED, replay="plan"),
    Recipe("graph", "06", "the step plan replayed as one CUDA graph per token", PAGED, replay="graph"),
    Recipe("graph8", "06", "the step plan, eight tokens per CUDA graph launch", PAGED, replay="graph",
           steps_per_launch=8),
    Recipe("fused", "05, 06", "the graph replay of a step of six kernels per layer: norm + QKV + RoPE + cache "
           "write, attention (chunks, merge), O + residual, norm + gate/up + SwiGLU, down + residual; the final norm "
           "in the logits", FUSED, replay="graph"),
    Recipe("overlap", "06", "the fused step's graph with every kernel launched programmatically (Hopper): it starts "
           "while the kernel before it ends, asks the L2 cache for its weights, then waits for its inputs", FUSED,
           replay="graph", overlap=True),
    Recipe("row_dot", "05, 06", "the overlapped graph of the fused step with its projections in one pass: a warp per "
           "pair of outputs over weights stored a row per output, the first weights loaded before waiting for the "
           "inputs, no partial sums", ROW_DOT, replay="graph", overlap=True),
    Recipe("five", "05, 06", "the row_dot step in five kernels a layer: flash-decoding in one launch, the chunks of "
           "each query head merged by the last of its blocks to finish", FIVE, replay="graph", overlap=True),
    Recipe("megakernel", "06", "one persistent kernel interprets the step's instruction list (fused operations on "
           "slices of work, each started when what it reads is written), 16 tokens per launch", FUSED,
           replay="megakernel", steps_per_launch=16),
)}


def default_recipe(gpu: bool) -> str:
    """The fastest recipe verified on this kind of machine: on a GPU the graph replay of the fused step in five kernels
    a layer, its projections in one pass, its launches overlapping (on GPUs before Hopper the launches simply do not
    overlap); in the simulator (no graphs), the step plan launched kernel by kernel. One step per replay, not eight:
    both decode at the same speed within about 1% on the H200 (notebook 06), and one step per replay sees an end
    token sooner."""
    return "five" if gpu else "plan"


def get_recipe(name: str) -> Recipe:
    try:
        return RECIPES[name]
    except KeyError:
        raise ValueError(f"unknown recipe {name!r} (recipes: {', '.join(RECIPES)})") from None
