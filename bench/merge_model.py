"""A synthetic Llama-shaped BF16 model of about SIZE_MB megabytes, for bench/merge.sh.

Usage: python bench/merge_model.py OUT_DIR SIZE_MB SEED

Writes OUT_DIR/config.json (LlamaForCausalLM, the layer count chosen for the size),
OUT_DIR/model.safetensors (every tensor mergekit's Llama definition expects, values ~N(0, 0.02)
rounded to BF16); no tokenizer (the benchmark merges with --no-copy-tokenizer). Values come from numpy's PCG64 seeded by
SEED, in chunks, so memory stays small whatever the size. Needs only numpy.
"""

import json
import os
import struct
import sys

import numpy as np

CHUNK = 1 << 22  # elements drawn at a time


def shape_for(size_mb):
    """Hidden size, intermediate size, vocabulary and layer count near `size_mb` MB of BF16."""
    if size_mb <= 300:
        hidden, inter, vocab = 512, 1408, 8192
    else:
        hidden, inter, vocab = 2048, 5632, 32000
    per_layer = 4 * hidden * hidden + 3 * hidden * inter + 2 * hidden
    outside = 2 * vocab * hidden + hidden
    layers = max(1, round((size_mb * 1e6 / 2 - outside) / per_layer))
    return hidden, inter, vocab, layers


def tensors(hidden, inter, vocab, layers):
    yield "model.embed_tokens.weight", (vocab, hidden)
    for i in range(layers):
        p = f"model.layers.{i}."
        for m in ("q_proj", "k_proj", "v_proj", "o_proj"):
            yield p + f"self_attn.{m}.weight", (hidden, hidden)
        yield p + "mlp.gate_proj.weight", (inter, hidden)
        yield p + "mlp.up_proj.weight", (inter, hidden)
        yield p + "mlp.down_proj.weight", (hidden, inter)
        yield p + "input_layernorm.weight", (hidden,)
        yield p + "post_attention_layernorm.weight", (hidden,)
    yield "model.norm.weight", (hidden,)
    yield "lm_head.weight", (vocab, hidden)


def bf16(x):
    """float32 array -> BF16 bits, round to nearest even."""
    bits = x.astype(np.float32).view(np.uint32)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def main():
    out, size_mb, seed = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
    hidden, inter, vocab, layers = shape_for(size_mb)
    os.makedirs(out, exist_ok=True)
    specs = list(tensors(hidden, inter, vocab, layers))
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, shape in specs:
        n = int(np.prod(shape)) * 2
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    rng = np.random.default_rng(seed)
    with open(os.path.join(out, "model.safetensors"), "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        for name, shape in specs:
            left = int(np.prod(shape))
            norm = name.endswith("norm.weight")
            while left:
                n = min(left, CHUNK)
                x = 1.0 + rng.standard_normal(n, np.float32) * 0.02 if norm else rng.standard_normal(n, np.float32) * 0.02
                f.write(bf16(x).tobytes())
                left -= n
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_attention_heads": hidden // 64,
        "num_key_value_heads": hidden // 64,
        "num_hidden_layers": layers,
        "vocab_size": vocab,
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    print(f"{out}: {layers} layers, hidden {hidden}, {offset} bytes")


if __name__ == "__main__":
    main()
