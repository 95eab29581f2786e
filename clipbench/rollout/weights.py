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
* Parameters then persistent buffers, with tied weights once (named_parameters() deduplicates a
  tied output head; the engine ties it back itself). Wrapper prefixes that are not part of the
  checkpoint's names (torch.compile's `_orig_mod.`, activation checkpointing's
  `_checkpoint_wrapped_module.`) are removed.
"""

from __future__ import annotations

from typing import Iterator

import torch

WRAPPER_PREFIXES = ("_orig_mod.", "_checkpoint_wrapped_module.", "_fsdp_wrapped_module.")


def checkpoint_name(name: str) -> str:
    """A parameter's name as in the model's checkpoint (wrapper prefixes removed)."""
    for prefix in WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def _persistent_buffers(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    for module_name, module in model.named_modules():
        for name, buf in module.named_buffers(recurse=False):
            if buf is not None and name not in module._non_persistent_buffers_set:
                yield (f"{module_name}.{name}" if module_name else name), buf


def training_weights(model: torch.nn.Module, dtype: torch.dtype | None = None
                     ) -> Iterator[tuple[str, torch.Tensor]]:
    """(checkpoint name, full detached tensor) of every parameter and persistent buffer of `model`,
    one at a time, cast to `dtype` (None: as they are). DTensors are cast on their shard, then
    gathered; every rank must exhaust the iterator."""
    from torch.distributed.tensor import DTensor

    with torch.no_grad():
        for name, tensor in (*model.named_parameters(), *_persistent_buffers(model)):
            t = tensor.detach()
            if dtype is not None and t.is_floating_point():
                t = t.to(dtype)                      # on the local shard for a DTensor
            if isinstance(t, DTensor):
                t = t.full_tensor()
            yield checkpoint_name(name), t
