//! `merge-lora` against PEFT's own merges in `tests/fixtures/peft/`, plus synthetic cases:
//! bad adapters fail before output, FP8 base + adapter in one pass, training-output folders.

mod common;

use std::path::{Path, PathBuf};

use common::peft::*;
use common::*;
use tftf::format::dtype::DType;

/// Merges one fixture case and compares with PEFT's result ([`assert_matches_peft`]):
/// something is merged, and every adapter pair matched.
fn check_case(case: &str) {
    let dir = peft_case(case);
    let (d, out) = tmp_out();
    let rep = d.path().join("r.json");
    lora_merged(
        &dir.join("base"),
        &dir.join("adapter"),
        &out,
        &["-q", "--report", s(&rep)],
    );
    let changed = assert_matches_peft(case, &out);
    assert!(!changed.is_empty(), "{case}: nothing merged");
    assert_all_matched(case, &merge_lora_report(&rep));
}

/// Copies `from/adapter_config.json` into the folder `to`.
fn copy_config(from: &Path, to: &Path) {
    let name = "adapter_config.json";
    std::fs::copy(from.join(name), to.join(name)).unwrap();
}

#[test]
fn peft_llama_lora_f32() {
    check_case("llama-lora-f32");
}

#[test]
fn peft_llama_lora_bf16() {
    check_case("llama-lora-bf16");
}

#[test]
fn peft_rslora_with_rank_and_alpha_patterns() {
    check_case("llama-rslora");
}

#[test]
fn peft_dora() {
    check_case("llama-dora");
}

#[test]
fn peft_embeddings_and_lm_head() {
    check_case("llama-embed-lora");
}

#[test]
fn peft_gpt2_fan_in_fan_out() {
    check_case("gpt2-fan-in-fan-out");
}

#[test]
fn peft_modules_to_save() {
    check_case("modules-to-save");
    // The replacement is PEFT's copy, bit for bit.
    let dir = peft_case("modules-to-save");
    let (_d, out) = tmp_out();
    lora_merged(&dir.join("base"), &dir.join("adapter"), &out, &["-q"]);
    assert_eq!(
        load_all(&out)["lm_head.weight"],
        load_all(&dir.join("merged/model.safetensors"))["lm_head.weight"]
    );
}

#[test]
fn bad_adapters_fail_before_any_output() {
    let case = peft_case("llama-lora-f32");
    let (d, out) = tmp_out();
    let base = case.join("base");

    // Missing adapter_config.json.
    let no_cfg = copy_adapter_weights(&case, &d.path().join("no-cfg"));
    let err = fails(&merge_lora(&base, &no_cfg, &out, &[]));
    assert_mentions(&err, &["adapter_config.json not found", "--adapter-config"]);
    assert!(!out.exists());

    // Unmatched keys: a LoRA pair for a module the base does not have, and a lone lora_A.
    let extra = d.path().join("extra");
    copy_dir(&case.join("adapter"), &extra);
    let mut rng = Rng(3);
    Model::new()
        .rand(
            &mut rng,
            "base_model.model.model.layers.9.mlp.up_proj.lora_A.weight",
            DType::F32,
            &[8, 64],
        )
        .rand(
            &mut rng,
            "base_model.model.model.layers.9.mlp.up_proj.lora_B.weight",
            DType::F32,
            &[128, 8],
        )
        .rand(
            &mut rng,
            "base_model.model.model.layers.0.mlp.up_proj.lora_A.weight",
            DType::F32,
            &[8, 64],
        )
        .write_file(&extra.join("more.safetensors"));
    copy_config(&case.join("adapter"), &extra);
    // Nothing in it matches: refused as a whole, with or without --allow-unmatched, unless
    // --allow-empty (then the model passes through).
    let more = extra.join("more.safetensors");
    let args = merge_lora(&base, &more, &out, &["-q"]);
    let err = fails(&args);
    assert_eq!(
        err,
        format!(
            "error: {}: merge-lora: the adapter {} matches no tensor of this base model (is -b the model it was trained on? is --adapter-name right?); pass --allow-empty to write the output anyway\n",
            base.display(),
            more.display()
        )
    );
    assert!(!out.exists());
    let err = fails(&[&args[..], &["--allow-unmatched"]].concat());
    assert!(err.contains("matches no tensor"), "{err}");
    tftf_ok(&[&args[..], &["--allow-empty"]].concat());
    std::fs::remove_dir_all(&out).unwrap();

    // Wrong shapes: a rank that disagrees with the config.
    let wrong = d.path().join("wrong");
    Model::adapter()
        .rand(
            &mut rng,
            "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight",
            DType::F32,
            &[4, 64],
        )
        .rand(
            &mut rng,
            "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight",
            DType::F32,
            &[64, 4],
        )
        .write(&wrong);
    copy_config(&case.join("adapter"), &wrong);
    let err = fails(&merge_lora(&base, &wrong, &out, &[]));
    assert_mentions(&err, &["lora_A has rank 4", "says 8"]);
    assert!(!out.exists());
}

#[test]
fn training_output_uses_the_latest_checkpoint_and_scale_multiplies() {
    let case = peft_case("llama-lora-f32");
    let d = tmp();
    let train = d.path().join("run");
    copy_dir(&case.join("adapter"), &train.join("checkpoint-500"));
    // An older checkpoint with a broken adapter must not be picked.
    std::fs::create_dir_all(train.join("checkpoint-90")).unwrap();
    std::fs::write(
        train.join("checkpoint-90/adapter_model.safetensors"),
        b"junk",
    )
    .unwrap();
    let out = d.path().join("out");
    let rep = d.path().join("r.json");
    lora_merged(
        &case.join("base"),
        &train,
        &out,
        &["-q", "--report", s(&rep)],
    );
    assert!(std::fs::read_to_string(&rep)
        .unwrap()
        .contains("checkpoint-500"));
    // --scale 0 merges nothing: every tensor equals the base.
    let zero = d.path().join("zero");
    lora_merged(&case.join("base"), &train, &zero, &["-q", "--scale", "0"]);
    assert_eq!(
        load_all(&zero),
        load_all(&case.join("base/model.safetensors"))
    );
}

#[test]
fn fp8_base_is_dequantised_then_merged_in_one_pass() {
    let d = tmp();
    let src = d.path().join("base");
    let (out_f, in_f, r) = (256u64, 128u64, 4u64);
    let codes: Vec<u8> = (0..out_f * in_f).map(|i| (i * 7 % 120) as u8).collect();
    let scales: Vec<u8> = [0.5f32, 0.25]
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect();
    Model::new()
        .tensor(
            "m.proj.weight",
            DType::F8_E4M3,
            &[out_f, in_f],
            codes.clone(),
        )
        .tensor("m.proj.weight_scale_inv", DType::F32, &[2, 1], scales)
        .write(&src);
    let adapter = d.path().join("adapter");
    std::fs::create_dir_all(&adapter).unwrap();
    let mut rng = Rng(9);
    let a: Vec<f32> = (0..r * in_f)
        .map(|_| (rng.next_u32() % 200) as f32 / 1000.0 - 0.1)
        .collect();
    let b: Vec<f32> = (0..out_f * r)
        .map(|_| (rng.next_u32() % 200) as f32 / 1000.0 - 0.1)
        .collect();
    let fb = |v: &[f32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
    Model::adapter()
        .tensor(
            "base_model.model.m.proj.lora_A.weight",
            DType::F32,
            &[r, in_f],
            fb(&a),
        )
        .tensor(
            "base_model.model.m.proj.lora_B.weight",
            DType::F32,
            &[out_f, r],
            fb(&b),
        )
        .file("adapter_config.json", r#"{"r": 4, "lora_alpha": 8}"#)
        .write(&adapter);
    let out = d.path().join("out");
    convert_ok(
        "dequant-fp8",
        &src,
        &out,
        &[
            "-q",
            "--dtype",
            "f32",
            "--merge-lora",
            s(&adapter),
            "--block-size",
            "128",
        ],
    );
    let got = floats("F32", &load_all(&out)["m.proj.weight"].2);
    for i in 0..out_f as usize {
        for j in 0..in_f as usize {
            let w = tftf::ops::fp8::codec::e4m3_to_f32(codes[i * in_f as usize + j]) as f64
                * [0.5, 0.25][i / 128];
            let delta: f64 = (0..r as usize)
                .map(|k| b[i * r as usize + k] as f64 * a[k * in_f as usize + j] as f64)
                .sum();
            let want = w + 2.0 * delta;
            let g = got[i * in_f as usize + j] as f64;
            assert!(
                (g - want).abs() <= 1e-5 * want.abs().max(1.0),
                "[{i},{j}] {g} vs {want}"
            );
        }
    }
}

/// Splits every tensor of an adapter into dim-0 slices, one file per rank.
fn split_ranks(adapter: &Path, dir: &Path, ranks: usize) -> Vec<PathBuf> {
    let bytes = std::fs::read(adapter).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut names: Vec<String> = st.names().into_iter().map(String::from).collect();
    names.sort();
    let mut files = Vec::new();
    for k in 0..ranks {
        let mut tensors = Vec::new();
        for n in &names {
            let v = st.tensor(n).unwrap();
            let shape: Vec<u64> = v.shape().iter().map(|&x| x as u64).collect();
            let rows = shape[0] as usize;
            let per = rows / ranks;
            let row_bytes = v.data().len() / rows;
            let mut sshape = shape.clone();
            sshape[0] = per as u64;
            let dtype: DType = format!("{:?}", v.dtype()).parse().unwrap();
            tensors.push(t(
                n,
                dtype,
                &sshape,
                v.data()[k * per * row_bytes..(k + 1) * per * row_bytes].to_vec(),
            ));
        }
        let f = dir.join(format!("rank-{k}.safetensors"));
        write_file(&f, &tensors);
        files.push(f);
    }
    files
}

#[test]
fn fsdp_rank_shards_merge_like_the_whole_adapter() {
    let case = peft_case("llama-lora-f32");
    let d = tmp();
    let ranks = d.path().join("ranks");
    std::fs::create_dir_all(&ranks).unwrap();
    let files = split_ranks(&case.join("adapter/adapter_model.safetensors"), &ranks, 2);
    copy_config(&case.join("adapter"), &ranks);
    let whole = d.path().join("whole");
    lora_merged(&case.join("base"), &case.join("adapter"), &whole, &["-q"]);
    let base = case.join("base");
    // `merge-fsdp-lora -b BASE SHARDS... -o OUT EXTRA...`.
    let fsdp = |shards: &[&str], out: &Path, extra: &[&str]| {
        let args = [
            &["merge-fsdp-lora", "-b", s(&base)][..],
            shards,
            &["-o", s(out)],
        ];
        tftf(&[&args.concat()[..], extra].concat())
    };
    let by_dir = d.path().join("by-dir");
    ok(&fsdp(&["--shard-dir", s(&ranks)], &by_dir, &["-q"]));
    assert_eq!(load_all(&by_dir), load_all(&whole));
    let by_files = d.path().join("by-files");
    let in_order = ["-s", s(&files[0]), "-s", s(&files[1])];
    ok(&fsdp(&in_order, &by_files, &["-q"]));
    assert_eq!(load_all(&by_files), load_all(&whole));
    // Wrong rank order changes the assembled tensors: the result must differ.
    let swapped = d.path().join("swapped");
    let cfg = ranks.join("adapter_config.json");
    let reversed = ["-s", s(&files[1]), "-s", s(&files[0])];
    ok(&fsdp(
        &reversed,
        &swapped,
        &["-q", "--adapter-config", s(&cfg)],
    ));
    assert_ne!(load_all(&swapped), load_all(&whole));
    // A rank missing a slice is an error before output.
    let bad = d.path().join("bad");
    std::fs::create_dir_all(&bad).unwrap();
    std::fs::copy(&files[0], bad.join("rank-0.safetensors")).unwrap();
    let mut rng = Rng(1);
    Model::new()
        .rand(
            &mut rng,
            "base_model.model.x.lora_A.weight",
            DType::F32,
            &[4, 64],
        )
        .write_file(&bad.join("rank-1.safetensors"));
    copy_config(&ranks, &bad);
    let out = d.path().join("out");
    let o = fsdp(&["--shard-dir", s(&bad)], &out, &[]);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    let err = stderr(&o);
    assert_mentions(&err, &["rank-1.safetensors", "mismatched rank slices"]);
    assert!(!out.exists());
}

#[test]
fn moe_experts_per_module_and_grouped_through_target_parameters() {
    let d = tmp();
    let base = d.path().join("base");
    let (e, r) = (3usize, 2usize);
    let mut rng = Rng(17);
    let vals = |rng: &mut Rng, n: usize| -> Vec<f32> {
        (0..n)
            .map(|_| (rng.next_u32() % 2000) as f32 / 10000.0 - 0.1)
            .collect()
    };
    let fb = |v: &[f32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
    // PEFT's layout [E, in, out] (gpt-oss gate_up_proj), an [E, out, in] stack, and a plain
    // per-expert linear module.
    let (gin, gout) = (16usize, 24usize);
    let gate_up = vals(&mut rng, e * gin * gout);
    let (sout, sin) = (10usize, 12usize);
    let stack = vals(&mut rng, e * sout * sin);
    let w1 = vals(&mut rng, 8 * 6);
    Model::new()
        .tensor(
            "model.layers.0.mlp.experts.gate_up_proj",
            DType::F32,
            &[e as u64, gin as u64, gout as u64],
            fb(&gate_up),
        )
        .tensor(
            "model.layers.1.mlp.experts.w13",
            DType::F32,
            &[e as u64, sout as u64, sin as u64],
            fb(&stack),
        )
        .tensor(
            "model.layers.2.ffn.experts.5.w1.weight",
            DType::F32,
            &[8, 6],
            fb(&w1),
        )
        .write(&base);
    let adapter = d.path().join("adapter");
    std::fs::create_dir_all(&adapter).unwrap();
    let ga = vals(&mut rng, e * r * gin);
    let gb = vals(&mut rng, gout * e * r);
    let sa = vals(&mut rng, e * r * sin);
    let sb = vals(&mut rng, sout * e * r);
    let la = vals(&mut rng, r * 6);
    let lb = vals(&mut rng, 8 * r);
    let p = "base_model.model.model.layers";
    // (module, lora_A shape and values, lora_B shape and values)
    let (er, r64) = ((e * r) as u64, r as u64);
    let (g_in, g_out, s_in, s_out) = (gin as u64, gout as u64, sin as u64, sout as u64);
    let pairs = [
        ("0.mlp.experts", [er, g_in], &ga, [g_out, er], &gb),
        ("1.mlp.experts", [er, s_in], &sa, [s_out, er], &sb),
        ("2.ffn.experts.5.w1", [r64, 6], &la, [8, r64], &lb),
    ];
    let mut lora = Model::adapter();
    for (m, a_shape, a, b_shape, b) in pairs {
        let name = |ab: &str| format!("{p}.{m}.lora_{ab}.weight");
        lora = lora.tensor(&name("A"), DType::F32, &a_shape, fb(a));
        lora = lora.tensor(&name("B"), DType::F32, &b_shape, fb(b));
    }
    lora
        .file(
            "adapter_config.json",
            r#"{"r": 2, "lora_alpha": 4, "target_modules": ["w1"], "target_parameters": ["mlp.experts.gate_up_proj", "experts.w13"]}"#,
        )
        .write(&adapter);
    let out = d.path().join("out");
    lora_merged(&base, &adapter, &out, &["-q", "--memory-budget", "16MiB"]);
    let got = load_all(&out);
    let close =
        |g: f32, w: f64, what: &str| assert!((g as f64 - w).abs() < 1e-6, "{what}: {g} vs {w}");
    // Expert x's delta at (in i, out o) of grouped factors `a` [E·r, n_in] and `b` [n_out, E·r]
    // (PEFT's layout: rank k of expert x at column k·E + x of `b`).
    let delta = |a: &[f32], b: &[f32], n_in: usize, (x, i, o): (usize, usize, usize)| -> f64 {
        (0..r)
            .map(|k| a[(x * r + k) * n_in + i] as f64 * b[o * e * r + k * e + x] as f64)
            .sum()
    };
    // (tensor, its input values, factors A and B, in, out, where element (expert, in, out)
    // is): gate_up_proj is [E, in, out], w13 [E, out, in].
    type Case<'a> = (
        &'a str,
        &'a [f32],
        &'a [f32],
        &'a [f32],
        usize,
        usize,
        At<'a>,
    );
    type At<'a> = &'a dyn Fn(usize, usize, usize) -> usize;
    let gu = "model.layers.0.mlp.experts.gate_up_proj";
    let w13 = "model.layers.1.mlp.experts.w13";
    let gu_at = |x: usize, i: usize, o: usize| (x * gin + i) * gout + o;
    let w13_at = |x: usize, i: usize, o: usize| (x * sout + o) * sin + i;
    let cases: [Case; 2] = [
        (gu, &gate_up, &ga, &gb, gin, gout, &gu_at),
        (w13, &stack, &sa, &sb, sin, sout, &w13_at),
    ];
    for (name, input, a, b, n_in, n_out, at) in cases {
        let g = floats("F32", &got[name].2);
        for x in 0..e {
            for i in 0..n_in {
                for o in 0..n_out {
                    let want = input[at(x, i, o)] as f64 + 2.0 * delta(a, b, n_in, (x, i, o));
                    close(g[at(x, i, o)], want, name);
                }
            }
        }
    }
    let g = floats("F32", &got["model.layers.2.ffn.experts.5.w1.weight"].2);
    for o in 0..8 {
        for i in 0..6 {
            let delta: f64 = (0..r)
                .map(|k| lb[o * r + k] as f64 * la[k * 6 + i] as f64)
                .sum();
            close(
                g[o * 6 + i],
                w1[o * 6 + i] as f64 + 2.0 * delta,
                "experts.5.w1",
            );
        }
    }
}

#[test]
fn run_section_merges_then_renames() {
    let case = peft_case("llama-lora-f32");
    let d = tmp();
    let out = d.path().join("out.safetensors");
    convert_ok(
        "run",
        &case.join("base"),
        &out,
        &[
            "-q",
            "--merge-lora",
            s(&case.join("adapter")),
            "--key-rename",
            r"^model\.",
            "",
        ],
    );
    let got = load_all(&out);
    let want = load_all(&case.join("merged/model.safetensors"));
    for (name, (_, _, bytes)) in &want {
        let key = name.strip_prefix("model.").unwrap_or(name);
        let g = floats("F32", &got[key].2);
        for (x, y) in g.iter().zip(floats("F32", bytes)) {
            assert!((x - y).abs() <= 1e-6 * y.abs().max(1.0), "{name}");
        }
    }
}

/// Adapters whose shapes cannot be merged: DoRA on a Conv1D weight, grouped expert factors that
/// fit neither base layout. Named errors, no output.
#[test]
fn unmergeable_dora_and_grouped_factors_fail_before_output() {
    let (d, out) = tmp_out();

    // GPT-2 (Conv1D, fan_in_fan_out) adapter plus a DoRA magnitude on c_attn.
    let case = peft_case("gpt2-fan-in-fan-out");
    let dora = d.path().join("gpt2-dora");
    copy_dir(&case.join("adapter"), &dora);
    let file = dora.join("adapter_model.safetensors");
    let mut tensors = load_ts(&file);
    let mag = "base_model.model.transformer.h.0.attn.c_attn.lora_magnitude_vector";
    tensors.push(t(mag, DType::F32, &[192], vec![0; 192 * 4]));
    write_file(&file, &tensors);
    let err = fails(&merge_lora(&case.join("base"), &dora, &out, &[]));
    assert_mentions(
        &err,
        &[&format!(
            "`{mag}`: DoRA on transposed (Conv1D or embedding) weights is not supported"
        )],
    );
    assert!(!out.exists());

    // An adapter file without tensors.
    let empty = d.path().join("empty");
    Model::adapter().write(&empty);
    copy_config(&case.join("adapter"), &empty);
    let err = fails(&merge_lora(&case.join("base"), &empty, &out, &[]));
    assert_mentions(
        &err,
        &["adapter_model.safetensors: holds no tensors, so there is nothing to merge"],
    );
    assert!(!out.exists());

    // Grouped factors for in=5, out=7 against an [3, 16, 24] expert stack.
    let base = d.path().join("moe");
    let mut rng = Rng(4);
    Model::new()
        .rand(
            &mut rng,
            "model.layers.0.mlp.experts.gate_up_proj",
            DType::F32,
            &[3, 16, 24],
        )
        .write(&base);
    let adapter = d.path().join("moe-adapter");
    std::fs::create_dir_all(&adapter).unwrap();
    let p = "base_model.model.model.layers.0.mlp.experts";
    Model::adapter()
        .rand(&mut rng, &format!("{p}.lora_A.weight"), DType::F32, &[6, 5])
        .rand(&mut rng, &format!("{p}.lora_B.weight"), DType::F32, &[7, 6])
        .file(
            "adapter_config.json",
            r#"{"r": 2, "lora_alpha": 4, "target_modules": [], "target_parameters": ["mlp.experts.gate_up_proj"]}"#,
        )
        .write(&adapter);
    let err = fails(&merge_lora(&base, &adapter, &out, &[]));
    assert_mentions(&err, &["factors for in=5, out=7 do not fit base `model.layers.0.mlp.experts.gate_up_proj` [3, 16, 24]"]);
    assert!(!out.exists());
}

/// Issue #24 item 6: one NaN or infinity in an adapter factor would make a whole row of the
/// merged weight NaN; the merge is refused naming the adapter tensor and the element, before
/// any output exists, unless `--allow-nonfinite` (in `merge-lora` and `run --merge-lora`).
#[test]
fn nonfinite_adapter_values_are_refused_naming_tensor_and_element() {
    let case = peft_case("llama-lora-f32");
    let base = case.join("base");
    let d = tmp();
    let factor = "base_model.model.model.layers.0.mlp.down_proj.lora_B.weight";
    let weight = "model.layers.0.mlp.down_proj.weight";
    let tensors = load_all(&case.join("adapter/adapter_model.safetensors"));
    // lora_B is [64, 8]: element 1·8 + 2 is [1, 2].
    let with = |value: f32, dir: &Path| -> PathBuf {
        let edited: Vec<T> = tensors
            .iter()
            .map(|(name, (dtype, shape, bytes))| {
                let mut bytes = bytes.clone();
                if name == factor {
                    bytes[10 * 4..11 * 4].copy_from_slice(&value.to_le_bytes());
                }
                let shape: Vec<u64> = shape.iter().map(|&x| x as u64).collect();
                t(name, dtype.parse::<DType>().unwrap(), &shape, bytes)
            })
            .collect();
        let adapter = Model::adapter().tensors(edited).write(dir);
        copy_config(&case.join("adapter"), &adapter);
        adapter
    };
    for (value, shown) in [(f32::NAN, "NaN"), (f32::NEG_INFINITY, "-inf")] {
        let adapter = with(value, &d.path().join(shown));
        let out = d.path().join(format!("out-{shown}"));
        let err = fails(&merge_lora(&base, &adapter, &out, &["-q"]));
        assert_refused(
            &err,
            &[
                &format!("tensor `{factor}`: holds {shown} at [1, 2]"),
                "adapter_model.safetensors",
                "--allow-nonfinite",
            ],
            &out,
        );
        let err = fails(&[
            "run",
            "-i",
            s(&base),
            "-o",
            s(&out),
            "--merge-lora",
            s(&adapter),
        ]);
        assert_refused(&err, &[factor, "[1, 2]"], &out);
    }
    // --allow-nonfinite merges it as asked: row 1 of the merged weight is NaN, row 0 is not.
    let adapter = with(f32::NAN, &d.path().join("allowed"));
    let out = d.path().join("out");
    tftf_ok(&merge_lora(
        &base,
        &adapter,
        &out,
        &["-q", "--allow-nonfinite"],
    ));
    let (dtype, shape, bytes) = &load_all(&out)[weight];
    let w = floats(dtype, bytes);
    let cols = shape[1];
    assert!(w[cols..2 * cols].iter().all(|v| v.is_nan()));
    assert!(w[..cols].iter().all(|v| v.is_finite()));
}
