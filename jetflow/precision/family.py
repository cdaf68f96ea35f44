"""One strategy per recipe family (fp8_block, mxfp8, nvfp4): what differs between them, chosen once.

`family_of(recipe)` is the one place a recipe's family is looked up; a linear asks it once, when it is
given its recipe (PrecisionLinear, the Megatron linears), and keeps the strategy. Everything a family
decides is a method or attribute of its strategy (`RecipeFamily`), so no other module tests
`recipe.family`:

  quantize_weight         the weight's bytes: a QuantizedTensor (fp8_block), an MXTensor or an NVFP4Tensor
  linear                  the recipe's linear with its fprop, dgrad and wgrad (autograd), fast or exact
  exact_product           the exact fprop without autograd (rollout, no-grad log-probs): x2 (M, K) -> (M, N)
                          fp32; the linear's exact fprop computes the same function (one route:
                          jetflow.precision.exact calls one of the two)
  exact_reads_bytes       the exact GEMMs read the quantized bytes (no dequantized fp32 copy is worth keeping)
  gathers_in_fp8          FSDP's all-gather moves the family's bytes (jetflow.train.fsdp.gather)
  static_input_scales     its export carries each linear's static input scale (NVFP4's, for vLLM's kernels)
  all_backends_read       the recipe's blocks are ones vLLM, Megatron-Core and FSDP lay out
  quantization_config     config.json's `quantization_config` for an export (vLLM block-FP8 or ModelOpt)
  checkpoint_tensors      one linear's tensors in that export layout
  held_bytes_per_weight   bytes a linear keeps per weight element beside the weight (the memory estimate)

The strategies: jetflow.precision.fp8_function.FP8Block, jetflow.precision.microscaled.MXFP8 / NVFP4.
"""

from __future__ import annotations

from typing import Protocol

import torch

from jetflow.precision.fp8_function import FP8Block
from jetflow.precision.microscaled import MXFP8, NVFP4
from jetflow.precision.recipe import QuantRecipe


class RecipeFamily(Protocol):
    """A recipe family's strategy (see the module docstring)."""

    name: str
    gathers_in_fp8: bool
    static_input_scales: bool
    exact_reads_bytes: bool

    def quantize_weight(self, weight: torch.Tensor, recipe: QuantRecipe, name: str = "weight"): ...

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, wq, recipe: QuantRecipe,
               backend: str = "auto", name: str = "linear", numerics: str = "fast", groups: int | None = None,
               combine=None) -> torch.Tensor: ...

    def exact_product(self, x2: torch.Tensor, wq, recipe: QuantRecipe, name: str = "linear",
                      groups: int | None = None, combine=None, cache=None) -> torch.Tensor: ...

    def all_backends_read(self, recipe: QuantRecipe) -> bool: ...

    def quantization_config(self, recipe: QuantRecipe, ignored_layers=()) -> dict: ...

    def checkpoint_tensors(self, module: str, q, input_scale: float = 1.0) -> dict[str, torch.Tensor]: ...

    def held_bytes_per_weight(self, numerics: str, cuda: bool, trainer: bool) -> float: ...


STRATEGIES: dict[str, RecipeFamily] = {"fp8_block": FP8Block(), "mxfp8": MXFP8(), "nvfp4": NVFP4()}
"""By family name, in the order of jetflow.precision.recipe.FAMILIES."""


def family_of(recipe: QuantRecipe) -> RecipeFamily:
    """The strategy of `recipe`'s family."""
    return STRATEGIES[recipe.family]


def quantize_weight_for_recipe(weight: torch.Tensor, recipe: QuantRecipe, name: str = "weight"):
    """The weight's bytes under `recipe`: a QuantizedTensor (fp8_block), an MXTensor or an NVFP4Tensor."""
    return family_of(recipe).quantize_weight(weight, recipe, name)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, wq, recipe: QuantRecipe,
               backend: str = "auto", name: str = "linear", numerics: str = "fast",
               groups: int | None = None) -> torch.Tensor:
    """The recipe's quantized linear (fprop, dgrad, wgrad) of any family; `wq` is `weight` quantized by it.
    A caller that runs many steps keeps `family_of(recipe)` and calls its `linear`."""
    return family_of(recipe).linear(x, weight, bias, wq, recipe, backend, name, numerics, groups)
