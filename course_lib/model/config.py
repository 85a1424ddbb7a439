"""Model configuration for the Llama family (Llama, SmolLM2, Qwen2), read from GGUF metadata or config.json."""

from __future__ import annotations

from dataclasses import asdict, dataclass

SUPPORTED_ARCHITECTURES = ("llama", "qwen2")


class UnsupportedModelError(ValueError):
    """The checkpoint describes a model this course does not implement."""


@dataclass(frozen=True)
class ModelConfig:
    """Shapes and constants of a Llama-family decoder.

    d_model = n_heads * head_dim; the K/V projections have n_kv_heads * head_dim outputs (GQA when
    n_kv_heads < n_heads). Qwen2 adds a bias to the Q, K and V projections (qkv_bias).
    """

    arch: str
    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    d_ff: int
    max_seq_len: int
    rope_theta: float = 10000.0
    rms_eps: float = 1e-5
    tied_embeddings: bool = True
    qkv_bias: bool = False
    name: str = ""

    def __post_init__(self):
        if self.arch not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(
                f"architecture {self.arch!r} is not supported (supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
            )
        if self.d_model % self.n_heads:
            raise UnsupportedModelError(f"d_model={self.d_model} is not a multiple of n_heads={self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise UnsupportedModelError(f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}")
        if self.head_dim % 2:
            raise UnsupportedModelError(f"head_dim={self.head_dim} must be even for RoPE")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def d_kv(self) -> int:
        """Width of the K and V projections: n_kv_heads * head_dim."""
        return self.n_kv_heads * self.head_dim

    def n_params(self) -> int:
        """Parameter count, embeddings included once when they are tied."""
        d, f = self.d_model, self.d_ff
        attn = d * d + 2 * d * self.d_kv + d * d + (d + 2 * self.d_kv if self.qkv_bias else 0)
        layer = attn + 3 * d * f + 2 * d
        embed = self.vocab_size * d * (1 if self.tied_embeddings else 2)
        return self.n_layers * layer + embed + d

    def kv_bytes_per_position(self, bytes_per_value: int = 4) -> int:
        """Bytes of K and V one position adds to the cache, all layers together."""
        return 2 * self.n_layers * self.d_kv * bytes_per_value

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_hf(cls, cfg: dict, name: str = "") -> ModelConfig:
        """Build from a Hugging Face config.json dictionary."""
        archs = cfg.get("architectures") or []
        model_type = cfg.get("model_type", "")
        arch = {"llama": "llama", "qwen2": "qwen2"}.get(model_type)
        if arch is None:
            raise UnsupportedModelError(
                f"model_type {model_type!r} ({', '.join(archs) or 'no architectures'}) is not supported "
                f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
            )
        scaling = cfg.get("rope_scaling") or (cfg.get("rope_parameters") or {})
        if scaling.get("rope_type", scaling.get("type", "default")) not in ("default", None):
            raise UnsupportedModelError(f"RoPE scaling {scaling!r} is not supported")
        n_heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // n_heads
        if head_dim * n_heads != cfg["hidden_size"]:
            raise UnsupportedModelError("head_dim * num_attention_heads != hidden_size is not supported")
        theta = cfg.get("rope_theta", (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0))
        return cls(
            arch=arch,
            vocab_size=cfg["vocab_size"],
            d_model=cfg["hidden_size"],
            n_layers=cfg["num_hidden_layers"],
            n_heads=n_heads,
            n_kv_heads=cfg.get("num_key_value_heads", n_heads),
            d_ff=cfg["intermediate_size"],
            max_seq_len=cfg.get("max_position_embeddings", 2048),
            rope_theta=float(theta),
            rms_eps=float(cfg.get("rms_norm_eps", 1e-5)),
            tied_embeddings=bool(cfg.get("tie_word_embeddings", arch == "qwen2")),
            qkv_bias=bool(cfg.get("attention_bias", arch == "qwen2")),
            name=name,
        )

    def to_hf(self) -> dict:
        """The config.json dictionary of this model (used to write tiny test checkpoints)."""
        return {
            "architectures": ["LlamaForCausalLM" if self.arch == "llama" else "Qwen2ForCausalLM"],
            "model_type": self.arch,
            "vocab_size": self.vocab_size,
            "hidden_size": self.d_model,
            "num_hidden_layers": self.n_layers,
            "num_attention_heads": self.n_heads,
            "num_key_value_heads": self.n_kv_heads,
            "intermediate_size": self.d_ff,
            "max_position_embeddings": self.max_seq_len,
            "rope_theta": self.rope_theta,
            "rms_norm_eps": self.rms_eps,
            "tie_word_embeddings": self.tied_embeddings,
            "attention_bias": self.qkv_bias,
            "hidden_act": "silu",
            "torch_dtype": "float32",
            "_name_or_path": self.name,
        }

    @classmethod
    def from_gguf_fields(cls, fields: dict, vocab_size: int, name: str = "") -> ModelConfig:
        """Build from GGUF metadata (a dict of key -> value); the caller checks that it is a complete file."""
        arch = fields.get("general.architecture")
        if arch not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(
                f"GGUF architecture {arch!r} is not supported (supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
            )
        n_heads = int(fields[f"{arch}.attention.head_count"])
        return cls(
            arch=arch,
            vocab_size=vocab_size,
            d_model=int(fields[f"{arch}.embedding_length"]),
            n_layers=int(fields[f"{arch}.block_count"]),
            n_heads=n_heads,
            n_kv_heads=int(fields.get(f"{arch}.attention.head_count_kv", n_heads)),
            d_ff=int(fields[f"{arch}.feed_forward_length"]),
            max_seq_len=int(fields[f"{arch}.context_length"]),
            rope_theta=float(fields.get(f"{arch}.rope.freq_base", 10000.0)),
            rms_eps=float(fields[f"{arch}.attention.layer_norm_rms_epsilon"]),
            tied_embeddings=True,  # set by the loader from the presence of output.weight
            qkv_bias=arch == "qwen2",
            name=name,
        )


# Shapes for accounting (no weights needed). SMOLLM2_135M is the default model's config.
SMOLLM2_135M = ModelConfig("llama", 49152, 576, 30, 9, 3, 1536, 8192, 100000.0, 1e-5, True, False,
                           "SmolLM2-135M-Instruct")
LLAMA_32_1B = ModelConfig("llama", 128256, 2048, 16, 32, 8, 8192, 131072, 500000.0, 1e-5, True, False, "Llama-3.2-1B")
LLAMA_31_8B = ModelConfig("llama", 128256, 4096, 32, 32, 8, 14336, 131072, 500000.0, 1e-5, False, False, "Llama-3.1-8B")
