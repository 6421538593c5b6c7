#!/usr/bin/env python3
"""Goldens for tests/gguf_quant.rs: llama-quantize (llama.cpp 0c1e570, the llama-cpp-python 0.3.36
sdist's vendored tree) applied to `convert_hf_to_gguf.py --outtype f32` of small models.

1. `llama/`: a 4-layer Llama (hidden 64, 4 heads, 1 kv head, ffn 96; BF16, random, seed 25),
   committed as config.json + model.safetensors. `e2e.json` holds, per case (a mix and
   llama-quantize options), every KV (sha256 of its type and value bytes, in file order; the
   converter's naming fields left out), and every tensor in file order (name, type id, ggml
   shape, sha256 of its bytes). The rows (64 or 96 wide) are not whole 256-blocks, so every
   k-quant falls back to a 32-block type that tftf writes today: the cases are byte-for-byte.
2. `types.json`: per model with 256-wide rows (a dense Llama with 8 layers and GQA 4, and a
   Mixtral with 8 experts), the tensors (name, shape, type in the F32 file, in the quantizer's
   order), the hyperparameters the rules read, and per mix the type `llama-quantize --dry-run`
   gives each tensor and whether it asks for an importance matrix. The models themselves are
   not kept (random weights; only shapes matter).
3. `llama256/`: a 2-layer Llama with whole 256-blocks (hidden 256, 4 heads, 2 kv heads, ffn
   512), so the k-quant, i-quant and ternary mixes write their own types. Its weights are not
   committed (2.4 MB): [`det_bf16`] makes them from each tensor's name, and the test makes the
   same bytes (llamacpp_goldens.py's and tests/common/gguf.rs's `det_bf16`). `e2e_k.json` is `e2e.json`'s record per mix.

Usage: gen-gguf-quant-goldens.py LLAMA_CPP_DIR LLAMA_QUANTIZE OUT_DIR WORK_DIR
(python with torch, transformers, safetensors, numpy, sentencepiece)"""
import json, os, re, shutil, subprocess, sys
import numpy as np
import torch
from safetensors.torch import save_file

LCP, LQ, OUT, WORK = sys.argv[1:5]
sys.path.insert(0, os.path.join(LCP, "gguf-py"))
from gguf import GGUFReader  # noqa: E402
from llamacpp_goldens import converter, det_bf16, record  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
TOK = os.path.join(HERE, "..", "tests", "fixtures", "gguf", "tokenizer")
VOCAB = 410
REF = converter(LCP)
MIXES = ["q4_0", "q4_1", "q5_0", "q5_1", "q2_k", "q2_k_s", "q3_k_s", "q3_k_m", "q3_k_l", "q4_k_s", "q4_k_m",
         "q5_k_s", "q5_k_m", "q6_k", "iq4_nl", "iq4_xs", "tq1_0", "tq2_0", "iq2_xxs", "iq2_xs", "iq2_s", "iq2_m",
         "iq3_xxs", "iq3_xs", "iq3_s", "iq3_m", "iq1_s", "iq1_m"]
E2E = [(m, []) for m in MIXES if not m.startswith("iq")] + [
    ("q4_k_m", ["--pure"]),
    ("q4_0", ["--tensor-type", "attn_v=q8_0", "--tensor-type", "FFN_DOWN=q5_1"]),
    ("q5_0", ["--output-tensor-type", "q4_1", "--token-embedding-type", "q8_0"]),
    ("q3_k_m", ["--leave-output-tensor"]),
]


def save_and_convert(d, cfg, sd):
    """Writes the model folder (config, weights, tokenizer) and its converter F32 GGUF."""
    json.dump(cfg, open(os.path.join(d, "config.json"), "w"), indent=1)
    save_file(sd, os.path.join(d, "model.safetensors"), metadata={"format": "pt"})
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(TOK, f), d)
    ref = os.path.join(WORK, os.path.basename(d) + ".f32.gguf")
    subprocess.run([sys.executable, "-c", REF, d, "--outfile", ref, "--outtype", "f32"], check=True, capture_output=True)
    return ref


def model(d, cfg, experts=0):
    torch.manual_seed(25)
    os.makedirs(d, exist_ok=True)
    h, heads, kv, ff = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["intermediate_size"]
    hd = h // heads
    w = lambda *s: (torch.randn(s) * 0.05).to(torch.bfloat16)
    sd = {"model.embed_tokens.weight": w(VOCAB, h), "model.norm.weight": (1 + w(h)).to(torch.bfloat16),
          "lm_head.weight": w(VOCAB, h)}
    for l in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{l}."
        sd[p + "input_layernorm.weight"] = (1 + w(h)).to(torch.bfloat16)
        sd[p + "post_attention_layernorm.weight"] = (1 + w(h)).to(torch.bfloat16)
        for n, o, i in (("q_proj", heads * hd, h), ("k_proj", kv * hd, h), ("v_proj", kv * hd, h), ("o_proj", h, heads * hd)):
            sd[p + f"self_attn.{n}.weight"] = w(o, i)
        if experts:
            sd[p + "block_sparse_moe.gate.weight"] = w(experts, h)
            for e in range(experts):
                for n, o, i in (("w1", ff, h), ("w2", h, ff), ("w3", ff, h)):
                    sd[p + f"block_sparse_moe.experts.{e}.{n}.weight"] = w(o, i)
        else:
            for n, o, i in (("gate_proj", ff, h), ("up_proj", ff, h), ("down_proj", h, ff)):
                sd[p + f"mlp.{n}.weight"] = w(o, i)
    return save_and_convert(d, cfg, sd)


def det_model(d, cfg):
    """The llama256 model: every shape as `model`, weights from [`det_bf16`] (norms around 1)."""
    os.makedirs(d, exist_ok=True)
    h, heads, kv, ff = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["intermediate_size"]
    hd = h // heads
    shapes = {"model.embed_tokens.weight": (VOCAB, h), "model.norm.weight": (h,), "lm_head.weight": (VOCAB, h)}
    for l in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{l}."
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        for n, o, i in (("q_proj", heads * hd, h), ("k_proj", kv * hd, h), ("v_proj", kv * hd, h), ("o_proj", h, heads * hd),
                        ("gate_proj", ff, h), ("up_proj", ff, h), ("down_proj", h, ff)):
            shapes[p + ("self_attn." if n.endswith("_proj") and n[0] in "qkvo" else "mlp.") + f"{n}.weight"] = (o, i)
    sd = {k: det_bf16(k, int(np.prod(s)), 1.0 if len(s) == 1 else 0.0).reshape(s) for k, s in shapes.items()}
    return save_and_convert(d, cfg, sd)


K_MIXES = ["q2_k", "q3_k_s", "q3_k_m", "q3_k_l", "q4_k_s", "q4_k_m", "q5_k_s", "q5_k_m", "q6_k", "iq4_nl", "iq4_xs",
           "tq1_0", "tq2_0"]


def k_goldens():
    cfg = dict(BASE, hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
               num_hidden_layers=2)
    d = os.path.join(WORK, "llama256")
    ref = det_model(d, cfg)
    os.makedirs(os.path.join(OUT, "llama256"), exist_ok=True)
    shutil.copy(os.path.join(d, "config.json"), os.path.join(OUT, "llama256", "config.json"))
    cases = []
    for mix in K_MIXES:
        out = os.path.join(WORK, "e2e_k.gguf")
        quantize([], ref, out, mix)
        cases.append(dict(record(out), mix=mix, args=[]))
    json.dump(cases, open(os.path.join(OUT, "e2e_k.json"), "w"), indent=0)


def quantize(args, ref, out, mix):
    r = subprocess.run([LQ] + args + [ref, out, mix.upper()], capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(f"llama-quantize {args} {mix}: {r.stderr[-400:]}")
    return r.stdout + r.stderr


BASE = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-05, "rope_theta": 10000.0, "vocab_size": VOCAB, "bos_token_id": 0, "eos_token_id": 1,
        "torch_dtype": "bfloat16", "tie_word_embeddings": False}


def main():
    os.makedirs(WORK, exist_ok=True)
    k_goldens()
    if os.environ.get("ONLY_K"):
        return
    small = dict(BASE, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=1,
                 num_hidden_layers=4)
    d = os.path.join(OUT, "llama")
    ref = model(d, small)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        os.remove(os.path.join(d, f))  # the test copies them from tests/fixtures/gguf/tokenizer
    cases = []
    for mix, args in E2E:
        out = os.path.join(WORK, "e2e.gguf")
        quantize(args, ref, out, mix)
        cases.append(dict(record(out), mix=mix, args=args))
    json.dump(cases, open(os.path.join(OUT, "e2e.json"), "w"), indent=0)

    big = {"dense": (dict(BASE, hidden_size=256, intermediate_size=512, num_attention_heads=8, num_key_value_heads=2,
                          num_hidden_layers=8), 0),
           "mixtral": (dict(BASE, architectures=["MixtralForCausalLM"], model_type="mixtral", hidden_size=256,
                            intermediate_size=256, num_attention_heads=4, num_key_value_heads=4,
                            num_hidden_layers=2, num_local_experts=8, num_experts_per_tok=2), 8)}
    line = re.compile(r"^\[\s*\d+/\s*\d+\]\s+(\S+)\s+- \[.*?\], type =\s+(\S+), size =.*?(?:\((\S+)\))?\s*$")
    types = {}
    for name, (cfg, experts) in big.items():
        ref = model(os.path.join(WORK, name), cfg, experts)
        r = GGUFReader(ref)
        arch = r.fields["general.architecture"].contents()
        get = lambda k: int(r.fields[f"{arch}.{k}"].contents()) if f"{arch}.{k}" in r.fields else 0
        entry = {"arch": arch, "n_layer": get("block_count"), "n_head": get("attention.head_count"),
                 "n_head_kv": get("attention.head_count_kv"), "n_expert": get("expert_count"),
                 "tensors": [[t.name, [int(x) for x in reversed(t.shape)], t.tensor_type.name] for t in r.tensors],
                 "mixes": {}}
        for mix in MIXES:
            log = quantize(["--dry-run"], ref, os.path.join(WORK, "dry.gguf"), mix)
            got = {}
            for l in log.splitlines():
                m = line.match(l.strip())
                if m:
                    got[m.group(1)] = (m.group(3) or m.group(2)).upper()
            entry["mixes"][mix] = {"types": got, "needs_imatrix": "will require an imatrix" in log}
        types[name] = entry
    json.dump(types, open(os.path.join(OUT, "types.json"), "w"), indent=0, sort_keys=True)
    print("wrote", OUT)


main()
