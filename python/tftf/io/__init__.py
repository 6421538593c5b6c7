"""Readers and writers: checkpoints in, safetensors (or GGUF) out."""
