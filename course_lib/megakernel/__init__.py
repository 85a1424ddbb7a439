"""A whole decode step as one instruction list: the program a persistent megakernel interprets (`program`) and its
NumPy twin (`twin`), which executes it instruction by instruction, in any order the dependencies allow."""

from .program import Access, Instruction, build_program, check_dependencies
from .twin import Twin, TwinState, first_difference, random_order

__all__ = ["Access", "Instruction", "Twin", "TwinState", "build_program", "check_dependencies", "first_difference",
           "random_order"]
