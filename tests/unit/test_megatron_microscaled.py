"""The Megatron trainer under the mxfp8 / nvfp4 recipes (issue 28), in one process (TP = PP = EP = 1):
MegatronPolicy(numerics="exact") gives the native exact Decoder's logits bit for bit, and its quantized
bytes are the native model's. (TP, PP and EP > 1 are not supported with these recipes yet: the shard
gathers of jetflow.train.megatron.weights carry FP8 blocks only, and NVFP4's weight tensor scale would
need a TP-wide amax.)"""

import copy

import pytest
import torch

from jetflow.precision import QuantRecipe, apply_precision, quantized_weights
from test_megatron import CONFIGS, left_padded_batch, megatron_process_group, random_decoder  # noqa: F401  (the fixture)
from test_megatron_exact_model import logits, needs_megatron


@needs_megatron
@pytest.mark.parametrize("family", ["mxfp8", "nvfp4"])
@pytest.mark.parametrize("model", ["llama", "qwen2"])
def test_exact_logits_and_bytes_equal_native(family, model):
    from jetflow.train import megatron as jm

    cfg, recipe = CONFIGS[model], QuantRecipe(family=family)
    base = random_decoder(cfg)
    native = apply_precision(copy.deepcopy(base), "fp8", recipe, numerics="exact")
    native.numerics = "exact"
    policy = jm.MegatronPolicy.from_decoder(base, kind="fp8", recipe=recipe, numerics="exact")
    native.embed_grid = policy.embed_grid = torch.bfloat16
    ids, mask = left_padded_batch(cfg.vocab_size)
    assert torch.equal(logits(policy, ids, mask), logits(native, ids, mask))
    mine, theirs = policy.quantized_weights(), quantized_weights(native)
    assert sorted(mine) == sorted(theirs)
    for name, q in mine.items():
        assert q.kind == family and all(torch.equal(a, b) for a, b in zip(q.parts().values(),
                                                                            theirs[name].parts().values()))
