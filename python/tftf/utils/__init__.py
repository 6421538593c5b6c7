"""Helpers: LoRA/DoRA merging, FP8 dequantisation, DCP loading."""
