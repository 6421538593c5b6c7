#!/usr/bin/env python3
"""Writes a BitNet b1.58 checkpoint shaped as microsoft/bitnet-b1.58-2B-4T for bench/bitnet.sh:
packed ternary projections (`quant_method: bitnet`: U8 [out/4, in] codes 0..2, four rows a byte,
and one BF16 `weight_scale` each), BF16 embeddings and norms, one shard, random (seed 25), with
the SentencePiece tokenizer fixture (400 pieces, padded to the vocabulary by the converters).
Usage: bitnet_model.py OUT_DIR [LAYERS HIDDEN INTER HEADS KV_HEADS VOCAB]"""
import json, os, shutil, struct, sys
import numpy as np

out = sys.argv[1]
defaults = [30, 2560, 6912, 20, 5, 128256]
given = [int(x) for x in sys.argv[2:8]]
layers, hidden, inter, heads, kv, vocab = given + defaults[len(given):]
kvd = kv * hidden // heads
os.makedirs(out, exist_ok=True)
fx = os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures", "gguf", "spm-llama2")
for f in ("tokenizer.model", "tokenizer.json", "tokenizer_config.json"):
    shutil.copy(os.path.join(fx, f), out)
json.dump({"architectures": ["BitNetForCausalLM"], "model_type": "bitnet", "hidden_size": hidden,
           "intermediate_size": inter, "num_attention_heads": heads, "num_key_value_heads": kv,
           "num_hidden_layers": layers, "max_position_embeddings": 4096, "rope_theta": 500000.0,
           "rms_norm_eps": 1e-5, "hidden_act": "relu2", "tie_word_embeddings": True, "vocab_size": vocab,
           "torch_dtype": "bfloat16", "quantization_config": {"quant_method": "bitnet",
           "linear_class": "autobitlinear", "quantization_mode": "offline"}},
          open(os.path.join(out, "config.json"), "w"), indent=1)
rng = np.random.default_rng(25)


def bf16(x):
    return (np.asarray(x, np.float32).view(np.uint32) >> 16).astype(np.uint16).tobytes()


tensors = {"model.embed_tokens.weight": ("BF16", (vocab, hidden), lambda: bf16(0.02 * rng.standard_normal((vocab, hidden)))),
           "model.norm.weight": ("BF16", (hidden,), lambda: bf16(1 + 0.1 * rng.standard_normal(hidden)))}
proj = [("self_attn.q_proj", hidden, hidden), ("self_attn.k_proj", kvd, hidden), ("self_attn.v_proj", kvd, hidden),
        ("self_attn.o_proj", hidden, hidden), ("mlp.gate_proj", inter, hidden), ("mlp.up_proj", inter, hidden),
        ("mlp.down_proj", hidden, inter)]
for l in range(layers):
    p = f"model.layers.{l}."
    for n, d in [("input_layernorm", hidden), ("post_attention_layernorm", hidden),
                 ("self_attn.attn_sub_norm", hidden), ("mlp.ffn_sub_norm", inter)]:
        tensors[p + n + ".weight"] = ("BF16", (d,), lambda d=d: bf16(1 + 0.1 * rng.standard_normal(d)))
    for n, o, i in proj:
        def codes(o=o, i=i):
            c = rng.integers(0, 3, size=(4, o // 4, i), dtype=np.uint8)
            return (c[0] | (c[1] << 2) | (c[2] << 4) | (c[3] << 6)).tobytes()
        tensors[p + n + ".weight"] = ("U8", (o // 4, i), codes)
        tensors[p + n + ".weight_scale"] = ("BF16", (1,), lambda: bf16([rng.uniform(20, 60)]))
names = sorted(tensors)
header, offset = {}, 0
for n in names:
    dt, shape, _ = tensors[n]
    size = int(np.prod(shape)) * (2 if dt == "BF16" else 1)
    header[n] = {"dtype": dt, "shape": list(shape), "data_offsets": [offset, offset + size]}
    offset += size
h = json.dumps(header).encode()
h += b" " * (-len(h) % 8)
with open(os.path.join(out, "model.safetensors"), "wb") as f:
    f.write(struct.pack("<Q", len(h)) + h)
    for n in names:
        f.write(tensors[n][2]())
