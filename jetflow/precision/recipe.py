"""The one low-precision recipe that the trainer and the rollout engine both apply.

A recipe family (`family`, Transformer Engine's recipe names) fixes each operand role's element
format, block shape, scale format and rounding (`operand(role)`):

  fp8_block  DeepSeek-V3 style block scaling, as in Jet-RL (arXiv 2601.14243) and FP8-RL (arXiv
             2601.18150), TE's Float8BlockScaling: weights in 128x128 blocks, activations and output
             gradients in 1x128 groups along the contraction dimension, the weight-gradient GEMM's
             second operand in 128x1 groups. E4M3 everywhere by default; `hybrid` keeps gradients in
             E5M2. One fp32 `scale_inv` per block (value = fp8 * scale_inv), optionally rounded up to
             a power of two (UE8M0-compatible). The default, and the recipe of every earlier run.
  mxfp8      TE's MXFP8BlockScaling (OCP MX): E4M3 values (E5M2 gradients under `hybrid`) in 1x32
             blocks along each GEMM's contraction dimension, one E8M0 power-of-two scale per block
             (jetflow.precision.mx).
  nvfp4      TE's NVFP4BlockScaling: E2M1 values, 1x16 blocks with E4M3 scales under an fp32 tensor
             scale; weights in 16x16 blocks (W and W^T share bytes), activations with one tensor scale
             per token row (TE's row-scaled NVFP4: a row's bytes do not depend on the batch), gradients
             stochastically rounded, a 16-point random Hadamard transform on both wgrad operands
             (jetflow.precision.nvfp4).

The recipe's `fingerprint()` is a short hash of every field that changes the bytes; trainer and
rollout log it and refuse to pair weights made under another one. The fp8_block family leaves
`family` out of the hash, so its fingerprints are those of the runs made before families existed.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import hashlib
import json
from dataclasses import dataclass
from typing import Literal

import torch

FORMATS = ("e4m3", "hybrid")
SCALE_RULES = ("fp32", "pow2")
FAMILIES = ("fp8_block", "mxfp8", "nvfp4")
ROLES = ("weight", "activation", "gradient")

FP8_DTYPES = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
FP8_MAX = {"e4m3": 448.0, "e5m2": 57344.0}
GRAD_PRECISIONS = ("fp8", "bf16")

# family -> (weight block, activation / gradient group, fields that do not apply to it)
_FAMILY_BLOCKS = {"mxfp8": ((1, 32), 32, ("scale_rule", "margin", "dgrad", "wgrad")),
                  "nvfp4": ((16, 16), 16, ("fmt", "scale_rule", "margin", "dgrad", "wgrad"))}
# fields written into to_dict (and so the fingerprint) only when they differ from their default: fields
# added after runs were made, whose recipes keep the fingerprints they had
_LATER_FIELDS = ("dgrad", "wgrad")


@dataclass(frozen=True)
class OperandSpec:
    """How one operand role is quantized for its GEMM (blocks run along the GEMM's contraction dim)."""

    element: str
    """e4m3 | e5m2 | e2m1."""
    block: tuple[int, int]
    """Scaling block of the operand as stored (rows, columns): (128, 128), (1, 128), (1, 32), (16, 16) ..."""
    scale: str
    """fp32 (amax / max), pow2 (fp32 rounded up to a power of two), e8m0 (a power of two in one byte), or
    e4m3+fp32 (an E4M3 block scale under an fp32 tensor scale, NVFP4's two levels)."""
    rounding: str = "nearest_even"
    """nearest_even | stochastic (gradients of nvfp4, from a generator seeded by the tensor itself)."""
    hadamard: bool = False
    """The wgrad GEMM's operands pass a 16-point random Hadamard transform along the tokens first."""


@dataclass(frozen=True)
class QuantRecipe:
    """The recipe of every low-precision linear, whichever family (fp8_block, mxfp8, nvfp4) it quantizes with."""

    fmt: Literal["e4m3", "hybrid"] = "e4m3"
    """`e4m3` for every operand, or `hybrid`: E4M3 weights and activations, E5M2 gradients."""
    weight_block: tuple[int, int] = (128, 128)
    """Weight scaling block (rows of the output dim, columns of the input dim)."""
    group_size: int = 128
    """Activation and gradient group length along the GEMM's contraction dimension (1 x group)."""
    scale_rule: Literal["fp32", "pow2"] = "fp32"
    """`fp32`: scale_inv = amax / fp8_max exactly. `pow2`: rounded up to a power of two."""
    margin: int = 0
    """Headroom in powers of two: scale_inv = amax * 2**margin / fp8_max (TE's `margin`)."""
    keep_high_precision: tuple[str, ...] = ("*embed_tokens*", "*lm_head*", "*norm*", "*router*",
                                            "*.mlp.gate", "*.block_sparse_moe.gate")
    """fnmatch patterns of full module names that stay in bf16 (embeddings, lm_head, norms, MoE routers:
    Qwen3-MoE's `model.layers.N.mlp.gate` and Mixtral's `...block_sparse_moe.gate`, matched whole so
    that `mlp.gate_proj` is not)."""
    keep_first_layers: int = 0
    """The first N decoder layers stay in bf16."""
    keep_last_layers: int = 0
    """The last N decoder layers stay in bf16."""
    family: Literal["fp8_block", "mxfp8", "nvfp4"] = "fp8_block"
    """fp8_block | mxfp8 | nvfp4 (see the module docstring). The mxfp8 and nvfp4 families set
    weight_block and group_size to their own blocks and refuse a non-default value of a field they do not use."""
    dgrad: Literal["fp8", "bf16"] = "fp8"
    """The input-gradient GEMM (dX = dY @ W): `fp8` (the recipe's gradient groups and weight blocks) or
    `bf16` (dY and the high-precision weight rounded to bf16, fp32 accumulation). fp8_block only."""
    wgrad: Literal["fp8", "bf16"] = "fp8"
    """The weight-gradient GEMM (dW = dY^T @ X): `fp8`, or `bf16` (dY and the input X rounded to bf16, X
    saved for backward in bf16 instead of FP8: torchao's ROWWISE_WITH_GW_HP). With dgrad=bf16 too, FP8
    is the forward's alone ("forward-only FP8"). fp8_block only."""

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"QuantRecipe.family={self.family!r}: valid families are {FAMILIES}")
        if self.family != "fp8_block":
            self._family_blocks()
        if self.fmt not in FORMATS:
            raise ValueError(f"QuantRecipe.fmt={self.fmt!r}: valid formats are {FORMATS}")
        if self.scale_rule not in SCALE_RULES:
            raise ValueError(f"QuantRecipe.scale_rule={self.scale_rule!r}: valid rules are {SCALE_RULES}")
        block = tuple(int(b) for b in self.weight_block)
        if len(block) != 2 or min(block) < 1:
            raise ValueError(f"QuantRecipe.weight_block={self.weight_block!r}: need two positive ints")
        object.__setattr__(self, "weight_block", block)
        object.__setattr__(self, "keep_high_precision", tuple(self.keep_high_precision))
        if self.group_size < 1:
            raise ValueError(f"QuantRecipe.group_size={self.group_size}: must be >= 1")
        for name in ("dgrad", "wgrad"):
            if getattr(self, name) not in GRAD_PRECISIONS:
                raise ValueError(f"QuantRecipe.{name}={getattr(self, name)!r}: valid values are {GRAD_PRECISIONS}")
        if self.margin < 0 or self.keep_first_layers < 0 or self.keep_last_layers < 0:
            raise ValueError("QuantRecipe.margin, keep_first_layers and keep_last_layers must be >= 0")

    def _family_blocks(self) -> None:
        """mxfp8 / nvfp4: weight_block and group_size are the family's (the fp8_block defaults are
        accepted and replaced); the fields the family does not use must keep their defaults."""
        block, group, unused = _FAMILY_BLOCKS[self.family]
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        if tuple(self.weight_block) not in (tuple(defaults["weight_block"]), block):
            raise ValueError(f"QuantRecipe.weight_block={list(self.weight_block)}: the {self.family} family's weight "
                             f"blocks are {list(block)}")
        if self.group_size not in (defaults["group_size"], group):
            raise ValueError(f"QuantRecipe.group_size={self.group_size}: the {self.family} family's groups are {group}")
        for name in unused:
            if getattr(self, name) != defaults[name]:
                raise ValueError(f"QuantRecipe.{name}={getattr(self, name)!r} does not apply to the {self.family} family")
        object.__setattr__(self, "weight_block", block)
        object.__setattr__(self, "group_size", group)

    # Operand formats -----------------------------------------------------------------------
    @property
    def forward_format(self) -> str:
        """Format of weights and activations."""
        return "e4m3"

    @property
    def grad_format(self) -> str:
        """Format of output gradients in dgrad / wgrad."""
        return "e5m2" if self.fmt == "hybrid" else "e4m3"

    def operand(self, role: str) -> OperandSpec:
        """How `role` (weight | activation | gradient) is quantized. The activation and gradient blocks
        run along each GEMM's contraction dim (in wgrad: the tokens)."""
        if role not in ROLES:
            raise ValueError(f"operand role {role!r}: valid roles are {ROLES}")
        if self.family == "nvfp4":
            return {"weight": OperandSpec("e2m1", (16, 16), "e4m3+fp32"),
                    "activation": OperandSpec("e2m1", (1, 16), "e4m3+fp32"),
                    "gradient": OperandSpec("e2m1", (1, 16), "e4m3+fp32", "stochastic", hadamard=True)}[role]
        fmt = self.grad_format if role == "gradient" else self.forward_format
        if self.family == "mxfp8":
            return OperandSpec(fmt, (1, 32) if role != "weight" else self.weight_block, "e8m0")
        block = self.weight_block if role == "weight" else (1, self.group_size)
        return OperandSpec(fmt, block, self.scale_rule)

    @property
    def canonical_blocks(self) -> bool:
        """fp8_block with 128x128 weight blocks and 1x128 groups: the blocks the FP8 kernels read
        (jetflow.kernels.invariant.fp8_gemm, cuBLAS and the Triton GEMM). Other fp8_block sizes (32-wide
        blocks, say) run on their dequantized values (jetflow.precision.gemm.fp8_matmul)."""
        return self.family == "fp8_block" and self.weight_block == (128, 128) and self.group_size == 128

    # Which modules are quantized ------------------------------------------------------------
    def keeps_in_high_precision(self, module_name: str, layer_index: int | None = None,
                                num_layers: int | None = None) -> bool:
        """True if `module_name` stays in bf16 under this recipe."""
        if any(fnmatch.fnmatch(module_name, pattern) for pattern in self.keep_high_precision):
            return True
        if layer_index is not None:
            if layer_index < self.keep_first_layers:
                return True
            if num_layers is not None and layer_index >= num_layers - self.keep_last_layers:
                return True
        return False

    # Identity -------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        """Every field that applies: fp8_block without `family` (the fingerprints of earlier runs),
        mxfp8 / nvfp4 without the fields they do not use, dgrad / wgrad only where not `fp8` (the same)."""
        d = dataclasses.asdict(self)
        d["weight_block"] = list(self.weight_block)
        d["keep_high_precision"] = list(self.keep_high_precision)
        for name in _LATER_FIELDS:
            if d[name] == "fp8":
                del d[name]
        if self.family == "fp8_block":
            del d["family"]
        else:
            for name in _FAMILY_BLOCKS[self.family][2]:
                d.pop(name, None)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "QuantRecipe":
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - fields
        if unknown:
            raise ValueError(f"unknown QuantRecipe keys {sorted(unknown)}; valid keys: {sorted(fields)}")
        d = dict(d)
        if "weight_block" in d:
            d["weight_block"] = tuple(d["weight_block"])
        if "keep_high_precision" in d:
            d["keep_high_precision"] = tuple(d["keep_high_precision"])
        return cls(**d)

    def fingerprint(self) -> str:
        """Short stable hash of every field: two recipes with one fingerprint make the same bytes."""
        payload = json.dumps(self.to_dict(), sort_keys=True).encode()
        return hashlib.sha256(payload).hexdigest()[:12]

    def vllm_quantization_config(self, ignored_layers: list[str] | tuple[str, ...] = ()) -> dict:
        """The `quantization_config` block of config.json in the vLLM / DeepSeek FP8 layout (fp8_block;
        the mxfp8 and nvfp4 families write ModelOpt's: jetflow.precision.export.quantization_config).

        ignored_layers: the linear modules the export stores in high precision (vLLM's Fp8Config reads
        them and gives those layers its unquantized method; without them it would expect FP8 bytes and
        scales for every linear it builds with the quant config, Qwen3-MoE's router among them)."""
        if self.family != "fp8_block":
            raise ValueError(f"the {self.family} family exports ModelOpt's layout: "
                             "jetflow.precision.export.quantization_config")
        qc = {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": list(self.weight_block),
            "jetflow_recipe": self.to_dict(),
            "jetflow_fingerprint": self.fingerprint(),
        }
        if ignored_layers:
            qc["ignored_layers"] = sorted(ignored_layers)
        return qc


class RecipeMismatchError(RuntimeError):
    """Weights made under one recipe were offered to a consumer running another."""


def check_fingerprint(expected: str, got: str, what: str = "weights") -> None:
    if expected != got:
        raise RecipeMismatchError(
            f"{what} were quantized under recipe {got}, but this side runs recipe {expected}; "
            "refusing to pair them (requantizing would break on-policy FP8)")
