"""The model's architecture description: `ModelConfig` (Llama / Qwen2 / Qwen3 families), read from and
written to Hugging Face `config.json` dictionaries."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch

from jetflow.errors import UserError

SUPPORTED = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}


class UnsupportedModelError(UserError, ValueError):
    pass


@dataclass
class ModelConfig:
    """Hyperparameters of a Llama-family decoder (a subset of HF's config.json)."""

    model_type: str = "llama"
    """One of SUPPORTED: llama (also SmolLM2, Llama 3), qwen2, qwen3."""
    vocab_size: int = 32000
    hidden_size: int = 576
    intermediate_size: int = 1536
    num_layers: int = 30
    """HF: num_hidden_layers."""
    num_heads: int = 9
    """HF: num_attention_heads (query heads)."""
    num_kv_heads: int = 3
    """HF: num_key_value_heads (GQA: each K/V head serves num_heads // num_kv_heads query heads)."""
    head_dim: int = 64
    """Defaults to hidden_size // num_heads in HF; Qwen3 sets it explicitly (may differ)."""
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    """None (plain RoPE) or {"rope_type": "llama3", "factor", "low_freq_factor", "high_freq_factor",
    "original_max_position_embeddings"}."""
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    """lm_head shares the embedding matrix (SmolLM2, small Qwens)."""
    qkv_bias: bool = False
    """q/k/v projections have a bias (always for Qwen2; `attention_bias` for Llama / Qwen3)."""
    o_bias: bool = False
    """o_proj has a bias (`attention_bias` for Llama / Qwen3; never for Qwen2)."""
    mlp_bias: bool = False
    """gate/up/down projections have a bias (Llama `mlp_bias`)."""
    qk_norm: bool = False
    """Qwen3: RMSNorm over head_dim on q and k, before RoPE."""
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    extra: dict = field(default_factory=dict, compare=False, repr=False)
    """Other HF config fields, carried so that save_hf_dir writes them back (not used here)."""

    @property
    def architecture(self) -> str:
        return SUPPORTED[self.model_type]

    @classmethod
    def from_hf(cls, hf: dict) -> "ModelConfig":
        """Build from a parsed HF config.json; unsupported models raise UnsupportedModelError."""
        model_type = hf.get("model_type")
        archs = hf.get("architectures") or []
        supported = ", ".join(f"{t} ({a})" for t, a in SUPPORTED.items())
        if model_type not in SUPPORTED:
            raise UnsupportedModelError(
                f"unsupported model_type {model_type!r} (architectures {archs}); supported: {supported}")
        bad = [a for a in archs if a != SUPPORTED[model_type]]
        if bad:
            raise UnsupportedModelError(
                f"unsupported architectures {bad} for model_type {model_type!r}; supported: {supported}")
        if hf.get("use_sliding_window") or any(t != "full_attention" for t in hf.get("layer_types") or []):
            raise UnsupportedModelError("sliding-window attention layers are not supported")
        if hf.get("hidden_act", "silu") != "silu":
            raise UnsupportedModelError(f"hidden_act {hf['hidden_act']!r} is not supported (only silu)")

        # RoPE: transformers >= 5 writes `rope_parameters` (with rope_theta inside); older files have
        # top-level `rope_theta` and an optional `rope_scaling` dict.
        rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
        rope_theta = float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        rope_scaling = None
        if rope_type == "llama3":
            rope_scaling = {
                "rope_type": "llama3",
                "factor": float(rope["factor"]),
                "low_freq_factor": float(rope["low_freq_factor"]),
                "high_freq_factor": float(rope["high_freq_factor"]),
                "original_max_position_embeddings": int(rope.get(
                    "original_max_position_embeddings", hf.get("max_position_embeddings", 8192))),
            }
        elif rope_type != "default":
            raise UnsupportedModelError(f"RoPE type {rope_type!r} is not supported (default, llama3)")
        if rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)) != 1.0:
            raise UnsupportedModelError("partial_rotary_factor != 1 is not supported")

        heads = hf["num_attention_heads"]
        attention_bias = bool(hf.get("attention_bias", False))
        known = {
            "model_type", "architectures", "vocab_size", "hidden_size", "intermediate_size",
            "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps",
            "rope_theta", "rope_scaling", "rope_parameters", "max_position_embeddings", "tie_word_embeddings",
            "attention_bias", "mlp_bias", "bos_token_id", "eos_token_id", "pad_token_id", "hidden_act",
            "torch_dtype", "dtype", "transformers_version", "quantization_config",
        }
        return cls(
            model_type=model_type,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            # absent key: the default of LlamaConfig / Qwen2Config / Qwen3Config (all False)
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=True if model_type == "qwen2" else attention_bias,
            o_bias=False if model_type == "qwen2" else attention_bias,
            mlp_bias=bool(hf.get("mlp_bias", False)) if model_type == "llama" else False,
            qk_norm=model_type == "qwen3",
            bos_token_id=hf.get("bos_token_id"),
            eos_token_id=hf.get("eos_token_id"),
            pad_token_id=hf.get("pad_token_id"),
            extra={k: v for k, v in hf.items() if k not in known},
        )

    def to_hf(self, dtype: torch.dtype | None = None) -> dict:
        """A config.json dict that transformers loads into the same architecture.

        RoPE is written both ways (`rope_parameters` for transformers >= 5, `rope_theta` /
        `rope_scaling` for older readers such as vLLM's pinned transformers)."""
        if self.qkv_bias != self.o_bias and self.model_type != "qwen2":
            raise UnsupportedModelError("llama/qwen3 configs cannot express qkv_bias != o_bias")
        if self.model_type == "qwen2" and not (self.qkv_bias and not self.o_bias):
            raise UnsupportedModelError("qwen2 always has q/k/v biases and no o_proj bias")
        rope_parameters = {"rope_type": "default", "rope_theta": self.rope_theta}
        if self.rope_scaling is not None:
            rope_parameters.update(self.rope_scaling)
        hf = dict(self.extra)
        hf.update({
            "architectures": [self.architecture],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_parameters": rope_parameters,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "pad_token_id": self.pad_token_id,
        })
        if self.rope_scaling is not None:
            hf["rope_scaling"] = dict(self.rope_scaling)
        if self.model_type in ("llama", "qwen3"):
            hf["attention_bias"] = self.qkv_bias
        if self.model_type == "llama":
            hf["mlp_bias"] = self.mlp_bias
        if dtype is not None:
            hf["torch_dtype"] = str(dtype).removeprefix("torch.")
        return hf

    def to_dict(self) -> dict:
        return asdict(self)


# ------------------------------------------------------------------------------------------------
# the decoder
