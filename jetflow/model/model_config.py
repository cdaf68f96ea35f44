"""The model's architecture description: `ModelConfig` (Llama / Qwen2 / Qwen3 families and the
Qwen3-MoE / Mixtral mixture-of-experts decoders), read from and written to Hugging Face `config.json`
dictionaries."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch

from jetflow.errors import UserError

SUPPORTED = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
}
MOE_TYPES = ("qwen3_moe", "mixtral")
"""model_types whose decoder layers hold a sparse mixture-of-experts block (jetflow.model.moe)."""
MOE_ATTR = {"qwen3_moe": "mlp", "mixtral": "block_sparse_moe"}
"""The attribute (and checkpoint name) of a layer's MoE block, as stored on disk."""


class UnsupportedModelError(UserError, ValueError):
    pass


@dataclass
class ModelConfig:
    """Hyperparameters of a Llama-family decoder (a subset of HF's config.json)."""

    model_type: str = "llama"
    """One of SUPPORTED: llama (also SmolLM2, Llama 3), qwen2, qwen3, qwen3_moe, mixtral."""
    vocab_size: int = 32000
    hidden_size: int = 576
    intermediate_size: int = 1536
    """Width of the dense MLPs (for Mixtral also the experts' width: see moe_intermediate_size)."""
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
    """Qwen3 (and Qwen3-MoE): RMSNorm over head_dim on q and k, before RoPE."""
    num_experts: int = 0
    """Routed experts per MoE layer; 0 for a dense model. HF: qwen3_moe `num_experts` (transformers 5
    writes it as `num_local_experts`), mixtral `num_local_experts`."""
    num_experts_per_tok: int = 0
    """Experts each token is routed to (top-k)."""
    moe_intermediate_size: int = 0
    """Each expert's SwiGLU width: qwen3_moe `moe_intermediate_size`, mixtral `intermediate_size`."""
    norm_topk_prob: bool = False
    """Renormalize the top-k router probabilities to sum to 1 (qwen3_moe's flag; Mixtral always does)."""
    decoder_sparse_step: int = 1
    """qwen3_moe: layer i is sparse iff (i + 1) % decoder_sparse_step == 0 and i not in mlp_only_layers."""
    mlp_only_layers: tuple[int, ...] = ()
    """qwen3_moe: layers that keep a dense MLP of width intermediate_size."""
    router_aux_loss_coef: float = 0.001
    """Weight of the load-balancing loss (jetflow.model.moe.load_balancing_loss) in HF's training loss."""
    output_router_logits: bool = False
    """HF's flag for returning router logits (and adding the aux loss); carried through, not used here."""
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    extra: dict = field(default_factory=dict, compare=False, repr=False)
    """Other HF config fields, carried so that save_hf_dir writes them back (not used here)."""

    @property
    def architecture(self) -> str:
        return SUPPORTED[self.model_type]

    @property
    def is_moe(self) -> bool:
        return self.model_type in MOE_TYPES

    @property
    def moe_attr(self) -> str:
        """The layer attribute holding the MoE block: `mlp` (Qwen3-MoE) or `block_sparse_moe` (Mixtral)."""
        return MOE_ATTR[self.model_type]

    def is_moe_layer(self, layer_idx: int) -> bool:
        """Whether decoder layer `layer_idx` holds a sparse MoE block (HF's Qwen3MoeDecoderLayer rule)."""
        return (self.is_moe and layer_idx not in self.mlp_only_layers
                and (layer_idx + 1) % self.decoder_sparse_step == 0)

    def linear_shapes(self) -> list[tuple[str, int, int]]:
        """(module name, out_features, in_features) of every nn.Linear of the Decoder (jetflow.model.decoder)
        built from this config, without building it (the memory estimate sizes the precisions' copies
        from them). lm_head is included even when tied to the embedding: its weight is then not a
        parameter of its own, but the precisions keep copies of it as of any linear."""
        h, q, kv = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        out = []
        for layer in range(self.num_layers):
            pre = f"model.layers.{layer}"
            out += [(f"{pre}.self_attn.q_proj", q, h), (f"{pre}.self_attn.k_proj", kv, h),
                    (f"{pre}.self_attn.v_proj", kv, h), (f"{pre}.self_attn.o_proj", h, q)]
            if self.is_moe_layer(layer):  # the router, then each expert's SwiGLU under the checkpoint's names
                moe, i = f"{pre}.{self.moe_attr}", self.moe_intermediate_size
                mixtral = self.model_type == "mixtral"
                gate, up, down = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
                out.append((f"{moe}.gate", self.num_experts, h))
                for e in range(self.num_experts):
                    out += [(f"{moe}.experts.{e}.{gate}", i, h), (f"{moe}.experts.{e}.{up}", i, h),
                            (f"{moe}.experts.{e}.{down}", h, i)]
            else:
                i = self.intermediate_size
                out += [(f"{pre}.mlp.gate_proj", i, h), (f"{pre}.mlp.up_proj", i, h), (f"{pre}.mlp.down_proj", h, i)]
        out.append(("lm_head", self.vocab_size, h))
        return out

    def num_parameters(self) -> int:
        """Parameters of the Decoder built from this config (a tied lm_head counted once), without building
        it: what `Decoder.num_params()` counts. The linears' weights and biases, the embedding, the norms
        (2 h a layer, q / k norms of head_dim each under qk_norm, the final norm)."""
        linears = self.linear_shapes()
        weights = sum(o * i for name, o, i in linears if not (name == "lm_head" and self.tie_word_embeddings))
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        biases = self.num_layers * ((q + 2 * kv) * self.qkv_bias + self.hidden_size * self.o_bias)
        if self.mlp_bias:
            biases += sum(o for name, o, _ in linears if name.endswith(("gate_proj", "up_proj", "down_proj")))
        norms = self.num_layers * (2 * self.hidden_size + 2 * self.head_dim * self.qk_norm) + self.hidden_size
        return weights + biases + norms + self.vocab_size * self.hidden_size

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
        moe = _moe_fields(model_type, hf)
        if moe:
            known |= MOE_KEYS
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
            qkv_bias=True if model_type == "qwen2" else attention_bias,  # mixtral: _moe_fields refuses biases
            o_bias=False if model_type == "qwen2" else attention_bias,
            mlp_bias=bool(hf.get("mlp_bias", False)) if model_type == "llama" else False,
            qk_norm=model_type in ("qwen3", "qwen3_moe"),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_id=hf.get("eos_token_id"),
            pad_token_id=hf.get("pad_token_id"),
            extra={k: v for k, v in hf.items() if k not in known},
            **moe,
        )

    def to_hf(self, dtype: torch.dtype | None = None) -> dict:
        """A config.json dict that transformers loads into the same architecture.

        RoPE is written both ways (`rope_parameters` for transformers >= 5, `rope_theta` /
        `rope_scaling` for older readers such as vLLM's pinned transformers)."""
        if self.qkv_bias != self.o_bias and self.model_type != "qwen2":
            raise UnsupportedModelError(f"{self.model_type} configs cannot express qkv_bias != o_bias")
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
        if self.model_type in ("llama", "qwen3", "qwen3_moe"):
            hf["attention_bias"] = self.qkv_bias
        if self.model_type == "llama":
            hf["mlp_bias"] = self.mlp_bias
        if self.is_moe:
            hf.update(self._moe_to_hf())
        if dtype is not None:
            hf["torch_dtype"] = str(dtype).removeprefix("torch.")
        return hf

    def _moe_to_hf(self) -> dict:
        """The MoE keys of config.json, under the names the model's real checkpoints (and vLLM) use."""
        common = {"num_experts_per_tok": self.num_experts_per_tok, "router_aux_loss_coef": self.router_aux_loss_coef,
                  "output_router_logits": self.output_router_logits}
        if self.model_type == "mixtral":
            if self.moe_intermediate_size != self.intermediate_size:
                raise UnsupportedModelError("mixtral experts have width intermediate_size: "
                                            "moe_intermediate_size must equal it")
            if not self.norm_topk_prob or self.decoder_sparse_step != 1 or self.mlp_only_layers:
                raise UnsupportedModelError("mixtral always renormalizes top-k and has an MoE block in every layer")
            if self.qkv_bias or self.o_bias or self.mlp_bias or self.qk_norm:
                raise UnsupportedModelError("mixtral has no biases and no q/k norms")
            return {"num_local_experts": self.num_experts, **common}
        return {"num_experts": self.num_experts, "moe_intermediate_size": self.moe_intermediate_size,
                "norm_topk_prob": self.norm_topk_prob, "decoder_sparse_step": self.decoder_sparse_step,
                "mlp_only_layers": list(self.mlp_only_layers), **common}

    def to_dict(self) -> dict:
        return asdict(self)


MOE_KEYS = {
    "num_experts", "num_local_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
    "decoder_sparse_step", "mlp_only_layers", "router_aux_loss_coef", "output_router_logits",
}
"""config.json keys that `_moe_fields` turns into ModelConfig fields (not carried in `extra`)."""


def _moe_fields(model_type: str, hf: dict) -> dict:
    """The MoE fields of ModelConfig from an HF config dict ({} for a dense model_type); refuses MoE
    settings this decoder does not implement. Absent keys take transformers' defaults."""
    if model_type not in MOE_TYPES:
        return {}
    if model_type == "mixtral":
        _check_mixtral(hf)
        fields = dict(num_experts=_default(hf.get("num_local_experts", hf.get("num_experts")), 8),
                      num_experts_per_tok=_default(hf.get("num_experts_per_tok"), 2),
                      moe_intermediate_size=hf["intermediate_size"], norm_topk_prob=True,
                      decoder_sparse_step=1, mlp_only_layers=())
    else:
        # transformers >= 5 writes qwen3_moe's `num_experts` as `num_local_experts` (an attribute_map
        # alias); the released Qwen3-MoE checkpoints (and vLLM) use `num_experts`
        fields = dict(num_experts=_default(hf.get("num_experts", hf.get("num_local_experts")), 128),
                      num_experts_per_tok=_default(hf.get("num_experts_per_tok"), 8),
                      moe_intermediate_size=_default(hf.get("moe_intermediate_size"), 768),
                      norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
                      decoder_sparse_step=_default(hf.get("decoder_sparse_step"), 1),
                      mlp_only_layers=tuple(hf.get("mlp_only_layers") or ()))
    fields.update(router_aux_loss_coef=float(_default(hf.get("router_aux_loss_coef"), 0.001)),
                  output_router_logits=bool(hf.get("output_router_logits", False)))
    experts, top_k = fields["num_experts"], fields["num_experts_per_tok"]
    if experts < 1 or not 1 <= top_k <= experts:
        raise UnsupportedModelError(f"{model_type}: need num_experts >= 1 and 1 <= num_experts_per_tok <= "
                                    f"num_experts, got {experts} and {top_k}")
    if fields["decoder_sparse_step"] < 1:
        raise UnsupportedModelError(f"decoder_sparse_step={fields['decoder_sparse_step']} is not supported (>= 1)")
    layers = hf["num_hidden_layers"]
    bad = [i for i in fields["mlp_only_layers"] if not 0 <= i < layers]
    if bad:
        raise UnsupportedModelError(f"mlp_only_layers {bad} are not layers of a {layers}-layer model")
    return fields


def _check_mixtral(hf: dict) -> None:
    """Mixtral settings the decoder does not implement: a sliding window that can bite, router jitter."""
    window = hf.get("sliding_window")
    if window is not None and window < hf.get("max_position_embeddings", 4096 * 32):
        raise UnsupportedModelError(f"mixtral sliding_window={window} (shorter than max_position_embeddings) "
                                    "is not supported: only full attention (sliding_window null)")
    if hf.get("router_jitter_noise"):
        raise UnsupportedModelError("mixtral router_jitter_noise > 0 (training-time noise on the router "
                                    "input) is not supported")
    if hf.get("attention_bias") or hf.get("mlp_bias"):
        raise UnsupportedModelError("mixtral has no biases")


def _default(value, default):
    """`value`, or `default` where config.json has null or lacks the key (0 is a value)."""
    return default if value is None else value


# ------------------------------------------------------------------------------------------------
# the decoder
