//! `tftf gguf` end to end: small models with the real tokenizer fixture, converted by the
//! binary, read back with a GGUF parser written here, and checked against the converter's
//! fixtures (hparam KVs, tokenizer KVs, transforms) and against bytes computed independently.

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use common::*;
use serde_json::Value as Json;
use tftf::format::dtype::DType;
use tftf::sink::gguf::quant;

fn gguf_fixture(name: &str) -> PathBuf {
    fixture(&format!("gguf/{name}"))
}

fn read_fixture(name: &str) -> Vec<u8> {
    std::fs::read(gguf_fixture(name)).unwrap()
}

/// A GGUF file read back as llama.cpp's loader reads it.
struct Gguf {
    /// Key → raw type id + value bytes, in file order.
    kvs: Vec<(String, Vec<u8>)>,
    /// Name → (shape outermost first, type id, data bytes).
    tensors: BTreeMap<String, (Vec<u64>, u32, Vec<u8>)>,
    order: Vec<String>,
}

impl Gguf {
    fn kv(&self, key: &str) -> Option<&[u8]> {
        self.kvs
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_slice())
    }
    fn u32(&self, key: &str) -> u32 {
        let v = self.kv(key).unwrap_or_else(|| panic!("no {key}"));
        assert_eq!(u32::from_le_bytes(v[..4].try_into().unwrap()), 4, "{key}");
        u32::from_le_bytes(v[4..8].try_into().unwrap())
    }
    fn str(&self, key: &str) -> String {
        let v = self.kv(key).unwrap_or_else(|| panic!("no {key}"));
        assert_eq!(u32::from_le_bytes(v[..4].try_into().unwrap()), 8, "{key}");
        String::from_utf8(v[12..].to_vec()).unwrap()
    }
    fn tensor(&self, name: &str) -> &(Vec<u64>, u32, Vec<u8>) {
        self.tensors
            .get(name)
            .unwrap_or_else(|| panic!("no tensor {name}: {:?}", self.order))
    }
}

fn type_size(ty: u32, elems: u64) -> u64 {
    match ty {
        0 => elems * 4,
        1 | 30 => elems * 2,
        8 => elems / 32 * 34,
        39 => elems / 32 * 17,
        t => panic!("type {t}"),
    }
}

fn parse(path: &Path) -> Gguf {
    let b = std::fs::read(path).unwrap();
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
        skip_value(&b, &mut p, ty);
        kvs.push((key, b[start..p].to_vec()));
    }
    assert!(
        !kvs.iter().any(|(k, _)| k == "general.alignment"),
        "32-byte alignment is written as no key"
    );
    let mut infos = Vec::new();
    for _ in 0..n_tensors {
        let name = str_at(&mut p);
        let nd = u32_at(&mut p);
        let mut dims: Vec<u64> = (0..nd).map(|_| u64_at(&mut p)).collect();
        dims.reverse();
        let ty = u32_at(&mut p);
        let off = u64_at(&mut p);
        infos.push((name, dims, ty, off));
    }
    let data_start = (p as u64).div_ceil(32) * 32;
    assert!(b[p..data_start as usize].iter().all(|&x| x == 0));
    // gguf.cpp: each offset is the previous one plus the previous size padded to 32.
    let mut expect = 0u64;
    let mut tensors = BTreeMap::new();
    let mut order = Vec::new();
    for (name, dims, ty, off) in infos {
        assert_eq!(off, expect, "{name}: offset");
        let len = type_size(ty, dims.iter().product());
        let at = (data_start + off) as usize;
        let data = b[at..at + len as usize].to_vec();
        expect = (off + len).div_ceil(32) * 32;
        order.push(name.clone());
        assert!(tensors.insert(name, (dims, ty, data)).is_none());
    }
    assert_eq!(b.len() as u64, data_start + expect, "file length");
    Gguf {
        kvs,
        tensors,
        order,
    }
}

/// Raw bytes (type + value) of a KV value, encoded as gguf-py encodes it.
fn enc_u32(v: u32) -> Vec<u8> {
    [4u32.to_le_bytes(), v.to_le_bytes()].concat()
}

fn bf16_to_f32_bytes(b: &[u8]) -> Vec<u8> {
    b.chunks_exact(2)
        .flat_map(|c| ((u16::from_le_bytes([c[0], c[1]]) as u32) << 16).to_le_bytes())
        .collect()
}

fn bf16_to_f32s(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(2)
        .map(|c| f32::from_bits((u16::from_le_bytes([c[0], c[1]]) as u32) << 16))
        .collect()
}

/// `LlamaModel.permute`: `w.reshape(n_head, 2, rows / n_head / 2, *rest).swapaxes(1, 2)`.
fn permute(src: &[u8], rows: usize, n_head: usize) -> Vec<u8> {
    let row = src.len() / rows;
    let half = rows / n_head / 2;
    let mut out = Vec::with_capacity(src.len());
    for h in 0..n_head {
        for i in 0..half {
            for j in 0..2 {
                let r = h * 2 * half + j * half + i;
                out.extend_from_slice(&src[r * row..(r + 1) * row]);
            }
        }
    }
    out
}

/// A model directory: `config.json` from the fixture `configs/{cfg}.config.json` with the
/// tokenizer fixture's vocabulary size and special ids, the tokenizer fixture, and `tensors`.
fn model_dir(root: &Path, cfg: &str, edit: impl FnOnce(&mut Json), tensors: &[T]) -> PathBuf {
    let dir = root.join(format!("{cfg}-model"));
    std::fs::create_dir_all(&dir).unwrap();
    let mut config: Json =
        serde_json::from_slice(&read_fixture(&format!("configs/{cfg}.config.json"))).unwrap();
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

fn dense_layers(rng: &mut Rng, dtype: DType, q: u64, kv: u64, extra: &[(&str, &[u64])]) -> Vec<T> {
    let mut v = vec![
        rand_t(rng, "model.embed_tokens.weight", dtype, &[410, 64]),
        rand_t(rng, "model.norm.weight", dtype, &[64]),
        rand_t(rng, "lm_head.weight", dtype, &[410, 64]),
    ];
    for l in 0..2 {
        let p = |s: &str| format!("model.layers.{l}.{s}");
        for (name, shape) in [
            ("input_layernorm.weight", vec![64]),
            ("post_attention_layernorm.weight", vec![64]),
            ("self_attn.q_proj.weight", vec![q, 64]),
            ("self_attn.k_proj.weight", vec![kv, 64]),
            ("self_attn.v_proj.weight", vec![kv, 64]),
            ("self_attn.o_proj.weight", vec![64, q]),
            ("mlp.gate_proj.weight", vec![128, 64]),
            ("mlp.up_proj.weight", vec![128, 64]),
            ("mlp.down_proj.weight", vec![64, 128]),
        ] {
            v.push(rand_t(rng, &p(name), dtype, &shape));
        }
        for (name, shape) in extra {
            v.push(rand_t(rng, &p(name), dtype, shape));
        }
    }
    v
}

fn src<'a>(tensors: &'a [T], name: &str) -> &'a [u8] {
    &tensors.iter().find(|t| t.0 == name).unwrap().3
}

/// The hparam KVs equal the reference's `set_gguf_parameters` (fixture), but for the
/// vocabulary size and file type, which the test model changes.
fn assert_hparams(g: &Gguf, cfg: &str, file_type: u32) {
    let want: Vec<Json> =
        serde_json::from_slice(&read_fixture(&format!("configs/{cfg}.kvs.json"))).unwrap();
    for w in &want {
        let key = w[0].as_str().unwrap();
        let got = g.kv(key).unwrap_or_else(|| panic!("{cfg}: no {key}"));
        let want_bytes = match (w[1].as_str().unwrap(), &w[2]) {
            _ if key == "general.file_type" => enc_u32(file_type),
            _ if key.ends_with(".vocab_size") => enc_u32(410),
            ("UINT32", v) => enc_u32(v.as_u64().unwrap() as u32),
            ("FLOAT32", v) => [
                6u32.to_le_bytes(),
                (v.as_f64().unwrap() as f32).to_le_bytes(),
            ]
            .concat(),
            ("BOOL", v) => [
                7u32.to_le_bytes().to_vec(),
                vec![v.as_bool().unwrap() as u8],
            ]
            .concat(),
            ("STRING", v) => {
                let s = v.as_str().unwrap();
                [
                    8u32.to_le_bytes().to_vec(),
                    (s.len() as u64).to_le_bytes().to_vec(),
                    s.as_bytes().to_vec(),
                ]
                .concat()
            }
            (t, _) => panic!("{t}"),
        };
        assert_eq!(got, want_bytes.as_slice(), "{cfg}: {key}");
    }
    assert_eq!(g.u32("general.quantization_version"), 2);
}

/// The tokenizer KVs equal gguf-py's `SpecialVocab` + `_set_vocab_gpt2` output (fixture made
/// with `tokenizer.ggml.pre = test-pre`).
fn assert_tokenizer(g: &Gguf) {
    let path = gguf_fixture("tokenizer/vocab.gguf");
    let want = parse(&path);
    let mut n = 0;
    for (k, v) in want.kvs.iter().filter(|(k, _)| k.starts_with("tokenizer.")) {
        assert_eq!(g.kv(k), Some(v.as_slice()), "{k}");
        n += 1;
    }
    assert!(n >= 5, "{n}");
    let ours = g
        .kvs
        .iter()
        .filter(|(k, _)| k.starts_with("tokenizer."))
        .count();
    assert_eq!(ours, n, "extra tokenizer keys");
}

fn no_litter(dir: &Path) {
    let left: Vec<String> = listing(dir)
        .into_iter()
        .filter(|n| n.contains(".tftf-") || n.ends_with(".gguf"))
        .collect();
    assert!(left.is_empty(), "left behind: {left:?}");
}

#[test]
fn llama_bf16_has_permuted_q_k_reference_kvs_and_copied_bytes() {
    let d = tmp();
    let mut rng = Rng(7);
    let tensors = dense_layers(&mut rng, DType::BF16, 64, 32, &[]);
    let model = model_dir(d.path(), "llama3", |_| {}, &tensors);
    let out = d.path().join("out").join("llama.gguf");
    let report = d.path().join("report.json");
    ok(&tftf(&[
        "gguf",
        "-i",
        s(&model),
        "-o",
        s(&out),
        "--vocab-pre",
        "test-pre",
        "--report",
        s(&report),
        "-q",
    ]));
    let g = parse(&out);
    assert_eq!(g.str("general.architecture"), "llama");
    assert_eq!(g.str("general.name"), "llama3-model");
    assert_hparams(&g, "llama3", 32);
    assert_tokenizer(&g);
    assert_eq!(g.str("tokenizer.ggml.pre"), "test-pre");

    // 2 × 9 per layer, embeddings, norm, output, rope_freqs.
    assert_eq!(g.tensors.len(), 22, "{:?}", g.order);
    let (shape, ty, data) = g.tensor("rope_freqs.weight");
    assert_eq!((shape.as_slice(), *ty), (&[8u64][..], 0));
    let want: Vec<u8> =
        tftf::sink::gguf::transform::llama3_rope_freqs(500000.0, 16, 8.0, 1.0, 4.0, 8192.0)
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .collect();
    assert_eq!(data, &want);

    let (shape, ty, data) = g.tensor("token_embd.weight");
    assert_eq!((shape.as_slice(), *ty), (&[410u64, 64][..], 30));
    assert_eq!(data, src(&tensors, "model.embed_tokens.weight"));
    assert_eq!(g.tensor("output.weight").2, src(&tensors, "lm_head.weight"));
    let (_, ty, data) = g.tensor("output_norm.weight");
    assert_eq!(*ty, 0, "norms are F32");
    assert_eq!(data, &bf16_to_f32_bytes(src(&tensors, "model.norm.weight")));
    for l in 0..2 {
        let h = |s: &str| format!("model.layers.{l}.{s}");
        let b = |s: &str| format!("blk.{l}.{s}");
        let (shape, ty, data) = g.tensor(&b("attn_q.weight"));
        assert_eq!((shape.as_slice(), *ty), (&[64u64, 64][..], 30));
        assert_eq!(
            data,
            &permute(src(&tensors, &h("self_attn.q_proj.weight")), 64, 4)
        );
        assert_ne!(data, src(&tensors, &h("self_attn.q_proj.weight")));
        let (shape, _, data) = g.tensor(&b("attn_k.weight"));
        assert_eq!(shape, &[32, 64]);
        assert_eq!(
            data,
            &permute(src(&tensors, &h("self_attn.k_proj.weight")), 32, 2)
        );
        for (hf, gg) in [
            ("self_attn.v_proj.weight", "attn_v.weight"),
            ("self_attn.o_proj.weight", "attn_output.weight"),
            ("mlp.gate_proj.weight", "ffn_gate.weight"),
            ("mlp.up_proj.weight", "ffn_up.weight"),
            ("mlp.down_proj.weight", "ffn_down.weight"),
        ] {
            let (_, ty, data) = g.tensor(&b(gg));
            assert_eq!(*ty, 30, "{gg}");
            assert_eq!(data, src(&tensors, &h(hf)), "{gg}");
        }
        for (hf, gg) in [
            ("input_layernorm.weight", "attn_norm.weight"),
            ("post_attention_layernorm.weight", "ffn_norm.weight"),
        ] {
            let (_, ty, data) = g.tensor(&b(gg));
            assert_eq!(*ty, 0, "{gg}");
            assert_eq!(data, &bf16_to_f32_bytes(src(&tensors, &h(hf))), "{gg}");
        }
    }
    let r: Json = serde_json::from_slice(&std::fs::read(&report).unwrap()).unwrap();
    assert_eq!(r["status"], "ok");
    assert_eq!(r["command"], "gguf");
    assert!(r["bytes"]["copied_unchanged"].as_u64().unwrap() > 0);
    assert!(r["shared_fraction"].as_f64().is_some());
    no_litter_except(&out);
}

/// Only the output itself in its directory.
fn no_litter_except(out: &Path) {
    let names = listing(out.parent().unwrap());
    assert_eq!(
        names,
        [out.file_name().unwrap().to_string_lossy().into_owned()]
    );
}

#[test]
fn the_test_permutation_is_the_converters() {
    for (inp, outp, rows, n_head) in [
        ("permute_q.in", "permute_q.out", 24, 4),
        ("permute_k.in", "permute_k.out", 12, 2),
    ] {
        assert_eq!(
            permute(&read_fixture(inp), rows, n_head),
            read_fixture(outp)
        );
    }
}

#[test]
fn qwen3_q8_0_quantises_weights_keeps_norms_f32_and_does_not_permute() {
    let d = tmp();
    let mut rng = Rng(11);
    let extra: &[(&str, &[u64])] = &[
        ("self_attn.q_norm.weight", &[32]),
        ("self_attn.k_norm.weight", &[32]),
    ];
    let mut tensors = dense_layers(&mut rng, DType::F32, 128, 64, extra);
    // An output head big enough for several row chunks under the budget, on several threads.
    let head = tensors
        .iter_mut()
        .find(|t| t.0 == "lm_head.weight")
        .unwrap();
    *head = rand_t(&mut rng, "lm_head.weight", DType::F32, &[20000, 64]);
    let model = model_dir(d.path(), "qwen3", |_| {}, &tensors);
    let out = d.path().join("q.gguf");
    ok(&tftf(&[
        "gguf",
        s(&model),
        "-o",
        s(&out),
        "--outtype",
        "q8_0",
        "--vocab-pre",
        "test-pre",
        "--memory-budget",
        "16MiB",
        "--threads",
        "3",
        "-q",
    ]));
    let g = parse(&out);
    assert_eq!(g.str("general.architecture"), "qwen3");
    assert_hparams(&g, "qwen3", 7);
    assert_tokenizer(&g);
    assert!(!g.tensors.contains_key("rope_freqs.weight"));
    assert_eq!(g.tensors.len(), 3 + 2 * 11);
    let q8 = |b: &[u8]| {
        let f: Vec<f32> = b
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect();
        let mut out = vec![0u8; f.len() / 32 * 34];
        quant::quantize_q8_0(&f, &mut out);
        out
    };
    let (shape, ty, data) = g.tensor("blk.1.attn_q.weight");
    assert_eq!((shape.as_slice(), *ty), (&[128u64, 64][..], 8));
    assert_eq!(
        data,
        &q8(src(&tensors, "model.layers.1.self_attn.q_proj.weight"))
    );
    let (_, ty, data) = g.tensor("blk.0.attn_k_norm.weight");
    assert_eq!(*ty, 0);
    assert_eq!(
        data,
        src(&tensors, "model.layers.0.self_attn.k_norm.weight")
    );
    let (_, ty, data) = g.tensor("token_embd.weight");
    assert_eq!(*ty, 8);
    assert_eq!(data, &q8(src(&tensors, "model.embed_tokens.weight")));
    let (sh, ty, data) = g.tensor("output.weight");
    assert_eq!((sh.as_slice(), *ty), (&[20000u64, 64][..], 8));
    assert_eq!(data, &q8(src(&tensors, "lm_head.weight")));
}

#[test]
fn f32_checkpoint_auto_becomes_f16_except_norms() {
    let d = tmp();
    let mut rng = Rng(3);
    let extra: &[(&str, &[u64])] = &[
        ("self_attn.q_norm.weight", &[32]),
        ("self_attn.k_norm.weight", &[32]),
    ];
    let tensors = dense_layers(&mut rng, DType::F32, 128, 64, extra);
    let model = model_dir(d.path(), "qwen3", |_| {}, &tensors);
    let out = d.path().join("a.gguf");
    ok(&tftf(&[
        "gguf",
        s(&model),
        "-o",
        s(&out),
        "--vocab-pre",
        "qwen2",
        "-q",
    ]));
    let g = parse(&out);
    assert_eq!(g.u32("general.file_type"), 1);
    assert_eq!(g.str("tokenizer.ggml.pre"), "qwen2");
    let (_, ty, data) = g.tensor("blk.0.ffn_up.weight");
    assert_eq!(*ty, 1);
    let want: Vec<u8> = src(&tensors, "model.layers.0.mlp.up_proj.weight")
        .chunks_exact(4)
        .flat_map(|c| {
            half::f16::from_f32(f32::from_le_bytes(c.try_into().unwrap()))
                .to_bits()
                .to_le_bytes()
        })
        .collect();
    assert_eq!(data, &want);
    assert_eq!(g.tensor("output_norm.weight").1, 0);
}

#[test]
fn qwen3_moe_experts_are_stacked_in_expert_order() {
    let d = tmp();
    let mut rng = Rng(5);
    let mut tensors = vec![
        rand_t(
            &mut rng,
            "model.embed_tokens.weight",
            DType::BF16,
            &[410, 64],
        ),
        rand_t(&mut rng, "model.norm.weight", DType::BF16, &[64]),
        rand_t(&mut rng, "lm_head.weight", DType::BF16, &[410, 64]),
    ];
    for l in 0..2 {
        let p = |s: &str| format!("model.layers.{l}.{s}");
        for (name, shape) in [
            ("input_layernorm.weight", vec![64u64]),
            ("post_attention_layernorm.weight", vec![64]),
            ("self_attn.q_proj.weight", vec![64, 64]),
            ("self_attn.k_proj.weight", vec![32, 64]),
            ("self_attn.v_proj.weight", vec![32, 64]),
            ("self_attn.o_proj.weight", vec![64, 64]),
            ("self_attn.q_norm.weight", vec![16]),
            ("self_attn.k_norm.weight", vec![16]),
            ("mlp.gate.weight", vec![4, 64]),
        ] {
            tensors.push(rand_t(&mut rng, &p(name), DType::BF16, &shape));
        }
        // Experts written out of order: the GGUF stacks them by id.
        for x in [2, 0, 3, 1] {
            for (w, shape) in [
                ("gate_proj", [32u64, 64]),
                ("up_proj", [32, 64]),
                ("down_proj", [64, 32]),
            ] {
                let name = p(&format!("mlp.experts.{x}.{w}.weight"));
                tensors.push(rand_t(&mut rng, &name, DType::BF16, &shape));
            }
        }
    }
    let model = model_dir(d.path(), "qwen3moe", |_| {}, &tensors);
    let out = d.path().join("moe.gguf");
    ok(&tftf(&[
        "gguf",
        s(&model),
        "-o",
        s(&out),
        "--vocab-pre",
        "test-pre",
        "-q",
    ]));
    let g = parse(&out);
    assert_hparams(&g, "qwen3moe", 32);
    for l in 0..2 {
        for (w, gg, shape) in [
            ("gate_proj", "ffn_gate_exps", [4u64, 32, 64]),
            ("up_proj", "ffn_up_exps", [4, 32, 64]),
            ("down_proj", "ffn_down_exps", [4, 64, 32]),
        ] {
            let (sh, ty, data) = g.tensor(&format!("blk.{l}.{gg}.weight"));
            assert_eq!((sh.as_slice(), *ty), (&shape[..], 30));
            let want: Vec<u8> = (0..4)
                .flat_map(|x| {
                    src(
                        &tensors,
                        &format!("model.layers.{l}.mlp.experts.{x}.{w}.weight"),
                    )
                    .to_vec()
                })
                .collect();
            assert_eq!(data, &want, "{gg}");
        }
        let (sh, ty, _) = g.tensor(&format!("blk.{l}.ffn_gate_inp.weight"));
        assert_eq!(
            (sh.as_slice(), *ty),
            (&[4u64, 64][..], 0),
            "routers stay F32"
        );
    }
    assert_eq!(g.tensors.len(), 3 + 2 * 12);
}

#[test]
fn gpt_oss_mxfp4_experts_are_repacked_as_the_converter_does() {
    let d = tmp();
    let mut rng = Rng(9);
    let blocks = read_fixture("mxfp4_blocks.in");
    let scales = read_fixture("mxfp4_scales.in");
    let bias = read_fixture("gate_up_bias.in");
    let mut tensors = vec![
        rand_t(
            &mut rng,
            "model.embed_tokens.weight",
            DType::BF16,
            &[410, 64],
        ),
        rand_t(&mut rng, "model.norm.weight", DType::BF16, &[64]),
        rand_t(&mut rng, "lm_head.weight", DType::BF16, &[410, 64]),
    ];
    let l = 0;
    let p = |s: &str| format!("model.layers.{l}.{s}");
    for (name, shape) in [
        ("input_layernorm.weight", vec![64u64]),
        ("post_attention_layernorm.weight", vec![64]),
        ("self_attn.q_proj.weight", vec![64, 64]),
        ("self_attn.k_proj.weight", vec![32, 64]),
        ("self_attn.v_proj.weight", vec![32, 64]),
        ("self_attn.o_proj.weight", vec![64, 64]),
        ("self_attn.sinks", vec![4]),
        ("mlp.router.weight", vec![2, 64]),
        ("mlp.router.bias", vec![2]),
        ("mlp.experts.down_proj_bias", vec![2, 6]),
    ] {
        tensors.push(rand_t(&mut rng, &p(name), DType::BF16, &shape));
    }
    for w in ["gate_up_proj", "down_proj"] {
        tensors.push(t(
            &p(&format!("mlp.experts.{w}_blocks")),
            DType::U8,
            &[2, 6, 3, 16],
            blocks.clone(),
        ));
        tensors.push(t(
            &p(&format!("mlp.experts.{w}_scales")),
            DType::U8,
            &[2, 6, 3],
            scales.clone(),
        ));
    }
    tensors.push(t(
        &p("mlp.experts.gate_up_proj_bias"),
        DType::BF16,
        &[2, 8],
        bias.clone(),
    ));
    let model = model_dir(
        d.path(),
        "gptoss",
        |c| {
            c["num_hidden_layers"] = 1.into();
            c["num_local_experts"] = 2.into();
        },
        &tensors,
    );
    let out = d.path().join("oss.gguf");
    ok(&tftf(&[
        "gguf",
        s(&model),
        "-o",
        s(&out),
        "--vocab-pre",
        "test-pre",
        "-q",
    ]));
    let g = parse(&out);
    assert_eq!(g.str("general.architecture"), "gpt-oss");
    assert_eq!(g.u32("general.file_type"), 38);
    for (name, want, shape) in [
        (
            "blk.0.ffn_down_exps.weight",
            "mxfp4_down.out",
            [2u64, 6, 96],
        ),
        ("blk.0.ffn_gate_exps.weight", "mxfp4_gate.out", [2, 3, 96]),
        ("blk.0.ffn_up_exps.weight", "mxfp4_up.out", [2, 3, 96]),
    ] {
        let (sh, ty, data) = g.tensor(name);
        assert_eq!((sh.as_slice(), *ty), (&shape[..], 39), "{name}");
        assert_eq!(data, &read_fixture(want), "{name}");
    }
    for (name, want) in [
        ("blk.0.ffn_gate_exps.bias", "gate_up_bias_gate.out"),
        ("blk.0.ffn_up_exps.bias", "gate_up_bias_up.out"),
    ] {
        let (sh, ty, data) = g.tensor(name);
        assert_eq!((sh.as_slice(), *ty), (&[2u64, 4][..], 0), "{name}");
        assert_eq!(data, &bf16_to_f32_bytes(&read_fixture(want)), "{name}");
    }
    assert_eq!(g.tensor("blk.0.attn_sinks.weight").1, 0);
    assert_eq!(g.tensor("blk.0.ffn_gate_inp.weight").1, 0);
    let _ = bf16_to_f32s(&bias);
}

#[test]
fn split_output_follows_gguf_split_and_holds_the_same_tensors() {
    let d = tmp();
    let mut rng = Rng(13);
    let tensors = dense_layers(&mut rng, DType::BF16, 64, 32, &[]);
    let model = model_dir(
        d.path(),
        "mistral",
        |c| c["num_key_value_heads"] = 2.into(),
        &tensors,
    );
    let whole = d.path().join("whole.gguf");
    let outdir = d.path().join("split");
    std::fs::create_dir(&outdir).unwrap();
    let parts = outdir.join("m.gguf");
    for (o, extra) in [(&whole, None), (&parts, Some("60K"))] {
        let mut args = vec![
            "gguf",
            s(&model),
            "-o",
            s(o),
            "--vocab-pre",
            "test-pre",
            "-q",
        ];
        if let Some(x) = extra {
            args.extend(["--split-max-size", x]);
        }
        ok(&tftf(&args));
    }
    let whole = parse(&whole);
    let names = listing(&outdir);
    let n = names.len();
    assert!(n >= 3, "{names:?}");
    let mut all = BTreeMap::new();
    for (i, name) in names.iter().enumerate() {
        assert_eq!(name, &format!("m-{:05}-of-{:05}.gguf", i + 1, n));
        let g = parse(&outdir.join(name));
        let u16_kv = |k: &str| {
            let v = g.kv(k).unwrap();
            assert_eq!(
                u32::from_le_bytes(v[..4].try_into().unwrap()),
                2,
                "{k} is u16"
            );
            u16::from_le_bytes(v[4..6].try_into().unwrap())
        };
        assert_eq!(u16_kv("split.no"), i as u16);
        assert_eq!(u16_kv("split.count"), n as u16);
        let tc = g.kv("split.tensors.count").unwrap();
        assert_eq!(
            tc,
            [
                5u32.to_le_bytes(),
                (whole.tensors.len() as i32).to_le_bytes()
            ]
            .concat()
        );
        if i == 0 {
            assert_eq!(g.str("general.architecture"), "llama");
            assert!(g.kv("tokenizer.ggml.tokens").is_some());
        } else {
            assert_eq!(g.kvs.len(), 3, "only split.* keys after the first file");
        }
        let bytes: u64 = g.tensors.values().map(|t| t.2.len() as u64).sum();
        assert!(bytes <= 60_000 || g.tensors.len() == 1, "{name}: {bytes}");
        all.extend(g.tensors);
    }
    assert_eq!(all, whole.tensors);
    // Mistral has no rope_freqs; K is permuted with its KV heads (config default 8 → file's).
    assert!(!all.contains_key("rope_freqs.weight"));
}

#[test]
fn dry_run_prints_the_plan_and_writes_nothing() {
    let d = tmp();
    let mut rng = Rng(17);
    let tensors = dense_layers(&mut rng, DType::BF16, 64, 32, &[]);
    let model = model_dir(d.path(), "llama3", |_| {}, &tensors);
    let out = d.path().join("out").join("x.gguf");
    let report = d.path().join("r.json");
    let o = tftf(&[
        "gguf",
        s(&model),
        "-o",
        s(&out),
        "--vocab-pre",
        "llama-bpe",
        "--dry-run",
        "--report",
        s(&report),
    ]);
    ok(&o);
    let text = stdout(&o);
    for want in [
        "dry run",
        "x.gguf",
        "blk.1.attn_q.weight",
        "BF16",
        "F32",
        "shared fraction",
    ] {
        assert!(text.contains(want), "{want}: {text}");
    }
    assert!(!out.parent().unwrap().exists());
    let r: Json = serde_json::from_slice(&std::fs::read(&report).unwrap()).unwrap();
    assert_eq!(r["dry_run"], true);
    assert!(r["shared_fraction"].is_number());
}

/// Each refusal happens before any output exists: no file, no temporary, no directory.
#[test]
fn bad_inputs_fail_before_any_output_exists() {
    let d = tmp();
    let mut rng = Rng(19);
    let tensors = dense_layers(&mut rng, DType::BF16, 64, 32, &[]);
    let out_dir = d.path().join("out");
    let out = out_dir.join("x.gguf");
    let run = |model: &Path, extra: &[&str]| {
        let mut args = vec!["gguf", s(model), "-o", s(&out)];
        args.extend_from_slice(extra);
        let err = fails(&args);
        assert!(!out_dir.exists(), "output created: {err}");
        err
    };

    let m = model_dir(
        d.path(),
        "llama3",
        |c| c["architectures"] = serde_json::json!(["FalconForCausalLM"]),
        &tensors,
    );
    let err = run(&m, &["--vocab-pre", "x"]);
    assert!(
        err.contains("FalconForCausalLM") && err.contains("Qwen3ForCausalLM"),
        "{err}"
    );
    // --arch overrides it.
    let ok_out = d.path().join("arch.gguf");
    ok(&tftf(&[
        "gguf",
        s(&m),
        "-o",
        s(&ok_out),
        "--arch",
        "llama",
        "--vocab-pre",
        "x",
        "-q",
    ]));
    std::fs::remove_file(&ok_out).unwrap();
    let err = run(&m, &["--arch", "falcon", "--vocab-pre", "x"]);
    assert!(err.contains("supported"), "{err}");
    std::fs::remove_dir_all(&m).unwrap();

    let m = model_dir(d.path(), "qwen3", |_| {}, &tensors);
    let err = run(&m, &[]);
    let hash = String::from_utf8(read_fixture("tokenizer/chkhsh.txt")).unwrap();
    assert!(
        err.contains(hash.trim()) && err.contains("--vocab-pre"),
        "{err}"
    );

    std::fs::remove_file(m.join("tokenizer.json")).unwrap();
    let err = run(&m, &["--vocab-pre", "qwen2"]);
    assert!(err.contains("tokenizer.json"), "{err}");
    std::fs::remove_dir_all(&m).unwrap();

    let m = model_dir(
        d.path(),
        "qwen3",
        |c| {
            c.as_object_mut().unwrap().remove("num_hidden_layers");
        },
        &tensors,
    );
    let err = run(&m, &["--vocab-pre", "qwen2"]);
    assert!(err.contains("num_hidden_layers"), "{err}");
    std::fs::remove_dir_all(&m).unwrap();

    let m = model_dir(d.path(), "qwen3", |_| {}, &tensors);
    std::fs::remove_file(m.join("config.json")).unwrap();
    let err = run(&m, &["--vocab-pre", "qwen2"]);
    assert!(err.contains("config.json"), "{err}");
    std::fs::remove_dir_all(&m).unwrap();

    // A tensor the architecture does not have.
    let mut extra = tensors.clone();
    extra.push(rand_t(&mut rng, "vision.proj.weight", DType::BF16, &[4, 4]));
    let m = model_dir(d.path(), "qwen3", |_| {}, &extra);
    let err = run(&m, &["--vocab-pre", "qwen2"]);
    assert!(err.contains("vision.proj.weight"), "{err}");
}

#[test]
fn output_is_refused_inside_the_input_and_over_an_existing_file_without_force() {
    let d = tmp();
    let mut rng = Rng(23);
    let tensors = dense_layers(&mut rng, DType::BF16, 64, 32, &[]);
    let m = model_dir(d.path(), "qwen3", |_| {}, &tensors);
    let inside = m.join("x.gguf");
    let err = fails(&["gguf", s(&m), "-o", s(&inside), "--vocab-pre", "qwen2"]);
    assert!(err.contains("inside"), "{err}");
    assert!(!inside.exists());

    let out = d.path().join("o.gguf");
    std::fs::write(&out, "keep me").unwrap();
    let err = fails(&["gguf", s(&m), "-o", s(&out), "--vocab-pre", "qwen2"]);
    assert!(err.contains("--force"), "{err}");
    assert_eq!(std::fs::read(&out).unwrap(), b"keep me");
    ok(&tftf(&[
        "gguf",
        s(&m),
        "-o",
        s(&out),
        "--vocab-pre",
        "qwen2",
        "--force",
        "-q",
    ]));
    parse(&out);
    let left: Vec<String> = listing(d.path())
        .into_iter()
        .filter(|n| n.contains(".tftf-"))
        .collect();
    assert!(left.is_empty(), "{left:?}");
    no_litter(&m);
}

struct Xfs {
    mnt: PathBuf,
    _dir: tempfile::TempDir,
}

impl Xfs {
    /// A loop-mounted reflink XFS image (root and xfsprogs), or why not.
    fn mount() -> Result<Xfs, String> {
        let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
        let img = dir.path().join("xfs.img");
        let mnt = dir.path().join("mnt");
        std::fs::create_dir(&mnt).map_err(|e| e.to_string())?;
        std::fs::File::create(&img)
            .and_then(|f| f.set_len(1 << 30))
            .map_err(|e| e.to_string())?;
        let run = |cmd: &str, args: &[&str]| -> Result<(), String> {
            let o = std::process::Command::new(cmd)
                .args(args)
                .output()
                .map_err(|e| format!("{cmd}: {e}"))?;
            if o.status.success() {
                Ok(())
            } else {
                Err(format!(
                    "{cmd}: {}",
                    String::from_utf8_lossy(&o.stderr).trim()
                ))
            }
        };
        run("mkfs.xfs", &["-q", "-m", "reflink=1", s(&img)])?;
        run("mount", &["-o", "loop", s(&img), s(&mnt)])?;
        Ok(Xfs { mnt, _dir: dir })
    }
}

impl Drop for Xfs {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount")
            .arg("-l")
            .arg(&self.mnt)
            .status();
    }
}

/// On a reflink filesystem the copied tensors are laid out congruent with their source
/// offsets (a padding KV moves the data start), cloned, and the file still reads the same.
#[test]
fn on_xfs_copied_tensors_are_cloned_at_congruent_offsets() {
    let xfs = match Xfs::mount() {
        Ok(x) => x,
        Err(why) => {
            println!("SKIPPED: cannot mount a reflink XFS image: {why}");
            return;
        }
    };
    let mut rng = Rng(29);
    let tensors = dense_layers(&mut rng, DType::BF16, 128, 64, &[]);
    let model = model_dir(&xfs.mnt, "qwen2", |_| {}, &tensors);
    // Data section at a multiple of 32, as GGUF's alignment needs for any congruence (the
    // Python writer pads headers to 8 only: one shard in four is so placed by chance).
    let mut infos = Vec::new();
    let mut begin = 0;
    for (name, dtype, shape, data) in &tensors {
        infos.push(tftf::format::header::TensorInfo {
            name: name.clone(),
            dtype: *dtype,
            shape: shape.clone(),
            begin,
            end: begin + data.len() as u64,
        });
        begin += data.len() as u64;
    }
    let mut meta = serde_json::Map::new();
    meta.insert("format".into(), "pt".into());
    let mut bytes = tftf::format::header::serialize_header(&meta, &infos, 32);
    for t in &tensors {
        bytes.extend_from_slice(&t.3);
    }
    std::fs::write(model.join("model.safetensors"), bytes).unwrap();
    let plain = tmp();
    let want = plain.path().join("plain.gguf");
    ok(&tftf(&[
        "gguf",
        s(&model),
        "-o",
        s(&want),
        "--vocab-pre",
        "qwen2",
        "-q",
    ]));
    let out = xfs.mnt.join("out.gguf");
    let report = xfs.mnt.join("r.json");
    ok(&tftf(&[
        "gguf",
        s(&model),
        "-o",
        s(&out),
        "--vocab-pre",
        "qwen2",
        "--report",
        s(&report),
        "-q",
    ]));
    let r: Json = serde_json::from_slice(&std::fs::read(&report).unwrap()).unwrap();
    assert_eq!(r["reflink_layout"], true, "{r}");
    let copied = r["bytes"]["copied_unchanged"].as_u64().unwrap();
    let congruent = r["bytes"]["congruent"].as_u64().unwrap();
    let reflinked = r["bytes"]["reflinked"].as_u64().unwrap();
    println!("copied {copied}, congruent {congruent}, reflinked {reflinked}");
    assert!(copied > 0 && congruent > 0 && reflinked > 0, "{r}");
    assert!(r["shared_fraction"].as_f64().unwrap() > 0.5, "{r}");
    let (a, b) = (parse(&out), parse(&want));
    assert_eq!(a.tensors, b.tensors);
    let strip = |g: &Gguf| -> Vec<(String, Vec<u8>)> {
        let mut v: Vec<_> = g
            .kvs
            .iter()
            .filter(|(k, _)| k != "tftf.reflink_padding")
            .cloned()
            .collect();
        v.sort();
        v
    };
    assert_eq!(strip(&a), strip(&b));
}

fn deepseek_tensors() -> Vec<T> {
    let mut rng = Rng(31);
    let mut tensors = vec![
        rand_t(
            &mut rng,
            "model.embed_tokens.weight",
            DType::BF16,
            &[410, 64],
        ),
        rand_t(&mut rng, "model.norm.weight", DType::BF16, &[64]),
        rand_t(&mut rng, "lm_head.weight", DType::BF16, &[410, 64]),
    ];
    let kv_b = read_fixture("kv_b.in");
    for l in 0..3 {
        let p = |s: &str| format!("model.layers.{l}.{s}");
        for (name, shape) in [
            ("input_layernorm.weight", vec![64u64]),
            ("post_attention_layernorm.weight", vec![64]),
            ("self_attn.q_a_proj.weight", vec![24, 64]),
            ("self_attn.q_a_layernorm.weight", vec![24]),
            ("self_attn.q_b_proj.weight", vec![24, 24]),
            ("self_attn.kv_a_proj_with_mqa.weight", vec![9, 64]),
            ("self_attn.kv_a_layernorm.weight", vec![5]),
            ("self_attn.o_proj.weight", vec![64, 6]),
        ] {
            tensors.push(rand_t(&mut rng, &p(name), DType::BF16, &shape));
        }
        tensors.push(t(
            &p("self_attn.kv_b_proj.weight"),
            DType::BF16,
            &[18, 5],
            kv_b.clone(),
        ));
        if l == 0 {
            for (w, shape) in [
                ("gate_proj", [128u64, 64]),
                ("up_proj", [128, 64]),
                ("down_proj", [64, 128]),
            ] {
                tensors.push(rand_t(
                    &mut rng,
                    &p(&format!("mlp.{w}.weight")),
                    DType::BF16,
                    &shape,
                ));
            }
            continue;
        }
        tensors.push(rand_t(
            &mut rng,
            &p("mlp.gate.weight"),
            DType::BF16,
            &[4, 64],
        ));
        tensors.push(rand_t(
            &mut rng,
            &p("mlp.gate.e_score_correction_bias"),
            DType::F32,
            &[4],
        ));
        for x in ["shared_experts".to_string()]
            .into_iter()
            .chain((0..4).map(|x| format!("experts.{x}")))
        {
            for (w, shape) in [
                ("gate_proj", [32u64, 64]),
                ("up_proj", [32, 64]),
                ("down_proj", [64, 32]),
            ] {
                tensors.push(rand_t(
                    &mut rng,
                    &p(&format!("mlp.{x}.{w}.weight")),
                    DType::BF16,
                    &shape,
                ));
            }
        }
    }
    // Layer 2 is the multi-token-prediction layer (num_hidden_layers 2).
    tensors.push(rand_t(
        &mut rng,
        "model.layers.2.eh_proj.weight",
        DType::BF16,
        &[64, 128],
    ));
    tensors
}

fn deepseek_config(c: &mut Json) {
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

#[test]
fn deepseek_v3_splits_kv_b_stacks_experts_and_skips_mtp_layers() {
    let d = tmp();
    let tensors = deepseek_tensors();
    let model = model_dir(d.path(), "deepseekv3", deepseek_config, &tensors);
    let out = d.path().join("ds.gguf");
    ok(&tftf(&[
        "gguf",
        s(&model),
        "-o",
        s(&out),
        "--vocab-pre",
        "test-pre",
        "-q",
    ]));
    let g = parse(&out);
    assert_eq!(g.str("general.architecture"), "deepseek2");
    assert_eq!(g.u32("deepseek2.attention.head_count_kv"), 1);
    assert_eq!(g.u32("deepseek2.leading_dense_block_count"), 1);
    for l in 0..2 {
        let (sh, ty, data) = g.tensor(&format!("blk.{l}.attn_k_b.weight"));
        assert_eq!((sh.as_slice(), *ty), (&[3u64, 5, 4][..], 30));
        assert_eq!(data, &read_fixture("kv_b_k.out"));
        let (sh, _, data) = g.tensor(&format!("blk.{l}.attn_v_b.weight"));
        assert_eq!(sh, &[3, 2, 5]);
        assert_eq!(data, &read_fixture("kv_b_v.out"));
        assert!(!g.tensors.contains_key(&format!("blk.{l}.attn_kv_b.weight")));
    }
    let (sh, ty, data) = g.tensor("blk.1.ffn_down_exps.weight");
    assert_eq!((sh.as_slice(), *ty), (&[4u64, 64, 32][..], 30));
    let want: Vec<u8> = (0..4)
        .flat_map(|x| {
            src(
                &tensors,
                &format!("model.layers.1.mlp.experts.{x}.down_proj.weight"),
            )
            .to_vec()
        })
        .collect();
    assert_eq!(data, &want);
    assert_eq!(g.tensor("blk.1.exp_probs_b.bias").1, 0);
    assert_eq!(g.tensor("blk.1.ffn_gate_shexp.weight").1, 30);
    assert!(
        g.order.iter().all(|n| !n.starts_with("blk.2.")),
        "{:?}",
        g.order
    );
}

#[test]
fn qwen2_keeps_attention_biases_f32_and_unpermuted() {
    let d = tmp();
    let mut rng = Rng(37);
    let mut tensors = dense_layers(&mut rng, DType::BF16, 64, 32, &[]);
    for l in 0..2 {
        for (w, n) in [("q_proj", 64u64), ("k_proj", 32), ("v_proj", 32)] {
            let name = format!("model.layers.{l}.self_attn.{w}.bias");
            tensors.push(rand_t(&mut rng, &name, DType::BF16, &[n]));
        }
    }
    let model = model_dir(d.path(), "qwen2", |_| {}, &tensors);
    let out = d.path().join("q2.gguf");
    ok(&tftf(&[
        "gguf",
        s(&model),
        "-o",
        s(&out),
        "--vocab-pre",
        "test-pre",
        "-q",
    ]));
    let g = parse(&out);
    assert_hparams(&g, "qwen2", 32);
    assert_tokenizer(&g);
    let (sh, ty, data) = g.tensor("blk.1.attn_q.bias");
    assert_eq!((sh.as_slice(), *ty), (&[64u64][..], 0));
    assert_eq!(
        data,
        &bf16_to_f32_bytes(src(&tensors, "model.layers.1.self_attn.q_proj.bias"))
    );
    assert_eq!(
        g.tensor("blk.1.attn_q.weight").2,
        src(&tensors, "model.layers.1.self_attn.q_proj.weight")
    );
}

/// E4M3 code → f32 (no NaN codes are generated here).
fn e4m3(c: u8) -> f32 {
    let sign = if c & 0x80 != 0 { -1.0 } else { 1.0 };
    let (e, m) = (((c >> 3) & 0xF) as i32, (c & 7) as f32);
    sign * if e == 0 {
        m / 8.0 * 2f32.powi(-6)
    } else {
        (1.0 + m / 8.0) * 2f32.powi(e - 7)
    }
}

/// FP8 weights (128×128 block scales, `weight_scale_inv`) are dequantised in f32 and written
/// as BF16, as the reference does with DeepSeek-V3's released checkpoint.
#[test]
fn deepseek_v3_fp8_weights_are_dequantised_to_bf16() {
    let d = tmp();
    let mut rng = Rng(41);
    let mut tensors = deepseek_tensors();
    let fp8_names = [
        "model.layers.0.self_attn.q_a_proj.weight",
        "model.layers.1.mlp.experts.0.gate_proj.weight",
        "model.layers.1.mlp.experts.1.gate_proj.weight",
        "model.layers.1.mlp.experts.2.gate_proj.weight",
        "model.layers.1.mlp.experts.3.gate_proj.weight",
        "model.layers.0.mlp.down_proj.weight",
    ];
    let mut want: BTreeMap<String, Vec<u8>> = BTreeMap::new();
    for name in fp8_names {
        let at = tensors.iter().position(|t| t.0 == name).unwrap();
        let shape = tensors[at].2.clone();
        let (rows, cols) = (shape[0] as usize, shape[1] as usize);
        let codes: Vec<u8> = rng
            .bytes(rows * cols)
            .into_iter()
            .map(|c| if c & 0x7F == 0x7F { 0 } else { c })
            .collect();
        let grid = (rows.div_ceil(128), cols.div_ceil(128));
        let scales: Vec<f32> = (0..grid.0 * grid.1)
            .map(|k| 0.001 * (k as f32 + 1.5))
            .collect();
        let bf16: Vec<u8> = codes
            .iter()
            .enumerate()
            .flat_map(|(k, &c)| {
                let (r, j) = (k / cols, k % cols);
                let x = e4m3(c) * scales[r / 128 * grid.1 + j / 128];
                half::bf16::from_f32(x).to_bits().to_le_bytes()
            })
            .collect();
        want.insert(name.to_string(), bf16);
        tensors[at] = t(name, DType::F8_E4M3, &shape, codes);
        tensors.push(t(
            &format!("{name}_scale_inv"),
            DType::F32,
            &[grid.0 as u64, grid.1 as u64],
            scales.iter().flat_map(|x| x.to_le_bytes()).collect(),
        ));
    }
    let model = model_dir(
        d.path(),
        "deepseekv3",
        |c| {
            let q = c["quantization_config"].clone();
            deepseek_config(c);
            c["quantization_config"] = q;
        },
        &tensors,
    );
    let out = d.path().join("fp8.gguf");
    ok(&tftf(&[
        "gguf",
        s(&model),
        "-o",
        s(&out),
        "--vocab-pre",
        "test-pre",
        "--memory-budget",
        "16MiB",
        "-q",
    ]));
    let g = parse(&out);
    assert_eq!(g.u32("general.file_type"), 32);
    assert!(
        g.order.iter().all(|n| !n.contains("scale")),
        "{:?}",
        g.order
    );
    let (sh, ty, data) = g.tensor("blk.0.attn_q_a.weight");
    assert_eq!((sh.as_slice(), *ty), (&[24u64, 64][..], 30));
    assert_eq!(data, &want["model.layers.0.self_attn.q_a_proj.weight"]);
    assert_eq!(
        g.tensor("blk.0.ffn_down.weight").2,
        want["model.layers.0.mlp.down_proj.weight"]
    );
    let stacked: Vec<u8> = (0..4)
        .flat_map(|x| want[&format!("model.layers.1.mlp.experts.{x}.gate_proj.weight")].clone())
        .collect();
    assert_eq!(g.tensor("blk.1.ffn_gate_exps.weight").2, stacked);
}

/// A failure while tensors are being written (a NaN FP8 code, found only when its rows are
/// read) leaves no file, no temporary and no created directory behind.
#[test]
fn a_failure_while_writing_leaves_nothing_behind() {
    let d = tmp();
    let mut tensors = deepseek_tensors();
    let name = "model.layers.1.self_attn.q_a_proj.weight";
    let at = tensors.iter().position(|t| t.0 == name).unwrap();
    let mut codes = vec![0x38u8; 24 * 64];
    codes[24 * 64 - 3] = 0x7F; // E4M3 NaN
    tensors[at] = t(name, DType::F8_E4M3, &[24, 64], codes);
    tensors.push(t(
        &format!("{name}_scale_inv"),
        DType::F32,
        &[1, 1],
        1.0f32.to_le_bytes().to_vec(),
    ));
    let model = model_dir(d.path(), "deepseekv3", deepseek_config, &tensors);
    let out_dir = d.path().join("new").join("dir");
    let out = out_dir.join("x.gguf");
    let err = fails(&[
        "gguf",
        s(&model),
        "-o",
        s(&out),
        "--vocab-pre",
        "test-pre",
        "--split-max-size",
        "20K",
    ]);
    assert!(err.contains("q_a_proj") && err.contains("NaN"), "{err}");
    assert!(!d.path().join("new").exists(), "{:?}", listing(&out_dir));
}

#[test]
fn mixtral_permutes_q_k_and_stacks_w1_w2_w3() {
    let d = tmp();
    let mut rng = Rng(43);
    let mut tensors = vec![
        rand_t(
            &mut rng,
            "model.embed_tokens.weight",
            DType::BF16,
            &[410, 64],
        ),
        rand_t(&mut rng, "model.norm.weight", DType::BF16, &[64]),
        rand_t(&mut rng, "lm_head.weight", DType::BF16, &[410, 64]),
    ];
    for l in 0..2 {
        let p = |s: &str| format!("model.layers.{l}.{s}");
        for (name, shape) in [
            ("input_layernorm.weight", vec![64u64]),
            ("post_attention_layernorm.weight", vec![64]),
            ("self_attn.q_proj.weight", vec![64, 64]),
            ("self_attn.k_proj.weight", vec![32, 64]),
            ("self_attn.v_proj.weight", vec![32, 64]),
            ("self_attn.o_proj.weight", vec![64, 64]),
            ("block_sparse_moe.gate.weight", vec![4, 64]),
        ] {
            tensors.push(rand_t(&mut rng, &p(name), DType::BF16, &shape));
        }
        for x in 0..4 {
            for (w, shape) in [("w1", [128u64, 64]), ("w2", [64, 128]), ("w3", [128, 64])] {
                let name = p(&format!("block_sparse_moe.experts.{x}.{w}.weight"));
                tensors.push(rand_t(&mut rng, &name, DType::BF16, &shape));
            }
        }
    }
    let model = model_dir(
        d.path(),
        "mixtral",
        |c| {
            c["num_key_value_heads"] = 2.into();
            c["num_local_experts"] = 4.into();
        },
        &tensors,
    );
    let out = d.path().join("mx.gguf");
    ok(&tftf(&[
        "gguf",
        s(&model),
        "-o",
        s(&out),
        "--vocab-pre",
        "test-pre",
        "-q",
    ]));
    let g = parse(&out);
    assert_eq!(g.str("general.architecture"), "llama");
    assert_eq!(g.u32("llama.expert_count"), 4);
    for l in 0..2 {
        let h = |s: &str| format!("model.layers.{l}.{s}");
        assert_eq!(
            g.tensor(&format!("blk.{l}.attn_k.weight")).2,
            permute(src(&tensors, &h("self_attn.k_proj.weight")), 32, 2)
        );
        for (w, gg) in [
            ("w1", "ffn_gate_exps"),
            ("w2", "ffn_down_exps"),
            ("w3", "ffn_up_exps"),
        ] {
            let want: Vec<u8> = (0..4)
                .flat_map(|x| {
                    src(
                        &tensors,
                        &h(&format!("block_sparse_moe.experts.{x}.{w}.weight")),
                    )
                    .to_vec()
                })
                .collect();
            let (sh, ty, data) = g.tensor(&format!("blk.{l}.{gg}.weight"));
            assert_eq!((sh.len(), *ty), (3, 30), "{gg}");
            assert_eq!(data, &want, "{gg}");
        }
        assert_eq!(g.tensor(&format!("blk.{l}.ffn_gate_inp.weight")).1, 0);
    }
}

/// `formula` in bench/gguf_reference.py: deterministic bytes of the `k`-th tensor (names
/// sorted) of a reference model.
fn formula(k: usize, name: &str, dtype: DType, n: u64) -> Vec<u8> {
    let mut out = Vec::new();
    for i in 0..n {
        let mut u = i
            .wrapping_mul(2654435761)
            .wrapping_add((k as u64 + 1) * 0x9E37_79B9)
            & 0xFFFF_FFFF;
        u = (u ^ (u >> 13)) & 0xFFFF_FFFF;
        let bf = (0x3C00 | (u & 0x3FF) | ((u >> 10) & 1) << 15) as u16;
        if name.ends_with("_scales") {
            out.push((118 + u % 12) as u8);
        } else if dtype == DType::U8 {
            out.push(u as u8);
        } else if dtype == DType::F8_E4M3 {
            out.push(((u & 0x77) | ((u >> 8) & 0x80)) as u8);
        } else if name.ends_with("weight_scale_inv") {
            out.extend((0x3C00_0000 | (u & 0x3F_FFFF) as u32).to_le_bytes());
        } else if dtype == DType::F32 {
            out.extend(((bf as u32) << 16).to_le_bytes());
        } else {
            out.extend(bf.to_le_bytes());
        }
    }
    out
}

fn sha256_hex(b: &[u8]) -> String {
    use sha2::Digest;
    sha2::Sha256::digest(b)
        .iter()
        .map(|x| format!("{x:02x}"))
        .collect()
}

/// Every `reference/*.json` (bench/gguf_reference.py with GGUF_REFERENCE_FIXTURES): the same
/// model converted by tftf has convert_hf_to_gguf.py's KVs (but `general.*` naming fields) and
/// its tensor names, types, shapes and bytes, in its order (tmp is not a reflink filesystem
/// here; where it is, the order may differ and only then).
#[test]
fn outputs_equal_convert_hf_to_gguf_on_every_reference_model() {
    let dir = gguf_fixture("reference");
    let mut cases: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "json"))
        .collect();
    cases.sort();
    assert!(cases.len() >= 14, "{cases:?}");
    let naming = [
        "general.name",
        "general.basename",
        "general.size_label",
        "general.finetune",
        "general.version",
        "general.quantized_by",
        "general.type",
    ];
    for case in cases {
        let spec: Json = serde_json::from_slice(&std::fs::read(&case).unwrap()).unwrap();
        let what = case.file_name().unwrap().to_string_lossy().to_string();
        let d = tmp();
        let model = d.path().join("model");
        std::fs::create_dir(&model).unwrap();
        std::fs::write(
            model.join("config.json"),
            serde_json::to_vec(&spec["config"]).unwrap(),
        )
        .unwrap();
        let mut tok: Json =
            serde_json::from_slice(&read_fixture("tokenizer/tokenizer.json")).unwrap();
        for a in spec["added_tokens"].as_array().unwrap() {
            tok["added_tokens"].as_array_mut().unwrap().push(a.clone());
        }
        std::fs::write(
            model.join("tokenizer.json"),
            serde_json::to_vec(&tok).unwrap(),
        )
        .unwrap();
        let mut tc: Json =
            serde_json::from_slice(&read_fixture("tokenizer/tokenizer_config.json")).unwrap();
        tc["tokenizer_class"] = "PreTrainedTokenizerFast".into();
        std::fs::write(
            model.join("tokenizer_config.json"),
            serde_json::to_vec(&tc).unwrap(),
        )
        .unwrap();
        let tensors: Vec<T> = spec["tensors"]
            .as_array()
            .unwrap()
            .iter()
            .enumerate()
            .map(|(k, e)| {
                let name = e[0].as_str().unwrap();
                let dtype: DType = e[1].as_str().unwrap().parse().unwrap();
                let shape: Vec<u64> = e[2]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|x| x.as_u64().unwrap())
                    .collect();
                let n = shape.iter().product();
                t(name, dtype, &shape, formula(k, name, dtype, n))
            })
            .collect();
        write_file(&model.join("model.safetensors"), &tensors);
        let out = d.path().join("out.gguf");
        ok(&tftf(&[
            "gguf",
            s(&model),
            "-o",
            s(&out),
            "--outtype",
            spec["outtype"].as_str().unwrap(),
            "--vocab-pre",
            "test-pre",
            "-q",
        ]));
        let g = parse(&out);
        let ours: BTreeMap<&str, String> = g
            .kvs
            .iter()
            .filter(|(k, _)| !naming.contains(&k.as_str()) && !k.starts_with("tftf."))
            .map(|(k, v)| (k.as_str(), sha256_hex(v)))
            .collect();
        let want: BTreeMap<&str, String> = spec["kvs"]
            .as_object()
            .unwrap()
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str().unwrap().to_string()))
            .collect();
        assert_eq!(ours, want, "{what}: KVs");
        let order: Vec<&str> = spec["order"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_str().unwrap())
            .collect();
        assert_eq!(g.order, order, "{what}: tensor order");
        let want = spec["out"].as_object().unwrap();
        assert_eq!(
            g.tensors.keys().collect::<Vec<_>>(),
            want.keys().collect::<Vec<_>>(),
            "{what}: tensor names"
        );
        for (name, (shape, ty, data)) in &g.tensors {
            let w = &want[name];
            let mut wshape: Vec<u64> = w[0]
                .as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_u64().unwrap())
                .collect();
            wshape.reverse();
            assert_eq!(
                (shape, *ty as u64),
                (&wshape, w[1].as_u64().unwrap()),
                "{what}: {name} shape/type"
            );
            assert_eq!(
                sha256_hex(data),
                w[2].as_str().unwrap(),
                "{what}: {name} bytes"
            );
        }
    }
}

#[test]
fn json_progress_names_every_split_file_and_ends_with_the_report() {
    let d = tmp();
    let mut rng = Rng(11);
    let tensors = dense_layers(&mut rng, DType::BF16, 64, 32, &[]);
    let model = model_dir(d.path(), "llama3", |_| {}, &tensors);
    let out = d.path().join("out").join("x.gguf");
    let o = tftf(&[
        "gguf",
        s(&model),
        "-o",
        s(&out),
        "--vocab-pre",
        "test-pre",
        "--split-max-size",
        "20K",
        "--progress",
        "json",
        "-q",
    ]);
    ok(&o);
    let lines: Vec<Json> = stderr(&o)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{l}: {e}")))
        .collect();
    let files = listing(&d.path().join("out"));
    assert!(files.len() >= 2, "{files:?}");
    // Files are written in parallel: each is named once, in the order it was finished.
    let mut written: Vec<&str> = lines
        .iter()
        .filter(|l| l["event"] == "shard_written")
        .map(|l| l["shard"].as_str().unwrap())
        .collect();
    written.sort();
    assert_eq!(
        written,
        files.iter().map(String::as_str).collect::<Vec<_>>()
    );
    let last = lines.last().unwrap();
    assert_eq!(last["event"], "report");
    assert_eq!(last["report"]["status"], "ok");
}
