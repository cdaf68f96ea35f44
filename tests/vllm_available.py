"""The vLLM test modules' one skip: `from vllm_available import vllm_importable` in a module makes its autouse
fixture skip the module, saying what to install, where vLLM cannot be imported (checked when the module's first
test runs, not when tests are collected: importing vLLM takes seconds)."""

from __future__ import annotations

import pytest

from jetflow.rollout.vllm import import_vllm


@pytest.fixture(scope="module", autouse=True)
def vllm_importable():
    try:
        import_vllm()
    except ImportError as e:
        pytest.skip(str(e))
