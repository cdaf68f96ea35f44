"""`jetflow bench rollout --lengths`: the response-length distributions and the page arithmetic of the
fit table, on SmolLM2-135M's shapes (30 layers, 3 KV heads of 64)."""

import pytest

from jetflow.bench.kv_cache import fit_table, response_lengths
from jetflow.model import ModelConfig

SMOLLM2 = ModelConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
                      num_kv_heads=3, head_dim=64)


def test_kv_bytes_per_token_and_sequences_that_fit_two_gib():
    rows = {r["storage"]: r for r in fit_table(SMOLLM2, 2 * 2**30, 64, 4096)}
    assert rows["fp32"]["kv_bytes_per_token"] == 46080 and rows["fp8 e4m3"]["kv_bytes_per_token"] == 11520
    assert rows["fp32"]["pages_per_sequence"] == 65  # ceil(4160 / 64)
    assert rows["fp32"]["sequences_that_fit"] == 11 and rows["fp8 e4m3"]["sequences_that_fit"] == 44


def test_response_lengths():
    assert response_lengths("fixed", 3, 50) == [50, 50, 50]
    tail = response_lengths("longtail", 1000, 2048, seed=1)
    assert min(tail) >= 1 and max(tail) <= 2048 and sorted(tail)[500] < 2048 / 8 < max(tail) / 4
    assert response_lengths("eos", 3, 50) is None
    with pytest.raises(ValueError, match="one of"):
        response_lengths("uniform", 3, 50)
