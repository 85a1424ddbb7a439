"""A whole decode step as one instruction list: the program a persistent megakernel interprets (`program`) and its
NumPy twin (`twin`), which executes it instruction by instruction, in any order the dependencies allow, and the
instructions assigned to the kernel's blocks ahead of time (`schedule`)."""

from .program import Access, Instruction, build_program, check_dependencies
from .schedule import Schedule, assign, cost, encode, simulate
from .twin import Twin, TwinState, first_difference, random_order

__all__ = ["Access", "Instruction", "Schedule", "Twin", "TwinState", "assign", "build_program", "check_dependencies",
           "cost", "encode", "first_difference", "random_order", "simulate"]
