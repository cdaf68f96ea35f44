"""The Llama-family decoder: Llama 3 (incl. "llama3" RoPE scaling), Qwen2 / Qwen2.5
(q/k/v biases), Qwen3 (RMSNorm on q and k per head), SmolLM2 (Llama architecture).

This module holds ModelConfig and the Decoder with its forward passes; the attention (RoPE,
AttentionPlan, the SDPA / invariant-kernel dispatch) lives in jetflow.model.attention, RMSNorm and
the MLP in jetflow.model.layers. Their names stay importable from here.

Design rules (other parts of jetflow rely on them):
- Module and parameter names mirror Hugging Face exactly (`model.layers.0.self_attn.q_proj.weight`,
  ...), so `state_dict()` keys equal HF checkpoint keys.
- Every projection is a plain `nn.Linear` that is *called* (never `F.linear(x, module.weight)`), so
  the precision converter can swap any of them for an FP8 linear by name and the swap takes effect.
- Numerics follow transformers' implementation (RMSNorm in fp32 then cast, RoPE cos/sin in fp32 then
  cast to the activation dtype), so fp32 logits agree with HF to ~1e-5.

Shapes: B batch, T new tokens in this forward, S key slots attended (T, or cache.length + T),
C hidden size, H query heads, H_kv key/value heads, D head dim, V vocab.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch
import torch.nn as nn

from jetflow.kernels import invariant
from jetflow.model.attention import (  # noqa: F401  (re-exported: jetflow.model.decoder.apply_rope, ...)
    Attention,
    AttentionPlan,
    apply_rope,
    attention_plan,
    rope_inv_freq,
    rotate_half,
)
from jetflow.model.kv_cache import KVCache
from jetflow.model.layers import MLP, RMSNorm, silu_exact  # noqa: F401  (re-exported)

# model_type -> HF architecture class name
SUPPORTED = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}


class UnsupportedModelError(ValueError):
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


NUMERICS = ("fast", "exact")
"""fast: torch's kernels (SDPA, BLAS). exact: the batch-invariant kernels (jetflow.kernels.invariant),
so a token's hidden states come out bit for bit the same in a full forward, a prefill and a cached
decode, whatever else is in the batch."""


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.self_attn = Attention(config, layer_idx)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, cos, sin, plan: AttentionPlan, cache):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, plan, cache)
        x = x + self.mlp(self.post_attention_layernorm(x), plan.exact)
        return x  # (B, T, C)


class Decoder(nn.Module):
    """A causal LM. `Decoder(config)` gives random weights; use `jetflow.model.load` for a checkpoint."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        if config.num_heads % config.num_kv_heads:
            raise ValueError(f"num_heads {config.num_heads} not a multiple of num_kv_heads {config.num_kv_heads}")
        self.config = config
        self.model = nn.Module()  # the HF "model." prefix
        self.model.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.model.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.model.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()
        # RoPE inverse frequencies (D/2,), a non-persistent buffer (not in the state dict). Made on
        # the CPU even when the model is built on the meta device, and kept fp32 by `_apply`.
        self.register_buffer("rope_inv_freq", rope_inv_freq(config, device="cpu"), persistent=False)
        self.numerics = "fast"
        """fast | exact (NUMERICS): set with the precision of the linears (jetflow.run.build)."""
        self.embed_grid: torch.dtype | None = None
        """Round embedding outputs to this dtype's grid (bf16 under the bf16 / mixed / unified modes,
        as the recipe keeps embeddings in bf16): trainer and rollout then agree on them, and the
        embedding can ship in bf16 (jetflow.sync)."""

    def _apply(self, fn, recurse=True):
        """After .to() / .cuda() / .bfloat16(): recompute rope_inv_freq in fp32 on its new device, so
        that a bf16 model does not rotate with bf16-rounded frequencies."""
        super()._apply(fn, recurse)
        self.rope_inv_freq = rope_inv_freq(self.config, device=self.rope_inv_freq.device)
        return self

    def tie_weights(self) -> None:
        """With tie_word_embeddings, lm_head.weight *is* the embedding matrix (one Parameter)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        cache: KVCache | None = None,
    ) -> torch.Tensor:
        """Logits (B, T, V) for input_ids (B, T). See `forward_hidden` for the arguments."""
        return self.lm_head(self.forward_hidden(input_ids, position_ids, attention_mask, cache))

    def forward_hidden(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        cache: KVCache | None = None,
    ) -> torch.Tensor:
        """Final hidden states (B, T, C), after the last norm and before lm_head.

        input_ids: (B, T) new tokens.
        attention_mask: bool, True = real token, False = padding. Without a cache: (B, T), any
            padding in fast numerics, one contiguous run of real tokens per row in exact numerics
            (left-padded prompt + right-padded response, as a trainer batch is). With a cache:
            (B, cache.length + T) covering every slot so far, left padding, fast numerics only.
        position_ids: (B, T). Default: the number of real tokens before each token,
            `cumsum(attention_mask) - 1` (= arange without padding); with a cache and no mask,
            arange(cache.length, cache.length + T).
        cache: if given, the T new tokens are written into it and attend to its earlier slots; then
            this method raises cache.length. With an attention_mask, slots [cache.length,
            cache.length + T) of every row; without one, slot = position (right-padded rows: row b's
            token at position p goes to slot p and attends slots 0..p), the layout the rollout
            engine uses and exact numerics needs.

        Each token attends to the valid slots at or before its own. A padding token attends only to
        itself (fast) or to the slots before it (exact), so its (meaningless) outputs stay finite.
        """
        exact = self.numerics == "exact"
        if exact:
            invariant.check_device(input_ids.device)
        B, T = input_ids.shape
        L = cache.length if cache is not None else 0
        device = input_ids.device
        if attention_mask is not None:
            S = L + T
            if attention_mask.shape != (B, S):
                raise ValueError(
                    f"attention_mask must be (B, cache.length + T) = ({B}, {S}), got {tuple(attention_mask.shape)}")
            attention_mask = attention_mask.to(device=device, dtype=torch.bool)
            if exact:
                if cache is not None:
                    raise ValueError("exact numerics with a KV cache need right-padded rows (slot = position): "
                                     "pass position_ids, not an attention_mask")
                if position_ids is not None:
                    raise ValueError("exact numerics with an attention_mask derive the positions themselves; "
                                     "do not pass position_ids")
                return self._forward_aligned(input_ids, attention_mask)
        if position_ids is None:
            if attention_mask is not None:
                position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)[:, L:]  # (B, T)
            else:
                position_ids = torch.arange(L, L + T, device=device).expand(B, T)
        elif exact and cache is None and not torch.equal(position_ids, torch.arange(T, device=device).expand(B, T)):
            raise ValueError("exact numerics without a KV cache need slot = position: position_ids must be arange(T)")
        plan = attention_plan(position_ids, attention_mask, cache, exact)

        x = self.model.embed_tokens(input_ids)  # (B, T, C)
        if self.embed_grid is not None:  # the embedding computes on the bf16 grid (precision modes)
            x = x.to(self.embed_grid).to(x.dtype)
        # RoPE tables in fp32, then cast to the activation dtype (as transformers does)
        freqs = position_ids[..., None].float() * self.rope_inv_freq  # (B, T, D/2)
        emb = torch.cat((freqs, freqs), dim=-1)[:, None]  # (B, 1, T, D)
        cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)

        for layer in self.model.layers:
            x = layer(x, cos, sin, plan, cache)
        if cache is not None:
            cache.advance_to(plan.end)
        return self.model.norm(x)  # (B, T, C)

    def _forward_aligned(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Exact numerics on padded rows: shift each row so its real tokens start at slot 0 (slot =
        position, as in the rollout engine's cache), run, and shift the hidden states back."""
        B, T = input_ids.shape
        cols = torch.arange(T, device=input_ids.device)
        start = attention_mask.long().argmax(-1)  # (B,) first real token
        count = attention_mask.sum(-1)  # (B,)
        run = (cols[None] >= start[:, None]) & (cols[None] < (start + count)[:, None])
        if not torch.equal(run, attention_mask):
            raise ValueError("exact numerics need each row's real tokens to be one contiguous run "
                             "(left-padded prompt, right-padded response)")
        shift = (start[:, None] + cols[None]) % T  # (B, T): aligned column j holds original column shift[b, j]
        hidden = self.forward_hidden(input_ids.gather(1, shift))  # (B, T, C), positions arange(T)
        back = (cols[None] - start[:, None]) % T  # (B, T)
        return hidden.gather(1, back[..., None].expand(-1, -1, hidden.shape[-1]))

    def new_cache(self, batch_size: int, max_len: int, dtype: torch.dtype | None = None, device=None) -> KVCache:
        """A KVCache for this model (dtype/device default to the embedding's; K transposed under exact
        numerics, the layout the invariant attention reads)."""
        w = self.model.embed_tokens.weight
        return KVCache.for_model(self.config, batch_size, max_len, dtype or w.dtype, device or w.device,
                                 k_transposed=self.numerics == "exact")

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())  # shared (tied) parameters counted once
