#!/usr/bin/env python3
"""Goldens for tftf's BitNet conversion: `convert_hf_to_gguf.py` (llama.cpp 0c1e570, the
llama-cpp-python 0.3.36 sdist's vendored tree; class BitnetModel) on two tiny BitNet b1.58
models, and `llama-quantize` of the packed one's F32 file.

Both models: 2 layers, hidden 256, 4 heads, 2 kv heads, ffn 512 (relu2), vocab 400, tied
embeddings, the sub-norms `self_attn.inner_attn_ln` [256] and `mlp.ffn_layernorm` [512] that
the 0c1e570 tensor map knows (ATTN_SUB_NORM, FFN_SUB_NORM), and the 400-piece SentencePiece
tokenizer of tests/fixtures/gguf/spm-llama2 (copied in).

1. `bitnet_packed/` (committed, ~0.5 MB): the microsoft/bitnet-b1.58-2B-4T layout
   ("BitNetForCausalLM", model_type "bitnet", quantization_config quant_method "bitnet").
   Every q/k/v/o/gate/up/down projection is `X.weight` U8 [out/4, in], four 2-bit codes a byte
   (field i of packed row r is unpacked row i*out/4 + r; code c means c - 1), codes 0, 1, 2
   only, a different share of zeros (code 1) per tensor, and `X.weight_scale` BF16 [1] (the
   converter divides by it). Layer 0's q_proj has its unpacked row 0 all zero (a whole
   256-block: TQ1_0/TQ2_0 d = 0) and layer 1's down_proj the first 256-block of row 5.
   Embeddings and norms are plain BF16 (numpy, seed 25).
2. `bitnet_latent/`: the 1bitLLM layout ("BitnetForCausalLM", model_type "llama", no
   quantization_config), every tensor plain BF16 that the converter ternarises itself. Its
   weights (2.6 MB) are not committed: each tensor is `det_bf16(name, n, offset)` (1.0 for the
   1-D norms, else 0.0) of llamacpp_goldens.py, which tests/common/gguf.rs remakes, written to
   WORK_DIR/bitnet_latent/model.safetensors; OUT_DIR/bitnet_latent/ holds config.json and the
   tokenizer.

`bitnet.json` is a list of records in e2e.json's form (`kvs`: sha256 of each KV's type and
value bytes in file order, the converter's naming fields left out; `tensors`: name, type id,
ggml shape, sha256 of the bytes, in file order), each with `model` and either `outtype` (the
converter's `--outtype`: f32, bf16, tq1_0, tq2_0, auto) or, given LLAMA_QUANTIZE, `mix` and
`args` (llama-quantize on the packed model's `--outtype f32` file: tq1_0, tq2_0, q4_k_m).
An F32 record also has `ternary`: per ternarised tensor (attn_q/k/v/output, ffn_gate/up/down)
the sha256 of its sign pattern (int8 -1/0/1) and its one non-zero magnitude's f32 bits, so a
test can tell a last-bit difference in the mean (torch's f32 sum against an exact one) from a
wrong element.
`converter_args` is ["--no-lazy"] for the packed model: 0c1e570's lazy (default) run fails in
`dequant_bitnet` (`weight >> shift` with `shift` an eager CPU tensor and `weight` a lazy meta
one: "Tensor on device cpu is not on the expected device meta!", torch 2.15); the latent
model's records are the default lazy run, checked equal to the `--no-lazy` one. The converter
runs with OMP_NUM_THREADS=2 (torch's mean of |w| depends on the thread count, see THREADS).

Usage: gen-gguf-bitnet-goldens.py LLAMA_CPP_DIR [LLAMA_QUANTIZE] OUT_DIR WORK_DIR
(python with torch, transformers, safetensors, numpy, sentencepiece, protobuf)"""
import json, os, shutil, subprocess, sys
import numpy as np
import torch
from safetensors.torch import save_file

if len(sys.argv) == 5:
    LCP, LQ, OUT, WORK = sys.argv[1:5]
elif len(sys.argv) == 4:
    (LCP, OUT, WORK), LQ = sys.argv[1:4], None
else:
    raise SystemExit(__doc__.rsplit("\n\n", 1)[1])
sys.path.insert(0, os.path.join(LCP, "gguf-py"))
from llamacpp_goldens import converter, det_bf16, record  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
TOK = os.path.join(HERE, "..", "tests", "fixtures", "gguf", "spm-llama2")
REF = converter(LCP)
OUTTYPES = ["f32", "bf16", "tq1_0", "tq2_0", "auto"]
MIXES = ["tq1_0", "tq2_0", "q4_k_m"]
# torch's CPU sum (so BitnetModel.weight_quant's `abs().mean()`) splits a tensor of more than
# 32768 elements into min(threads, ceil(n / 32768)) chunks: 1 thread gives other last bits.
THREADS = "2"
H, FF, HEADS, KV_HEADS, LAYERS, VOCAB = 256, 512, 4, 2, 2, 400
KV = KV_HEADS * H // HEADS
SIZES = {"architectures": None, "hidden_size": H, "intermediate_size": FF, "num_hidden_layers": LAYERS,
         "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "vocab_size": VOCAB,
         "max_position_embeddings": 128, "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "hidden_act": "relu2",
         "tie_word_embeddings": True, "torch_dtype": "bfloat16"}
PACKED = dict(SIZES, architectures=["BitNetForCausalLM"], model_type="bitnet",
              quantization_config={"quant_method": "bitnet", "linear_class": "autobitlinear",
                                   "quantization_mode": "offline"})
LATENT = dict(SIZES, architectures=["BitnetForCausalLM"], model_type="llama")
PROJ = [("self_attn.q_proj", H, H), ("self_attn.k_proj", KV, H), ("self_attn.v_proj", KV, H),
        ("self_attn.o_proj", H, H), ("mlp.gate_proj", FF, H), ("mlp.up_proj", FF, H), ("mlp.down_proj", H, FF)]
NORMS = [("input_layernorm", H), ("post_attention_layernorm", H), ("self_attn.inner_attn_ln", H),
         ("mlp.ffn_layernorm", FF)]


def shapes():
    """Every tensor's name and shape (plain weights; the projections unpacked)."""
    s = {"model.embed_tokens.weight": (VOCAB, H), "model.norm.weight": (H,)}
    for l in range(LAYERS):
        p = f"model.layers.{l}."
        s.update({p + n + ".weight": (d,) for n, d in NORMS})
        s.update({p + n + ".weight": (o, i) for n, o, i in PROJ})
    return s


def bf16(x):
    return torch.from_numpy(np.asarray(x, np.float32)).to(torch.bfloat16)


def pack(codes):
    """[out, in] codes 0..3 -> U8 [out/4, in]: field i (bits 2i) of packed row r is row i*out/4 + r."""
    rows = codes.shape[0] // 4
    p = np.zeros((rows, codes.shape[1]), np.uint8)
    for i in range(4):
        p |= (codes[i * rows:(i + 1) * rows].astype(np.uint8) << np.uint8(2 * i))
    return torch.from_numpy(p)


def packed_weights():
    rng = np.random.default_rng(25)
    sd = {}
    n_proj = LAYERS * len(PROJ)
    zeros = np.linspace(0.1, 0.7, n_proj)[rng.permutation(n_proj)]  # share of code 1 per tensor
    k = 0
    for name, s in shapes().items():
        if len(s) == 1:
            sd[name] = bf16(1 + 0.1 * rng.standard_normal(s))
        elif "embed" in name:
            sd[name] = bf16(0.02 * rng.standard_normal(s))
        else:
            z = zeros[k]
            k += 1
            u = rng.random(s)
            codes = np.where(u < z, 1, np.where(u < z + (1 - z) / 2, 0, 2))
            if name == "model.layers.0.self_attn.q_proj.weight":
                codes[0, :] = 1  # one whole row (one 256-block) of zeros
            if name == "model.layers.1.mlp.down_proj.weight":
                codes[5, :256] = 1  # the first of row 5's two 256-blocks
            assert codes.max() <= 2
            base = name.removesuffix(".weight")
            sd[name] = pack(codes)
            sd[base + ".weight_scale"] = bf16([rng.uniform(0.5, 4.0)])
    return sd


def latent_weights():
    return {n: det_bf16(n, int(np.prod(s)), 1.0 if len(s) == 1 else 0.0).reshape(s) for n, s in shapes().items()}


def write_model(d, cfg, sd):
    os.makedirs(d, exist_ok=True)
    json.dump(cfg, open(os.path.join(d, "config.json"), "w"), indent=1)
    save_file(sd, os.path.join(d, "model.safetensors"), metadata={"format": "pt"})
    for f in ("tokenizer.model", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(TOK, f), d)


def convert(d, name, outtype, args=()):
    out = os.path.join(WORK, f"{name}.{outtype}{''.join(args)}.gguf")
    r = subprocess.run([sys.executable, "-c", REF, d, "--outfile", out, "--outtype", outtype, *args],
                       capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS=THREADS))
    open(out + ".log", "w").write(r.stdout + r.stderr)
    if r.returncode:
        raise SystemExit(f"convert {name} {outtype}: {r.stderr[-2000:]}")
    return out


TERNARISED = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def ternary(path):
    """Per ternarised tensor of an F32 GGUF: its sign pattern's sha256 and its magnitude's bits."""
    import hashlib
    from gguf import GGUFReader

    out = {}
    for t in GGUFReader(path).tensors:
        if t.name.split(".")[-2] not in TERNARISED:
            continue
        x = np.asarray(t.data, np.float32).ravel()
        mags = np.unique(np.abs(x[x != 0]))
        assert len(mags) == 1, (t.name, mags[:4])
        out[t.name] = {"signs": hashlib.sha256(np.sign(x).astype(np.int8).tobytes()).hexdigest(),
                       "magnitude": f"{int(mags[0].view(np.uint32)):08x}"}
    return out


def main():
    os.makedirs(WORK, exist_ok=True)
    packed = os.path.join(OUT, "bitnet_packed")
    write_model(packed, PACKED, packed_weights())
    latent = os.path.join(WORK, "bitnet_latent")
    write_model(latent, LATENT, latent_weights())
    kept = os.path.join(OUT, "bitnet_latent")
    os.makedirs(kept, exist_ok=True)
    for f in ("config.json", "tokenizer.model", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(latent, f), kept)
    cases = []
    for name, d, args in (("bitnet_packed", packed, ["--no-lazy"]), ("bitnet_latent", latent, [])):
        for t in OUTTYPES:
            path = convert(d, name, t, args)
            rec = record(path)
            if not args:  # the eager converter writes the same file as the lazy one
                assert record(convert(d, name, t, ["--no-lazy"])) == rec, (name, t)
            if t == "f32":
                rec["ternary"] = ternary(path)
            cases.append(dict(model=name, outtype=t, converter_args=args, **rec))
    if LQ:
        ref = os.path.join(WORK, "bitnet_packed.f32--no-lazy.gguf")
        for mix in MIXES:
            out = os.path.join(WORK, f"bitnet_packed.lq.{mix}.gguf")
            r = subprocess.run([LQ, ref, out, mix.upper()], capture_output=True, text=True)
            open(out + ".log", "w").write(r.stdout + r.stderr)
            if r.returncode:
                raise SystemExit(f"llama-quantize {mix}: {r.stderr[-400:]}")
            cases.append(dict(model="bitnet_packed", mix=mix, args=[], **record(out)))
    json.dump(cases, open(os.path.join(OUT, "bitnet.json"), "w"), indent=0)
    print("wrote", OUT)


main()
