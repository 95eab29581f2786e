"""Counterfactual replay: every rule on the same recorded batches (`clipbench replay`; docs/replay.md)."""
