#!/usr/bin/env python3
"""Writes a Qwen3-shaped BF16 checkpoint (random bits) for bench/gguf.sh, with the tokenizer
fixture: shards of at most 2 GB, headers padded to 8 bytes as the `safetensors` library pads
them (so each shard's data section starts wherever its header length puts it, as in real
checkpoints). Usage: gguf_model.py OUT_DIR LAYERS [HIDDEN INTER HEADS KV_HEADS VOCAB]"""
import json, os, struct, sys
import numpy as np

out, layers = sys.argv[1], int(sys.argv[2])
hidden, inter, heads, kv, vocab = (int(x) for x in (sys.argv[3:8] or [2048, 6144, 16, 8, 151936]))
head_dim = 128
os.makedirs(out, exist_ok=True)
fx = os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures", "gguf", "tokenizer")
# As bench/gguf_reference.py builds its Qwen models: real Qwen tokenizers hold `<|endoftext|>`,
# and without it transformers' Qwen2Tokenizer adds one for the reference converter (which tftf
# does not emulate), so the two outputs' vocabularies would differ for a reason no real
# checkpoint has.
tj = json.load(open(os.path.join(fx, "tokenizer.json")))
tj["added_tokens"].append({"id": 402, "content": "<|endoftext|>", "single_word": False, "lstrip": False,
                           "rstrip": False, "normalized": False, "special": True})
json.dump(tj, open(os.path.join(out, "tokenizer.json"), "w"), ensure_ascii=False)
tc = json.load(open(os.path.join(fx, "tokenizer_config.json")))
tc["tokenizer_class"] = "PreTrainedTokenizerFast"
json.dump(tc, open(os.path.join(out, "tokenizer_config.json"), "w"), indent=1)
json.dump({"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": hidden,
           "intermediate_size": inter, "num_attention_heads": heads, "num_key_value_heads": kv,
           "head_dim": head_dim, "num_hidden_layers": layers, "max_position_embeddings": 40960,
           "rope_theta": 1000000, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
           "vocab_size": vocab, "eos_token_id": 1, "torch_dtype": "bfloat16"},
          open(os.path.join(out, "config.json"), "w"))

tensors = [("model.embed_tokens.weight", (vocab, hidden))]
for l in range(layers):
    p = f"model.layers.{l}."
    tensors += [(p + "input_layernorm.weight", (hidden,)),
                (p + "self_attn.q_proj.weight", (heads * head_dim, hidden)),
                (p + "self_attn.k_proj.weight", (kv * head_dim, hidden)),
                (p + "self_attn.v_proj.weight", (kv * head_dim, hidden)),
                (p + "self_attn.o_proj.weight", (hidden, heads * head_dim)),
                (p + "self_attn.q_norm.weight", (head_dim,)),
                (p + "self_attn.k_norm.weight", (head_dim,)),
                (p + "post_attention_layernorm.weight", (hidden,)),
                (p + "mlp.gate_proj.weight", (inter, hidden)),
                (p + "mlp.up_proj.weight", (inter, hidden)),
                (p + "mlp.down_proj.weight", (hidden, inter))]
tensors += [("model.norm.weight", (hidden,)), ("lm_head.weight", (vocab, hidden))]

rng = np.random.default_rng(0)
shards, cur, size = [], [], 0
for name, shape in tensors:
    n = int(np.prod(shape)) * 2
    if cur and size + n > 2_000_000_000:
        shards.append(cur); cur, size = [], 0
    cur.append((name, shape)); size += n
shards.append(cur)
weight_map = {}
for i, group in enumerate(shards):
    fname = f"model-{i + 1:05}-of-{len(shards):05}.safetensors"
    header, off = {"__metadata__": {"format": "pt"}}, 0
    for name, shape in group:
        n = int(np.prod(shape)) * 2
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [off, off + n]}
        off += n
        weight_map[name] = fname
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    with open(os.path.join(out, fname), "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h)
        for name, shape in group:
            n = int(np.prod(shape))
            # Finite bf16 values (|x| < 2): random mantissas, small exponents.
            bits = rng.integers(0, 1 << 16, size=n, dtype=np.uint16) & np.uint16(0xBFFF)
            bits |= np.uint16(0x3800)
            f.write(bits.tobytes())
json.dump({"metadata": {}, "weight_map": weight_map},
          open(os.path.join(out, "model.safetensors.index.json"), "w"))
