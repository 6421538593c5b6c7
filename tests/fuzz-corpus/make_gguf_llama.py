"""Writes the `gguf-llama` fuzz case: a one-layer Llama (hidden 32, 2 heads of 16, 1 KV head,
tied embeddings) in BF16 that `tftf gguf --vocab-pre llama-bpe` converts, with the GGUF
tests' tokenizer (tests/fixtures/gguf/tokenizer), a chat template given as a list of named
templates and `imatrix.dat`, a legacy importance matrix for its layer (`--imatrix`); and the
`gguf-packed-int` case: the same model with its layer's matrices stored as compressed-tensors
4-bit pack-quantized ints (I32 words, BF16 scales per 16 columns, `weight_shape`), which
`tftf gguf` dequantises on the fly. Deterministic: run
`python3 tests/fuzz-corpus/make_gguf_llama.py` from the repository root to rewrite the same
bytes."""

import json
import random
import shutil
import struct
from pathlib import Path

root = Path(__file__).resolve().parent
out = root / "gguf-llama" / "model"
tok = root.parent / "fixtures" / "gguf" / "tokenizer"
out.mkdir(parents=True, exist_ok=True)

hidden, heads, kv_heads, head_dim, ff, vocab = 32, 2, 1, 16, 32, 410
config = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": hidden,
    "intermediate_size": ff,
    "num_attention_heads": heads,
    "num_key_value_heads": kv_heads,
    "num_hidden_layers": 1,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-05,
    "rope_theta": 10000.0,
    "vocab_size": vocab,
    "eos_token_id": 1,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
}
(out / "config.json").write_text(json.dumps(config))
shutil.copy(tok / "tokenizer.json", out / "tokenizer.json")
tc = json.loads((tok / "tokenizer_config.json").read_text())
tc["chat_template"] = [
    {"name": "default", "template": tc["chat_template"]},
    {"name": "tool use", "template": "{{ tools }}"},
]
(out / "tokenizer_config.json").write_text(json.dumps(tc))

layer = "model.layers.0."
shapes = {
    "model.embed_tokens.weight": [vocab, hidden],
    "model.norm.weight": [hidden],
    layer + "input_layernorm.weight": [hidden],
    layer + "post_attention_layernorm.weight": [hidden],
    layer + "self_attn.q_proj.weight": [heads * head_dim, hidden],
    layer + "self_attn.k_proj.weight": [kv_heads * head_dim, hidden],
    layer + "self_attn.v_proj.weight": [kv_heads * head_dim, hidden],
    layer + "self_attn.o_proj.weight": [hidden, heads * head_dim],
    layer + "mlp.gate_proj.weight": [ff, hidden],
    layer + "mlp.up_proj.weight": [ff, hidden],
    layer + "mlp.down_proj.weight": [hidden, ff],
}
rng = random.Random(24)
header, data = {"__metadata__": {"format": "pt"}}, b""
for name in sorted(shapes):
    n = 1
    for d in shapes[name]:
        n *= d
    # BF16 values in [-1, 1): sign, exponent 0x3F00 range, random mantissa.
    values = b"".join(
        struct.pack("<H", (rng.getrandbits(1) << 15) | rng.randrange(0x3C00, 0x3F80))
        for _ in range(n)
    )
    header[name] = {"dtype": "BF16", "shape": shapes[name], "data_offsets": [len(data), len(data) + len(values)]}
    data += values


def write_safetensors(path, header, data):
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)


write_safetensors(out / "model.safetensors", header, data)

# llama-imatrix's legacy .dat: entry count, then per entry name, call count, values (one per
# column of the weight).
gguf_names = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
dat = struct.pack("<i", len(gguf_names))
for hf, gg in gguf_names.items():
    name = f"blk.0.{gg}.weight".encode()
    cols = shapes[layer + hf + ".weight"][1]
    dat += struct.pack("<i", len(name)) + name + struct.pack("<ii", 1, cols)
    dat += b"".join(struct.pack("<f", 1.0 + rng.random()) for _ in range(cols))
(out / "imatrix.dat").write_bytes(dat)

# The packed-int case: the same files, the layer's matrices as 4-bit pack-quantized ints.
packed = root / "gguf-packed-int" / "model"
packed.mkdir(parents=True, exist_ok=True)
for f in ["tokenizer.json", "tokenizer_config.json"]:
    shutil.copy(out / f, packed / f)
config["quantization_config"] = {
    "quant_method": "compressed-tensors",
    "format": "pack-quantized",
    "config_groups": {"group_0": {"targets": ["Linear"], "format": "pack-quantized", "weights": {
        "num_bits": 4, "type": "int", "symmetric": True, "group_size": 16, "strategy": "group"}}},
}
(packed / "config.json").write_text(json.dumps(config))
tensors = {}
for name in sorted(shapes):
    rows, cols = (shapes[name] + [1])[:2]
    if name.startswith(layer) and len(shapes[name]) == 2:
        base = name.removesuffix(".weight")
        words = b"".join(struct.pack("<I", rng.getrandbits(32)) for _ in range(rows * cols // 8))
        scales = b"".join(struct.pack("<H", rng.randrange(0x3B00, 0x3C80)) for _ in range(rows * cols // 16))
        tensors[base + ".weight_packed"] = ("I32", [rows, cols // 8], words)
        tensors[base + ".weight_scale"] = ("BF16", [rows, cols // 16], scales)
        tensors[base + ".weight_shape"] = ("I64", [2], struct.pack("<qq", rows, cols))
    else:
        h = header[name]
        a, b = h["data_offsets"]
        tensors[name] = ("BF16", h["shape"], data[a:b])
header, data = {"__metadata__": {"format": "pt"}}, b""
for name in sorted(tensors):
    dtype, shape, values = tensors[name]
    header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [len(data), len(data) + len(values)]}
    data += values
write_safetensors(packed / "model.safetensors", header, data)
