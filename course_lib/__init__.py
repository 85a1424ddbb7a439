"""course_lib: the companion package of the course "Fast LLM decoding with kernels written in Python".

    import course_lib
    model = course_lib.load_model()                     # SmolLM2-135M-Instruct, fetched and converted once
    out = course_lib.generate(model, "Explain what a KV cache is.", chat=True, max_new_tokens=64)
    print(out.text, out.tokens_per_s)
"""

from .batch import generate_batch
from .device import by_mode, gpu_available, mode
from .engine import Engine
from .generate import Generation, generate
from .model.config import ModelConfig, UnsupportedModelError
from .model.loading import DEFAULT_MODEL, Model, load_model
from .model.tiny import tiny_model
from .recipes import RECIPES

__all__ = ["DEFAULT_MODEL", "RECIPES", "by_mode", "Engine", "Generation", "Model", "ModelConfig",
           "UnsupportedModelError", "generate", "generate_batch", "gpu_available", "load_model", "mode", "tiny_model"]
