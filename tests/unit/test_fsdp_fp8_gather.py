"""FSDP's FP8 all-gather quantizes each rank's row shard of a weight by itself (jetflow.train.fsdp.fp8_gather):
the shards' bytes stacked must be the bytes quantize_blocks gives the whole weight, for shards on and off
the 128-row block boundaries, FSDP's uneven last shard, and both scale rules. Ranks are simulated here by
torch.chunk (FSDP's sharding) and the MAX of their amax grids (the all-reduce); the same path across real
ranks runs in tests/integration/fsdp_fp8_gather_worker.py."""

import pytest
import torch

from jetflow.precision.quant import compute_scale_inv, quantize_blocks, quantize_row_shard, row_shard_amax


def _weight(rows: int, cols: int) -> torch.Tensor:
    torch.manual_seed(rows * 1000 + cols)
    w = torch.randn(rows, cols)
    # blocks of very different magnitudes, so a shard using another block's scale would get other bytes
    return w * torch.logspace(2, -3, rows)[:, None]


@pytest.mark.parametrize("rows,cols", [(576, 576), (192, 576), (1536, 256), (70, 200)])
@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("scale_rule", ["fp32", "pow2"])
def test_row_shards_quantized_alone_give_the_whole_weights_bytes(rows, cols, world, scale_rule):
    w = _weight(rows, cols)
    whole = quantize_blocks(w, (128, 128), "e4m3", scale_rule)
    chunk = -(-rows // world)  # FSDP's shard: torch.chunk's
    shards = [(r * chunk, s) for r, s in enumerate(torch.chunk(w, world))]
    amax = torch.stack([row_shard_amax(s, offset, rows, (128, 128)) for offset, s in shards]).amax(0)
    scale_inv = compute_scale_inv(amax, "e4m3", scale_rule)
    data = torch.cat([quantize_row_shard(s, offset, scale_inv, (128, 128)) for offset, s in shards])
    assert torch.equal(scale_inv, whole.scale_inv)
    assert torch.equal(data.view(torch.uint8), whole.data.view(torch.uint8))


def test_a_shard_alone_does_not_know_the_blocks_it_shares():
    """Why the ranks all-reduce the amax: 576 rows at 2 ranks split block 2 (rows 256-383) between them;
    with only its own rows' amax, rank 1 quantizes its half of that block with another scale."""
    w = _weight(576, 576)
    whole = quantize_blocks(w, (128, 128))
    top, bottom = torch.chunk(w, 2)  # rows 0-287, 288-575
    alone = compute_scale_inv(row_shard_amax(bottom, 288, 576, (128, 128)), "e4m3")
    assert not torch.equal(alone[2], whole.scale_inv[2])  # rows above it: larger values
    assert torch.equal(alone[3:], whole.scale_inv[3:])  # its own whole blocks
