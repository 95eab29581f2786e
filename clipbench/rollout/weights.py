"""The training model's weights as a stream of (name, full tensor) pairs, for an inference engine.

    for name, tensor in training_weights(model, dtype=torch.bfloat16):
        ...   # one tensor at a time, in the engine's dtype, named as in the checkpoint

Design choices:
* Tensor by tensor, lazily: the consumer (vLLM's in-place reload, in this process) copies each
  tensor into its own parameter before it asks for the next one, so at most one full tensor of
  the training model exists at a time beyond the engine's own weights. Buckets would only raise
  that peak: they pay off when tensors cross a process boundary, which they do not here.
* FSDP2 (DTensor parameters): each shard is cast to the engine dtype first and then gathered
  (`full_tensor()`), so no float32 copy of a whole tensor (let alone of the model) is ever made,
  and the all-gather moves half the bytes. `full_tensor()` is a collective: every rank must consume
  the stream to the end, in the same order (named_parameters order), which a full reload does.
* Everything the state dict has (parameters and persistent buffers), each distinct tensor gathered
  once: a tensor with several names (a tied output head) is yielded under each of them, one right
  after the other, so the engine reloads the head too without a second gather. Wrapper prefixes
  that are not part of the checkpoint's names (torch.compile's `_orig_mod.`, activation
  checkpointing's `_checkpoint_wrapped_module.`) are removed.
* The checkpoint's layout, not the module's (`engine_weights`): transformers 5 keeps some weights
  fused in memory (a mixture-of-experts layer's experts packed into two 3-D tensors,
  `mlp.experts.gate_up_proj` and `mlp.experts.down_proj`) and converts them on load and save. An
  engine loads the checkpoint's layout (`mlp.experts.<e>.gate_proj.weight`, ...), so each streamed
  tensor goes through transformers' own reverse conversion (`revert_weight_conversion`, what
  `save_pretrained` applies), one tensor at a time; a dense model's names pass unchanged.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

WRAPPER_PREFIXES = ("_orig_mod.", "_checkpoint_wrapped_module.", "_fsdp_wrapped_module.")


def checkpoint_name(name: str) -> str:
    """A parameter's name as in the model's checkpoint (wrapper prefixes removed)."""
    for prefix in WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def training_weights(model: torch.nn.Module, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(checkpoint name, full detached tensor) for every state-dict entry of `model`, one tensor at
    a time, cast to `dtype` (None: as they are). DTensors are cast on their shard, then gathered;
    every rank must exhaust the iterator."""
    from torch.distributed.tensor import DTensor  # noqa: PLC0415 - torch is heavy

    names: dict[int, list[str]] = {}  # distinct tensor -> its names, in state-dict order
    tensors: dict[int, torch.Tensor] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():  # references, no copies
        names.setdefault(id(tensor), []).append(checkpoint_name(name))
        tensors.setdefault(id(tensor), tensor)
    with torch.no_grad():
        for key, tensor in tensors.items():
            t = tensor.detach()
            if dtype is not None and t.is_floating_point():
                t = t.to(dtype)  # on the local shard for a DTensor
            if isinstance(t, DTensor):
                t = t.full_tensor()
            for name in names[key]:
                yield name, t
            del t


def engine_weights(model: torch.nn.Module, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """`training_weights` named and shaped as in the model's checkpoint (what an inference engine
    loaded): a packed MoE expert tensor becomes its per-expert pieces (views, no copies)."""
    from transformers.core_model_loading import revert_weight_conversion  # noqa: PLC0415 - transformers is heavy

    for name, tensor in training_weights(model, dtype):
        yield from revert_weight_conversion(model, {name: tensor}).items()
