"""GPU memory planning before anything loads (`clipbench plan`, and the check every run's preflight makes).

    estimator.py  bytes per GPU from first principles: weights, gradients, AdamW state, activations
                  of one micro-batch, logits, the vLLM share; fits or not; which knob to turn
    plan.py       a run config -> a plan (the shapes: clipbench.models.shapes); fits or not

This package imports nothing of clipbench above config (the run config) and models (the shapes).
"""

from clipbench.memory.estimator import GIB, MARGIN, MemoryPlan, Row, Setup, advise, estimate, gib

__all__ = ["GIB", "MARGIN", "MemoryPlan", "Row", "Setup", "advise", "estimate", "gib"]
