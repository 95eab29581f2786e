"""Mixture-of-experts models in the trainer: the routers' load-balancing loss of a forward.

    with RouterLogits(model, on=coef > 0) as routed:        # hooks every router of the model
        logp, entropy = completion_logprobs(model, mb)
    aux = routed.aux_loss(mb.attention_mask)                 # Switch Transformer's loss, transformers' code

A router is a module transformers calls `*TopKRouter` (Qwen3-MoE, Mixtral, ...: returns (logits,
top-k weights, top-k indices)); its logits are collected in the decoder layers' order, while the
context is open: an activation-checkpoint recompute (during backward, after the context) adds none.
"""

from __future__ import annotations

import torch


def routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's routers, in module order (= decoder layer order)."""
    return [m for m in model.modules() if type(m).__name__.endswith("TopKRouter")]


class RouterLogits:
    """Collects each router's logits (tokens, experts) during one forward; `on=False`: a no-op (None)."""

    def __init__(self, model: torch.nn.Module, *, on: bool = True):
        self.model, self.on = model, on
        self.logits: list[torch.Tensor] = []
        self._handles: list = []

    def __enter__(self) -> RouterLogits | None:
        if not self.on:
            return None
        mods = routers(self.model)
        if not mods:
            raise RuntimeError(f"{type(self.model).__name__}: no *TopKRouter module (not a mixture-of-experts model)")
        self._handles = [m.register_forward_hook(self._hook) for m in mods]
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def _hook(self, module, args, output) -> None:
        self.logits.append(output[0])

    def aux_loss(self, attention_mask: torch.Tensor) -> torch.Tensor:
        """transformers' load_balancing_loss_func over this forward's non-padding tokens:
        E * sum_e f_e * P_e (f_e: share of top-k assignments to expert e, P_e: mean router probability)."""
        # PLC0415, deferred: transformers is heavy
        from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func  # noqa: PLC0415

        router = routers(self.model)[0]
        return load_balancing_loss_func(tuple(self.logits), router.num_experts, router.top_k, attention_mask)
