"""The model: the Llama family's configuration, loading (GGUF files, Hugging Face directories, the safetensors
cache), the weights, the tokenizer and chat template, and a tiny model of the same architecture for tests."""

from .config import ModelConfig, UnsupportedModelError
from .loading import DEFAULT_MODEL, Model, load_model
from .tiny import tiny_model

__all__ = ["DEFAULT_MODEL", "Model", "ModelConfig", "UnsupportedModelError", "load_model", "tiny_model"]
