"""Writes the `gguf-llama` fuzz case: a one-layer Llama (hidden 32, 2 heads of 16, 1 KV head,
tied embeddings) in BF16 that `tftf gguf --vocab-pre llama-bpe` converts, with the GGUF
tests' tokenizer (tests/fixtures/gguf/tokenizer) and a chat template given as a list of named
templates. Deterministic: run `python3 tests/fuzz-corpus/make_gguf_llama.py` from the
repository root to rewrite the same bytes."""

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
text = json.dumps(header, separators=(",", ":")).encode()
text += b" " * (-len(text) % 8)
(out / "model.safetensors").write_bytes(struct.pack("<Q", len(text)) + text + data)
