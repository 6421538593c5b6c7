//! GGUF helpers: one reader for every test, and small models for `tftf gguf`.
//!
//! - Read: [`read_header`] (KVs and tensor infos of a header, as llama.cpp's loader reads
//!   them), [`Gguf::read`] / [`parse`] (a whole file, its layout checked, tensors with data).
//! - Write and convert: [`GgufCase`] (a temporary folder with a model made by [`model_dir`]:
//!   config fixture, tokenizer fixture, tensors), [`GgufCase::convert`] runs
//!   `tftf gguf MODEL -o OUT --vocab-pre PRE EXTRA... -q` and reads the output back;
//!   [`dense_layers`] / [`head`] make Llama-like tensors.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde_json::Value as Json;
use tftf::format::dtype::DType;

use super::{fixture, ok, rand_t, s, t, tftf, tmp, write_file, Rng, T};

/// `tests/fixtures/gguf/<name>`.
pub fn gguf_fixture(name: &str) -> PathBuf {
    fixture(&format!("gguf/{name}"))
}

/// The bytes of `tests/fixtures/gguf/<name>`.
pub fn read_gguf_fixture(name: &str) -> Vec<u8> {
    let path = gguf_fixture(name);
    std::fs::read(&path).unwrap_or_else(|e| panic!("{name}: {e}"))
}

/// The header of a GGUF file: KVs as (key, encoded type + value), tensor infos as
/// (name, dims innermost first as stored, type id, offset), and where the data starts
/// (`general.alignment`, 32 by default).
pub struct Header {
    pub kvs: Vec<(String, Vec<u8>)>,
    pub tensors: Vec<(String, Vec<u64>, u32, u64)>,
    pub data_start: u64,
    /// Where the tensor infos end.
    pub end: usize,
}

/// Reads the header of the GGUF bytes `b` (version 3), following llama.cpp's loader rules.
pub fn read_header(b: &[u8]) -> Header {
    let mut p = 0usize;
    let u32_at = |p: &mut usize| {
        let v = u32::from_le_bytes(b[*p..*p + 4].try_into().unwrap());
        *p += 4;
        v
    };
    let u64_at = |p: &mut usize| {
        let v = u64::from_le_bytes(b[*p..*p + 8].try_into().unwrap());
        *p += 8;
        v
    };
    let str_at = |p: &mut usize| {
        let n = u64_at(p) as usize;
        let s = String::from_utf8(b[*p..*p + n].to_vec()).unwrap();
        *p += n;
        s
    };
    assert_eq!(&b[..4], b"GGUF");
    p += 4;
    assert_eq!(u32_at(&mut p), 3);
    let n_tensors = u64_at(&mut p);
    let n_kv = u64_at(&mut p);
    fn skip_value(b: &[u8], p: &mut usize, ty: u32) {
        let fixed = |t| match t {
            0 | 1 | 7 => 1,
            2 | 3 => 2,
            4..=6 => 4,
            10..=12 => 8,
            t => panic!("kv type {t}"),
        };
        match ty {
            8 => {
                let n = u64::from_le_bytes(b[*p..*p + 8].try_into().unwrap()) as usize;
                *p += 8 + n;
            }
            9 => {
                let et = u32::from_le_bytes(b[*p..*p + 4].try_into().unwrap());
                let n = u64::from_le_bytes(b[*p + 4..*p + 12].try_into().unwrap());
                *p += 12;
                for _ in 0..n {
                    skip_value(b, p, et);
                }
            }
            t => *p += fixed(t),
        }
    }
    let mut kvs = Vec::new();
    for _ in 0..n_kv {
        let key = str_at(&mut p);
        let start = p;
        let ty = u32_at(&mut p);
        skip_value(b, &mut p, ty);
        kvs.push((key, b[start..p].to_vec()));
    }
    let align = kvs
        .iter()
        .find(|(k, _)| k == "general.alignment")
        .map(|(_, v)| u32::from_le_bytes(v[4..8].try_into().unwrap()) as u64)
        .unwrap_or(32);
    let mut tensors = Vec::new();
    for _ in 0..n_tensors {
        let name = str_at(&mut p);
        let nd = u32_at(&mut p);
        let dims: Vec<u64> = (0..nd).map(|_| u64_at(&mut p)).collect();
        let ty = u32_at(&mut p);
        let off = u64_at(&mut p);
        tensors.push((name, dims, ty, off));
    }
    Header {
        kvs,
        tensors,
        data_start: (p as u64).div_ceil(align) * align,
        end: p,
    }
}

/// A GGUF file read back as llama.cpp's loader reads it.
pub struct Gguf {
    /// Key → raw type id + value bytes, in file order.
    pub kvs: Vec<(String, Vec<u8>)>,
    /// Name → (shape outermost first, type id, data bytes).
    pub tensors: BTreeMap<String, (Vec<u64>, u32, Vec<u8>)>,
    pub order: Vec<String>,
}

/// `(type ids, elements, bytes)` of a block of each ggml type the tests write: F32, F16/BF16,
/// Q8_0, MXFP4, Q4_0/IQ4_NL, Q4_1, Q5_0, Q5_1; then the 256-blocks Q2_K … Q6_K, IQ2_XXS,
/// IQ2_XS, IQ3_XXS, IQ1_S, IQ3_S, IQ2_S, IQ4_XS, IQ1_M, TQ1_0, TQ2_0.
#[rustfmt::skip]
const BLOCKS: &[(&[u32], u64, u64)] = &[
    (&[0], 1, 4), (&[1, 30], 1, 2),
    (&[8], 32, 34), (&[39], 32, 17), (&[2, 20], 32, 18), (&[3], 32, 20), (&[6], 32, 22), (&[7], 32, 24),
    (&[10], 256, 84), (&[16], 256, 66), (&[17], 256, 74), (&[19], 256, 50), (&[22], 256, 82),
    (&[29], 256, 56), (&[11, 21], 256, 110), (&[12], 256, 144), (&[13], 256, 176), (&[14], 256, 210),
    (&[18], 256, 98), (&[23], 256, 136), (&[34], 256, 54), (&[35], 256, 66),
];

/// Bytes of `elems` elements of the ggml type `ty` (the types the tests write).
fn type_size(ty: u32, elems: u64) -> u64 {
    let &(_, block_elems, block_bytes) = BLOCKS
        .iter()
        .find(|(ids, _, _)| ids.contains(&ty))
        .unwrap_or_else(|| panic!("type {ty}"));
    elems / block_elems * block_bytes
}

impl Gguf {
    /// Reads the file at `path`, checking the layout: no `general.alignment` (32 bytes), zero
    /// padding to the data, each offset the previous one plus its size padded to 32 (as
    /// gguf.cpp), and the file ending with the last tensor.
    pub fn read(path: &Path) -> Gguf {
        let b = std::fs::read(path).unwrap();
        let h = read_header(&b);
        assert!(
            !h.kvs.iter().any(|(k, _)| k == "general.alignment"),
            "32-byte alignment is written as no key"
        );
        assert!(b[h.end..h.data_start as usize].iter().all(|&x| x == 0));
        let mut expect = 0u64;
        let mut tensors = BTreeMap::new();
        let mut order = Vec::new();
        for (name, mut dims, ty, off) in h.tensors {
            dims.reverse();
            assert_eq!(off, expect, "{name}: offset");
            let len = type_size(ty, dims.iter().product());
            let at = (h.data_start + off) as usize;
            let data = b[at..at + len as usize].to_vec();
            expect = (off + len).div_ceil(32) * 32;
            order.push(name.clone());
            assert!(tensors.insert(name, (dims, ty, data)).is_none());
        }
        assert_eq!(b.len() as u64, h.data_start + expect, "file length");
        Gguf {
            kvs: h.kvs,
            tensors,
            order,
        }
    }

    pub fn kv(&self, key: &str) -> Option<&[u8]> {
        self.kvs
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_slice())
    }

    pub fn u32(&self, key: &str) -> u32 {
        let v = self.kv(key).unwrap_or_else(|| panic!("no {key}"));
        assert_eq!(u32::from_le_bytes(v[..4].try_into().unwrap()), 4, "{key}");
        u32::from_le_bytes(v[4..8].try_into().unwrap())
    }

    pub fn str(&self, key: &str) -> String {
        let v = self.kv(key).unwrap_or_else(|| panic!("no {key}"));
        assert_eq!(u32::from_le_bytes(v[..4].try_into().unwrap()), 8, "{key}");
        String::from_utf8(v[12..].to_vec()).unwrap()
    }

    pub fn tensor(&self, name: &str) -> &(Vec<u64>, u32, Vec<u8>) {
        self.tensors
            .get(name)
            .unwrap_or_else(|| panic!("no tensor {name}: {:?}", self.order))
    }
}

/// [`Gguf::read`].
pub fn parse(path: &Path) -> Gguf {
    Gguf::read(path)
}

/// A model directory `root/{cfg}-model`: `config.json` from the fixture
/// `configs/{cfg}.config.json` with the tokenizer fixture's vocabulary size and special ids
/// (then `edit`), the tokenizer fixture, and `tensors` as `model.safetensors`.
pub fn model_dir(root: &Path, cfg: &str, edit: impl FnOnce(&mut Json), tensors: &[T]) -> PathBuf {
    let dir = root.join(format!("{cfg}-model"));
    std::fs::create_dir_all(&dir).unwrap();
    let mut config: Json =
        serde_json::from_slice(&read_gguf_fixture(&format!("configs/{cfg}.config.json"))).unwrap();
    let m = config.as_object_mut().unwrap();
    m.insert("vocab_size".into(), 410.into());
    m.remove("bos_token_id");
    m.insert("eos_token_id".into(), 1.into());
    edit(&mut config);
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    for f in ["tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(gguf_fixture(&format!("tokenizer/{f}")), dir.join(f)).unwrap();
    }
    write_file(&dir.join("model.safetensors"), tensors);
    dir
}

/// Embeddings `[410, 64]`, final norm `[64]` and output head `[410, 64]` of `dtype`.
pub fn head(rng: &mut Rng, dtype: DType) -> Vec<T> {
    head_of(rng, dtype, 64)
}

/// [`head`] of hidden size `hidden`.
pub fn head_of(rng: &mut Rng, dtype: DType, hidden: u64) -> Vec<T> {
    vec![
        rand_t(rng, "model.embed_tokens.weight", dtype, &[410, hidden]),
        rand_t(rng, "model.norm.weight", dtype, &[hidden]),
        rand_t(rng, "lm_head.weight", dtype, &[410, hidden]),
    ]
}

/// The norms and attention of a layer of hidden size 64: (name in the layer, shape).
pub fn attention(q: u64, kv: u64) -> Vec<(&'static str, Vec<u64>)> {
    vec![
        ("input_layernorm.weight", vec![64]),
        ("post_attention_layernorm.weight", vec![64]),
        ("self_attn.q_proj.weight", vec![q, 64]),
        ("self_attn.k_proj.weight", vec![kv, 64]),
        ("self_attn.v_proj.weight", vec![kv, 64]),
        ("self_attn.o_proj.weight", vec![64, q]),
    ]
}

/// Query and key/value rows of an attention layer under the config fixture `cfg`: heads (and
/// key/value heads) times `head_dim`, or times hidden size / heads without one.
pub fn attention_rows(cfg: &str) -> (u64, u64) {
    let c: Json =
        serde_json::from_slice(&read_gguf_fixture(&format!("configs/{cfg}.config.json"))).unwrap();
    let get = |k: &str| c.get(k).and_then(Json::as_u64);
    let heads = get("num_attention_heads").unwrap();
    let head_dim = get("head_dim").unwrap_or(get("hidden_size").unwrap() / heads);
    let kv = get("num_key_value_heads").unwrap_or(heads);
    (heads * head_dim, kv * head_dim)
}

/// Random `model.layers.{layer}.{name}` tensors of `dtype` for each (name, shape).
pub fn layer<N: AsRef<str>, S: AsRef<[u64]>>(
    rng: &mut Rng,
    layer: usize,
    dtype: DType,
    names: impl IntoIterator<Item = (N, S)>,
) -> Vec<T> {
    names
        .into_iter()
        .map(|(name, shape)| {
            let name = format!("model.layers.{layer}.{}", name.as_ref());
            rand_t(rng, &name, dtype, shape.as_ref())
        })
        .collect()
}

/// Layer `l` of BF16: [`attention`] with 64 query and 32 key/value rows, then `extra`.
pub fn attention_layer(
    rng: &mut Rng,
    l: usize,
    extra: impl IntoIterator<Item = (&'static str, Vec<u64>)>,
) -> Vec<T> {
    let mut names = attention(64, 32);
    names.extend(extra);
    layer(rng, l, DType::BF16, names)
}

/// A two-layer Llama-like model of hidden size 64: [`head`], then per layer [`attention`]
/// with `q` / `kv` rows, a 128-wide MLP and `extra` tensors, all of `dtype`.
pub fn dense_layers(
    rng: &mut Rng,
    dtype: DType,
    q: u64,
    kv: u64,
    extra: &[(&str, &[u64])],
) -> Vec<T> {
    dense_layers_mlp(rng, dtype, q, kv, 128, extra)
}

/// [`dense_layers`] with an MLP `inter` wide.
pub fn dense_layers_mlp(
    rng: &mut Rng,
    dtype: DType,
    q: u64,
    kv: u64,
    inter: u64,
    extra: &[(&str, &[u64])],
) -> Vec<T> {
    let mut v = head(rng, dtype);
    for l in 0..2 {
        let mut names = attention(q, kv);
        names.extend([
            ("mlp.gate_proj.weight", vec![inter, 64]),
            ("mlp.up_proj.weight", vec![inter, 64]),
            ("mlp.down_proj.weight", vec![64, inter]),
        ]);
        names.extend(extra.iter().map(|(n, sh)| (*n, sh.to_vec())));
        v.extend(layer(rng, l, dtype, names));
    }
    v
}

/// The bytes of the tensor `name` in `tensors`.
pub fn src<'a>(tensors: &'a [T], name: &str) -> &'a [u8] {
    &tensors
        .iter()
        .find(|t| t.0 == name)
        .unwrap_or_else(|| panic!("no source tensor {name}"))
        .3
}

/// The bytes of `n` tensors named `name(0)`, `name(1)`, ... one after another (stacked
/// experts).
pub fn stacked(tensors: &[T], n: usize, name: impl Fn(usize) -> String) -> Vec<u8> {
    (0..n)
        .flat_map(|x| src(tensors, &name(x)).to_vec())
        .collect()
}

/// (name, shape) of the gate, up and down projections (32 wide) of each expert in `experts`:
/// `{expert}.gate_proj.weight`, ...
pub fn expert_mlps(experts: impl IntoIterator<Item = String>) -> Vec<(String, Vec<u64>)> {
    let shapes = [
        ("gate_proj", [32u64, 64]),
        ("up_proj", [32, 64]),
        ("down_proj", [64, 32]),
    ];
    experts
        .into_iter()
        .flat_map(|x| shapes.map(|(w, sh)| (format!("{x}.{w}.weight"), sh.to_vec())))
        .collect()
}

/// The arguments `gguf MODEL -o OUT EXTRA...`.
pub fn gguf_args<'a>(model: &'a Path, out: &'a Path, extra: &[&'a str]) -> Vec<&'a str> {
    [&["gguf", s(model), "-o", s(out)][..], extra].concat()
}

/// Runs `tftf gguf MODEL -o OUT --vocab-pre PRE EXTRA... -q`, asserts success and reads the
/// output back.
pub fn to_gguf(model: &Path, out: &Path, pre: &str, extra: &[&str]) -> Gguf {
    let args = [&["--vocab-pre", pre][..], extra, &["-q"]].concat();
    ok(&tftf(&gguf_args(model, out, &args)));
    parse(out)
}

/// A temporary folder with a model written by [`model_dir`].
pub struct GgufCase {
    pub dir: tempfile::TempDir,
    pub model: PathBuf,
    pub tensors: Vec<T>,
}

impl GgufCase {
    /// `tensors` with the config fixture `cfg` (changed by `edit`) in a fresh folder.
    pub fn new(cfg: &str, edit: impl FnOnce(&mut Json), tensors: Vec<T>) -> Self {
        let dir = tmp();
        let model = model_dir(dir.path(), cfg, edit, &tensors);
        GgufCase {
            dir,
            model,
            tensors,
        }
    }

    /// [`dense_layers`] of BF16 drawn from `Rng(seed)` with the config fixture `cfg`, whose
    /// heads and head size give the query and key/value rows (64 and 32 for head size 16).
    pub fn dense(seed: u64, cfg: &str) -> Self {
        let (q, kv) = attention_rows(cfg);
        let tensors = dense_layers(&mut Rng(seed), DType::BF16, q, kv, &[]);
        Self::new(cfg, |_| {}, tensors)
    }

    /// A two-layer Llama of hidden size 1024 (4 heads of 256, 2 KV heads) of BF16 drawn from
    /// `Rng(seed)`: its Q/K permutations and Q8_0 rows are several pipeline chunks each at the
    /// smallest memory budget.
    pub fn wide_llama(seed: u64) -> Self {
        const H: u64 = 1024;
        let mut rng = Rng(seed);
        let mut tensors = head_of(&mut rng, DType::BF16, H);
        for l in 0..2 {
            tensors.extend(layer(
                &mut rng,
                l,
                DType::BF16,
                [
                    ("input_layernorm.weight", vec![H]),
                    ("post_attention_layernorm.weight", vec![H]),
                    ("self_attn.q_proj.weight", vec![H, H]),
                    ("self_attn.k_proj.weight", vec![H / 2, H]),
                    ("self_attn.v_proj.weight", vec![H / 2, H]),
                    ("self_attn.o_proj.weight", vec![H, H]),
                    ("mlp.gate_proj.weight", vec![256, H]),
                    ("mlp.up_proj.weight", vec![256, H]),
                    ("mlp.down_proj.weight", vec![H, 256]),
                ],
            ));
        }
        Self::new(
            "llama3",
            |c| {
                c["hidden_size"] = H.into();
                c["intermediate_size"] = 256.into();
            },
            tensors,
        )
    }

    /// A two-layer Qwen3-MoE of BF16 drawn from `Rng(seed)`, its four experts per layer
    /// written out of order (2, 0, 3, 1).
    pub fn qwen3_moe(seed: u64) -> Self {
        let mut rng = Rng(seed);
        let mut tensors = head(&mut rng, DType::BF16);
        for l in 0..2 {
            tensors.extend(attention_layer(
                &mut rng,
                l,
                [
                    ("self_attn.q_norm.weight", vec![16]),
                    ("self_attn.k_norm.weight", vec![16]),
                    ("mlp.gate.weight", vec![4, 64]),
                ],
            ));
            let experts = expert_mlps([2, 0, 3, 1].map(|x| format!("mlp.experts.{x}")));
            tensors.extend(layer(&mut rng, l, DType::BF16, experts));
        }
        Self::new("qwen3moe", |_| {}, tensors)
    }

    /// `rel` in the temporary folder.
    pub fn path(&self, rel: &str) -> PathBuf {
        self.dir.path().join(rel)
    }

    /// [`to_gguf`] of the model into `rel` in the temporary folder.
    pub fn convert(&self, rel: &str, pre: &str, extra: &[&str]) -> Gguf {
        to_gguf(&self.model, &self.path(rel), pre, extra)
    }

    /// The bytes of the source tensor `name`.
    pub fn src(&self, name: &str) -> &[u8] {
        src(&self.tensors, name)
    }
}

/// A DeepSeek-V3 of BF16 drawn from `Rng(31)` (for the config fixture `deepseekv3` edited by
/// [`deepseek_config`]): a dense layer 0, a MoE layer 1 of four experts and a shared one, and
/// the multi-token-prediction layer 2 the converter skips; `kv_b_proj` from `kv_b.in`.
pub fn deepseek_tensors() -> Vec<T> {
    let mut rng = Rng(31);
    let mut tensors = head(&mut rng, DType::BF16);
    let kv_b = read_gguf_fixture("kv_b.in");
    for l in 0..3 {
        let names = [
            ("input_layernorm.weight", vec![64u64]),
            ("post_attention_layernorm.weight", vec![64]),
            ("self_attn.q_a_proj.weight", vec![24, 64]),
            ("self_attn.q_a_layernorm.weight", vec![24]),
            ("self_attn.q_b_proj.weight", vec![24, 24]),
            ("self_attn.kv_a_proj_with_mqa.weight", vec![9, 64]),
            ("self_attn.kv_a_layernorm.weight", vec![5]),
            ("self_attn.o_proj.weight", vec![64, 6]),
        ];
        tensors.extend(layer(&mut rng, l, DType::BF16, names));
        let p = |s: &str| format!("model.layers.{l}.{s}");
        tensors.push(t(
            &p("self_attn.kv_b_proj.weight"),
            DType::BF16,
            &[18, 5],
            kv_b.clone(),
        ));
        if l == 0 {
            let mlp = [
                ("mlp.gate_proj.weight", [128u64, 64]),
                ("mlp.up_proj.weight", [128, 64]),
                ("mlp.down_proj.weight", [64, 128]),
            ];
            tensors.extend(layer(&mut rng, l, DType::BF16, mlp));
            continue;
        }
        tensors.extend(layer(
            &mut rng,
            l,
            DType::BF16,
            [("mlp.gate.weight", [4u64, 64])],
        ));
        let bias = [("mlp.gate.e_score_correction_bias", [4u64])];
        tensors.extend(layer(&mut rng, l, DType::F32, bias));
        let experts = ["mlp.shared_experts".to_string()]
            .into_iter()
            .chain((0..4).map(|x| format!("mlp.experts.{x}")));
        tensors.extend(layer(&mut rng, l, DType::BF16, expert_mlps(experts)));
    }
    // Layer 2 is the multi-token-prediction layer (num_hidden_layers 2).
    tensors.extend(layer(
        &mut rng,
        2,
        DType::BF16,
        [("eh_proj.weight", [64u64, 128])],
    ));
    tensors
}

/// The `deepseekv3` config fixture made small: two layers, three heads, MLA ranks to match
/// [`deepseek_tensors`], no `quantization_config`.
pub fn deepseek_config(c: &mut Json) {
    let m = c.as_object_mut().unwrap();
    m.remove("quantization_config");
    for (k, v) in [
        ("num_hidden_layers", 2),
        ("num_attention_heads", 3),
        ("num_key_value_heads", 3),
        ("qk_nope_head_dim", 4),
        ("qk_rope_head_dim", 4),
        ("v_head_dim", 2),
        ("kv_lora_rank", 5),
    ] {
        m.insert(k.into(), v.into());
    }
}

/// The sha256 of `b`, in hex.
pub fn sha256_hex(b: &[u8]) -> String {
    use sha2::Digest;
    sha2::Sha256::digest(b)
        .iter()
        .map(|x| format!("{x:02x}"))
        .collect()
}

/// The converter's naming KVs, which goldens leave out.
pub const NAMING: [&str; 5] = [
    "general.name",
    "general.basename",
    "general.finetune",
    "general.version",
    "general.quantized_by",
];

/// scripts/gen-gguf-quant-goldens.py's `det_bf16`: element `i` of tensor `name` is a 32-bit
/// hash of `i` and the name's FNV-1a, its low 24 bits a uniform f32 in [-0.1, 0.1) (+ offset),
/// truncated to BF16 (little-endian bytes).
pub fn det_bf16(name: &str, n: u64, offset: f32) -> Vec<u8> {
    let seed = name.bytes().fold(0x811C_9DC5u32, |h, c| {
        (h ^ c as u32).wrapping_mul(0x0100_0193)
    });
    (0..n)
        .flat_map(|i| {
            let mut u = (i as u32)
                .wrapping_mul(0x9E37_79B1)
                .wrapping_add(seed.wrapping_mul(0x85EB_CA77));
            u ^= u >> 15;
            u = u.wrapping_mul(0x2C1B_3C6D);
            u ^= u >> 12;
            let x = ((u & 0xFF_FFFF) as f32 / 16_777_216.0 - 0.5) * 0.2 + offset;
            ((x.to_bits() >> 16) as u16).to_le_bytes()
        })
        .collect()
}

/// `g` has the KVs (sha256 of type and value bytes, in order, naming fields left out) and the
/// tensors (name, type, shape, sha256 of the bytes, in order) of the golden `case`; `kv_values`
/// replaces a golden KV's hash by that of the value given here.
pub fn assert_equals_golden(g: &Gguf, case: &Json, what: &str, kv_values: &[(&str, Vec<u8>)]) {
    let kvs: Vec<(String, String)> = g
        .kvs
        .iter()
        .filter(|(k, _)| !NAMING.contains(&k.as_str()))
        .map(|(k, v)| (k.clone(), sha256_hex(v)))
        .collect();
    let want: Vec<(String, String)> = case["kvs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| {
            let k = e[0].as_str().unwrap();
            let v = match kv_values.iter().find(|(key, _)| *key == k) {
                Some((_, v)) => sha256_hex(v),
                None => e[1].as_str().unwrap().into(),
            };
            (k.to_string(), v)
        })
        .collect();
    assert_eq!(kvs, want, "{what}: KVs");
    let want = case["tensors"].as_array().unwrap();
    let names: Vec<&str> = want.iter().map(|t| t[0].as_str().unwrap()).collect();
    assert_eq!(g.order, names, "{what}: tensor order");
    for t in want {
        let name = t[0].as_str().unwrap();
        let (shape, ty, data) = g.tensor(name);
        let mut wshape: Vec<u64> = serde_json::from_value(t[2].clone()).unwrap();
        wshape.reverse();
        assert_eq!(
            (*ty as u64, shape),
            (t[1].as_u64().unwrap(), &wshape),
            "{what}: {name} type/shape"
        );
        assert_eq!(sha256_hex(data), t[3].as_str().unwrap(), "{what}: {name}");
    }
}

/// HF names and shapes of a Llama-layout model of `cfg`, sorted: the embeddings, the final norm,
/// `lm_head` when asked, and per layer the two norms, the seven projections and the 1-D `extra`
/// tensors (`(name, wide)`: `intermediate_size` long when wide, else `hidden_size`).
pub fn llama_shapes(cfg: &Json, lm_head: bool, extra: &[(&str, bool)]) -> Vec<(String, Vec<u64>)> {
    let get = |k: &str| cfg[k].as_u64().unwrap();
    let (h, ff, vocab) = (
        get("hidden_size"),
        get("intermediate_size"),
        get("vocab_size"),
    );
    let kv = get("num_key_value_heads") * h / get("num_attention_heads");
    let mut shapes: Vec<(String, Vec<u64>)> = vec![
        ("model.embed_tokens.weight".into(), vec![vocab, h]),
        ("model.norm.weight".into(), vec![h]),
    ];
    if lm_head {
        shapes.push(("lm_head.weight".into(), vec![vocab, h]));
    }
    let extra = extra
        .iter()
        .map(|&(n, wide)| (n, vec![if wide { ff } else { h }]));
    for l in 0..get("num_hidden_layers") {
        for (n, s) in [
            ("input_layernorm", vec![h]),
            ("post_attention_layernorm", vec![h]),
            ("self_attn.q_proj", vec![h, h]),
            ("self_attn.k_proj", vec![kv, h]),
            ("self_attn.v_proj", vec![kv, h]),
            ("self_attn.o_proj", vec![h, h]),
            ("mlp.gate_proj", vec![ff, h]),
            ("mlp.up_proj", vec![ff, h]),
            ("mlp.down_proj", vec![h, ff]),
        ]
        .into_iter()
        .chain(extra.clone())
        {
            shapes.push((format!("model.layers.{l}.{n}.weight"), s));
        }
    }
    shapes.sort();
    shapes
}

/// BF16 tensors of `shapes` made by [`det_bf16`] (the 1-D ones, norms, around 1).
pub fn det_bf16_tensors(shapes: &[(String, Vec<u64>)]) -> Vec<T> {
    shapes
        .iter()
        .map(|(n, s)| {
            let offset = if s.len() == 1 { 1.0 } else { 0.0 };
            t(n, DType::BF16, s, det_bf16(n, s.iter().product(), offset))
        })
        .collect()
}
