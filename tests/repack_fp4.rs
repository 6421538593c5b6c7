#![allow(clippy::needless_range_loop)] // index loops keep the reference code close to the formulas
//! `repack-fp4` on a synthetic DeepSeek-V4-style checkpoint: MXFP4 experts to NVFP4 (bytes kept,
//! exactness checked by decoding), E4M3 Engram tables to E2M1, everything else untouched.

mod common;

use common::*;
use tftf::format::dtype::DType;
use tftf::ops::fp8::codec::e4m3_to_f32;

const E2M1: [f64; 8] = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0];

fn e2m1(n: u8) -> f64 {
    let v = E2M1[(n & 7) as usize];
    if n & 8 != 0 {
        -v
    } else {
        v
    }
}

/// Nearest E2M1 code by brute force, ties to the even index, saturating.
fn nearest_e2m1(x: f64) -> u8 {
    let a = x.abs();
    let mut best = 0usize;
    for i in 1..8 {
        let (d, db) = ((E2M1[i] - a).abs(), (E2M1[best] - a).abs());
        if d < db || (d == db && i % 2 == 0) {
            best = i;
        }
    }
    best as u8 | if x.is_sign_negative() { 8 } else { 0 }
}

/// Packed nibbles with a controlled mix of zero blocks; rows x (cols/2) bytes.
fn nibbles(rng: &mut Rng, rows: usize, half: usize, zero_blocks: &[(usize, usize)]) -> Vec<u8> {
    let mut v: Vec<u8> = (0..rows * half)
        .map(|_| rng.next_u32() as u8 | 0x01)
        .collect();
    for &(r, b) in zero_blocks {
        for x in &mut v[r * half + b * 16..r * half + (b + 1) * 16] {
            *x &= 0x88; // ±0 nibbles
        }
    }
    v
}

struct V4 {
    experts: Vec<(String, Vec<u8>, Vec<u8>)>, // (prefix.proj, weight, scale)
    table: Vec<u8>,
    table_scale: Vec<u8>,
    attn: Vec<u8>,
}

const ROWS: usize = 64;
const IN: usize = 128; // 4 MXFP4 blocks per row
const T_ROWS: usize = 300;
const T_COLS: usize = 64;

fn v4_model(dir: &std::path::Path) -> V4 {
    let mut rng = Rng(77);
    let mut experts = Vec::new();
    let mut shard1 = Vec::new();
    for e in 0..2 {
        for proj in ["w1", "w2", "w3"] {
            let prefix = format!("layers.0.ffn.experts.{e}.{proj}");
            let zero = if e == 1 { vec![(0, 0), (5, 3)] } else { vec![] };
            let w = nibbles(&mut rng, ROWS, IN / 2, &zero);
            let scale: Vec<u8> = (0..ROWS * IN / 32)
                .map(|i| match (e, i) {
                    // Expert 0: exponents within 10 powers: always exact.
                    (0, _) => 120 + (i % 10) as u8,
                    // Expert 1: a dense cluster, zero blocks at extreme exponents (must not
                    // steer the window) and in w1 two real outliers 30 powers up.
                    (1, 0) => 1,
                    (1, 23) => 250,
                    (1, 7 | 9) if proj == "w1" => 160,
                    _ => 125 + (i % 6) as u8,
                })
                .collect();
            shard1.push(t(
                &format!("{prefix}.weight"),
                DType::I8,
                &[ROWS as u64, (IN / 2) as u64],
                w.clone(),
            ));
            shard1.push(t(
                &format!("{prefix}.scale"),
                DType::F8_E8M0,
                &[ROWS as u64, (IN / 32) as u64],
                scale.clone(),
            ));
            experts.push((prefix, w, scale));
        }
    }
    let table: Vec<u8> = (0..T_ROWS * T_COLS)
        .map(|i| {
            if i % 97 == 0 {
                0
            } else {
                (rng.next_u32() as u8) & 0xFE
            }
        })
        .collect();
    let mut table_scale: Vec<u8> = (0..T_ROWS * T_COLS / 32)
        .map(|i| 110 + (i % 20) as u8)
        .collect();
    table_scale[3] = 0; // 2^-127: the smallest E8M0 scale
    let attn = rng.bytes(32 * 32);
    let shard2 = vec![
        t(
            "layers.0.attn.wq.weight",
            DType::F8_E4M3,
            &[32, 32],
            attn.iter().map(|b| b & 0xFE).collect(),
        ),
        t("layers.0.attn.wq.scale", DType::F8_E8M0, &[1, 1], vec![120]),
        t(
            "layers.0.engram.embed.weight",
            DType::F8_E4M3,
            &[T_ROWS as u64, T_COLS as u64],
            table.clone(),
        ),
        t(
            "layers.0.engram.embed.scale",
            DType::F8_E8M0,
            &[T_ROWS as u64, (T_COLS / 32) as u64],
            table_scale.clone(),
        ),
        t("embed.weight", DType::BF16, &[16, 16], vec![0x3F; 512]),
    ];
    write_sharded(dir, &[shard1, shard2]);
    std::fs::write(
        dir.join("config.json"),
        "{\"model_type\": \"deepseek_v4\", \"expert_dtype\": \"fp4\"}\n",
    )
    .unwrap();
    V4 {
        experts,
        table,
        table_scale,
        attn: attn.iter().map(|b| b & 0xFE).collect(),
    }
}

/// `tftf repack-fp4 -i SRC -o OUT -q ARGS...`, then the output's tensors.
fn repacked(
    src: &std::path::Path,
    out: &std::path::Path,
    args: &[&str],
) -> std::collections::BTreeMap<String, (String, Vec<usize>, Vec<u8>)> {
    converted("repack-fp4", src, out, &[&["-q"], args].concat())
}

#[test]
fn experts_transcode_losslessly_and_engram_requantises_exactly() {
    let (d, src) = tmp_in();
    let m = v4_model(&src);
    let out = d.path().join("out");
    let rep = d.path().join("r.json");
    tftf_ok(&[
        "repack-fp4",
        "--src",
        s(&src),
        "--out",
        s(&out),
        "-q",
        "--report",
        s(&rep),
    ]);
    let got = load_all(&out);
    let r: serde_json::Value = read_json(&rep);
    let reports = r["tensor_reports"].as_array().unwrap();
    let report_of = |name: &str| {
        reports
            .iter()
            .find(|x| x["tensor"] == name)
            .unwrap_or_else(|| panic!("no report for {name}: {r}"))
            .clone()
    };
    let mut g_of = std::collections::HashMap::new();
    for (prefix, w, scale) in &m.experts {
        let wt = &got[&format!("{prefix}.weight")];
        assert_eq!(wt.0, "U8");
        let ws = &got[&format!("{prefix}.weight_scale")];
        assert_eq!(
            (ws.0.as_str(), ws.1.clone()),
            ("F8_E4M3", vec![ROWS, IN / 16])
        );
        let ws2 = &got[&format!("{prefix}.weight_scale_2")];
        assert_eq!((ws2.0.as_str(), ws2.1.len()), ("F32", 0));
        let t2 = f32::from_le_bytes(ws2.2[..4].try_into().unwrap()) as f64;
        let rep = report_of(&format!("{prefix}.weight"));
        let g = rep["g"].as_i64().unwrap() as i32;
        assert_eq!(t2, 2f64.powi(g));
        g_of.insert(prefix.clone(), g);
        // Decode both sides; exact blocks must agree bit for bit, and the count of differing
        // non-zero blocks must be what the report says was re-encoded.
        let mut reencoded = 0;
        for blk in 0..ROWS * IN / 32 {
            let (row, b) = (blk / (IN / 32), blk % (IN / 32));
            let k = scale[blk] as i32 - 127;
            let s_in = 2f64.powi(k);
            let s_out: Vec<f64> = (0..2)
                .map(|h| e4m3_to_f32(ws.2[row * IN / 16 + 2 * b + h]) as f64 * t2)
                .collect();
            let bytes_in = &w[row * IN / 2 + b * 16..row * IN / 2 + (b + 1) * 16];
            let bytes_out = &wt.2[row * IN / 2 + b * 16..row * IN / 2 + (b + 1) * 16];
            let mut same = true;
            for (i, (&x, &y)) in bytes_in.iter().zip(bytes_out).enumerate() {
                let h = i / 8; // first 8 bytes = first 16 elements = first NVFP4 block
                for sh in [0, 4] {
                    let a = e2m1((x >> sh) & 0xF) * s_in;
                    let c = e2m1((y >> sh) & 0xF) * s_out[h];
                    same &= a.to_bits() == c.to_bits() || (a == 0.0 && c == 0.0);
                }
            }
            if !same {
                reencoded += 1;
            } else if bytes_in != bytes_out {
                panic!("{prefix}: block {blk} decodes the same but its bytes changed");
            }
        }
        assert_eq!(
            reencoded,
            rep["reencoded_blocks"].as_u64().unwrap(),
            "{prefix}"
        );
        if prefix.contains("experts.0") {
            assert_eq!(reencoded, 0);
            assert_eq!(&wt.2, w, "exact tensors keep their bytes");
        }
    }
    // w1 and w3 share one tensor scale; the zero blocks at 2^-126 and 2^123 did not move the
    // window, so only w1's two outliers (2^33) were re-encoded.
    assert_eq!(
        g_of["layers.0.ffn.experts.1.w1"],
        g_of["layers.0.ffn.experts.1.w3"]
    );
    assert_eq!(
        report_of("layers.0.ffn.experts.1.w1.weight")["reencoded_blocks"],
        2
    );
    assert_eq!(
        report_of("layers.0.ffn.experts.1.w3.weight")["reencoded_blocks"],
        0
    );
    assert_eq!(
        report_of("layers.0.ffn.experts.1.w2.weight")["reencoded_blocks"],
        0
    );
    assert_eq!(
        report_of("layers.0.ffn.experts.1.w2.weight")["zero_blocks"],
        2
    );

    // Engram: E2M1 codes and E8M0 scales equal an independent reference.
    let tw = &got["layers.0.engram.embed.weight"];
    let ts = &got["layers.0.engram.embed.scale"];
    assert_eq!(
        (tw.0.as_str(), tw.1.clone()),
        ("U8", vec![T_ROWS, T_COLS / 2])
    );
    assert_eq!(
        (ts.0.as_str(), ts.1.clone()),
        ("F8_E8M0", vec![T_ROWS, T_COLS / 32])
    );
    let mut want_codes = vec![0u8; T_ROWS * T_COLS / 2];
    let mut want_scales = vec![0u8; T_ROWS * T_COLS / 32];
    for blk in 0..T_ROWS * T_COLS / 32 {
        let vals: Vec<f64> = (0..32)
            .map(|i| {
                e4m3_to_f32(m.table[blk * 32 + i]) as f64
                    * 2f64.powi(m.table_scale[blk] as i32 - 127)
            })
            .collect();
        let amax = vals.iter().fold(0f64, |a, v| a.max(v.abs()));
        let mut p = -127;
        while amax > 0.0 && 6.0 * 2f64.powi(p) < amax {
            p += 1;
        }
        want_scales[blk] = (p + 127) as u8;
        for i in 0..32 {
            let q = nearest_e2m1(vals[i] / 2f64.powi(p));
            want_codes[blk * 16 + i / 2] |= if i % 2 == 0 { q } else { q << 4 };
        }
    }
    assert_eq!(ts.2, want_scales);
    assert_eq!(tw.2, want_codes);
    let q = report_of("layers.0.engram.embed.weight");
    assert_eq!(q["rows"], T_ROWS as u64);
    let (mean, min) = (
        q["mean_row_cosine"].as_f64().unwrap(),
        q["min_row_cosine"].as_f64().unwrap(),
    );
    assert!(min <= mean && mean <= 1.0 && min > 0.9, "{q}");
    assert!(q["relative_mse"].as_f64().unwrap() > 0.0);

    // Untouched tensors, index and config.
    assert_eq!(got["layers.0.attn.wq.weight"].2, m.attn);
    assert_eq!(got["embed.weight"].2, vec![0x3F; 512]);
    let index: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(out.join("model.safetensors.index.json")).unwrap(),
    )
    .unwrap();
    let mapped: Vec<&String> = index["weight_map"].as_object().unwrap().keys().collect();
    assert_eq!(mapped.len(), got.len());
    assert!(mapped
        .iter()
        .any(|k| k.as_str() == "layers.0.engram.embed.scale"));
    let cfg: serde_json::Value = read_json(&out.join("config.json"));
    assert_eq!(cfg["expert_dtype"], "nvfp4");
    assert_eq!(cfg["engram_dtype"], "fp4");
    assert_eq!(cfg["model_type"], "deepseek_v4");
}

#[test]
fn require_lossless_fails_before_output_and_options_select_work() {
    let (d, src) = tmp_in();
    v4_model(&src);
    let out = d.path().join("out");
    let err = fails(&cmd("repack-fp4", &src, &out, &["--require-lossless"]));
    assert_mentions(
        &err,
        &["`layers.0.ffn.experts.1.w1.weight`", "2 of 256 blocks"],
    );
    assert!(!out.exists());
    // Dry run reports the choice without writing.
    let rep = d.path().join("dry.json");
    convert_ok(
        "repack-fp4",
        &src,
        &out,
        &["--dry-run", "--report", s(&rep)],
    );
    assert!(!out.exists());
    assert!(std::fs::read_to_string(&rep)
        .unwrap()
        .contains("\"reencoded_blocks\": 2"));
    // Keep the experts, only requantise Engram; leave config alone.
    let got = repacked(&src, &out, &["--experts", "keep", "--no-config-update"]);
    assert_eq!(got["layers.0.ffn.experts.0.w1.weight"].0, "I8");
    assert_eq!(got["layers.0.engram.embed.weight"].0, "U8");
    assert_eq!(
        std::fs::read(out.join("config.json")).unwrap(),
        std::fs::read(src.join("config.json")).unwrap()
    );
    // Only the second shard.
    let o2 = d.path().join("o2");
    let got = repacked(
        &src,
        &o2,
        &["--shard-list", "model-00002-of-00002.safetensors"],
    );
    assert!(got.keys().all(|k| !k.contains("experts")));
    assert_eq!(got["layers.0.engram.embed.weight"].0, "U8");
    let o3 = d.path().join("o3");
    let got = repacked(&src, &o3, &["--only-shards", "1", "--engram", "keep"]);
    assert!(got
        .keys()
        .all(|k| !k.contains("engram") && !k.contains("attn")));
    let o4 = d.path().join("o4");
    let r = convert("repack-fp4", &src, &o4, &["--device", "bogus"]);
    assert_eq!(r.status.code(), Some(2), "a usage error");
    assert!(stderr(&r).contains("--device bogus: use auto, cpu, cuda or cuda:N"));
    assert!(!o4.exists());
}

#[test]
fn engram_table_larger_than_the_budget_streams_with_identical_output() {
    let (d, src) = tmp_in();
    let mut rng = Rng(5);
    let (rows, cols) = (6144u64, 4096u64); // 24 MiB of E4M3
    let table: Vec<u8> = (0..rows * cols)
        .map(|_| rng.next_u32() as u8 & 0xFE)
        .collect();
    let scales: Vec<u8> = (0..rows * cols / 32)
        .map(|i| 100 + (i % 40) as u8)
        .collect();
    Model::new()
        .tensor(
            "layers.3.engram.embed.weight",
            DType::F8_E4M3,
            &[rows, cols],
            table,
        )
        .tensor(
            "layers.3.engram.embed.scale",
            DType::F8_E8M0,
            &[rows, cols / 32],
            scales,
        )
        .write(&src);
    let mut files = Vec::new();
    for (i, budget) in ["16MiB", "1GiB"].iter().enumerate() {
        let out = d.path().join(format!("o{i}"));
        let rep = d.path().join(format!("r{i}.json"));
        convert_ok(
            "repack-fp4",
            &src,
            &out,
            &["-q", "--memory-budget", budget, "--report", s(&rep)],
        );
        files.push(std::fs::read(out.join("model.safetensors")).unwrap());
        let r: serde_json::Value = read_json(&rep);
        if i == 0 {
            assert!(r["pool_peak_bytes"].as_u64().unwrap() <= 16 << 20, "{r}");
        }
    }
    assert_eq!(files[0], files[1]);
}

#[test]
fn run_section_repacks() {
    let (d, src) = tmp_in();
    v4_model(&src);
    let out = d.path().join("out.safetensors");
    let got = converted(
        "run",
        &src,
        &out,
        &["-q", "--repack-fp4", "--key-exclude", "embed.weight"],
    );
    assert_eq!(got["layers.0.ffn.experts.0.w1.weight_scale"].0, "F8_E4M3");
    assert_eq!(got["layers.0.engram.embed.weight"].0, "U8");
    assert!(!got.contains_key("embed.weight"));
}

/// Bad inputs found from headers: named errors before any output exists.
#[test]
fn missing_or_misshapen_scales_and_unknown_shards_fail_before_output() {
    let d = tmp();
    let mut rng = Rng(5);
    let expert = |rng: &mut Rng, scale: bool| {
        let mut v = vec![t(
            "layers.0.ffn.experts.0.w1.weight",
            DType::I8,
            &[4, 32],
            rng.bytes(128),
        )];
        if scale {
            v.push(t(
                "layers.0.ffn.experts.0.w1.scale",
                DType::F8_E8M0,
                &[4, 2],
                vec![127; 8],
            ));
        }
        v
    };
    let engram = |rng: &mut Rng, scale_shape: &[u64]| {
        let n: u64 = scale_shape.iter().product();
        vec![
            t(
                "layers.0.engram.embed.weight",
                DType::F8_E4M3,
                &[4, 64],
                rng.bytes(256).iter().map(|b| b & 0x3F).collect(),
            ),
            t(
                "layers.0.engram.embed.scale",
                DType::F8_E8M0,
                scale_shape,
                vec![120; n as usize],
            ),
        ]
    };
    let cases: [(&str, Vec<T>, &str); 3] = [
        (
            "no-expert-scale",
            expert(&mut rng, false),
            "MXFP4 expert weight `layers.0.ffn.experts.0.w1.weight` has no scale (looked for `layers.0.ffn.experts.0.w1.scale`); pass --experts keep",
        ),
        (
            "engram-scale-shape",
            engram(&mut rng, &[4, 3]),
            "scale `layers.0.engram.embed.scale` of `layers.0.engram.embed.weight`: expected F8_E8M0 [4, 2] for a table of 64 columns, got F8_E8M0 [4, 3]",
        ),
        (
            "engram-no-scale",
            engram(&mut rng, &[4, 2])[..1].to_vec(),
            "Engram table `layers.0.engram.embed.weight` has no scale (looked for `layers.0.engram.embed.scale`); pass --engram keep",
        ),
    ];
    for (name, tensors, want) in cases {
        let src = d.path().join(name);
        write_sharded(&src, &[tensors]);
        let out = d.path().join(format!("{name}-out"));
        let err = fails(&cmd("repack-fp4", &src, &out, &[]));
        assert!(err.contains(want), "{name}: {err}");
        assert!(
            err.contains("model-00001-of-00001.safetensors"),
            "{name} names the file: {err}"
        );
        assert!(!out.exists(), "{name}: no output");
    }
    // The keep switches let the same inputs through untouched; with nothing else to convert
    // that takes --allow-empty.
    let src = d.path().join("no-expert-scale");
    let out = d.path().join("kept");
    let keep = cmd("repack-fp4", &src, &out, &["--experts", "keep"]);
    let err = fails(&keep);
    assert!(
        err.contains("repack-fp4 found no MXFP4 expert weight (--expert-pattern) or E4M3 Engram table (--engram-pattern) to convert; pass --allow-empty"),
        "{err}"
    );
    tftf_ok(&[&keep[..], &["--allow-empty"]].concat());

    let src = d.path().join("engram-no-scale");
    let out = d.path().join("list-out");
    let r = convert(
        "repack-fp4",
        &src,
        &out,
        &["--shard-list", "model-00009-of-00009.safetensors"],
    );
    assert_eq!(r.status.code(), Some(2), "a usage error");
    assert!(stderr(&r).contains(
        "--shard-list names `model-00009-of-00009.safetensors`, which is not a shard of"
    ));
    assert!(!out.exists());
}
