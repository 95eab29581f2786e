"""GPU memory planning before anything loads (`clipbench plan`, and the check `clipbench train` runs).

    shapes.py     the shape of a dense decoder (the Qwen3 family ships with clipbench; others from
                  transformers AutoConfig), its parameter count and KV bytes per token
    estimator.py  bytes per GPU from first principles: weights, gradients, AdamW state, activations
                  of one micro-batch, logits, the vLLM share; fits or not; which knob to turn
    plan.py       a run config -> a plan; the rich table; the preflight check of `clipbench train`

This package imports nothing from clipbench but errors (shapes, estimator) and config (plan), so the
trainer and the samplers may use it.
"""

from clipbench.memory.estimator import GIB, MARGIN, MemoryPlan, Row, Setup, advise, estimate, gib
from clipbench.memory.shapes import QWEN3, ModelShape, model_shape

__all__ = ["GIB", "MARGIN", "QWEN3", "MemoryPlan", "ModelShape", "Row", "Setup", "advise", "estimate",
           "gib", "model_shape"]
