"""Helper of `PYTHON=... bench/quantize.sh`: the llm-compressor side of the quantize benchmark.

    python quantize_reference.py gen DIR LAYERS        # random bf16 Llama (transformers layout)
    python quantize_reference.py oneshot IN SCHEME OUT # llm-compressor 0.14, as the fixtures
    python quantize_reference.py compare A B           # every tensor's dtype, shape and bytes

`gen` writes a Llama-architecture checkpoint (hidden 4096, intermediate 11008, 32 heads,
vocab 32000, untied lm_head: 10 layers = 4.57 GB) straight from the tensor shapes, each
tensor `randn * 0.02` in bf16 (norms 1), in 2 GB shards with an index, and config.json with
`torch_dtype: bfloat16`; `from_pretrained` loads it like any Llama. `gen(path, layers, h, inter,
vocab, heads, kv_heads)` takes other dimensions (`quantize_logits.py` makes a small model).
"""

import json
import mmap
import os
import struct
import sys


def gen(path, layers, h=4096, inter=11008, vocab=32000, heads=32, kv_heads=32):
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    kv = h // heads * kv_heads
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=h,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
    )
    os.makedirs(path, exist_ok=True)
    cfg.save_pretrained(path)
    c = json.load(open(os.path.join(path, "config.json")))
    c["torch_dtype"] = "bfloat16"
    c["dtype"] = "bfloat16"
    json.dump(c, open(os.path.join(path, "config.json"), "w"), indent=2)

    shapes = [("model.embed_tokens.weight", (vocab, h))]
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes += [
            (p + "input_layernorm.weight", (h,)),
            (p + "self_attn.q_proj.weight", (h, h)),
            (p + "self_attn.k_proj.weight", (kv, h)),
            (p + "self_attn.v_proj.weight", (kv, h)),
            (p + "self_attn.o_proj.weight", (h, h)),
            (p + "post_attention_layernorm.weight", (h,)),
            (p + "mlp.gate_proj.weight", (inter, h)),
            (p + "mlp.up_proj.weight", (inter, h)),
            (p + "mlp.down_proj.weight", (h, inter)),
        ]
    shapes += [("model.norm.weight", (h,)), ("lm_head.weight", (vocab, h))]

    torch.manual_seed(2026)
    shards, cur, size, limit = [], {}, 0, 2 * 10**9
    for name, shape in shapes:
        n = 2
        for d in shape:
            n *= d
        if cur and size + n > limit:
            shards.append(cur)
            cur, size = {}, 0
        cur[name] = shape
        size += n
    shards.append(cur)
    weight_map, total = {}, 0
    for k, shard in enumerate(shards):
        fname = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {}
        for name, shape in shard.items():
            if len(shape) == 1:
                tensors[name] = torch.ones(shape, dtype=torch.bfloat16)
            else:
                tensors[name] = torch.randn(shape, dtype=torch.bfloat16) * 0.02
            weight_map[name] = fname
            total += tensors[name].numel() * 2
        save_file(tensors, os.path.join(path, fname), metadata={"format": "pt"})
        del tensors
    json.dump(
        {"metadata": {"total_size": total}, "weight_map": weight_map},
        open(os.path.join(path, "model.safetensors.index.json"), "w"),
        indent=2,
    )


def oneshot(src, scheme, dst):
    import torch
    from llmcompressor import oneshot as run
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src, torch_dtype=torch.bfloat16)
    recipe = QuantizationModifier(targets="Linear", scheme=scheme, ignore=["lm_head"])
    run(model=model, recipe=recipe)
    model.save_pretrained(dst, save_compressed=True)


def tensors(path):
    """name -> (dtype, shape, memoryview of the bytes) over every *.safetensors in `path`."""
    out = {}
    for f in sorted(os.listdir(path)):
        if not f.endswith(".safetensors"):
            continue
        fh = open(os.path.join(path, f), "rb")
        m = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        (n,) = struct.unpack("<Q", m[:8])
        header = json.loads(m[8 : 8 + n])
        base = 8 + n
        for name, t in header.items():
            if name == "__metadata__":
                continue
            a, b = t["data_offsets"]
            out[name] = (t["dtype"], t["shape"], memoryview(m)[base + a : base + b], f)
    return out


def compare(a, b):
    ta, tb = tensors(a), tensors(b)
    only_a, only_b = sorted(set(ta) - set(tb)), sorted(set(tb) - set(ta))
    diff, nbytes = [], 0
    for name in sorted(set(ta) & set(tb)):
        da, sa, ba, _ = ta[name]
        db, sb, bb, _ = tb[name]
        nbytes += len(ba)
        if (da, sa) != (db, sb) or ba != bb:
            nd = sum(1 for x, y in zip(bytes(ba), bytes(bb)) if x != y) if len(ba) == len(bb) else -1
            diff.append(f"{name}: {da}{sa} vs {db}{sb}, {nd} bytes differ of {len(ba)}")
    ca = json.load(open(os.path.join(a, "config.json"))).get("quantization_config")
    cb = json.load(open(os.path.join(b, "config.json"))).get("quantization_config")
    same = not (only_a or only_b or diff)
    print(
        f"compare {a} {b}: {len(set(ta) & set(tb))} common tensors, {nbytes} bytes; "
        f"only in first: {only_a}; only in second: {only_b}; differing: {len(diff)}; "
        f"quantization_config {'equal' if ca == cb else 'DIFFERENT'}; "
        f"{'IDENTICAL' if same else 'NOT IDENTICAL'}"
    )
    for d in diff[:50]:
        print("  " + d)
    if ca != cb:
        print("  ours:", json.dumps(ca, sort_keys=True))
        print("  llmc:", json.dumps(cb, sort_keys=True))
    return 0 if same else 1


def main(commands):
    """Runs the command named by the first argument: `commands` maps its name to a function of
    the remaining arguments (strings); what the function returns is the exit status."""
    cmd = sys.argv[1]
    if cmd not in commands:
        sys.exit(f"unknown command {cmd}")
    sys.exit(commands[cmd](*sys.argv[2:]))


if __name__ == "__main__":
    main(
        {"gen": lambda path, layers: gen(path, int(layers)), "oneshot": oneshot, "compare": compare}
    )
