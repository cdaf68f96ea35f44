"""Freed heap memory goes back to the OS (jetflow.host_memory), and activation checkpointing asks for it
after each layer's forward and after each layer's backward."""

import os
import platform
import subprocess
import sys

import pytest
import torch

from jetflow.host_memory import release_freed_memory
from jetflow.train import checkpointing

from tests.unit.test_activation_checkpointing import batch, step, exact_model

glibc = pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
                           reason="malloc_trim is glibc's")


def resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


@glibc
def test_freed_heap_blocks_are_resident_until_released():
    big = torch.ones(30 * 2**20, dtype=torch.uint8)  # mmapped; freed, it raises the mmap threshold to 30 MiB
    del big
    blocks = [torch.ones(2**20) for _ in range(128)]  # 128 x 4 MiB, now carved from the heap
    top = torch.ones(2**20)  # live above them: the heap cannot shrink from its top
    del blocks
    before = resident_bytes()
    release_freed_memory(keep_free=0)
    released = before - resident_bytes()
    assert released > 400 * 2**20, f"released {released / 2**20:.0f} MiB of the 512 MiB freed"
    assert top.sum() == 2**20


@pytest.mark.parametrize("release", [True, False])
def test_checkpointing_releases_memory_after_each_layers_forward_and_backward(monkeypatch, release):
    calls = []
    monkeypatch.setattr(checkpointing, "release_freed_memory", lambda: calls.append(1))
    model, cfg = exact_model("fp32", (f"train.release_host_memory={str(release).lower()}",))
    step(model, cfg, batch(model.config.vocab_size), checkpointing=True)
    layers = model.config.num_layers
    micro_batches = 2  # 3 sequences, train.micro_batch_size=2
    # one after each layer's forward, one after its backward (the recomputation does not add one)
    assert len(calls) == (2 * layers * micro_batches if release else 0)


@pytest.mark.parametrize("given, expected", [(None, "1"), ("0", "0")])
def test_the_cli_asks_torch_for_huge_pages_before_importing_it(given, expected):
    env = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    if given is not None:
        env["THP_MEM_ALLOC_ENABLE"] = given
    code = "import sys, os, jetflow.cli; assert 'torch' not in sys.modules; print(os.environ['THP_MEM_ALLOC_ENABLE'])"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == expected
