"""The policy's attention: transformers' SDPA, with grouped-query attention inside the kernel on CPU
when no gradient is taken.

    use_fast_attention(model)     # after loading: "sdpa" -> "sdpa_gqa" (other implementations unchanged)

Why: a grouped-query model (Qwen3: 4 query heads share 2 key/value heads in the built-in models)
under transformers' "sdpa" copies every key and value head to each query head it serves
(`repeat_kv`, one (B, H, L, D) copy per layer and forward) unless there is no attention mask,
which sampling and training always have. PyTorch's CPU kernel takes the shared heads itself
(`enable_gqa=True`) and gives the same output bit for bit (tests/test_fast_attention.py); at the
quickstart's decoding shape (128 rows, one query, ~30 keys) it is about twice as fast.

What is not promised: the gradients. Where a gradient flows into the keys or values, the kernel's
backward sums the shared heads in another order than the copy's backward (differences of ~2e-7),
so there the forward is transformers' own, unchanged. The kernel path is taken only on CPU (CUDA's
fused kernels do not take a mask with `enable_gqa`, and would fall back to the math kernel).
"""

from __future__ import annotations

import torch

NAME = "sdpa_gqa"


def _sdpa():
    from transformers.integrations.sdpa_attention import sdpa_attention_forward  # noqa: PLC0415 - transformers is heavy

    return sdpa_attention_forward


def sdpa_gqa_forward(
    module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' `sdpa_attention_forward`, with the key/value heads shared inside the kernel
    (no `repeat_kv` copy) when that gives the same numbers: on CPU, no gradient into the keys or
    values, a plain boolean or float mask (no position bias, paged cache or attention weights)."""
    groups = getattr(module, "num_key_value_groups", 1)
    grad = torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad)
    plain = not any(kwargs.get(k) for k in ("position_bias", "cache", "output_attentions"))
    if groups == 1 or grad or not plain or query.device.type != "cpu":
        return _sdpa()(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )
    q_len, kv_len = query.shape[2], key.shape[2]
    # transformers' rule: the causal flag only without a mask, while prefilling, on a causal module
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    causal = q_len > 1 and attention_mask is None and causal
    if causal and kv_len > q_len:  # an empty static cache's prefill: the keys past the queries are unused
        key, value = key[:, :, :q_len], value[:, :, :q_len]
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, is_causal=causal, enable_gqa=True
    )
    return out.transpose(1, 2).contiguous(), None


def register() -> None:
    """Make NAME a transformers attention implementation (its masks are SDPA's); idempotent."""
    # PLC0415, deferred: torch is heavy
    from transformers import AttentionInterface  # noqa: PLC0415
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask  # noqa: PLC0415

    AttentionInterface.register(NAME, sdpa_gqa_forward)
    ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, sdpa_mask)


def use_fast_attention(model) -> None:
    """Switch a model loaded with transformers' "sdpa" to NAME (the same numbers; see the module
    docstring); any other implementation (eager, flash, a model without SDPA) is left as it is."""
    if getattr(model.config, "_attn_implementation", None) != "sdpa":
        return
    register()
    model.set_attn_implementation(NAME)
