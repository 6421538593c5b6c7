//! `tftf gguf` end to end: small models with the real tokenizer fixture, converted by the
//! binary, read back with the GGUF reader of `common::gguf`, and checked against the
//! converter's fixtures (hparam KVs, tokenizer KVs, transforms) and against bytes computed
//! independently.

mod common;

use std::collections::BTreeMap;
use std::path::Path;

use common::gguf::*;
use common::xfs::xfs_or_skip;
use common::*;
use serde_json::Value as Json;
use tftf::format::dtype::DType;
use tftf::sink::gguf::quant;

fn read_fixture(name: &str) -> Vec<u8> {
    read_gguf_fixture(name)
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

/// The hparam KVs equal the reference's `set_gguf_parameters` (fixture), but for the
/// vocabulary size and file type, which the test model changes, and the u32 KVs ending with a
/// suffix in `changed` (what a test's config edit changes).
fn assert_hparams(g: &Gguf, cfg: &str, file_type: u32, changed: &[(&str, u32)]) {
    let want: Vec<Json> =
        serde_json::from_slice(&read_fixture(&format!("configs/{cfg}.kvs.json"))).unwrap();
    for w in &want {
        let key = w[0].as_str().unwrap();
        let got = g.kv(key).unwrap_or_else(|| panic!("{cfg}: no {key}"));
        let want_bytes = match (w[1].as_str().unwrap(), &w[2]) {
            _ if key == "general.file_type" => enc_u32(file_type),
            _ if key.ends_with(".vocab_size") => enc_u32(410),
            _ if changed.iter().any(|(k, _)| key.ends_with(k)) => {
                enc_u32(changed.iter().find(|(k, _)| key.ends_with(k)).unwrap().1)
            }
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
    let c = GgufCase::dense(7, "llama3");
    let tensors = &c.tensors;
    let out = c.path("out/llama.gguf");
    let report = c.path("report.json");
    // The input given with `-i` rather than as the positional argument.
    tftf_ok(&cmd(
        "gguf",
        &c.model,
        &out,
        &["--vocab-pre", "test-pre", "--report", s(&report), "-q"],
    ));
    let g = parse(&out);
    assert_eq!(g.str("general.architecture"), "llama");
    assert_eq!(g.str("general.name"), "llama3-model");
    assert_hparams(&g, "llama3", 32, &[]);
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
    assert_eq!(data, src(tensors, "model.embed_tokens.weight"));
    assert_eq!(g.tensor("output.weight").2, src(tensors, "lm_head.weight"));
    let (_, ty, data) = g.tensor("output_norm.weight");
    assert_eq!(*ty, 0, "norms are F32");
    assert_eq!(data, &bf16_to_f32_bytes(src(tensors, "model.norm.weight")));
    for l in 0..2 {
        let h = |s: &str| format!("model.layers.{l}.{s}");
        let b = |s: &str| format!("blk.{l}.{s}");
        let (shape, ty, data) = g.tensor(&b("attn_q.weight"));
        assert_eq!((shape.as_slice(), *ty), (&[64u64, 64][..], 30));
        assert_eq!(
            data,
            &permute(src(tensors, &h("self_attn.q_proj.weight")), 64, 4)
        );
        assert_ne!(data, src(tensors, &h("self_attn.q_proj.weight")));
        let (shape, _, data) = g.tensor(&b("attn_k.weight"));
        assert_eq!(shape, &[32, 64]);
        assert_eq!(
            data,
            &permute(src(tensors, &h("self_attn.k_proj.weight")), 32, 2)
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
            assert_eq!(data, src(tensors, &h(hf)), "{gg}");
        }
        for (hf, gg) in [
            ("input_layernorm.weight", "attn_norm.weight"),
            ("post_attention_layernorm.weight", "ffn_norm.weight"),
        ] {
            let (_, ty, data) = g.tensor(&b(gg));
            assert_eq!(*ty, 0, "{gg}");
            assert_eq!(data, &bf16_to_f32_bytes(src(tensors, &h(hf))), "{gg}");
        }
    }
    let r = read_json(&report);
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

/// Qwen3's per-head query and key norms, as `extra` for [`dense_layers`].
const QK_NORMS: &[(&str, &[u64])] = &[
    ("self_attn.q_norm.weight", &[32]),
    ("self_attn.k_norm.weight", &[32]),
];

#[test]
fn qwen3_q8_0_quantises_weights_keeps_norms_f32_and_does_not_permute() {
    let mut rng = Rng(11);
    let mut tensors = dense_layers(&mut rng, DType::F32, 128, 64, QK_NORMS);
    // A feed-forward weight big enough for several row chunks under the budget, on several
    // threads (intermediate_size says 20000: llama.cpp checks the shapes against it).
    for t in tensors.iter_mut().filter(|t| t.0.contains(".mlp.")) {
        let shape = if t.0.ends_with("down_proj.weight") {
            [64, 20000]
        } else {
            [20000, 64]
        };
        *t = rand_t(&mut rng, &t.0.clone(), DType::F32, &shape);
    }
    let c = GgufCase::new("qwen3", |c| c["intermediate_size"] = 20000.into(), tensors);
    let tensors = &c.tensors;
    let g = c.convert(
        "q.gguf",
        "test-pre",
        &[
            "--outtype",
            "q8_0",
            "--memory-budget",
            "16MiB",
            "--threads",
            "3",
        ],
    );
    assert_eq!(g.str("general.architecture"), "qwen3");
    assert_hparams(&g, "qwen3", 7, &[(".feed_forward_length", 20000)]);
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
        &q8(src(tensors, "model.layers.1.self_attn.q_proj.weight"))
    );
    let (_, ty, data) = g.tensor("blk.0.attn_k_norm.weight");
    assert_eq!(*ty, 0);
    assert_eq!(data, src(tensors, "model.layers.0.self_attn.k_norm.weight"));
    let (_, ty, data) = g.tensor("token_embd.weight");
    assert_eq!(*ty, 8);
    assert_eq!(data, &q8(src(tensors, "model.embed_tokens.weight")));
    let (sh, ty, data) = g.tensor("blk.1.ffn_up.weight");
    assert_eq!((sh.as_slice(), *ty), (&[20000u64, 64][..], 8));
    assert_eq!(data, &q8(src(tensors, "model.layers.1.mlp.up_proj.weight")));
}

#[test]
fn f32_checkpoint_auto_becomes_f16_except_norms() {
    let c = GgufCase::new(
        "qwen3",
        |_| {},
        dense_layers(&mut Rng(3), DType::F32, 128, 64, QK_NORMS),
    );
    let tensors = &c.tensors;
    let g = c.convert("a.gguf", "qwen2", &[]);
    assert_eq!(g.u32("general.file_type"), 1);
    assert_eq!(g.str("tokenizer.ggml.pre"), "qwen2");
    let (_, ty, data) = g.tensor("blk.0.ffn_up.weight");
    assert_eq!(*ty, 1);
    let want: Vec<u8> = src(tensors, "model.layers.0.mlp.up_proj.weight")
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
    // Experts written out of order: the GGUF stacks them by id.
    let c = GgufCase::qwen3_moe(5);
    let g = c.convert("moe.gguf", "test-pre", &[]);
    assert_hparams(&g, "qwen3moe", 32, &[]);
    for l in 0..2 {
        for (w, gg, shape) in [
            ("gate_proj", "ffn_gate_exps", [4u64, 32, 64]),
            ("up_proj", "ffn_up_exps", [4, 32, 64]),
            ("down_proj", "ffn_down_exps", [4, 64, 32]),
        ] {
            let (sh, ty, data) = g.tensor(&format!("blk.{l}.{gg}.weight"));
            assert_eq!((sh.as_slice(), *ty), (&shape[..], 30));
            let want = stacked(&c.tensors, 4, |x| {
                format!("model.layers.{l}.mlp.experts.{x}.{w}.weight")
            });
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
    let mut rng = Rng(9);
    let blocks = read_fixture("mxfp4_blocks.in");
    let scales = read_fixture("mxfp4_scales.in");
    let bias = read_fixture("gate_up_bias.in");
    let mut tensors = head(&mut rng, DType::BF16);
    tensors.extend(attention_layer(
        &mut rng,
        0,
        [
            ("self_attn.sinks", vec![4]),
            ("mlp.router.weight", vec![2, 64]),
            ("mlp.router.bias", vec![2]),
            ("mlp.experts.down_proj_bias", vec![2, 6]),
        ],
    ));
    let p = |s: &str| format!("model.layers.0.{s}");
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
    let edit = |c: &mut Json| {
        c["num_hidden_layers"] = 1.into();
        c["num_local_experts"] = 2.into();
    };
    let g = GgufCase::new("gptoss", edit, tensors).convert("oss.gguf", "test-pre", &[]);
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
    let tensors = dense_layers(&mut Rng(13), DType::BF16, 64, 32, &[]);
    let c = GgufCase::new("mistral", |c| c["num_key_value_heads"] = 2.into(), tensors);
    let whole = c.convert("whole.gguf", "test-pre", &[]);
    let outdir = c.path("split");
    std::fs::create_dir(&outdir).unwrap();
    let parts = outdir.join("m.gguf");
    let args = ["--vocab-pre", "test-pre", "-q", "--split-max-size", "60K"];
    tftf_ok(&gguf_args(&c.model, &parts, &args));
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
    let c = GgufCase::dense(17, "llama3");
    let out = c.path("out/x.gguf");
    let report = c.path("r.json");
    let extra = [
        "--vocab-pre",
        "llama-bpe",
        "--dry-run",
        "--report",
        s(&report),
    ];
    let o = tftf_ok(&gguf_args(&c.model, &out, &extra));
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
    let r = read_json(&report);
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
        let err = fails(&gguf_args(model, &out, extra));
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
    assert_mentions(&err, &["FalconForCausalLM", "Qwen3ForCausalLM"]);
    // --arch overrides it.
    let ok_out = d.path().join("arch.gguf");
    let extra = ["--arch", "llama", "--vocab-pre", "x", "-q"];
    tftf_ok(&gguf_args(&m, &ok_out, &extra));
    std::fs::remove_file(&ok_out).unwrap();
    let err = run(&m, &["--arch", "falcon", "--vocab-pre", "x"]);
    assert!(err.contains("supported"), "{err}");
    std::fs::remove_dir_all(&m).unwrap();

    let m = model_dir(d.path(), "qwen3", |_| {}, &tensors);
    let err = run(&m, &[]);
    let hash = String::from_utf8(read_fixture("tokenizer/chkhsh.txt")).unwrap();
    assert_mentions(&err, &[hash.trim(), "--vocab-pre"]);

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

    // A tensor the architecture does not have (a multimodal one, `vision.*`, is left out as
    // the reference leaves it out).
    let mut extra = tensors.clone();
    extra.push(rand_t(
        &mut rng,
        "encoder.proj.weight",
        DType::BF16,
        &[4, 4],
    ));
    let m = model_dir(d.path(), "qwen3", |_| {}, &extra);
    let err = run(&m, &["--vocab-pre", "qwen2"]);
    assert!(err.contains("encoder.proj.weight"), "{err}");
}

#[test]
fn output_is_refused_inside_the_input_and_over_an_existing_file_without_force() {
    let c = GgufCase::dense(23, "qwen3");
    let m = &c.model;
    let inside = m.join("x.gguf");
    let err = fails(&gguf_args(m, &inside, &["--vocab-pre", "qwen2"]));
    assert!(err.contains("inside"), "{err}");
    assert!(!inside.exists());

    let out = c.path("o.gguf");
    std::fs::write(&out, "keep me").unwrap();
    let err = fails(&gguf_args(m, &out, &["--vocab-pre", "qwen2"]));
    assert!(err.contains("--force"), "{err}");
    assert_eq!(std::fs::read(&out).unwrap(), b"keep me");
    to_gguf(m, &out, "qwen2", &["--force"]);
    let left: Vec<String> = listing(c.dir.path())
        .into_iter()
        .filter(|n| n.contains(".tftf-"))
        .collect();
    assert!(left.is_empty(), "{left:?}");
    no_litter(m);
}

/// On a reflink filesystem the copied tensors are laid out congruent with their source
/// offsets (a padding KV moves the data start), cloned, and the file still reads the same.
#[test]
fn on_xfs_copied_tensors_are_cloned_at_congruent_offsets() {
    let Some(xfs) = xfs_or_skip("on_xfs_copied_tensors_are_cloned_at_congruent_offsets") else {
        return;
    };
    let mut rng = Rng(29);
    let tensors = dense_layers(&mut rng, DType::BF16, 64, 32, &[]);
    let model = model_dir(&xfs.mnt, "qwen2", |_| {}, &tensors);
    // Data section at a multiple of 32, as GGUF's alignment needs for any congruence (the
    // Python writer pads headers to 8 only: one shard in four is so placed by chance).
    let mut end = 0;
    let infos: Vec<_> = tensors
        .iter()
        .map(|(name, dtype, shape, data)| {
            end += data.len() as u64;
            let begin = end - data.len() as u64;
            let (name, dtype, shape) = (name.clone(), *dtype, shape.clone());
            tftf::format::header::TensorInfo {
                name,
                dtype,
                shape,
                begin,
                end,
            }
        })
        .collect();
    let mut meta = serde_json::Map::new();
    meta.insert("format".into(), "pt".into());
    let mut bytes = tftf::format::header::serialize_header(&meta, &infos, 32);
    for t in &tensors {
        bytes.extend_from_slice(&t.3);
    }
    std::fs::write(model.join("model.safetensors"), bytes).unwrap();
    let plain = tmp();
    let b = to_gguf(&model, &plain.path().join("plain.gguf"), "qwen2", &[]);
    let report = xfs.mnt.join("r.json");
    let a = to_gguf(
        &model,
        &xfs.mnt.join("out.gguf"),
        "qwen2",
        &["--report", s(&report)],
    );
    let r = read_json(&report);
    assert_eq!(r["reflink_layout"], true, "{r}");
    let copied = r["bytes"]["copied_unchanged"].as_u64().unwrap();
    let congruent = r["bytes"]["congruent"].as_u64().unwrap();
    let reflinked = r["bytes"]["reflinked"].as_u64().unwrap();
    println!("copied {copied}, congruent {congruent}, reflinked {reflinked}");
    assert!(copied > 0 && congruent > 0 && reflinked > 0, "{r}");
    assert!(r["shared_fraction"].as_f64().unwrap() > 0.5, "{r}");
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

#[test]
fn deepseek_v3_splits_kv_b_stacks_experts_and_skips_mtp_layers() {
    let c = GgufCase::new("deepseekv3", deepseek_config, deepseek_tensors());
    let g = c.convert("ds.gguf", "test-pre", &[]);
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
    let want = stacked(&c.tensors, 4, |x| {
        format!("model.layers.1.mlp.experts.{x}.down_proj.weight")
    });
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
    let mut rng = Rng(37);
    let mut tensors = dense_layers(&mut rng, DType::BF16, 64, 32, &[]);
    for l in 0..2 {
        let biases = [
            ("self_attn.q_proj.bias", [64u64]),
            ("self_attn.k_proj.bias", [32]),
            ("self_attn.v_proj.bias", [32]),
        ];
        tensors.extend(layer(&mut rng, l, DType::BF16, biases));
    }
    let c = GgufCase::new("qwen2", |_| {}, tensors);
    let tensors = &c.tensors;
    let g = c.convert("q2.gguf", "test-pre", &[]);
    assert_hparams(&g, "qwen2", 32, &[]);
    assert_tokenizer(&g);
    let (sh, ty, data) = g.tensor("blk.1.attn_q.bias");
    assert_eq!((sh.as_slice(), *ty), (&[64u64][..], 0));
    assert_eq!(
        data,
        &bf16_to_f32_bytes(src(tensors, "model.layers.1.self_attn.q_proj.bias"))
    );
    assert_eq!(
        g.tensor("blk.1.attn_q.weight").2,
        src(tensors, "model.layers.1.self_attn.q_proj.weight")
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
    let edit = |c: &mut Json| {
        let q = c["quantization_config"].clone();
        deepseek_config(c);
        c["quantization_config"] = q;
    };
    let c = GgufCase::new("deepseekv3", edit, tensors);
    let g = c.convert("fp8.gguf", "test-pre", &["--memory-budget", "16MiB"]);
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
    let c = GgufCase::new("deepseekv3", deepseek_config, tensors);
    let out_dir = c.path("new/dir");
    let out = out_dir.join("x.gguf");
    let extra = ["--vocab-pre", "test-pre", "--split-max-size", "20K"];
    let err = fails(&gguf_args(&c.model, &out, &extra));
    assert!(err.contains("q_a_proj") && err.contains("NaN"), "{err}");
    assert!(!c.path("new").exists(), "{:?}", listing(&out_dir));
}

#[test]
fn mixtral_permutes_q_k_and_stacks_w1_w2_w3() {
    let mut rng = Rng(43);
    let mut tensors = head(&mut rng, DType::BF16);
    for l in 0..2 {
        let router = [("block_sparse_moe.gate.weight", vec![4, 64])];
        tensors.extend(attention_layer(&mut rng, l, router));
        let experts = (0..4).flat_map(|x| {
            [("w1", [128u64, 64]), ("w2", [64, 128]), ("w3", [128, 64])]
                .map(|(w, sh)| (format!("block_sparse_moe.experts.{x}.{w}.weight"), sh))
        });
        tensors.extend(layer(&mut rng, l, DType::BF16, experts));
    }
    let edit = |c: &mut Json| {
        c["num_key_value_heads"] = 2.into();
        c["num_local_experts"] = 4.into();
    };
    let c = GgufCase::new("mixtral", edit, tensors);
    let tensors = &c.tensors;
    let g = c.convert("mx.gguf", "test-pre", &[]);
    assert_eq!(g.str("general.architecture"), "llama");
    assert_eq!(g.u32("llama.expert_count"), 4);
    for l in 0..2 {
        let h = |s: &str| format!("model.layers.{l}.{s}");
        assert_eq!(
            g.tensor(&format!("blk.{l}.attn_k.weight")).2,
            permute(src(tensors, &h("self_attn.k_proj.weight")), 32, 2)
        );
        for (w, gg) in [
            ("w1", "ffn_gate_exps"),
            ("w2", "ffn_down_exps"),
            ("w3", "ffn_up_exps"),
        ] {
            let want = stacked(tensors, 4, |x| {
                h(&format!("block_sparse_moe.experts.{x}.{w}.weight"))
            });
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

/// The BPE tokenizer fixture with a reference case's added tokens and `tokenizer_config`
/// entries.
fn write_bpe_tokenizer(model: &Path, spec: &Json) {
    let write_json = |name: &str, v: &Json| {
        std::fs::write(model.join(name), serde_json::to_vec(v).unwrap()).unwrap()
    };
    let mut tok = read_json(&gguf_fixture("tokenizer/tokenizer.json"));
    for a in spec["added_tokens"].as_array().unwrap() {
        tok["added_tokens"].as_array_mut().unwrap().push(a.clone());
    }
    write_json("tokenizer.json", &tok);
    let mut tc = read_json(&gguf_fixture("tokenizer/tokenizer_config.json"));
    tc["tokenizer_class"] = "PreTrainedTokenizerFast".into();
    for (k, v) in spec["tokenizer_config"].as_object().unwrap() {
        tc[k] = v.clone();
    }
    write_json("tokenizer_config.json", &tc);
}

/// The model a `reference/*.json` case describes (config, tokenizer files, formula tensors),
/// written to `model` (created).
fn build_reference_model(spec: &Json, model: &Path) {
    std::fs::create_dir(model).unwrap();
    let write_json = |name: &str, v: &Json| {
        std::fs::write(model.join(name), serde_json::to_vec(v).unwrap()).unwrap()
    };
    write_json("config.json", &spec["config"]);
    if let Some(fx) = spec["tokenizer"].as_str() {
        // A SentencePiece model: its tokenizer folder as the converter read it.
        for f in [
            "tokenizer.model",
            "tokenizer.json",
            "tokenizer_config.json",
            "added_tokens.json",
        ] {
            let src = gguf_fixture(fx).join(f);
            if f != "added_tokens.json" || src.exists() {
                std::fs::copy(src, model.join(f)).unwrap();
            }
        }
    } else {
        write_bpe_tokenizer(model, spec);
    }
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
}

/// Every `reference/*.json` (bench/gguf_reference.py with GGUF_REFERENCE_FIXTURES): the same
/// model converted by tftf has convert_hf_to_gguf.py's KVs (all but the naming fields it derives from the folder) and
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
    assert!(cases.len() >= 46, "{cases:?}");
    let naming = [
        "general.name",
        "general.basename",
        "general.finetune",
        "general.version",
        "general.quantized_by",
    ];
    for case in cases {
        let spec: Json = serde_json::from_slice(&std::fs::read(&case).unwrap()).unwrap();
        let what = case.file_name().unwrap().to_string_lossy().to_string();
        let d = tmp();
        let model = d.path().join("model");
        build_reference_model(&spec, &model);
        let outtype = spec["outtype"].as_str().unwrap();
        let g = to_gguf(
            &model,
            &d.path().join("out.gguf"),
            "test-pre",
            &["--outtype", outtype],
        );
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
        let order = json_strs(&spec["order"]);
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

/// A k-quant mix goes through Phi-3's fused tensors: the LongRoPE reference model (Phi-3.5)
/// as `q4_k_m` keeps its rope factors F32 and quantises `attn_qkv` and the fused `ffn_up` (rows
/// of 64 do not fill a 256-block: their 32-block fallbacks), with the mix's file type.
#[test]
fn phi3_longrope_converts_to_a_k_quant_mix() {
    let spec = read_json(&gguf_fixture("reference/phi3.5.bf16.json"));
    let d = tmp();
    let model = d.path().join("model");
    build_reference_model(&spec, &model);
    let g = to_gguf(
        &model,
        &d.path().join("out.gguf"),
        "test-pre",
        &["--outtype", "q4_k_m"],
    );
    for f in ["rope_factors_long.weight", "rope_factors_short.weight"] {
        assert_eq!((&g.tensors[f].0, g.tensors[f].1), (&vec![8], 0), "{f}");
    }
    for (name, shape) in [
        ("blk.0.attn_qkv.weight", [192, 64]),
        ("blk.0.ffn_up.weight", [256, 64]),
    ] {
        let (sh, ty, _) = &g.tensors[name];
        assert_eq!(sh, &shape.to_vec(), "{name}");
        assert!([6, 8].contains(ty), "{name}: type {ty}");
    }
    let ftype = g
        .kvs
        .iter()
        .find(|(k, _)| k == "general.file_type")
        .unwrap();
    assert_eq!(ftype.1[4..], 15u32.to_le_bytes(), "Q4_K_M");
}

#[test]
fn json_progress_names_every_split_file_and_ends_with_the_report() {
    let c = GgufCase::dense(11, "llama3");
    let out = c.path("out/x.gguf");
    let extra = [
        "--vocab-pre",
        "test-pre",
        "--split-max-size",
        "20K",
        "--progress",
        "json",
        "-q",
    ];
    let o = tftf_ok(&gguf_args(&c.model, &out, &extra));
    let lines: Vec<Json> = stderr(&o)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{l}: {e}")))
        .collect();
    let files = listing(&c.path("out"));
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

/// Issue 25: a Llama-family `tokenizer_config.json` with `add_prefix_space` gives
/// `tokenizer.ggml.add_space_prefix` (a bool) before the other tokenizer KVs, a Qwen one does
/// not, and a value that is not a boolean is refused naming the file.
#[test]
fn add_prefix_space_becomes_add_space_prefix_for_llama_tokenizers_only() {
    for (cfg, value, want) in [
        ("llama3", Json::Bool(true), Some(1u8)),
        ("qwen3", Json::Bool(true), None),
        ("llama3", Json::Null, None),
    ] {
        let c = GgufCase::dense(12, cfg);
        let tc_path = c.model.join("tokenizer_config.json");
        let mut tc = read_json(&tc_path);
        tc["add_prefix_space"] = value;
        std::fs::write(&tc_path, serde_json::to_vec(&tc).unwrap()).unwrap();
        let g = to_gguf(&c.model, &c.path("o.gguf"), "test-pre", &[]);
        let kv = g.kv("tokenizer.ggml.add_space_prefix");
        assert_eq!(
            kv.map(|v| (v[..4].to_vec(), v[4])),
            want.map(|b| (7u32.to_le_bytes().to_vec(), b)),
            "{cfg}"
        );
        if want.is_some() {
            let keys: Vec<&str> = g.kvs.iter().map(|(k, _)| k.as_str()).collect();
            let at = keys
                .iter()
                .position(|k| *k == "tokenizer.ggml.add_space_prefix")
                .unwrap();
            assert_eq!(keys[at + 1], "tokenizer.ggml.model");
        }
    }
    let c = GgufCase::dense(12, "llama3");
    let tc_path = c.model.join("tokenizer_config.json");
    let mut tc = read_json(&tc_path);
    tc["add_prefix_space"] = "yes".into();
    std::fs::write(&tc_path, serde_json::to_vec(&tc).unwrap()).unwrap();
    let out = c.path("o.gguf");
    let o = tftf(&gguf_args(
        &c.model,
        &out,
        &["--vocab-pre", "test-pre", "-q"],
    ));
    assert!(!o.status.success());
    let err = stderr(&o);
    assert!(
        err.contains("tokenizer_config.json") && err.contains("`add_prefix_space` is \"yes\""),
        "{err}"
    );
    assert!(!out.exists());
}
