//! `tftf gguf` on quantised checkpoints (issue #25, items 3 and bad input): FP8 (DeepSeek-V3's
//! 128×128 blocks), NVFP4, MXFP4, packed-int and GPTQ weights dequantised on the fly into any `--outtype`,
//! the same bytes as `tftf dequant --dtype f32` then `tftf gguf`; what `--outtype auto` picks
//! per input kind; and the refusals, each before any output exists.

mod common;

use std::path::{Path, PathBuf};

use common::gguf::*;
use common::*;
use serde_json::{json, Value as Json};
use tftf::format::dtype::DType;

/// A quantisation of a `[rows, cols]` weight `name` (its `.weight` name): the tensors stored.
type Scheme = fn(&mut Rng, &str, u64, u64) -> Vec<T>;

/// E4M3 codes without NaN (`0x7F`, `0xFF`).
fn e4m3_codes(rng: &mut Rng, n: u64) -> Vec<u8> {
    rng.bytes(n as usize)
        .into_iter()
        .map(|c| if c & 0x7F == 0x7F { 0x3C } else { c })
        .collect()
}

fn f32_bytes(v: impl IntoIterator<Item = f32>) -> Vec<u8> {
    v.into_iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// DeepSeek-V3's FP8: E4M3 codes, `weight_scale_inv` F32 per 128×128 block.
fn fp8_block(rng: &mut Rng, name: &str, rows: u64, cols: u64) -> Vec<T> {
    let grid = [rows.div_ceil(128), cols.div_ceil(128)];
    let scales = (0..grid[0] * grid[1]).map(|k| 0.001 * (k as f32 + 1.5));
    vec![
        t(
            name,
            DType::F8_E4M3,
            &[rows, cols],
            e4m3_codes(rng, rows * cols),
        ),
        t(
            &format!("{name}_scale_inv"),
            DType::F32,
            &grid,
            f32_bytes(scales),
        ),
    ]
}

/// Packed E2M1 pairs and one `scale_dtype` scale per `group` (`scale` draws each).
fn fp4_packed(
    rng: &mut Rng,
    base: &str,
    (rows, cols): (u64, u64),
    group: u64,
    scale_dtype: DType,
    scale: fn(u32) -> u8,
) -> Vec<T> {
    let scales: Vec<u8> = (0..rows * cols / group)
        .map(|_| scale(rng.next_u32()))
        .collect();
    vec![
        t(
            &format!("{base}.weight_packed"),
            DType::U8,
            &[rows, cols / 2],
            rng.bytes((rows * cols / 2) as usize),
        ),
        t(
            &format!("{base}.weight_scale"),
            scale_dtype,
            &[rows, cols / group],
            scales,
        ),
    ]
}

/// compressed-tensors NVFP4: packed E2M1 pairs, E4M3 scales per 16 (0.25 to 1), a global
/// scale that divides.
fn nvfp4(rng: &mut Rng, name: &str, rows: u64, cols: u64) -> Vec<T> {
    let base = name.strip_suffix(".weight").unwrap();
    let mut ts = fp4_packed(rng, base, (rows, cols), 16, DType::F8_E4M3, |r| {
        0x28 + (r % 16) as u8
    });
    ts.push(t(
        &format!("{base}.weight_global_scale"),
        DType::F32,
        &[1],
        f32_bytes([48.0]),
    ));
    ts
}

/// compressed-tensors pack-quantized ints of `bits`, symmetric, BF16 scales per 128.
fn packed_int(rng: &mut Rng, name: &str, rows: u64, cols: u64, bits: u64) -> Vec<T> {
    let base = name.strip_suffix(".weight").unwrap();
    let words = cols * bits / 32;
    let scales: Vec<u8> = (0..rows * cols / 128)
        .flat_map(|k| half::bf16::from_f32(0.002 * (1 + k % 7) as f32).to_le_bytes())
        .collect();
    let shape: Vec<u8> = [rows as i64, cols as i64]
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect();
    vec![
        t(
            &format!("{base}.weight_packed"),
            DType::I32,
            &[rows, words],
            rng.bytes((rows * words * 4) as usize),
        ),
        t(
            &format!("{base}.weight_scale"),
            DType::BF16,
            &[rows, cols / 128],
            scales,
        ),
        t(&format!("{base}.weight_shape"), DType::I64, &[2], shape),
    ]
}

/// compressed-tensors MXFP4: packed E2M1 pairs, E8M0 exponents per 32 (2^-8 to 2^-1).
fn mxfp4(rng: &mut Rng, name: &str, rows: u64, cols: u64) -> Vec<T> {
    let base = name.strip_suffix(".weight").unwrap();
    fp4_packed(rng, base, (rows, cols), 32, DType::U8, |r| {
        119 + (r % 8) as u8
    })
}

/// AutoGPTQ 4-bit (v1 zero points, no act-order): `qweight` `[in/8, out]`, `qzeros`
/// `[in/128, out/8]`, F16 `scales` `[in/128, out]`.
fn gptq4(rng: &mut Rng, name: &str, rows: u64, cols: u64) -> Vec<T> {
    let base = name.strip_suffix(".weight").unwrap();
    let groups = cols / 128;
    let scales: Vec<u8> = (0..groups * rows)
        .flat_map(|k| half::f16::from_f32(0.002 * (1 + k % 5) as f32).to_le_bytes())
        .collect();
    vec![
        t(
            &format!("{base}.qweight"),
            DType::I32,
            &[cols / 8, rows],
            rng.bytes((cols / 8 * rows * 4) as usize),
        ),
        t(
            &format!("{base}.qzeros"),
            DType::I32,
            &[groups, rows / 8],
            rng.bytes((groups * rows / 8 * 4) as usize),
        ),
        t(
            &format!("{base}.scales"),
            DType::F16,
            &[groups, rows],
            scales,
        ),
    ]
}

fn int4(rng: &mut Rng, name: &str, rows: u64, cols: u64) -> Vec<T> {
    packed_int(rng, name, rows, cols, 4)
}

fn int8(rng: &mut Rng, name: &str, rows: u64, cols: u64) -> Vec<T> {
    packed_int(rng, name, rows, cols, 8)
}

/// `quantization_config` of each scheme, as the libraries write it.
fn quant_config(scheme: &str) -> Json {
    let ct = |format: &str, weights: Json| {
        json!({
            "quant_method": "compressed-tensors",
            "format": format,
            "config_groups": {"group_0": {"targets": ["Linear"], "format": format, "weights": weights}},
        })
    };
    let int = |bits: u64| json!({"num_bits": bits, "type": "int", "symmetric": true, "group_size": 128, "strategy": "group"});
    match scheme {
        "fp8" => json!({
            "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
            "weight_block_size": [128, 128],
        }),
        "nvfp4" => ct(
            "nvfp4-pack-quantized",
            json!({"num_bits": 4, "type": "float", "group_size": 16, "strategy": "tensor_group"}),
        ),
        "mxfp4" => ct(
            "mxfp4-pack-quantized",
            json!({"num_bits": 4, "type": "float", "group_size": 32, "strategy": "group"}),
        ),
        "gptq" => json!({
            "quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": false, "sym": true,
        }),
        "int4" => ct("pack-quantized", int(4)),
        "int8" => ct("pack-quantized", int(8)),
        other => panic!("no scheme {other}"),
    }
}

/// A two-layer Llama with 256-wide rows (the `gguf_quant/llama256` config: hidden 256, MLP
/// 512, 4 heads, 2 KV heads) in `root/model`, its attention and MLP weights stored by
/// `scheme`, embeddings, head and norms BF16.
fn llama256(root: &Path, scheme: &str, quantise: Scheme) -> PathBuf {
    llama256_without(root, scheme, quantise, "")
}

/// [`llama256`] without the tensor `drop`.
fn llama256_without(root: &Path, scheme: &str, quantise: Scheme, drop: &str) -> PathBuf {
    let model = root.join("model");
    std::fs::create_dir_all(&model).unwrap();
    let mut cfg = read_json(&fixture("gguf_quant/llama256/config.json"));
    cfg["quantization_config"] = quant_config(scheme);
    std::fs::write(model.join("config.json"), cfg.to_string()).unwrap();
    for f in ["tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(gguf_fixture(&format!("tokenizer/{f}")), model.join(f)).unwrap();
    }
    let mut rng = Rng(2025);
    let mut tensors = head_of(&mut rng, DType::BF16, 256);
    for l in 0..2 {
        let p = |n: &str| format!("model.layers.{l}.{n}");
        for n in ["input_layernorm.weight", "post_attention_layernorm.weight"] {
            tensors.push(rand_t(&mut rng, &p(n), DType::BF16, &[256]));
        }
        for (n, rows, cols) in [
            ("self_attn.q_proj.weight", 256, 256),
            ("self_attn.k_proj.weight", 128, 256),
            ("self_attn.v_proj.weight", 128, 256),
            ("self_attn.o_proj.weight", 256, 256),
            ("mlp.gate_proj.weight", 512, 256),
            ("mlp.up_proj.weight", 512, 256),
            ("mlp.down_proj.weight", 256, 512),
        ] {
            tensors.extend(quantise(&mut rng, &p(n), rows, cols));
        }
    }
    tensors.retain(|t| t.0 != drop);
    write_file(&model.join("model.safetensors"), &tensors);
    model
}

/// `tftf gguf MODEL -o OUT --outtype TYPE` in one pass (the smallest budget, on 3
/// threads), and `tftf dequant --dtype f32` into a folder of the same name then `tftf gguf`:
/// returns both files' bytes.
fn one_pass_and_two(model: &Path, outtype: &str, root: &Path) -> (Vec<u8>, Vec<u8>) {
    let one = root.join("one.gguf");
    let chunked = [
        "--outtype",
        outtype,
        "--vocab-pre",
        "test-pre",
        "--memory-budget",
        "16MiB",
        "--threads",
        "3",
        "-q",
    ];
    ok(&tftf(&gguf_args(model, &one, &chunked)));
    // The same folder name: general.name comes from it.
    let deq = root.join("dequantised").join(model.file_name().unwrap());
    convert_ok("dequant", model, &deq, &["--dtype", "f32", "-q"]);
    let two = root.join("two.gguf");
    let args = ["--outtype", outtype, "--vocab-pre", "test-pre", "-q"];
    ok(&tftf(&gguf_args(&deq, &two, &args)));
    (std::fs::read(&one).unwrap(), std::fs::read(&two).unwrap())
}

/// Asserts the one-pass file equals the two-pass one byte for byte, holds no scale or packed
/// tensor, and has a tensor of ggml type `want_ty` (the k-quant really ran).
fn assert_same_file(what: &str, root: &Path, (one, two): (Vec<u8>, Vec<u8>), want_ty: u32) {
    assert!(
        one == two,
        "{what}: one pass differs from dequant then gguf"
    );
    let g = parse(&root.join("one.gguf"));
    assert!(
        g.order
            .iter()
            .all(|n| !n.contains("scale") && !n.contains("packed")),
        "{what}: {:?}",
        g.order
    );
    assert!(
        g.tensors.values().any(|(_, ty, _)| *ty == want_ty),
        "{what}: no tensor of type {want_ty}"
    );
}

#[test]
fn deepseek_v3_fp8_to_q4_k_m_equals_dequant_then_gguf() {
    let mut rng = Rng(7);
    let mut tensors = deepseek_tensors();
    // Every matrix of layers 0 and 1 in FP8 with its block scales, kv_b and the experts
    // included (their stack and split read decoded rows).
    let quantised: Vec<T> = tensors
        .iter()
        .filter(|t| {
            t.2.len() == 2
                && t.0.starts_with("model.layers.")
                && !t.0.starts_with("model.layers.2.")
        })
        .filter(|t| !t.0.contains("mlp.gate.weight"))
        .flat_map(|t| fp8_block(&mut rng, &t.0, t.2[0], t.2[1]))
        .collect();
    tensors.retain(|t| !quantised.iter().any(|q| q.0 == t.0));
    tensors.extend(quantised);
    let edit = |c: &mut Json| {
        deepseek_config(c);
        c["quantization_config"] = quant_config("fp8");
    };
    let c = GgufCase::new("deepseekv3", edit, tensors);
    for outtype in ["q4_k_m", "q8_0", "bf16"] {
        let root = c.path(outtype);
        std::fs::create_dir(&root).unwrap();
        let files = one_pass_and_two(&c.model, outtype, &root);
        let want_ty = match outtype {
            "q8_0" => 8,
            "bf16" => 30,
            // 64-wide rows: Q4_K falls back to Q5_0, as llama-quantize does.
            _ => 6,
        };
        assert_same_file(outtype, &root, files, want_ty);
    }
}

#[test]
fn fp8_fp4_int_and_gptq_weights_to_k_quants_equal_dequant_then_gguf() {
    let cases: [(&str, Scheme, &str); 6] = [
        ("fp8", fp8_block, "q4_k_m"),
        ("nvfp4", nvfp4, "q4_k_m"),
        ("mxfp4", mxfp4, "q4_k_m"),
        ("gptq", gptq4, "q6_k"),
        ("int4", int4, "q5_k_s"),
        ("int8", int8, "q6_k"),
    ];
    for (scheme, quantise, outtype) in cases {
        let d = tmp();
        let model = llama256(d.path(), scheme, quantise);
        let files = one_pass_and_two(&model, outtype, d.path());
        let want_ty = match outtype {
            "q4_k_m" => 12,
            "q5_k_s" => 13,
            _ => 14,
        };
        assert_same_file(scheme, d.path(), files, want_ty);
    }
}

/// The ggml type of every tensor of `g`, by name.
fn types(g: &Gguf) -> std::collections::BTreeMap<String, u32> {
    g.tensors
        .iter()
        .map(|(n, (_, ty, _))| (n.clone(), *ty))
        .collect()
}

/// `--outtype auto` on each quantised kind: FP8 weights become BF16, 8-bit ints and FP4 Q8_0,
/// 4-bit ints (pack-quantized and GPTQ) Q4_1, with the bytes the dequantised checkpoint gets
/// at that type; the BF16 embeddings and head stay BF16, norms F32; `general.file_type` names
/// the weights' type.
#[test]
fn auto_keeps_each_quantised_kind_close_to_how_it_was_stored() {
    // (scheme, weight type id, file type, the outtype whose weights are the same bytes)
    let cases: [(&str, Scheme, u32, u32, &str); 6] = [
        ("fp8", fp8_block, 30, 32, "bf16"),
        ("int8", int8, 8, 7, "q8_0"),
        ("nvfp4", nvfp4, 8, 7, "q8_0"),
        ("mxfp4", mxfp4, 8, 7, "q8_0"),
        ("int4", int4, 3, 3, "q4_1"),
        ("gptq", gptq4, 3, 3, "q4_1"),
    ];
    for (scheme, quantise, weight_ty, file_type, same_as) in cases {
        let d = tmp();
        let model = llama256(d.path(), scheme, quantise);
        let (one, _) = one_pass_and_two(&model, "auto", d.path());
        let g = parse(&d.path().join("one.gguf"));
        assert_eq!(g.u32("general.file_type"), file_type, "{scheme}");
        for (name, ty) in types(&g) {
            let want = if name.ends_with("norm.weight") {
                0
            } else if name.starts_with("blk.") {
                weight_ty
            } else {
                30
            };
            assert_eq!(ty, want, "{scheme}: {name}");
        }
        // The dequantised checkpoint at that type: the same weight bytes.
        let deq = d.path().join("dequantised/model");
        let other = d.path().join("other.gguf");
        let args = ["--outtype", same_as, "--vocab-pre", "test-pre", "-q"];
        ok(&tftf(&gguf_args(&deq, &other, &args)));
        let o = parse(&other);
        for name in g.order.iter().filter(|n| n.starts_with("blk.")) {
            assert_eq!(g.tensor(name), o.tensor(name), "{scheme}: {name}");
        }
        if scheme == "fp8" {
            // Every tensor was BF16 or FP8: the whole file is the dequantised one's at bf16.
            assert!(one == std::fs::read(&other).unwrap(), "fp8 auto != bf16");
        }
    }
}

/// An unquantised checkpoint keeps the converter's `auto`: BF16 weights give a BF16 file,
/// F32 ones an F16 file (norms F32 in both).
#[test]
fn auto_on_an_unquantised_checkpoint_is_the_converters() {
    for (dtype, file_type, weight_ty) in [(DType::BF16, 32, 30), (DType::F32, 1, 1)] {
        let (q, kv) = attention_rows("llama3");
        let tensors = dense_layers(&mut Rng(5), dtype, q, kv, &[]);
        let c = GgufCase::new("llama3", |_| {}, tensors);
        let g = c.convert("a.gguf", "test-pre", &[]);
        assert_eq!(g.u32("general.file_type"), file_type, "{dtype}");
        assert_eq!(g.tensor("blk.0.attn_q.weight").1, weight_ty, "{dtype}");
        assert_eq!(g.tensor("blk.0.attn_norm.weight").1, 0, "{dtype}");
    }
}

/// Runs `tftf gguf` expecting failure: asserts stderr holds every part of `want` and no
/// output (file or temporary) is left in `out`'s folder.
fn refused(model: &Path, out: &Path, extra: &[&str], want: &[&str]) {
    let args = [extra, &["--vocab-pre", "test-pre", "-q"]].concat();
    let o = tftf(&gguf_args(model, out, &args));
    let e = stderr(&o);
    assert!(!o.status.success(), "{extra:?} succeeded");
    for w in want {
        assert!(e.contains(w), "{extra:?}: `{w}` not in: {e}");
    }
    let left = listing(out.parent().unwrap());
    assert!(
        left.iter().all(|n| !n.contains(".gguf")),
        "{extra:?}: left {left:?}"
    );
}

/// A temporary directory with the model `make` builds in it and the path of an output whose
/// directory exists, for [`refused`] to check that nothing was written there.
fn refusal_case(make: impl FnOnce(&Path) -> PathBuf) -> (tempfile::TempDir, PathBuf, PathBuf) {
    let d = tmp();
    let model = make(d.path());
    let out = d.path().join("out/x.gguf");
    std::fs::create_dir_all(out.parent().unwrap()).unwrap();
    (d, model, out)
}

/// llama-quantize refuses IQ2/IQ1 mixes and Q2_K_S without an importance matrix; so does
/// tftf, naming the first tensor and its type, before any output.
#[test]
fn a_type_that_needs_an_imatrix_is_refused_without_one() {
    let (_d, model, out) = refusal_case(|root| llama256(root, "int4", int4));
    for (mix, ty) in [
        ("q2_k_s", "Q2_K"),
        ("iq2_xxs", "IQ2_XXS"),
        ("iq1_m", "IQ1_M"),
    ] {
        let want = [
            &format!("--outtype {mix}: `blk.")[..],
            &format!(" would be {ty}, which needs an importance matrix (--imatrix FILE); llama-quantize refuses it without one"),
        ];
        refused(&model, &out, &["--outtype", mix], &want);
    }
}

/// A legacy `.dat` importance matrix of `entries` (name, values), one call each.
fn imatrix_dat(entries: &[(String, usize)]) -> Vec<u8> {
    let mut b = (entries.len() as i32).to_le_bytes().to_vec();
    for (name, n) in entries {
        b.extend((name.len() as i32).to_le_bytes());
        b.extend(name.as_bytes());
        b.extend(1i32.to_le_bytes());
        b.extend((*n as i32).to_le_bytes());
        b.extend((0..*n).flat_map(|k| (1.0 + k as f32 / 64.0).to_le_bytes()));
    }
    b
}

/// An imatrix with entries for every tensor but one that needs them (Q2_K in Q2_K_S):
/// refused naming the file, the tensor and the type, as llama-quantize bails out; with the
/// entry present the same file converts.
#[test]
fn an_imatrix_without_an_entry_a_tensor_needs_is_refused() {
    let (d, model, out) = refusal_case(|root| llama256(root, "int4", int4));
    let mut entries: Vec<(String, usize)> = Vec::new();
    for l in 0..2 {
        for (n, cols) in [
            ("attn_q", 256),
            ("attn_k", 256),
            ("attn_v", 256),
            ("attn_output", 256),
            ("ffn_gate", 256),
            ("ffn_up", 256),
            ("ffn_down", 512),
        ] {
            entries.push((format!("blk.{l}.{n}.weight"), cols));
        }
    }
    let full = d.path().join("full.dat");
    std::fs::write(&full, imatrix_dat(&entries)).unwrap();
    let missing: Vec<(String, usize)> = entries
        .iter()
        .filter(|e| e.0 != "blk.1.ffn_up.weight")
        .cloned()
        .collect();
    let part = d.path().join("part.dat");
    std::fs::write(&part, imatrix_dat(&missing)).unwrap();
    let want = [
        "part.dat",
        "no entry for `blk.1.ffn_up.weight`, which --outtype q2_k_s makes Q2_K",
    ];
    refused(
        &model,
        &out,
        &["--outtype", "q2_k_s", "--imatrix", s(&part)],
        &want,
    );
    // --exclude-weights that removes a needed entry is the same refusal.
    let want = ["full.dat", "no entry for `blk.0.ffn_up.weight`"];
    let args = [
        "--outtype",
        "q2_k_s",
        "--imatrix",
        s(&full),
        "--exclude-weights",
        "ffn_up",
    ];
    refused(&model, &out, &args, &want);
    let args = ["--outtype", "q2_k_s", "--imatrix", s(&full)];
    let g = to_gguf(&model, &out, "test-pre", &args);
    assert_eq!(g.tensor("blk.1.ffn_up.weight").1, 10);
}

/// A tensor whose rows no block type of the mix divides (40 columns) is written as F16, as
/// llama-quantize writes it, and a warning names it even with `-q`.
#[test]
fn rows_no_block_type_fits_are_f16_with_a_warning() {
    let (q, kv) = attention_rows("llama3");
    let tensors = dense_layers_mlp(&mut Rng(9), DType::BF16, q, kv, 40, &[]);
    let c = GgufCase::new(
        "llama3",
        |cfg| cfg["intermediate_size"] = 40.into(),
        tensors,
    );
    let out = c.path("x.gguf");
    let args = ["--outtype", "q4_k_m", "--vocab-pre", "test-pre", "-q"];
    let o = tftf(&gguf_args(&c.model, &out, &args));
    ok(&o);
    let e = stderr(&o);
    assert!(
        e.contains("warning: ") && e.contains("--outtype q4_k_m: 2 tensor(s) have rows that no block type divides and are written as F16, as llama-quantize does: `blk.0.ffn_down.weight` (rows of 40), `blk.1.ffn_down.weight` (rows of 40)"),
        "{e}"
    );
    assert_eq!(parse(&out).tensor("blk.0.ffn_down.weight").1, 1);
}

/// Quantised weights missing what decodes them are refused naming the file and tensor,
/// before any output: an NVFP4 weight without its global scale, a packed-int weight without
/// its shape.
#[test]
fn a_quantised_weight_missing_its_scales_is_refused_before_any_output() {
    let cases: [(&str, Scheme, &str, &str); 2] = [
        (
            "nvfp4",
            nvfp4,
            "model.layers.0.self_attn.q_proj.weight_global_scale",
            "`model.layers.0.self_attn.q_proj.weight_global_scale`",
        ),
        (
            "int4",
            int4,
            "model.layers.1.mlp.down_proj.weight_shape",
            "`model.layers.1.mlp.down_proj.weight_shape`",
        ),
    ];
    for (scheme, quantise, drop, want) in cases {
        let (_d, model, out) = refusal_case(|root| llama256_without(root, scheme, quantise, drop));
        refused(
            &model,
            &out,
            &["--outtype", "q4_k_m"],
            &["model.safetensors", want],
        );
    }
}
