#!/usr/bin/env python3
"""Generates tests/fixtures/gguf/ from the reference implementations.

    pip install gguf numpy tokenizers transformers
    scripts/gen-gguf-fixtures.py LLAMA_CPP_DIR

Uses gguf-py's quantiser and GGUFWriter, numpy ports of convert_hf_to_gguf.py's tensor
transforms, Hugging Face `tokenizers`, and transformers' AutoConfig. `cargo test` reads only
the committed outputs. LLAMA_CPP_DIR (a llama.cpp checkout) provides gguf-py; the script also
rebuilds GPT-2's
tokenizer from `models/ggml-vocab-gpt-2.gguf` and checks that its chkhsh is the converter's
`gpt-2` entry (a check of the hashing procedure against the real table; nothing is written).
"""
import hashlib
import json
import pathlib
import struct
import sys

import numpy as np

if len(sys.argv) > 1:  # the reference's own gguf-py, not whatever `pip install gguf` brought
    sys.path.insert(0, str(pathlib.Path(sys.argv[1]) / "gguf-py"))
import gguf  # noqa: E402
from gguf import GGUFWriter, GGMLQuantizationType as QT  # noqa: E402

OUT = pathlib.Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "gguf"
OUT.mkdir(parents=True, exist_ok=True)
rng = np.random.default_rng(1234)

CHKTXT = '\n \n\n \n\n\n \t \t\t \t\n  \n   \n    \n     \n🚀 (normal) 😶\u200d🌫️ (multiple emojis concatenated) ✅ 🦙🦙 3 33 333 3333 33333 333333 3333333 33333333 3.3 3..3 3...3 កាន់តែពិសេសអាច😁 ?我想在apple工作1314151天～ ------======= нещо на Български \'\'\'\'\'\'```````""""......!!!!!!?????? I\'ve been \'told he\'s there, \'RE you sure? \'M not sure I\'ll make it, \'D you like some tea? We\'Ve a\'lL'


def save(name, arr):
    (OUT / name).write_bytes(np.ascontiguousarray(arr).tobytes())


# --- Q8_0 ------------------------------------------------------------------------------------
def q8_0_inputs():
    blocks = [rng.standard_normal((64, 32)).astype(np.float32) * s for s in (1e-3, 1.0, 300.0)]
    edge = np.zeros((8, 32), np.float32)
    edge[1, :] = np.arange(32, dtype=np.float32) - 16.0          # ties at x * id = k + 0.5
    edge[2, :] = (np.arange(32, dtype=np.float32) + 0.5) * 127 / 31.5
    edge[3, :] = -1e-8                                           # d underflows in f16
    edge[4, 0] = 65504.0 * 127                                   # d overflows f16 -> inf
    edge[5, :] = 6.1e-5 * rng.standard_normal(32)                # f16 subnormal scales
    edge[6, ::2] = 1.0
    edge[6, 1::2] = -1.0
    edge[7, :] = rng.standard_normal(32) * 1e30
    return np.concatenate(blocks + [edge]).reshape(-1)


x = q8_0_inputs()
save("q8_0_input.f32", x)
save("q8_0_output.bin", gguf.quants.quantize(x.reshape(-1, 32 * 4), QT.Q8_0))


# --- GGUFWriter: one file and splits ---------------------------------------------------------
def writer_content():
    kvs = [
        ("t.u8", "u8", 200), ("t.i8", "i8", -100), ("t.u16", "u16", 65000),
        ("t.i16", "i16", -32000), ("t.u32", "u32", 4000000000), ("t.i32", "i32", -2000000000),
        ("t.u64", "u64", 2**63 + 5), ("t.i64", "i64", -(2**62)), ("t.f32", "f32", 0.1),
        ("t.f64", "f64", 0.1), ("t.bool", "bool", True), ("t.str", "str", "héllo"),
        ("t.arr_i32", "arr_i32", [1, -2, 3]), ("t.arr_f32", "arr_f32", [0.5, 1.5]),
        ("t.arr_str", "arr_str", ["a", "", "ü b"]), ("t.arr_bool", "arr_bool", [True, False]),
        ("t.arr_u8", "arr_u8", [1, 2, 255]), ("t.arr_u64", "arr_u64", [7, 2**40]),
    ]
    tensors = [
        ("a.weight", "F32", [3, 5], rng.standard_normal((3, 5)).astype(np.float32)),
        ("b.weight", "F16", [4, 8], rng.standard_normal((4, 8)).astype(np.float16)),
        ("c.weight", "Q8_0", [2, 64], gguf.quants.quantize(rng.standard_normal((2, 64)).astype(np.float32), QT.Q8_0)),
        ("d.weight", "BF16", [7], rng.integers(0, 2**16, 7, dtype=np.uint16)),
        ("e.bias", "F32", [1], np.array([1.0], np.float32)),
    ]
    return kvs, tensors


def add_kv(w, key, ty, v):
    VT = gguf.GGUFValueType
    simple = {"u8": w.add_uint8, "i8": w.add_int8, "u16": w.add_uint16, "i16": w.add_int16,
              "u32": w.add_uint32, "i32": w.add_int32, "u64": w.add_uint64, "i64": w.add_int64,
              "f32": w.add_float32, "f64": w.add_float64, "bool": w.add_bool, "str": w.add_string}
    if ty in simple:
        simple[ty](key, v)
    else:
        sub = {"arr_i32": VT.INT32, "arr_f32": VT.FLOAT32, "arr_str": VT.STRING, "arr_bool": VT.BOOL,
               "arr_u8": VT.UINT8, "arr_u64": VT.UINT64}[ty]
        w.add_key_value(key, v, VT.ARRAY, sub_type=sub)


def write_with_gguf_py(path, kvs, tensors, **split):
    w = GGUFWriter(path, "testarch", **split)
    for k, ty, v in kvs:
        add_kv(w, k, ty, v)
    for name, ty, shape, data in tensors:
        raw = {"F32": QT.F32, "F16": QT.F16, "Q8_0": QT.Q8_0, "BF16": QT.BF16}[ty]
        w.add_tensor(name, data, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


kvs, tensors = writer_content()
spec = {
    "arch": "testarch",
    "kvs": [[k, t, v] for k, t, v in kvs],
    "tensors": [],
}
blob = bytearray()
for name, ty, shape, data in tensors:
    b = np.ascontiguousarray(data).tobytes()
    spec["tensors"].append({"name": name, "type": ty, "shape": shape, "offset": len(blob), "len": len(b)})
    blob += b
(OUT / "writer_tensors.bin").write_bytes(bytes(blob))
(OUT / "writer_spec.json").write_text(json.dumps(spec, indent=1, ensure_ascii=False) + "\n")
write_with_gguf_py(OUT / "writer.gguf", kvs, tensors)
split_dir = OUT / "split"
split_dir.mkdir(exist_ok=True)
for old in split_dir.glob("*.gguf"):
    old.unlink()
write_with_gguf_py(split_dir / "bytensors.gguf", kvs, tensors, split_max_tensors=2)
# 15*4 = 60 bytes, 64, 136, 14, 4: a 130-byte limit gives [a, b], [c], [d, e]
write_with_gguf_py(split_dir / "bysize.gguf", kvs, tensors, split_max_size=130)

# --- tensor transforms (numpy ports of the converter) ----------------------------------------
def permute(w, n_head, n_head_kv):  # LlamaModel.permute
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


q = rng.integers(0, 2**16, (24, 5), dtype=np.uint16)       # 4 heads of 6 rows, 5 columns
k = rng.integers(0, 2**16, (12, 5), dtype=np.uint16)       # 2 kv heads
kb = rng.integers(0, 2**16, (12,), dtype=np.uint16)        # k bias
save("permute_q.in", q); save("permute_q.out", permute(q, 4, 4))
save("permute_k.in", k); save("permute_k.out", permute(k, 4, 2))
save("permute_kb.in", kb); save("permute_kb.out", permute(kb, 4, 2))


def transform_nibble_layout(t):  # gpt_oss.py, in numpy
    t_lo = t & 0x0F
    t_hi = t & 0xF0
    t = ((t_lo << 4) | (t_hi >> 4)).astype(np.uint8)
    blk_a, blk_b = np.split(t, 2, axis=-1)
    a0 = (blk_a & 0xF0).reshape(-1, 1)
    a1 = (blk_a << 4).astype(np.uint8).reshape(-1, 1)
    blk_a = np.stack((a0, a1), axis=2).reshape(t.shape)
    b0 = (blk_b >> 4).reshape(-1, 1)
    b1 = (blk_b & 0x0F).reshape(-1, 1)
    blk_b = np.stack((b0, b1), axis=2).reshape(t.shape)
    out = blk_a | blk_b
    return ((out & 0xF0) >> 4 | ((out & 0x0F) << 4)).astype(np.uint8)


def repack_mxfp4(blocks, scales):  # GptOssModel.repack_mxfp4
    b = transform_nibble_layout(blocks)
    new = np.concatenate((scales[..., None], b), axis=-1)
    return new.reshape(new.shape[0], new.shape[1], new.shape[2] * new.shape[3])


E, R, G = 2, 6, 3                                          # gate_up: 6 rows = 3 gate + 3 up
blocks = rng.integers(0, 256, (E, R, G, 16), dtype=np.uint8)
scales = rng.integers(100, 140, (E, R, G), dtype=np.uint8)
save("mxfp4_blocks.in", blocks); save("mxfp4_scales.in", scales)
save("mxfp4_down.out", repack_mxfp4(blocks, scales))
save("mxfp4_gate.out", repack_mxfp4(blocks[:, ::2], scales[:, ::2]))
save("mxfp4_up.out", repack_mxfp4(blocks[:, 1::2], scales[:, 1::2]))
bias = rng.integers(0, 2**16, (E, 8), dtype=np.uint16)    # gate_up_proj_bias [E, 2 * 4]
save("gate_up_bias.in", bias)
save("gate_up_bias_gate.out", bias[..., ::2]); save("gate_up_bias_up.out", bias[..., 1::2])

H, NOPE, V, L = 3, 4, 2, 5                                  # DeepseekV2Model kv_b split
kv_b = rng.integers(0, 2**16, (H * (NOPE + V), L), dtype=np.uint16)
view = kv_b.reshape(H, NOPE + V, L)
k_b, v_b = view[:, :NOPE], view[:, NOPE:]
save("kv_b.in", kv_b)
save("kv_b_k.out", np.ascontiguousarray(k_b.transpose(0, 2, 1)))
save("kv_b_v.out", v_b)

experts = [rng.integers(0, 2**16, (3, 4), dtype=np.uint16) for _ in range(3)]
save("experts.in", np.concatenate([e.reshape(-1) for e in experts]))
save("experts.out", np.stack(experts, axis=0))

packed = rng.integers(0, 2**16, (2, 6, 4), dtype=np.uint16)   # Qwen packed gate_up [E, 2ff, n]
save("gate_up_halves.in", packed)
save("gate_up_halves_gate.out", packed[..., :3, :]); save("gate_up_halves_up.out", packed[..., 3:, :])


# Llama-3 rope_freqs in float32 as torch computes it (scalar / tensor = reciprocal * scalar).
def llama3_rope_freqs(base, dim, factor, low, high, old):
    f32 = np.float32
    exps = np.arange(0, dim, 2, dtype=f32) / f32(dim)
    freqs = f32(1.0) / np.power(f32(base), exps, dtype=f32)
    out = []
    for freq in freqs:
        wavelen = (f32(1) / freq) * f32(2 * np.pi)
        if wavelen < f32(old / high):
            out.append(f32(1))
        elif wavelen > f32(old / low):
            out.append(f32(factor))
        else:
            smooth = ((f32(1) / wavelen) * f32(old) - f32(low)) / f32(high - low)
            out.append(f32(1) / ((f32(1) - smooth) / f32(factor) + smooth))
    return np.array(out, np.float32)


save("rope_freqs_llama3.out", llama3_rope_freqs(500000.0, 128, 8.0, 1.0, 4.0, 8192))

# --- configs as transformers sees them -------------------------------------------------------
from transformers import AutoConfig  # noqa: E402

cfg_dir = OUT / "configs"
cfg_dir.mkdir(exist_ok=True)
# The configs checked here, as tests/gguf.rs's ARCHS names them (the other architectures' configs
# are checked by their own goldens).
CHECKED = ["llama3", "mistral", "mixtral", "qwen2", "qwen3", "qwen3moe", "gptoss", "deepseekv3", "bitnet",
           "bitnet1bitllm"]
checked = [cfg_dir / f"{name}.config.json" for name in CHECKED]
for src in checked:
    tmp = pathlib.Path("/tmp/gguf-cfg") / src.name.removesuffix(".config.json")
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "config.json").write_text(src.read_text())
    d = AutoConfig.from_pretrained(tmp).to_dict()
    (cfg_dir / src.name.replace(".config.json", ".to_dict.json")).write_text(
        json.dumps(d, indent=1, sort_keys=True, default=str) + "\n")

# The reference's own set_gguf_parameters on each config: the model classes are built without
# __init__ (which would index tensors), torch is stubbed (these methods never touch it), and
# TextModel.__init__'s rope_parameters lines are repeated here.
if len(sys.argv) > 1:
    from unittest import mock

    sys.path.insert(0, sys.argv[1])
    sys.modules.setdefault("torch", mock.MagicMock())  # after transformers saw no torch
    from conversion.base import ModelBase  # noqa: E402
    from conversion import llama, qwen, deepseek, gpt_oss, bitnet  # noqa: E402

    classes = {"LlamaForCausalLM": llama.LlamaModel, "MistralForCausalLM": llama.LlamaModel,
               "MixtralForCausalLM": llama.LlamaModel, "Qwen2ForCausalLM": qwen.Qwen2Model,
               "Qwen3ForCausalLM": qwen.Qwen3Model, "Qwen3MoeForCausalLM": qwen.Qwen3MoeModel,
               "GptOssForCausalLM": gpt_oss.GptOssModel, "DeepseekV3ForCausalLM": deepseek.DeepseekV2Model,
               "BitNetForCausalLM": bitnet.BitnetModel, "BitnetForCausalLM": bitnet.BitnetModel}
    for src in checked:
        d = pathlib.Path("/tmp/gguf-cfg") / src.name.removesuffix(".config.json")
        hp = ModelBase.load_hparams(d, False)
        cls = classes[hp["architectures"][0]]
        m = object.__new__(cls)
        m.hparams, m.dir_model, m.is_mistral_format = hp, d, False
        m.hf_arch = m.origin_hf_arch = hp["architectures"][0]
        m.ftype, m.model_arch = gguf.LlamaFileType.MOSTLY_BF16, cls.model_arch
        m.block_count = m.find_hparam(["n_layers", "num_hidden_layers", "n_layer", "num_layers"])
        m.rope_parameters = m.hparams.get("rope_parameters", m.hparams.get("rope_scaling")) or {}
        theta = m.find_hparam(["global_rope_theta", "rope_global_theta", "rope_theta_global", "rope_theta",
                               "rotary_emb_base"], optional=True)
        if "full_attention" not in m.rope_parameters and "sliding_attention" not in m.rope_parameters:
            if "rope_theta" not in m.rope_parameters and theta is not None:
                m.rope_parameters["rope_theta"] = theta
            if "rope_type" not in m.rope_parameters and (rt := m.rope_parameters.get("type")) is not None:
                m.rope_parameters["rope_type"] = rt
        m.gguf_writer = GGUFWriter(None, gguf.MODEL_ARCH_NAMES[cls.model_arch])
        m._try_set_pooling_type = lambda: None
        m.set_gguf_parameters()
        kvs = [[k, v.type.name, float(np.float32(v.value)) if v.type.name == "FLOAT32" else v.value]
               for k, v in m.gguf_writer.kv_data[0].items()]
        (cfg_dir / src.name.replace(".config.json", ".kvs.json")).write_text(json.dumps(kvs, indent=1) + "\n")

# The reference's tensor-name map (tensor_mapping.py filtered by each architecture's tensor list)
# for the plain per-layer and global names of each configuration.
if len(sys.argv) > 1:
    attn = ["input_layernorm", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj"]
    dense = ["post_attention_layernorm", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]
    qk_norm = ["self_attn.q_norm", "self_attn.k_norm"]
    # The module names each transformers class emits (per layer, without .weight/.bias).
    plain_by_class = {
        "LlamaForCausalLM": attn + dense, "MistralForCausalLM": attn + dense,
        "MixtralForCausalLM": attn + ["post_attention_layernorm", "block_sparse_moe.gate"],
        "Qwen2ForCausalLM": attn + dense, "Qwen3ForCausalLM": attn + dense + qk_norm,
        "Qwen3MoeForCausalLM": attn + qk_norm + ["post_attention_layernorm", "mlp.gate"],
        "GptOssForCausalLM": attn + ["post_attention_layernorm", "mlp.router"],
        "DeepseekV3ForCausalLM": ["input_layernorm", "self_attn.q_a_proj", "self_attn.q_a_layernorm",
                                  "self_attn.q_b_proj", "self_attn.kv_a_proj_with_mqa", "self_attn.kv_a_layernorm",
                                  "self_attn.o_proj", "mlp.gate", "mlp.shared_experts.gate_proj",
                                  "mlp.shared_experts.up_proj", "mlp.shared_experts.down_proj"] + dense,
        "BitNetForCausalLM": attn + dense + ["self_attn.inner_attn_ln", "mlp.ffn_layernorm"],
        "BitnetForCausalLM": attn + dense + ["self_attn.inner_attn_ln", "mlp.ffn_layernorm"],
    }
    names = {}
    for src in checked:
        hp = json.loads(src.read_text())
        tm = gguf.get_tensor_name_map(classes[hp["architectures"][0]].model_arch, hp["num_hidden_layers"])
        pairs = []
        for hf in ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"] + [
                f"model.layers.1.{b}.{s}" for b in plain_by_class[hp["architectures"][0]] for s in ("weight", "bias")]:
            g = tm.get_name(hf, try_suffixes=(".weight", ".bias"))
            if g is not None:
                pairs.append([hf, g])
        names[src.name.removesuffix(".config.json")] = pairs
    (cfg_dir / "tensor_names.json").write_text(json.dumps(names, indent=1) + "\n")

# --- tokenizer -------------------------------------------------------------------------------
from tokenizers import Tokenizer, models, pre_tokenizers, decoders, processors, trainers  # noqa: E402

tok_dir = OUT / "tokenizer"
tok_dir.mkdir(exist_ok=True)
tok = Tokenizer(models.BPE())
tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
tok.decoder = decoders.ByteLevel()
trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|begin_of_text|>", "<|end_of_text|>", "<|pad|>"],
                              initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
corpus = [CHKTXT, "The quick brown fox jumps over the lazy dog. " * 20, "hello world 12345 ümlaut"]
tok.train_from_iterator(corpus, trainer)
tok.add_tokens(["<|user|>", "plain added"])
tok.post_processor = processors.Sequence([
    processors.ByteLevel(trim_offsets=False),
    processors.TemplateProcessing(single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A <|begin_of_text|> $B",
                                  special_tokens=[("<|begin_of_text|>", 0)]),
])
tok.save(str(tok_dir / "tokenizer.json"))
(tok_dir / "tokenizer_config.json").write_text(json.dumps({
    "bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>", "pad_token": "<|pad|>",
    "add_bos_token": False, "chat_template": "{% for m in messages %}{{ m['content'] }}{% endfor %}",
}, indent=1) + "\n")
(tok_dir / "config.json").write_text(json.dumps({"eos_token_id": 1, "vocab_size": 410}) + "\n")

tok = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
chktok = tok.encode(CHKTXT).ids  # add_special_tokens=True, as AutoTokenizer.encode
chkhsh = hashlib.sha256(str(chktok).encode()).hexdigest()

# get_vocab_base + SpecialVocab, as the converter (AutoTokenizer needs no torch).
from transformers import AutoTokenizer  # noqa: E402

hf = AutoTokenizer.from_pretrained(tok_dir)
assert hashlib.sha256(str(hf.encode(CHKTXT)).encode()).hexdigest() == chkhsh
vocab_size = 410
reverse = {i: t for t, i in hf.vocab.items()}
added = hf.get_added_vocab()
dec = hf.added_tokens_decoder
tokens, types = [], []
for i in range(vocab_size):
    if i not in reverse:
        tokens.append(f"[PAD{i}]"); types.append(5)
    else:
        t = reverse[i]
        if t in added:
            if dec[i].special or (t.startswith("<|") and t.endswith("|>")):
                types.append(3)
            else:
                t = t.replace("\u2581", " "); types.append(4)
        else:
            types.append(1)
        tokens.append(t)
w = GGUFWriter(tok_dir / "vocab.gguf", "llama")
w.add_tokenizer_model("gpt2")
w.add_tokenizer_pre("test-pre")
w.add_token_list(tokens)
w.add_token_types(types)
gguf.SpecialVocab(tok_dir, load_merges=True, n_vocab=len(tokens)).add_to_gguf(w)
w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
(tok_dir / "chkhsh.txt").write_text(chkhsh + "\n")

if len(sys.argv) > 1:
    r = gguf.GGUFReader(pathlib.Path(sys.argv[1]) / "models" / "ggml-vocab-gpt-2.gguf")
    f = r.fields
    toks = [bytes(f["tokenizer.ggml.tokens"].parts[i]).decode() for i in f["tokenizer.ggml.tokens"].data]
    merges = [bytes(f["tokenizer.ggml.merges"].parts[i]).decode() for i in f["tokenizer.ggml.merges"].data]
    g2 = Tokenizer(models.BPE({t: i for i, t in enumerate(toks)}, [tuple(m.split(" ")) for m in merges]))
    g2.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    h = hashlib.sha256(str(g2.encode(CHKTXT).ids).encode()).hexdigest()
    g2.save("/tmp/gpt2-tokenizer.json")
    print("gpt-2 chkhsh", h)
print("written to", OUT)
