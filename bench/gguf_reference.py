#!/usr/bin/env python3
"""Compares `tftf gguf` with llama.cpp's convert_hf_to_gguf.py on small random models of every
supported architecture (2 layers, hidden 64, the tokenizer fixture), per outtype: KVs (except
`general.*` naming fields and `tftf.*`), tensor names, types, shapes and bytes, and the tensor
order (`order`; tftf changes it only to share extents on reflink filesystems). Prints a table
and exits non-zero on any difference.

The fixture tokenizer's pre-tokenizer hash is in no table, so the reference runs with
`get_vocab_base_pre` returning "test-pre" and tftf with `--vocab-pre test-pre`.

With GGUF_REFERENCE_FIXTURES=DIR, tensor data come from a formula instead (`formula` here,
`formula` in tests/gguf_cli.rs) and each reference output is recorded as DIR/ARCH.OUTTYPE.json
(input config, tokens and tensor list; sha256 of each reference KV value and tensor) for
`cargo test --test gguf_cli reference` to check tftf against without Python.

Usage: gguf_reference.py LLAMA_CPP_DIR TFTF WORKDIR [ARCH...]   (needs torch, transformers,
numpy, safetensors; gguf-py is taken from LLAMA_CPP_DIR/gguf-py)"""
import json, os, shutil, subprocess, sys, time
import numpy as np
import torch
from safetensors.torch import save_file

LCP, TFTF, WORK = sys.argv[1], sys.argv[2], sys.argv[3]
ONLY = sys.argv[4:]
FIXTURES = os.environ.get("GGUF_REFERENCE_FIXTURES")
sys.path.insert(0, os.path.join(LCP, "gguf-py"))
from gguf import GGUFReader  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
FX = os.path.join(HERE, "..", "tests", "fixtures", "gguf")
VOCAB = 410
torch.manual_seed(0)


def rnd(shape, dtype=torch.bfloat16):
    return (torch.randn(shape) * 0.05).to(dtype)


def linear(sd, name, out, inn, bias=False):
    sd[name + ".weight"] = rnd((out, inn))
    if bias:
        sd[name + ".bias"] = rnd((out,))


def norm(sd, name, n):
    sd[name + ".weight"] = (1 + torch.randn(n) * 0.05).to(torch.bfloat16)


def config(name, **edit):
    c = json.load(open(os.path.join(FX, "configs", f"{name}.config.json")))
    c.update(vocab_size=VOCAB, bos_token_id=0, eos_token_id=1, num_hidden_layers=2)
    c.update(edit)
    return c


def attn(sd, p, c, bias=False, qk_norm=False, o_bias=False):
    h, heads, kv = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"]
    hd = c.get("head_dim", h // heads)
    linear(sd, p + "self_attn.q_proj", heads * hd, h, bias)
    linear(sd, p + "self_attn.k_proj", kv * hd, h, bias)
    linear(sd, p + "self_attn.v_proj", kv * hd, h, bias)
    linear(sd, p + "self_attn.o_proj", h, heads * hd, o_bias)
    if qk_norm:
        norm(sd, p + "self_attn.q_norm", hd)
        norm(sd, p + "self_attn.k_norm", hd)


def mlp(sd, p, h, inter):
    linear(sd, p + "gate_proj", inter, h)
    linear(sd, p + "up_proj", inter, h)
    linear(sd, p + "down_proj", h, inter)


def common(sd, c, layer_fn, tied=False, norms=("input_layernorm", "post_attention_layernorm")):
    h = c["hidden_size"]
    sd["model.embed_tokens.weight"] = rnd((c["vocab_size"], h))
    for l in range(c["num_hidden_layers"]):
        p = f"model.layers.{l}."
        for n in norms:
            norm(sd, p + n, h)
        layer_fn(sd, p, l)
    norm(sd, "model.norm", h)
    if not tied:
        sd["lm_head.weight"] = rnd((c["vocab_size"], h))


def dense(name, bias=False, qk_norm=False, dtype=torch.bfloat16, **edit):
    def make():
        c = config(name, **edit)
        c["torch_dtype"] = "float32" if dtype == torch.float32 else "bfloat16"
        sd = {}
        common(sd, c, lambda sd, p, l: (attn(sd, p, c, bias, qk_norm),
                                        mlp(sd, p + "mlp.", c["hidden_size"], c["intermediate_size"])),
               tied=c.get("tie_word_embeddings", False))
        return c, {k: v.to(dtype) for k, v in sd.items()}
    return make


def built(name, layer, **kw):
    """The config `name` and its random state dict: `common`'s tensors, each layer's own from
    `layer(sd, prefix, config)`."""
    c = config(name)
    sd = {}
    common(sd, c, lambda sd, p, l: layer(sd, p, c), **kw)
    return c, sd


def qwen3moe():
    def layer(sd, p, c):
        attn(sd, p, c, qk_norm=True)
        linear(sd, p + "mlp.gate", c["num_experts"], c["hidden_size"])
        for e in range(c["num_experts"]):
            mlp(sd, p + f"mlp.experts.{e}.", c["hidden_size"], c["moe_intermediate_size"])
    return built("qwen3moe", layer)


def mxfp4(shape):
    blocks = torch.randint(0, 256, shape + (shape[-1] and 16,), dtype=torch.uint8)
    return blocks


def gptoss():
    def layer(sd, p, c):
        h, inter, E = c["hidden_size"], c["intermediate_size"], c["num_local_experts"]
        attn(sd, p, c, bias=True, o_bias=True)
        sd[p + "self_attn.sinks"] = rnd((c["num_attention_heads"],))
        linear(sd, p + "mlp.router", E, h, bias=True)
        for w, rows, cols in (("gate_up_proj", 2 * inter, h), ("down_proj", h, inter)):
            sd[p + f"mlp.experts.{w}_blocks"] = torch.randint(0, 256, (E, rows, cols // 32, 16), dtype=torch.uint8)
            sd[p + f"mlp.experts.{w}_scales"] = torch.randint(118, 130, (E, rows, cols // 32), dtype=torch.uint8)
            sd[p + f"mlp.experts.{w}_bias"] = rnd((E, rows))
    return built("gptoss", layer)


def qwen2moe():
    def layer(sd, p, c):
        h = c["hidden_size"]
        attn(sd, p, c, bias=True)
        linear(sd, p + "mlp.gate", c["num_experts"], h)
        for e in range(c["num_experts"]):
            mlp(sd, p + f"mlp.experts.{e}.", h, c["moe_intermediate_size"])
        mlp(sd, p + "mlp.shared_expert.", h, c["shared_expert_intermediate_size"])
        linear(sd, p + "mlp.shared_expert_gate", 1, h)
    return built("qwen2moe", layer)


def olmo2():
    def layer(sd, p, c):
        h = c["hidden_size"]
        attn(sd, p, c)
        norm(sd, p + "self_attn.q_norm", h)  # full width: heads × head_dim
        norm(sd, p + "self_attn.k_norm", c["num_key_value_heads"] * (h // c["num_attention_heads"]))
        mlp(sd, p + "mlp.", h, c["intermediate_size"])
    return built("olmo2", layer, norms=("post_attention_layernorm", "post_feedforward_layernorm"))


def fp8(sd, name, out, inn):
    w = (torch.randn((out, inn)) * 0.5).to(torch.float8_e4m3fn)
    sd[name + ".weight"] = w
    sd[name + ".weight_scale_inv"] = torch.rand(((out + 127) // 128, (inn + 127) // 128)) * 0.1 + 0.01


def deepseek(name, fp8_weights=True, **edit):
    """DeepSeek-V2/V3-shaped MLA + MoE model; V3's MTP layer when `num_nextn_predict_layers`."""
    def make():
        c = config(name, **edit)  # 2 layers (+ the MTP layer 2 when num_nextn_predict_layers is 1)
        h, heads = c["hidden_size"], c["num_attention_heads"]
        qk = c["qk_nope_head_dim"] + c["qk_rope_head_dim"]
        w = fp8 if fp8_weights else (lambda sd, n, o, i: linear(sd, n, o, i))
        sd = {}
        def layer(sd, p, l):
            a = p + "self_attn."
            if c.get("q_lora_rank") is None:  # V2-Lite: a plain q_proj
                w(sd, a + "q_proj", heads * qk, h)
            else:
                w(sd, a + "q_a_proj", c["q_lora_rank"], h)
                norm(sd, a + "q_a_layernorm", c["q_lora_rank"])
                w(sd, a + "q_b_proj", heads * qk, c["q_lora_rank"])
            w(sd, a + "kv_a_proj_with_mqa", c["kv_lora_rank"] + c["qk_rope_head_dim"], h)
            norm(sd, a + "kv_a_layernorm", c["kv_lora_rank"])
            w(sd, a + "kv_b_proj", heads * (c["qk_nope_head_dim"] + c["v_head_dim"]), c["kv_lora_rank"])
            w(sd, a + "o_proj", h, heads * c["v_head_dim"])
            if l < c["first_k_dense_replace"]:
                for n, o, i in (("gate_proj", c["intermediate_size"], h), ("up_proj", c["intermediate_size"], h),
                                ("down_proj", h, c["intermediate_size"])):
                    w(sd, p + "mlp." + n, o, i)
                return
            sd[p + "mlp.gate.weight"] = rnd((c["n_routed_experts"], h))
            if c.get("topk_method") == "noaux_tc":
                sd[p + "mlp.gate.e_score_correction_bias"] = torch.rand(c["n_routed_experts"])
            mi = c["moe_intermediate_size"]
            for e in [f"experts.{e}" for e in range(c["n_routed_experts"])] + ["shared_experts"]:
                m = mi * (c["n_shared_experts"] if e == "shared_experts" else 1)
                for n, o, i in (("gate_proj", m, h), ("up_proj", m, h), ("down_proj", h, m)):
                    w(sd, p + f"mlp.{e}." + n, o, i)
            if l == c["num_hidden_layers"]:  # the MTP layer's extra tensors
                for n in ("enorm", "hnorm", "shared_head.norm"):
                    norm(sd, p + n, h)
                linear(sd, p + "eh_proj", h, 2 * h)
                sd[p + "embed_tokens.weight"] = rnd((VOCAB, h))
                sd[p + "shared_head.head.weight"] = rnd((VOCAB, h))
        common(sd, c, layer)
        if c.get("num_nextn_predict_layers"):
            p = f"model.layers.{c['num_hidden_layers']}."
            norm(sd, p + "input_layernorm", h)
            norm(sd, p + "post_attention_layernorm", h)
            layer(sd, p, c["num_hidden_layers"])
        return c, sd
    return make


def glm4moe():
    """GLM-4.5: Q/K/V biases, Q/K norms, first-k dense layers, sigmoid-routed experts with a
    correction bias and a shared expert, and the NextN/MTP layer (kept by the reference)."""
    c = config("glm4moe")
    # GLM-4.5's config.json names no bos_token_id. Its tokenizer_config.json names no
    # bos_token either (then the converter takes [gMASK]); the fixture's is kept here, as
    # without one gguf-py takes the fixture's TemplateProcessing first token, which tftf does
    # not (README); arch_glm's unit tests cover the [gMASK] case.
    del c["bos_token_id"]
    h, E = c["hidden_size"], c["n_routed_experts"]
    sd = {}
    def layer(sd, p, l):
        attn(sd, p, c, bias=True, qk_norm=c["use_qk_norm"])
        if l < c["first_k_dense_replace"]:
            mlp(sd, p + "mlp.", h, c["intermediate_size"])
            return
        linear(sd, p + "mlp.gate", E, h)
        sd[p + "mlp.gate.e_score_correction_bias"] = torch.rand(E)
        for e in range(E):
            mlp(sd, p + f"mlp.experts.{e}.", h, c["moe_intermediate_size"])
        mlp(sd, p + "mlp.shared_experts.", h, c["moe_intermediate_size"] * c["n_shared_experts"])
    common(sd, c, layer)
    p = f"model.layers.{c['num_hidden_layers']}."
    for n in ("input_layernorm", "post_attention_layernorm", "enorm", "hnorm", "shared_head.norm"):
        norm(sd, p + n, h)
    layer(sd, p, c["num_hidden_layers"])
    linear(sd, p + "eh_proj", h, 2 * h)
    sd[p + "embed_tokens.weight"] = rnd((VOCAB, h))
    sd[p + "shared_head.head.weight"] = rnd((VOCAB, h))
    return c, sd


def gemma(name, q_k_norm, text=None, extra=None, eos=1):
    """Gemma 2/3: norms before and after attention and feed-forward, tied embeddings; `text`
    edits go to `text_config` (Gemma3ForConditionalGeneration), `extra` adds tensors."""
    def make():
        c = config(name, vocab_size=400, bos_token_id=2, eos_token_id=eos)
        if text:
            c.pop("vocab_size")
            c["text_config"].update(text)
        t = {**c, **c.get("text_config", {})}
        h = t["hidden_size"]
        pre = "model.language_model." if text else "model."
        sd = {}
        def layer(sd, p, l):
            attn(sd, p, t, qk_norm=q_k_norm)
            mlp(sd, p + "mlp.", h, t["intermediate_size"])
        for l in range(2):
            p = f"{pre}layers.{l}."
            for n in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                      "post_feedforward_layernorm"):
                norm(sd, p + n, h)
            layer(sd, p, l)
        sd[pre + "embed_tokens.weight"] = rnd((t["vocab_size"], h))
        norm(sd, pre + "norm", h)
        if extra:
            extra(sd)
        return c, sd
    return make


def phi3(name, **edit):
    """Phi-3/Phi-4: fused `qkv_proj` and `gate_up_proj`; tied embeddings where the config says
    so (Phi-4-mini)."""
    def make():
        c = config(name, **edit)
        h, heads, kv, inter = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"], c["intermediate_size"]
        hd = h // heads
        sd = {}
        def layer(sd, p, l):
            linear(sd, p + "self_attn.qkv_proj", (heads + 2 * kv) * hd, h)
            linear(sd, p + "self_attn.o_proj", h, heads * hd)
            linear(sd, p + "mlp.gate_up_proj", 2 * inter, h)
            linear(sd, p + "mlp.down_proj", h, inter)
        common(sd, c, layer, tied=c.get("tie_word_embeddings", False))
        return c, sd
    return make


def gemma3_vision(sd):
    """A stand-in vision tower and projector: the text GGUF leaves them out."""
    linear(sd, "model.vision_tower.vision_model.encoder.layers.0.self_attn.q_proj", 32, 32)
    norm(sd, "model.vision_tower.vision_model.post_layernorm", 32)
    sd["model.multi_modal_projector.mm_input_projection_weight"] = rnd((32, 64))
    norm(sd, "model.multi_modal_projector.mm_soft_emb_norm", 32)


def llama4(name, **edit):
    """Llama 4: dense and MoE layers interleaved by `interleave_moe_layer_step`, the routed
    experts fused and transposed (`gate_up_proj` [E, hidden, 2·ff], `down_proj` [E, ff,
    hidden]), a shared expert, and for Llama4ForConditionalGeneration a stand-in vision tower
    and projector under `text_config`'s `language_model.` names."""
    def make():
        c = config(name, **edit)
        if "text_config" in c:
            for k in ("vocab_size", "bos_token_id", "eos_token_id", "num_hidden_layers"):
                c["text_config"][k] = c.pop(k)
        t = {**c, **c.get("text_config", {})}
        h, E, ff = t["hidden_size"], t["num_local_experts"], t["intermediate_size"]
        vl = "text_config" in c
        pre = "language_model.model." if vl else "model."
        sd = {pre + "embed_tokens.weight": rnd((VOCAB, h))}
        for l in range(t["num_hidden_layers"]):
            p = f"{pre}layers.{l}."
            norm(sd, p + "input_layernorm", h)
            norm(sd, p + "post_attention_layernorm", h)
            attn(sd, p, t)
            if (l + 1) % t["interleave_moe_layer_step"] == 0:
                sd[p + "feed_forward.experts.gate_up_proj"] = rnd((E, h, 2 * ff))
                sd[p + "feed_forward.experts.down_proj"] = rnd((E, ff, h))
                linear(sd, p + "feed_forward.router", E, h)
                mlp(sd, p + "feed_forward.shared_expert.", h, ff)
            else:
                mlp(sd, p + "feed_forward.", h, t["intermediate_size_mlp"])
        norm(sd, pre + "norm", h)
        sd[("language_model." if vl else "") + "lm_head.weight"] = rnd((VOCAB, h))
        if vl:
            linear(sd, "vision_model.model.layers.0.self_attn.q_proj", 32, 32, bias=True)
            sd["vision_model.positional_embedding_vlm"] = rnd((577, 32))
            linear(sd, "multi_modal_projector.linear_1", 64, 64)
        return c, sd
    return make


ARCHS = {  # name: (builder, outtypes)
    "llama": (dense("llama3"), ["bf16", "q8_0"]),
    "llama-f32": (dense("llama3", dtype=torch.float32), ["f16", "q8_0"]),
    "qwen2": (dense("qwen2", bias=True), ["bf16", "q8_0"]),
    "qwen3": (dense("qwen3", qk_norm=True), ["bf16", "q8_0"]),
    "qwen3moe": (qwen3moe, ["bf16", "q8_0"]),
    "gpt-oss": (gptoss, ["bf16", "q8_0"]),
    "deepseek-v3": (deepseek("deepseekv3"), ["bf16", "q8_0"]),
    "granite3": (dense("granite3"), ["bf16", "q8_0"]),  # tied embeddings, no lm_head
    "olmo2": (olmo2, ["bf16", "q8_0"]),
    "qwen2moe": (qwen2moe, ["bf16", "q8_0"]),
    # tests/fixtures/gguf/spm-llama2's tokenizer.model: 400 pieces, <s> 1, </s> 2.
    "llama2": (dense("llama2", vocab_size=400, bos_token_id=1, eos_token_id=2), ["bf16", "q8_0"]),
    # A tied checkpoint saved with its lm_head (a copy of the embeddings): the converter drops it.
    "gemma2": (gemma("gemma2", False, extra=lambda sd: sd.update({"lm_head.weight": sd["model.embed_tokens.weight"].clone()})), ["bf16", "q8_0"]),
    "gemma3": (gemma("gemma3", True, eos=[1, 106]), ["bf16", "q8_0"]),
    # Gemma3ForConditionalGeneration: text_config, 410 ids for 400 pieces, vision left out.
    "gemma3vl": (gemma("gemma3vl", True, text={"vocab_size": 410}, extra=gemma3_vision, eos=[1, 106]), ["bf16", "q8_0"]),
    "deepseek-v2": (deepseek("deepseekv2", fp8_weights=False), ["bf16", "q8_0"]),
    # llama.cpp tells V2-Lite (no q_lora_rank) by its 27 layers: keep them.
    "deepseek-v2-lite": (deepseek("deepseekv2lite", fp8_weights=False, num_hidden_layers=27), ["bf16", "q8_0"]),
    # Kimi K2's config (model_type kimi_k2: the reference reads config.json raw), FP8, 384
    # experts; bf16 only (its q8_0 path is DeepSeek-V3's), to keep the recorded digests small.
    "kimi-k2": (deepseek("kimik2"), ["bf16"]),
    "glm4moe": (glm4moe, ["bf16", "q8_0"]),
    # tests/fixtures/gguf/spm-phi3: 400 pieces, Phi-3's added tokens at 400-406 (<|endoftext|>
    # 400), padded to 410.
    "phi3": (phi3("phi3", bos_token_id=1, eos_token_id=400, pad_token_id=400), ["bf16", "q8_0"]),
    # LongRoPE: rope_factors_long/short and rope.scaling.attn_factor.
    "phi3.5": (phi3("phi3.5", bos_token_id=1, eos_token_id=400, pad_token_id=400), ["bf16", "q8_0"]),
    # Phi-3-mini-128k's first rope type, `su` (transformers renames it longrope), with an
    # original context of its own in rope_scaling.
    "phi3su": (phi3("phi3su", bos_token_id=1, eos_token_id=400, pad_token_id=400), ["bf16"]),
    # GPT2Tokenizer (the BPE fixture), no sliding window.
    "phi4": (phi3("phi4"), ["bf16", "q8_0"]),
    # partial rotary 0.75, LongRoPE, tied embeddings (no lm_head), GPT2Tokenizer.
    "phi4mini": (phi3("phi4mini"), ["bf16", "q8_0"]),
    # Llama4ForConditionalGeneration: Scout's llama3 rope (low = high frequency factor), dense
    # and MoE layers alternating, vision left out. Four layers: llama.cpp's chunked-attention
    # graph needs a NoPE layer (every fourth) to run.
    "llama4": (llama4("llama4", num_hidden_layers=4), ["bf16", "q8_0"]),
    # Llama4ForCausalLM: every layer MoE, all full attention (sliding window 0), no rope scaling.
    "llama4text": (llama4("llama4text"), ["bf16"]),
}

# SentencePiece architectures: the tokenizer fixture folder copied into the model (its
# tokenizer.model, tokenizer.json and tokenizer_config.json, and added_tokens.json where it has
# one) instead of the BPE one.
SPM = {"llama2": "spm-llama2", "gemma2": "spm-gemma", "gemma3": "spm-gemma", "gemma3vl": "spm-gemma",
       "phi3": "spm-phi3", "phi3.5": "spm-phi3", "phi3su": "spm-phi3"}

REF = f"""
import sys
sys.path[:0] = [{LCP!r}, {os.path.join(LCP, 'gguf-py')!r}]
import conversion.base as b
b.TextModel.get_vocab_base_pre = lambda self, tok: "test-pre"
import transformers
_auto_tok = transformers.AutoTokenizer.from_pretrained
def _tok(path, *a, **k):
    try:
        return _auto_tok(path, *a, **k)
    except AttributeError:
        # transformers 5.24 cannot build the bare config it falls back to for a model_type it
        # does not know when config.json has rope_scaling and the remote code is absent (Kimi
        # K2's here, which has a BPE tokenizer.json instead of its tiktoken one); the
        # tokenizer needs no config.
        return _auto_tok(path, *a, config=transformers.PretrainedConfig(), **k)
transformers.AutoTokenizer.from_pretrained = _tok
sys.argv = ["convert_hf_to_gguf.py"] + sys.argv[1:]
import convert_hf_to_gguf as c
c.main()
"""


def formula(k, name, dtype, shape):
    """Deterministic bytes for the k-th tensor (names sorted): finite, varied values."""
    n = int(np.prod(shape))
    i = np.arange(n, dtype=np.uint64)
    u = (i * np.uint64(2654435761) + np.uint64((k + 1) * 0x9E3779B9)) & np.uint64(0xFFFFFFFF)
    u = (u ^ (u >> np.uint64(13))) & np.uint64(0xFFFFFFFF)
    bf = (np.uint64(0x3C00) | (u & np.uint64(0x3FF)) | ((u >> np.uint64(10)) & np.uint64(1)) << np.uint64(15))
    if name.endswith("_scales"):
        return torch.from_numpy((np.uint64(118) + u % np.uint64(12)).astype(np.uint8)).reshape(shape)
    if dtype == torch.uint8:
        return torch.from_numpy((u & np.uint64(0xFF)).astype(np.uint8)).reshape(shape)
    if dtype == torch.float8_e4m3fn:
        b = ((u & np.uint64(0x77)) | ((u >> np.uint64(8)) & np.uint64(0x80))).astype(np.uint8)
        return torch.from_numpy(b).view(torch.float8_e4m3fn).reshape(shape)
    if name.endswith("weight_scale_inv"):
        return torch.from_numpy((np.uint64(0x3C000000) | (u & np.uint64(0x3FFFFF))).astype(np.uint32)).view(torch.float32).reshape(shape)
    if dtype == torch.float32:
        return torch.from_numpy((bf << np.uint64(16)).astype(np.uint32)).view(torch.float32).reshape(shape)
    return torch.from_numpy(bf.astype(np.uint16)).view(torch.bfloat16).reshape(shape)


def arch_type(c):
    return c["model_type"]


def build(name, make):
    d = os.path.join(WORK, name)
    os.makedirs(d, exist_ok=True)
    c, sd = make()
    if FIXTURES:
        sd = {n: formula(k, n, sd[n].dtype, tuple(sd[n].shape)) for k, n in enumerate(sorted(sd))}
    build.inputs = (c, {n: (str(v.dtype).split(".")[1], list(v.shape)) for n, v in sorted(sd.items())})
    json.dump(c, open(os.path.join(d, "config.json"), "w"), indent=1)
    save_file({k: v.contiguous() for k, v in sd.items()}, os.path.join(d, "model.safetensors"), metadata={"format": "pt"})
    build.tokenizer = SPM.get(name)
    if build.tokenizer:
        for f in ("tokenizer.model", "tokenizer.json", "tokenizer_config.json", "added_tokens.json"):
            if f != "added_tokens.json" or os.path.exists(os.path.join(FX, build.tokenizer, f)):
                shutil.copy(os.path.join(FX, build.tokenizer, f), os.path.join(d, f))
        build.added, build.tc_extra = [], {}
        return d
    tj = json.load(open(os.path.join(FX, "tokenizer", "tokenizer.json")))
    if arch_type(c).startswith("qwen"):
        # Real Qwen tokenizers hold `<|endoftext|>`; transformers' Qwen2Tokenizer adds it
        # (as its default unk token) when missing, which tftf does not emulate.
        tj["added_tokens"].append({"id": 402, "content": "<|endoftext|>", "single_word": False, "lstrip": False,
                                   "rstrip": False, "normalized": False, "special": True})
    if arch_type(c) == "glm4_moe":
        # GLM's converter takes eot/unk/eom (and bos, when the tokenizer files name none) from
        # these added tokens; tokenizer_config.json's bos_token stays (see glm4moe()).
        for i, t in enumerate(("[gMASK]", "<|endoftext|>", "<|observation|>")):
            tj["added_tokens"].append({"id": 402 + i, "content": t, "single_word": False, "lstrip": False,
                                       "rstrip": False, "normalized": False, "special": True})
    json.dump(tj, open(os.path.join(d, "tokenizer.json"), "w"), ensure_ascii=False)
    build.added = tj["added_tokens"][5:]
    # As real Llama-3 checkpoints do: without a class, transformers picks the model type's
    # (Qwen2Tokenizer adds its default `<|endoftext|>` when tokenizer.json lacks it).
    tc = json.load(open(os.path.join(FX, "tokenizer", "tokenizer_config.json")))
    tc["tokenizer_class"] = "PreTrainedTokenizerFast"
    # Llama-family converters copy `add_prefix_space` into tokenizer.ggml.add_space_prefix.
    build.tc_extra = {"add_prefix_space": False} if name == "llama" else {}
    if name.startswith("phi4"):
        # Phi-4's tokenizer class, which makes the Phi-3 converter take GPT-2 BPE.
        build.tc_extra = {"tokenizer_class": "GPT2Tokenizer"}
    tc.update(build.tc_extra)
    json.dump(tc, open(os.path.join(d, "tokenizer_config.json"), "w"), indent=1)
    return d


# Fields the converter derives from the folder name or a model card; every other KV, the
# parameter count's `general.size_label` included, must be equal.
NAMING = ("general.name", "general.basename", "general.finetune", "general.version", "general.quantized_by")


def kvs(r):
    out = {}
    for k, f in r.fields.items():
        if k.startswith("GGUF.") or k.startswith("tftf.") or k in NAMING:
            continue
        out[k] = (tuple(f.types), [bytes(f.parts[i]) for i in f.data])
    return out


def compare(ours, ref):
    a, b = GGUFReader(ours), GGUFReader(ref)
    ka, kb = kvs(a), kvs(b)
    kv_diff = sorted(set(ka) ^ set(kb)) + sorted(k for k in set(ka) & set(kb) if ka[k] != kb[k])
    ta, tb = {t.name: t for t in a.tensors}, {t.name: t for t in b.tensors}
    t_diff = sorted(set(ta) ^ set(tb))
    b_diff = []
    for n in sorted(set(ta) & set(tb)):
        x, y = ta[n], tb[n]
        if (x.tensor_type, list(x.shape)) != (y.tensor_type, list(y.shape)):
            t_diff.append(f"{n} {x.tensor_type.name}{list(x.shape)} vs {y.tensor_type.name}{list(y.shape)}")
        elif np.asarray(x.data).tobytes() != np.asarray(y.data).tobytes():
            b_diff.append(n)
    order = [t.name for t in a.tensors] == [t.name for t in b.tensors]
    return kv_diff, t_diff, b_diff, order, len(ta), (ka, kb)


ST = {"bfloat16": "BF16", "float32": "F32", "uint8": "U8", "float8_e4m3fn": "F8_E4M3"}


def record(arch, ot, ref):
    import hashlib
    c, tensors = build.inputs
    r = GGUFReader(ref)
    sha = lambda b: hashlib.sha256(b).hexdigest()
    kv = {k: sha(b"".join(bytes(p) for p in f.parts[2:])) for k, f in r.fields.items()
          if not k.startswith("GGUF.") and k not in NAMING}
    out = {t.name: [[int(x) for x in t.shape], int(t.tensor_type), sha(np.asarray(t.data).tobytes())] for t in r.tensors}
    os.makedirs(FIXTURES, exist_ok=True)
    json.dump({"outtype": ot, "config": c, "added_tokens": build.added, "tokenizer": build.tokenizer,
               "tokenizer_config": build.tc_extra, "order": [t.name for t in r.tensors],
               "tensors": [[n, ST[d], s] for n, (d, s) in tensors.items()], "kvs": kv, "out": out},
              open(os.path.join(FIXTURES, f"{arch}.{ot}.json"), "w"), indent=0, sort_keys=True)


def main():
    rows, bad = [], False
    for arch, (make, outtypes) in ARCHS.items():
        if ONLY and arch not in ONLY:
            continue
        d = build(arch, make)
        for ot in outtypes:
            ref, ours = os.path.join(WORK, f"{arch}.{ot}.ref.gguf"), os.path.join(WORK, f"{arch}.{ot}.tftf.gguf")
            for p in (ref, ours):
                if os.path.exists(p):
                    os.remove(p)
            r = subprocess.run([sys.executable, "-c", REF, d, "--outfile", ref, "--outtype", ot],
                               capture_output=True, text=True)
            if r.returncode:
                rows.append((arch, ot, "reference failed: " + r.stderr.strip().splitlines()[-1][:200]))
                bad = True
                continue
            t = subprocess.run([TFTF, "gguf", "-i", d, "-o", ours, "--outtype", ot, "--vocab-pre", "test-pre", "-q"],
                               capture_output=True, text=True)
            if t.returncode:
                rows.append((arch, ot, "tftf failed: " + t.stderr.strip()[:200]))
                bad = True
                continue
            if FIXTURES:
                record(arch, ot, ref)
            kv_diff, t_diff, b_diff, order, n, (ka, kb) = compare(ours, ref)
            if kv_diff or t_diff or b_diff or not order:
                bad = True
            for k in kv_diff:
                print(f"  {arch} {ot} KV {k}: ours {ka.get(k)!s:.160} ref {kb.get(k)!s:.160}")
            for k in t_diff:
                print(f"  {arch} {ot} tensor {k}")
            for k in b_diff[:10]:
                print(f"  {arch} {ot} bytes {k}")
            rows.append((arch, ot, f"{len(ka)} KVs {'equal' if not kv_diff else 'DIFFER: ' + ', '.join(kv_diff)} | "
                                   f"{n} tensors {'equal' if not t_diff else 'DIFFER (' + str(len(t_diff)) + ')'} | "
                                   f"bytes {'equal' if not b_diff else 'DIFFER (' + str(len(b_diff)) + ')'} | "
                                   f"order {'same' if order else 'differs'}"))
    print("| architecture | outtype | result |\n|---|---|---|")
    for r in rows:
        print(f"| {r[0]} | {r[1]} | {r[2]} |")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":  # bench/gguf_llama_check.py imports the model builders
    main()
