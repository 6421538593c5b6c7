//! End-to-end tests of the `tftf` binary on synthetic checkpoints built in each test.

mod common;

use std::path::Path;

use common::interrupt::*;
use common::*;
use tftf::format::dtype::DType;
use tftf::ops::cast::{f32_to_bf16, f32_to_f16};

fn bf16_of_f32(bytes: &[u8]) -> Vec<u8> {
    bytes
        .chunks_exact(4)
        .flat_map(|c| f32_to_bf16(f32::from_le_bytes(c.try_into().unwrap())).to_le_bytes())
        .collect()
}

#[test]
fn passthrough_round_trip_keeps_every_byte_and_side_files() {
    let (d, src, out, tensors) = small_model_passed("out", &["--quiet"]);
    let got = load_all(&out);
    assert_eq!(got.len(), tensors.len());
    for (name, dtype, shape, data) in &tensors {
        let (gd, gs, gdata) = &got[name];
        assert_eq!(gd, dtype.name(), "{name}");
        assert_eq!(gs.iter().map(|&x| x as u64).collect::<Vec<_>>(), *shape);
        assert_eq!(gdata, data, "{name} bytes");
    }
    // The input's shard boundaries are kept, and an unchanged shard is the input file byte for
    // byte (same header, so a reflink-capable filesystem shares all of it).
    assert_listing(
        &out,
        "config.json model-00001-of-00002.safetensors \
         model-00002-of-00002.safetensors model.safetensors.index.json \
         modeling_x.py tokenizer.json",
    );
    for shard in [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    ] {
        assert_eq!(
            std::fs::read(out.join(shard)).unwrap(),
            std::fs::read(src.join(shard)).unwrap()
        );
    }
    // An explicit --max-shard-size repacks: everything fits one file, no index.
    let packed = d.path().join("packed");
    passthrough_ok(&src, &packed, &["--max-shard-size", "1GB", "-q"]);
    assert_listing(
        &packed,
        "config.json model.safetensors modeling_x.py tokenizer.json",
    );
    assert_eq!(load_all(&packed).len(), tensors.len());
    // Unchanged config is copied verbatim.
    assert_eq!(
        std::fs::read(out.join("config.json")).unwrap(),
        std::fs::read(src.join("config.json")).unwrap()
    );
}

#[test]
fn input_forms_file_dir_without_index_and_index_path() {
    let (d, src, tensors) = tmp_small_model();
    let want = tensors.len();
    // Index file path.
    let o1 = d.path().join("o1");
    tftf_ok(&[
        "passthrough",
        s(&src.join("model.safetensors.index.json")),
        "-o",
        s(&o1),
        "-q",
    ]);
    assert_eq!(load_all(&o1).len(), want);
    // Directory of shards without an index.
    std::fs::remove_file(src.join("model.safetensors.index.json")).unwrap();
    let o2 = d.path().join("o2");
    tftf_ok(&["passthrough", "-b", s(&src), "-o", s(&o2), "-q"]);
    assert_eq!(load_all(&o2).len(), want);
    // A single file, to a single file.
    let one = src.join("model-00001-of-00002.safetensors");
    let o3 = d.path().join("single.safetensors");
    passthrough_ok(&one, &o3, &["-q"]);
    assert_eq!(load_all(&o3).len(), 5);
}

#[test]
fn reshards_with_index_and_gives_big_tensors_their_own_shard() {
    let (d, src) = tmp_in();
    let mut rng = Rng(3);
    let tensors = vec![
        rand_t(&mut rng, "a", DType::U8, &[3000]),
        rand_t(&mut rng, "b", DType::U8, &[3000]),
        rand_t(&mut rng, "big", DType::U8, &[20000]),
        rand_t(&mut rng, "c", DType::U8, &[1000]),
        rand_t(&mut rng, "d", DType::U8, &[1000]),
    ];
    std::fs::create_dir_all(&src).unwrap();
    write_file(&src.join("model.safetensors"), &tensors);
    let out = d.path().join("out");
    passthrough_ok(&src, &out, &["--max-shard-size", "6KB", "-q"]);
    let names = listing(&out);
    assert_eq!(
        names,
        [
            "model-00001-of-00003.safetensors",
            "model-00002-of-00003.safetensors",
            "model-00003-of-00003.safetensors",
            "model.safetensors.index.json"
        ]
    );
    let index: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(out.join("model.safetensors.index.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(index["metadata"]["total_size"], 28000);
    assert_eq!(
        index["weight_map"]["big"],
        "model-00002-of-00003.safetensors"
    );
    assert_eq!(index["weight_map"]["a"], "model-00001-of-00003.safetensors");
    assert_eq!(index["weight_map"]["d"], "model-00003-of-00003.safetensors");
    let got = load_all(&out);
    for (name, _, _, data) in &tensors {
        assert_eq!(&got[name].2, data);
    }
    // The output reads back as a checkpoint through its index.
    let again = d.path().join("again.safetensors");
    passthrough_ok(&out, &again, &["-q"]);
    assert_eq!(load_all(&again).len(), 5);
}

#[test]
fn cast_rounds_to_nearest_even_and_leaves_non_floats_alone() {
    let (d, src, out, tensors) = small_model_passed("out", &["--dtype", "bfloat16", "-q"]);
    let got = load_all(&out);
    for (name, dtype, _, data) in &tensors {
        let (gd, _, gdata) = &got[name];
        match dtype {
            // A scale of the FP8 weight is read as stored: never rounded by `--dtype`.
            DType::F32 if name.ends_with(".weight_scale_inv") => {
                assert_eq!(gd, "F32", "{name}");
                assert_eq!(gdata, data, "{name}");
            }
            DType::F32 => {
                assert_eq!(gd, "BF16");
                assert_eq!(gdata, &bf16_of_f32(data), "{name}");
            }
            DType::F16 => {
                assert_eq!(gd, "BF16");
                let want: Vec<u8> = data
                    .chunks_exact(2)
                    .flat_map(|c| {
                        f32_to_bf16(half::f16::from_le_bytes([c[0], c[1]]).to_f32()).to_le_bytes()
                    })
                    .collect();
                assert_eq!(gdata, &want, "{name}");
            }
            _ => {
                assert_eq!(gd, dtype.name(), "{name} must keep its dtype");
                assert_eq!(gdata, data, "{name} must keep its bytes");
            }
        }
    }
    let cfg = std::fs::read_to_string(out.join("config.json")).unwrap();
    assert!(cfg.contains("\"torch_dtype\": \"bfloat16\""), "{cfg}");
    // Key order is preserved.
    assert!(cfg.find("architectures").unwrap() < cfg.find("torch_dtype").unwrap());
    assert!(cfg.find("torch_dtype").unwrap() < cfg.find("hidden_size").unwrap());

    // f16 target, and --cast-ints converting the I64 tensor.
    let out2 = d.path().join("out2");
    passthrough_ok(&src, &out2, &["--dtype", "f16", "--cast-ints", "-q"]);
    let got2 = load_all(&out2);
    let (_, _, _, f32_data) = tensors.iter().find(|t| t.0 == "model.norm.weight").unwrap();
    let want: Vec<u8> = f32_data
        .chunks_exact(4)
        .flat_map(|c| f32_to_f16(f32::from_le_bytes(c.try_into().unwrap())).to_le_bytes())
        .collect();
    assert_eq!(got2["model.norm.weight"].2, want);
    let (_, _, _, ints) = tensors
        .iter()
        .find(|t| t.0 == "model.layers.1.step")
        .unwrap();
    let want_ints: Vec<u8> = ints
        .chunks_exact(8)
        .flat_map(|c| {
            let v = i64::from_le_bytes(c.try_into().unwrap());
            half::f16::from_f64(v as f64).to_bits().to_le_bytes()
        })
        .collect();
    assert_eq!(got2["model.layers.1.step"].0, "F16");
    assert_eq!(got2["model.layers.1.step"].2, want_ints);
    assert_eq!(got2["model.layers.1.experts.packed"].0, "F4");
}

#[test]
fn filters_and_renames_follow_fnmatch_and_python_groups() {
    let (_d, _, out, _) = small_model_passed(
        "out.safetensors",
        &[
            "-q",
            "--include",
            "model.layers.*",
            "--include",
            "lm_head.*",
            "--exclude",
            "*.weight_scale_inv",
            "--exclude",
            "*layernorm*",
            "--rename",
            r"^model\.layers\.(\d+)\.",
            r"blk.\1.",
        ],
    );
    let names: Vec<String> = load_all(&out).into_keys().collect();
    assert_eq!(
        names,
        [
            "blk.0.mlp.up_proj.weight",
            "blk.0.self_attn.q_proj.weight",
            "blk.1.experts.packed",
            "blk.1.mlp.up_proj.weight",
            "blk.1.step",
            "lm_head.weight"
        ]
    );
}

#[test]
fn rename_collision_names_both_sources_and_writes_nothing() {
    let (d, src, _) = tmp_small_model();
    let out = d.path().join("out");
    let err = fails(&cmd(
        "passthrough",
        &src,
        &out,
        &["--rename", r"layers\.\d+\.", "L."],
    ));
    assert_refused(
        &err,
        &[
            "`model.layers.0.mlp.up_proj.weight`",
            "`model.layers.1.mlp.up_proj.weight`",
            "`model.L.mlp.up_proj.weight`",
        ],
        &out,
    );
}

/// Issue #24 item 2: a replacement naming a group the regex lacks would rewrite every name
/// (`model.layers.0.w` → `.layers.0.w`); it is a usage error naming the group, in every syntax
/// and through `passthrough --rename`, `run --key-rename` and `validate --pipe rename:`.
#[test]
fn rename_to_a_group_the_regex_lacks_is_a_usage_error() {
    let (d, src, _) = tmp_small_model();
    let out = d.path().join("out");
    for (extra, group) in [
        (&["--rename", r"^model\.", r"\g<prefix>."][..], "prefix"),
        (&["--rename", r"^(model)\.", r"\2."], "2"),
        (&["--rename", r"^model\.", "${name}."], "name"),
    ] {
        let err = usage_error(&cmd("passthrough", &src, &out, extra));
        assert_refused(&err, &[&format!("group `{group}`"), extra[1]], &out);
    }
    let err = usage_error(&cmd(
        "run",
        &src,
        &out,
        &["--key-rename", r"^(?P<head>model)\.", r"\g<hed>."],
    ));
    assert_refused(&err, &["group `hed`", "named head"], &out);
    let err = usage_error(&["validate", s(&src), "--pipe", r"rename:^model\.=\g<x>"]);
    assert_mentions(&err, &["group `x`"]);
}

#[test]
fn run_applies_sections_in_command_line_order() {
    let (d, src, _) = tmp_small_model();
    // Rename first, then the filter sees the new names.
    let o1 = d.path().join("o1.safetensors");
    convert_ok(
        "run",
        &src,
        &o1,
        &[
            "-q",
            "--key-rename",
            r"^model\.",
            "",
            "--key-filter",
            "layers.1.*",
            "--dtype-cast",
            "bf16",
        ],
    );
    let got = load_all(&o1);
    assert_eq!(got.len(), 4);
    assert_eq!(got["layers.1.input_layernorm.weight"].0, "BF16");
    // Filter first on the old names: nothing matches `layers.1.*`, which is refused unless
    // --allow-empty, and then gives an empty output.
    let o2 = d.path().join("o2.safetensors");
    let args = cmd(
        "run",
        &src,
        &o2,
        &[
            "-q",
            "--key-filter",
            "layers.1.*",
            "--key-rename",
            r"^model\.",
            "",
        ],
    );
    let err = fails(&args);
    assert_eq!(
        err,
        "error: the filters (--include/--exclude, --key-filter/--key-exclude) keep none of the 11 input tensors: nothing to write; pass --allow-empty to write the output anyway\n"
    );
    assert!(!o2.exists());
    tftf_ok(&[&args[..], &["--allow-empty"]].concat());
    assert_eq!(load_all(&o2).len(), 0);
}

#[test]
fn output_is_identical_across_threads_budgets_and_copy_modes() {
    let (d, src) = tmp_in();
    let mut rng = Rng(9);
    // 24 MiB of f32 in one tensor: many chunks under a 16 MiB budget.
    let big = rand_t(&mut rng, "big", DType::F32, &[3 << 10, 2 << 10]);
    let small = rand_t(&mut rng, "small", DType::BF16, &[100, 3]);
    let odd = rand_t(&mut rng, "odd", DType::F64, &[7, 13]);
    write_sharded(&src, &[vec![big.clone(), small], vec![odd]]);
    let mut outputs = Vec::new();
    for (i, extra) in [
        vec!["--threads", "1", "--memory-budget", "16MiB"],
        vec!["--threads", "2", "--memory-budget", "1GiB"],
        vec!["--threads", "3", "--memory-budget", "20MiB", "--no-reflink"],
    ]
    .into_iter()
    .enumerate()
    {
        let out = d.path().join(format!("out{i}"));
        let mut args = cmd(
            "passthrough",
            &src,
            &out,
            &["--dtype", "bf16", "-q", "--max-shard-size", "10MiB"],
        );
        args.extend(extra);
        tftf_ok(&args);
        let files: Vec<Vec<u8>> = listing(&out)
            .iter()
            .map(|n| std::fs::read(out.join(n)).unwrap())
            .collect();
        outputs.push((listing(&out), files));
    }
    assert_eq!(outputs[0], outputs[1]);
    assert_eq!(outputs[0], outputs[2]);
    let got = load_all(&d.path().join("out0"));
    assert_eq!(got["big"].2, bf16_of_f32(&big.3));
}

#[test]
fn report_and_dry_run() {
    let (d, src, _) = tmp_small_model();
    let out = d.path().join("out");
    let report = d.path().join("plan.json");
    let o = passthrough_ok(
        &src,
        &out,
        &["--dtype", "bf16", "--dry-run", "--report", s(&report)],
    );
    let text = stdout(&o);
    assert!(text.contains("dry run: nothing written"), "{text}");
    assert!(text.contains("cast F32 -> BF16: 3 tensors"), "{text}");
    assert_mentions(&text, &["kept 1 quantisation tensor(s) (scales, zero points, packed codes) in their stored dtype"]);
    assert_mentions(
        &text,
        &["config.json: torch_dtype \"float32\" -> \"bfloat16\""],
    );
    assert!(text.contains("disk: needs"), "{text}");
    assert!(!out.exists(), "dry run created the output");
    let r: serde_json::Value = read_json(&report);
    assert_eq!(r["dry_run"], true);

    let report2 = d.path().join("run.json");
    passthrough_ok(
        &src,
        &out,
        &["--dtype", "bf16", "-q", "--report", s(&report2)],
    );
    let r: serde_json::Value = read_json(&report2);
    assert_eq!(r["status"], "ok");
    assert_eq!(r["tensors"]["written"], 11);
    assert_eq!(
        r["tensors"]["computed"], 4,
        "the FP8 scale is kept, not cast"
    );
    let copied = r["bytes"]["copied_in_kernel"].as_u64().unwrap()
        + r["bytes"]["copied_through_memory"].as_u64().unwrap();
    let computed = r["bytes"]["computed"].as_u64().unwrap();
    assert_eq!(copied + computed, r["bytes"]["tensors"].as_u64().unwrap());
    assert!(r["peak_rss_bytes"].as_u64().unwrap() > 0);
    assert!(r["wall_seconds"].as_f64().unwrap() > 0.0);

    // A failing run still writes a report saying why.
    let report3 = d.path().join("fail.json");
    fails(&cmd("passthrough", &src, &out, &["--report", s(&report3)]));
    let r: serde_json::Value = read_json(&report3);
    assert_eq!(r["status"], "error");
    assert!(r["error"].as_str().unwrap().contains("not empty"));
}

#[test]
fn refuses_output_inside_input_and_non_empty_output_without_force() {
    let (d, src, _) = tmp_small_model();
    let err = fails(&cmd("passthrough", &src, &src.join("sub"), &[]));
    assert!(err.contains("is the input or inside it"), "{err}");
    assert!(!src.join("sub").exists());
    let err = fails(&cmd("passthrough", &src, &src, &[]));
    assert!(err.contains("is the input or inside it"), "{err}");

    let out = d.path().join("out");
    std::fs::create_dir_all(&out).unwrap();
    std::fs::write(out.join("model-00001-of-00009.safetensors"), "stale").unwrap();
    std::fs::write(out.join("notes.txt"), "mine").unwrap();
    let err = fails(&cmd("passthrough", &src, &out, &[]));
    assert_mentions(&err, &["not empty", "--force"]);
    passthrough_ok(&src, &out, &["--force", "-q", "--max-shard-size", "1GB"]);
    // Stale shards are replaced; unrelated files stay.
    assert_listing(
        &out,
        "config.json model.safetensors modeling_x.py notes.txt tokenizer.json",
    );
    assert_eq!(load_all(&out).len(), 11);
}

/// Writes a model whose single shard has the given raw bytes and expects `passthrough` to fail
/// with a message containing every `needle`, leaving no output behind.
fn bad_input(raw: Vec<u8>, needles: &[&str]) {
    let (d, src) = tmp_in();
    std::fs::create_dir_all(&src).unwrap();
    std::fs::write(src.join("model.safetensors"), raw).unwrap();
    let out = d.path().join("out");
    let err = fails(&cmd("passthrough", &src, &out, &[]));
    assert!(err.contains("model.safetensors"), "no file name in: {err}");
    for n in needles {
        assert!(err.contains(n), "`{n}` not in: {err}");
    }
    assert!(!out.exists(), "output left behind");
    let v = tftf(&["validate", s(&src)]);
    assert_eq!(v.status.code(), Some(1));
    assert!(stdout(&v).contains("problem:"), "{}", stdout(&v));
}

fn raw(header: &str, data_len: usize) -> Vec<u8> {
    raw_safetensors(header, &vec![7u8; data_len])
}

#[test]
fn bad_headers_are_distinct_errors_naming_file_and_tensor() {
    let good = r#"{"w":{"dtype":"BF16","shape":[2,2],"data_offsets":[0,8]}}"#;
    let mut truncated = raw(good, 8);
    truncated.truncate(truncated.len() - 3);
    bad_input(truncated, &["data buffer is 5 bytes", "truncated"]);
    bad_input(raw(good, 10), &["2 trailing bytes"]);
    bad_input(
        raw(
            r#"{"w":{"dtype":"BF16","shape":[2,2],"data_offsets":[0,8]"#,
            8,
        ),
        &["not valid JSON"],
    );
    bad_input(
        raw(
            r#"{"w":{"dtype":"Q4_K","shape":[2,2],"data_offsets":[0,8]}}"#,
            8,
        ),
        &["`w`", "unknown dtype `Q4_K`"],
    );
    bad_input(
        raw(
            r#"{"w":{"dtype":"BF16","shape":[2,3],"data_offsets":[0,8]}}"#,
            8,
        ),
        &["`w`", "needs 12 bytes"],
    );
    bad_input(
        raw(
            r#"{"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},"b":{"dtype":"U8","shape":[4],"data_offsets":[2,6]}}"#,
            6,
        ),
        &[
            "`b`",
            "starts at data offset 2",
            "previous tensor ends at 4",
        ],
    );
    let mut huge = (200_000_000u64).to_le_bytes().to_vec();
    huge.extend_from_slice(b"{}");
    bad_input(huge, &["exceeds the limit"]);
    bad_input(vec![1, 2, 3], &["shorter than the 8-byte"]);
    let mut short_header = (1000u64).to_le_bytes().to_vec();
    short_header.extend_from_slice(b"{}");
    bad_input(short_header, &["header needs 1000 bytes"]);
}

#[test]
fn cross_shard_faults_are_caught_before_output() {
    let d = tmp();
    let mut rng = Rng(5);
    let a = rand_t(&mut rng, "a", DType::U8, &[4]);
    let b = rand_t(&mut rng, "b", DType::U8, &[4]);
    let out = d.path().join("out");
    // Each faulty input is refused naming the fault.
    let refused = |input: &Path, needles: &[&str]| {
        assert_mentions(&fails(&cmd("passthrough", input, &out, &[])), needles)
    };

    // Duplicate tensor across shards (no index).
    let dup = d.path().join("dup");
    std::fs::create_dir_all(&dup).unwrap();
    write_file(&dup.join("x-1.safetensors"), std::slice::from_ref(&a));
    write_file(&dup.join("x-2.safetensors"), &[a.clone(), b.clone()]);
    refused(
        &dup,
        &["`a` is defined twice", "x-1.safetensors", "x-2.safetensors"],
    );

    // Missing shard.
    let miss = d.path().join("miss");
    write_sharded(&miss, &[vec![a.clone()], vec![b.clone()]]);
    std::fs::remove_file(miss.join("model-00002-of-00002.safetensors")).unwrap();
    refused(
        &miss,
        &["shard `model-00002-of-00002.safetensors`", "`b`", "missing"],
    );

    // Index entry whose tensor is not in its shard.
    let wrong = d.path().join("wrong");
    write_sharded(&wrong, &[vec![a.clone()], vec![b.clone()]]);
    let idx = wrong.join("model.safetensors.index.json");
    let text = std::fs::read_to_string(&idx).unwrap().replace(
        r#""b":"model-00002-of-00002.safetensors""#,
        r#""b":"model-00001-of-00002.safetensors""#,
    );
    std::fs::write(&idx, text).unwrap();
    refused(
        &wrong,
        &[
            "model-00001-of-00002.safetensors",
            "`b`",
            "does not contain",
        ],
    );

    // Index pointing outside the directory.
    let esc = d.path().join("esc");
    write_sharded(&esc, &[vec![a.clone()]]);
    std::fs::write(
        esc.join("model.safetensors.index.json"),
        r#"{"weight_map":{"a":"../x.safetensors"}}"#,
    )
    .unwrap();
    refused(&esc, &["not a file in this directory"]);

    // Nothing to read.
    let empty = d.path().join("empty");
    std::fs::create_dir_all(&empty).unwrap();
    refused(&empty, &["no *.safetensors files"]);
    assert!(!out.exists());
}

#[test]
fn usage_errors_exit_2() {
    let (d, src, _) = tmp_small_model();
    let out = d.path().join("out");
    for args in [
        cmd("passthrough", &src, &out, &["--dtype", "int4"]),
        cmd("passthrough", &src, &out, &["--max-shard-size", "5XB"]),
        cmd("passthrough", &src, &out, &["--memory-budget", "1KB"]),
        cmd("passthrough", &src, &out, &["--rename", "(", "x"]),
        vec!["passthrough", "-o", s(&out)],
        vec!["frobnicate"],
    ] {
        let o = tftf(&args);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {}", stderr(&o));
        assert!(!out.exists());
    }
}

#[test]
fn info_reports_sizes_totals_and_widest_layer() {
    let (_d, src, _) = tmp_small_model();
    let o = tftf_ok(&["info", s(&src), "--json"]);
    let v: serde_json::Value = serde_json::from_str(&stdout(&o)).unwrap();
    let find = |n: &str| {
        v["tensors"]
            .as_array()
            .unwrap()
            .iter()
            .find(|t| t["name"] == n)
            .unwrap()
            .clone()
    };
    assert_eq!(find("model.layers.1.experts.packed")["bytes"], 256); // F4: half a byte each
    assert_eq!(
        find("model.layers.0.self_attn.q_proj.weight")["bytes"],
        1024
    ); // FP8: one byte
    assert_eq!(v["total_tensors"], 11);
    assert_eq!(v["dtypes"]["F4"]["tensors"], 1);
    // Layer 0: 1024 + 4 + 4096 + 128 = 5252; layer 1: 4096 + 128 + 256 + 24 = 4504.
    assert_eq!(v["widest_layer"]["name"], "model.layers.0");
    assert_eq!(v["widest_layer"]["bytes"], 5252);
    let text = stdout(&tftf(&["info", s(&src), "--filter", "mlp"]));
    assert_mentions(&text, &["model.layers.1.mlp.up_proj.weight  F16"]);
    assert!(text.contains(": 2 tensors in 2 shard(s)"), "{text}");
    let summary = stdout(&tftf(&["info", s(&src), "--dtype-summary"]));
    assert!(!summary.contains("NAME"), "{summary}");
    assert!(summary.contains("F8_E4M3"), "{summary}");
    assert!(summary.contains("widest: model.layers.0"), "{summary}");
}

#[test]
fn validate_reports_non_finite_values_and_pipe_collisions() {
    let (_d, src) = tmp_in();
    let mut vals: Vec<u8> = [1.0f32, 2.0, f32::NAN, 4.0, f32::INFINITY]
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect();
    let fp8 = vec![0x10u8, 0x7F, 0x20];
    Model::new()
        .tensor("x", DType::F32, &[5], vals.clone())
        .tensor("q", DType::F8_E4M3, &[3], fp8)
        .tensor("ok", DType::BF16, &[1], vec![0x80, 0x3F])
        .write(&src);
    let o = tftf_ok(&["validate", s(&src)]);
    assert!(stdout(&o).starts_with("ok:"), "{}", stdout(&o));
    let o = tftf(&["validate", s(&src), "--check-values"]);
    assert_eq!(o.status.code(), Some(1));
    let text = stdout(&o);
    assert_mentions(
        &text,
        &["tensor `x`: 2 non-finite value(s), first at element 2"],
    );
    assert_mentions(
        &text,
        &["tensor `q`: 1 non-finite value(s), first at element 1"],
    );
    assert!(!text.contains("`ok`"), "{text}");

    vals.truncate(8);
    Model::new().tensor("x", DType::F32, &[2], vals).write(&src);
    tftf_ok(&[
        "validate",
        s(&src),
        "--check-values",
        "--pipe",
        "dtype:bf16",
        "--pipe",
        "exclude:y*",
    ]);
    let o = tftf(&["validate", s(&src), "--json", "--pipe", "nonsense"]);
    assert_eq!(o.status.code(), Some(2));
}

#[test]
fn validate_lists_every_broken_shard() {
    let (_d, src) = tmp_in();
    let mut rng = Rng(8);
    Model::new()
        .rand(&mut rng, "a", DType::U8, &[4])
        .shard()
        .rand(&mut rng, "b", DType::U8, &[4])
        .write(&src);
    for n in [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    ] {
        let p = src.join(n);
        let mut bytes = std::fs::read(&p).unwrap();
        bytes.pop();
        std::fs::write(&p, bytes).unwrap();
    }
    let o = tftf(&["validate", s(&src)]);
    assert_eq!(o.status.code(), Some(1));
    let text = stdout(&o);
    assert_mentions(&text, &["model-00001-of-00002.safetensors: data buffer"]);
    assert_mentions(&text, &["model-00002-of-00002.safetensors: data buffer"]);
    assert!(text.contains("2 problem(s)"), "{text}");
}

#[test]
fn ctrl_c_removes_temporary_output() {
    assert_a_slow_run_stops_on(libc::SIGINT, "interrupt");
}

#[test]
fn demo_runs_and_checks_itself() {
    let o = tftf_ok(&["demo"]);
    let text = stdout(&o);
    assert!(text.contains("demo finished: every check passed"), "{text}");
    assert!(!text.contains("failed"), "{text}");
}

#[test]
fn full_disk_is_refused_before_writing() {
    let (d, src) = tmp_in();
    let mut rng = Rng(12);
    std::fs::create_dir_all(&src).unwrap();
    write_file(
        &src.join("model.safetensors"),
        &[rand_t(&mut rng, "w", DType::U8, &[4 << 20])],
    );
    let small = d.path().join("small");
    std::fs::create_dir_all(&small).unwrap();
    let mounted = std::process::Command::new("mount")
        .args(["-t", "tmpfs", "-o", "size=1m", "tmpfs", s(&small)])
        .status()
        .is_ok_and(|st| st.success());
    if !mounted {
        println!(
            "SKIPPED full_disk_is_refused_before_writing: cannot mount a 1 MiB tmpfs (needs root)"
        );
        return;
    }
    let out = small.join("out");
    let err = fails(&cmd("passthrough", &src, &out, &[]));
    let _ = std::process::Command::new("umount").arg(&small).status();
    assert_mentions(&err, &["not enough space", "out"]);
    assert!(!out.exists());
}
