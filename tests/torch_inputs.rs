//! PyTorch inputs through the whole tool: torch.save files (zip and legacy), folders of `.bin`
//! shards and Distributed Checkpoints (DCP) given to `info`, `validate` and `passthrough`. Every
//! converted tensor must equal its twin in the fixture's `expected/model.safetensors` byte for
//! byte (see `tests/fixtures/torch/README.md`); contiguous tensors must still move inside the
//! kernel; hostile and damaged inputs fail naming the culprit, creating nothing.

mod common;

use std::path::{Path, PathBuf};

use common::*;

fn torch_fixture(rel: &str) -> PathBuf {
    fixture(&format!("torch/{rel}"))
}

/// [`load_tensors`] without the `format` metadata requirement (the expected twins carry none).
fn read_safetensors(path: &Path) -> Tensors {
    load_tensors(path, false)
}

fn report(path: &Path) -> serde_json::Value {
    read_json(path)
}

/// `tftf passthrough input -o out --report …`; returns the report.
fn passthrough(input: &Path, out: &Path, extra: &[&str]) -> serde_json::Value {
    let rep = out.with_extension("report.json");
    let mut args = vec!["passthrough", s(input), "-o", s(out), "-q"];
    args.extend(["--report", s(&rep)]);
    args.extend(extra);
    tftf_ok(&args);
    report(&rep)
}

/// (input, expected twin) of every golden case; the DCP ones by each path that names them.
fn cases() -> Vec<(&'static str, PathBuf, PathBuf)> {
    let expected = |case: &str| torch_fixture(&format!("{case}/expected/model.safetensors"));
    vec![
        (
            "zip",
            torch_fixture("bin/corners/pytorch_model.bin"),
            expected("bin/corners"),
        ),
        (
            "legacy",
            torch_fixture("bin/legacy/pytorch_model.bin"),
            expected("bin/legacy"),
        ),
        (
            "sharded-dir",
            torch_fixture("bin/hf-sharded"),
            expected("bin/hf-sharded"),
        ),
        (
            "sharded-index",
            torch_fixture("bin/hf-sharded/pytorch_model.bin.index.json"),
            expected("bin/hf-sharded"),
        ),
        (
            "dcp-outer",
            torch_fixture("dcp/full-2rank"),
            expected("dcp/full-2rank"),
        ),
        (
            "dcp-inner",
            torch_fixture("dcp/full-2rank/pytorch_model_fsdp_0"),
            expected("dcp/full-2rank"),
        ),
        (
            "dcp-metadata-file",
            torch_fixture("dcp/full-2rank/pytorch_model_fsdp_0/.metadata"),
            expected("dcp/full-2rank"),
        ),
        (
            "dcp-lora",
            torch_fixture("dcp/lora-2rank"),
            expected("dcp/lora-2rank"),
        ),
        (
            "fp4-params",
            torch_fixture("bin/fp4-params/pytorch_model.bin"),
            expected("bin/fp4-params"),
        ),
        (
            "dcp-plain",
            torch_fixture("dcp/plain-hf"),
            expected("dcp/plain-hf"),
        ),
        (
            "dcp-wrapped-optim",
            torch_fixture("dcp/wrapped-optim"),
            expected("dcp/wrapped-optim"),
        ),
    ]
}

#[test]
fn passthrough_of_every_torch_input_equals_expected_twin() {
    for (name, input, expected) in cases() {
        let (_dir, out) = tmp_out();
        let r = passthrough(&input, &out, &[]);
        let got = read_safetensors(&out);
        let want = read_safetensors(&expected);
        assert_eq!(
            got.keys().collect::<Vec<_>>(),
            want.keys().collect::<Vec<_>>(),
            "{name}: tensor names"
        );
        for (t, w) in &want {
            assert_eq!(&got[t], w, "{name}: tensor `{t}` (dtype, shape, bytes)");
        }
        let total: u64 = want.values().map(|v| v.2.len() as u64).sum();
        let b = &r["bytes"];
        let moved = ["reflinked", "copied_in_kernel", "copied_through_memory"]
            .iter()
            .map(|k| b[k].as_u64().unwrap())
            .sum::<u64>();
        assert_eq!(moved, total, "{name}: every byte copied once: {r}");
        assert_eq!(b["computed"].as_u64(), Some(0), "{name}: {r}");
    }
}

#[test]
fn single_file_output_under_the_smallest_budget_matches_too() {
    for (name, input, expected) in cases() {
        let dir = tmp();
        let out = dir.path().join("one.safetensors");
        passthrough(
            &input,
            &out,
            &["--memory-budget", "16MiB", "--threads", "1"],
        );
        assert_eq!(
            read_safetensors(&out),
            read_safetensors(&expected),
            "{name}"
        );
    }
}

#[test]
fn side_files_follow_the_weights() {
    let (_dir, out) = tmp_out();
    passthrough(&torch_fixture("bin/hf-sharded"), &out, &[]);
    assert_eq!(
        std::fs::read(out.join("config.json")).unwrap(),
        std::fs::read(torch_fixture("bin/hf-sharded/config.json")).unwrap()
    );
    let names = listing(&out);
    assert!(
        names.iter().all(|n| !n.ends_with(".bin")
            && n != "pytorch_model.bin.index.json"
            && !n.ends_with(".distcp")),
        "{names:?}"
    );
    // A DCP folder's `.distcp` files and `.metadata` are weights, not side files; the adapter
    // config beside a LoRA checkpoint stays behind as for any input.
    for input in [
        torch_fixture("dcp/lora-2rank"),
        torch_fixture("dcp/lora-2rank/pytorch_model_fsdp_0"),
    ] {
        let (_dir, out) = tmp_out();
        passthrough(&input, &out, &[]);
        assert_eq!(listing(&out), ["model.safetensors"], "{}", input.display());
    }
}

#[test]
fn synthetic_grid_reads_in_row_major_order() {
    let dir = tmp();
    let out = dir.path().join("grid.safetensors");
    passthrough(
        &torch_fixture("dcp/grid-synthetic"),
        &out,
        &["--memory-budget", "16MiB"],
    );
    let got = read_safetensors(&out);
    let (dtype, shape, data) = &got["grid"];
    assert_eq!(
        (dtype.as_str(), shape.as_slice()),
        ("F32", &[5usize, 7][..])
    );
    let values: Vec<f32> = data
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect();
    let want: Vec<f32> = (0..35).map(|i| i as f32).collect();
    assert_eq!(values, want);
}

#[test]
fn contiguous_bin_tensors_move_in_the_kernel() {
    // Every tensor of the sharded `.bin` fixture is a plain range of its zip member.
    let dir = tmp();
    let r = passthrough(&torch_fixture("bin/hf-sharded"), &dir.path().join("o"), &[]);
    let b = &r["bytes"];
    let kernel = b["copied_in_kernel"].as_u64().unwrap() + b["reflinked"].as_u64().unwrap();
    assert_eq!(b["copied_through_memory"].as_u64(), Some(0), "{r}");
    assert_eq!(kernel, 49472, "{r}");
    // The corner cases hold strided views (gathered through memory) beside plain tensors
    // (still moved by the kernel).
    let r = passthrough(
        &torch_fixture("bin/corners/pytorch_model.bin"),
        &dir.path().join("c"),
        &[],
    );
    let b = &r["bytes"];
    assert!(b["copied_in_kernel"].as_u64().unwrap() + b["reflinked"].as_u64().unwrap() > 0);
    let through_memory = b["copied_through_memory"].as_u64().unwrap();
    assert!(through_memory > 0, "{r}");
    // The dry run says which bytes will be gathered.
    let o = tftf_ok(&[
        "passthrough",
        s(&torch_fixture("bin/corners/pytorch_model.bin")),
        "-o",
        s(&dir.path().join("dry")),
        "--dry-run",
    ]);
    assert_mentions(
        &stdout(&o),
        &[&format!(
            "gathered: {through_memory} B of the unchanged bytes"
        )],
    );
    // A DCP tensor split along dim 0 over two files is copied as two kernel ranges.
    let r = passthrough(&torch_fixture("dcp/full-2rank"), &dir.path().join("d"), &[]);
    assert_eq!(r["bytes"]["copied_through_memory"].as_u64(), Some(0), "{r}");
}

#[test]
fn info_names_the_format() {
    for (input, line) in [
        ("bin/corners/pytorch_model.bin", "format: torch.save zip\n"),
        (
            "bin/legacy/pytorch_model.bin",
            "format: torch.save legacy (pre-1.6)\n",
        ),
        ("bin/hf-sharded", "format: torch.save zip (3 files)\n"),
        ("dcp/full-2rank", "format: PyTorch DCP (2 files)\n"),
        ("dcp/grid-synthetic", "format: PyTorch DCP (2 files)\n"),
    ] {
        let o = tftf_ok(&["info", s(&torch_fixture(input))]);
        assert!(stdout(&o).contains(line), "{input}: {}", stdout(&o));
    }
    let o = tftf_ok(&["info", "--json", s(&torch_fixture("dcp/full-2rank"))]);
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["format"], "PyTorch DCP");
    assert_eq!(v["total_tensors"], 21);
    // Safetensors inputs say so.
    let dir = tmp();
    small_model(dir.path());
    let o = tftf_ok(&["info", s(dir.path())]);
    assert!(stdout(&o).contains("format: safetensors (2 files)\n"));
    // Skipped DCP entries are notes.
    let o = tftf(&["info", s(&torch_fixture("dcp/grid-synthetic"))]);
    assert!(stderr(&o).contains("optimizer state"), "{}", stderr(&o));
}

#[test]
fn validate_accepts_torch_inputs_and_scans_their_values() {
    for (input, format) in [
        ("bin/corners/pytorch_model.bin", "torch.save zip"),
        (
            "bin/legacy/pytorch_model.bin",
            "torch.save legacy (pre-1.6)",
        ),
        ("bin/hf-sharded", "torch.save zip (3 files)"),
        ("dcp/full-2rank", "PyTorch DCP (2 files)"),
        (
            "dcp/lora-2rank/pytorch_model_fsdp_0",
            "PyTorch DCP (2 files)",
        ),
        ("dcp/grid-synthetic", "PyTorch DCP (2 files)"),
    ] {
        let o = tftf_ok(&["validate", "--check-values", s(&torch_fixture(input))]);
        assert!(
            stdout(&o).contains(&format!("format: {format}\n")),
            "{input}: {}",
            stdout(&o)
        );
    }
}

#[test]
fn casting_a_dcp_checkpoint_reads_its_chunks() {
    let dir = tmp();
    let out = dir.path().join("bf16");
    tftf_ok(&[
        "passthrough",
        s(&torch_fixture("dcp/full-2rank")),
        "-o",
        s(&out),
        "-q",
        "--dtype",
        "bf16",
    ]);
    let got = read_safetensors(&out);
    let want = read_safetensors(&torch_fixture("dcp/full-2rank/expected/model.safetensors"));
    assert_eq!(got.len(), want.len());
    for (name, (_, shape, data)) in &want {
        let (dtype, gshape, gdata) = &got[name];
        assert_eq!((dtype.as_str(), gshape), ("BF16", shape), "{name}");
        // bf16 of an f32 is its high half, rounded to nearest even.
        let rounded: Vec<u8> = data
            .chunks_exact(4)
            .flat_map(|c| {
                let x = u32::from_le_bytes(c.try_into().unwrap());
                let r = x.wrapping_add(0x7fff + ((x >> 16) & 1)) >> 16;
                (r as u16).to_le_bytes()
            })
            .collect();
        assert_eq!(gdata, &rounded, "{name}");
    }
}

#[test]
fn malicious_pickle_is_refused_and_nothing_is_created() {
    let (dir, out) = tmp_out();
    let input = torch_fixture("bin/malicious/pytorch_model.bin");
    for cmd in [
        vec!["passthrough", s(&input), "-o", s(&out)],
        vec!["info", s(&input)],
        vec!["validate", s(&input)],
    ] {
        let o = tftf(&cmd);
        assert_eq!(o.status.code(), Some(1), "{cmd:?}");
        // `validate` lists problems on stdout; the others fail on stderr.
        let err = stderr(&o) + &stdout(&o);
        assert!(err.contains("`posix.system`"), "{cmd:?}: {err}");
        assert!(err.contains("pytorch_model.bin"), "{cmd:?}: {err}");
    }
    assert!(!out.exists());
    assert_eq!(listing(dir.path()), Vec::<String>::new());
}

#[test]
fn truncated_bin_names_the_file_and_creates_nothing() {
    let dir = tmp();
    let bytes = std::fs::read(torch_fixture("bin/corners/pytorch_model.bin")).unwrap();
    let input = dir.path().join("model.bin");
    std::fs::write(&input, &bytes[..bytes.len() / 2]).unwrap();
    let out = dir.path().join("out");
    let err = fails(&["passthrough", s(&input), "-o", s(&out)]);
    assert_refused(&err, &["model.bin"], &out);
    assert_eq!(listing(dir.path()), ["model.bin"]);
}

#[test]
fn a_folder_with_both_formats_reads_the_safetensors() {
    // transformers repositories often ship both; the safetensors ones win, as before.
    let dir = tmp();
    let tensors = small_model(dir.path());
    let o = tftf_ok(&["info", s(dir.path())]);
    assert!(stdout(&o).contains("format: safetensors"), "{}", stdout(&o));
    assert!(stdout(&o).contains(&format!("{} tensors", tensors.len())));
}

/// `dir` with the fixture's expected twin as `model.safetensors` and the case's config: the same
/// model in safetensors, to compare a command's output against.
fn safetensors_twin(case: &str, dir: &Path) -> PathBuf {
    let twin = dir.join("twin");
    std::fs::create_dir_all(&twin).unwrap();
    std::fs::copy(
        torch_fixture(&format!("{case}/expected/model.safetensors")),
        twin.join("model.safetensors"),
    )
    .unwrap();
    let config = torch_fixture(case).join("config.json");
    if config.is_file() {
        std::fs::copy(&config, twin.join("config.json")).unwrap();
    }
    twin
}

/// A LoRA adapter (r = 2) on the q_proj of both layers of the tiny Llama fixtures.
fn write_adapter(dir: &Path) -> PathBuf {
    let adapter = dir.join("adapter");
    std::fs::create_dir_all(&adapter).unwrap();
    std::fs::write(
        adapter.join("adapter_config.json"),
        r#"{"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": ["q_proj"]}"#,
    )
    .unwrap();
    let mut rng = Rng(7);
    let mut tensors = Vec::new();
    for layer in 0..2 {
        let p = format!("base_model.model.model.layers.{layer}.self_attn.q_proj");
        tensors.push(rand_t(
            &mut rng,
            &format!("{p}.lora_A.weight"),
            tftf::format::dtype::DType::F32,
            &[2, 32],
        ));
        tensors.push(rand_t(
            &mut rng,
            &format!("{p}.lora_B.weight"),
            tftf::format::dtype::DType::F32,
            &[32, 2],
        ));
    }
    write_file(&adapter.join("adapter_model.safetensors"), &tensors);
    adapter
}

#[test]
fn every_command_gives_the_same_tensors_from_torch_and_safetensors_inputs() {
    let dir = tmp();
    let adapter = write_adapter(dir.path());
    let commands: Vec<Vec<&str>> = vec![
        vec!["merge-lora", "-a", s(&adapter)],
        vec!["passthrough", "--dtype", "f32"],
        vec!["dequant-fp8", "--allow-empty"],
        vec![
            "run",
            "--merge-lora",
            "--adapter",
            s(&adapter),
            "--key-filter",
            "*layers.0*",
            "--dtype-cast",
            "f16",
        ],
    ];
    for (case, input) in [
        ("bin/hf-sharded", torch_fixture("bin/hf-sharded")),
        ("dcp/full-2rank", torch_fixture("dcp/full-2rank")),
    ] {
        let twin = safetensors_twin(case, &dir.path().join(case.replace('/', "-")));
        for (k, cmd) in commands.iter().enumerate() {
            let run = |input: &Path, out: &Path| {
                let mut args = vec![cmd[0], "-i", s(input), "-o", s(out), "-q"];
                args.extend(&cmd[1..]);
                tftf_ok(&args);
                read_safetensors(out)
            };
            let base = dir.path().join(format!("{}-{k}", case.replace('/', "-")));
            let from_torch = run(&input, &base.with_extension("torch"));
            let from_twin = run(&twin, &base.with_extension("st"));
            assert!(!from_torch.is_empty(), "{case} {cmd:?}");
            assert_eq!(from_torch, from_twin, "{case} {cmd:?}");
        }
    }
}

/// A torch.save zip holding `w`, a `[rows, cols]` F32 view with strides `[1, rows]` (a
/// transpose) of a storage whose element `i` is `i as f32`.
fn transposed_zip(rows: u16, cols: u16) -> Vec<u8> {
    transposed_zip_named("w", rows, cols)
}

/// [`transposed_zip`] with the tensor named `name`.
fn transposed_zip_named(name: &str, rows: u16, cols: u16) -> Vec<u8> {
    use std::io::Write;
    let bin2 = |p: &mut Vec<u8>, v: u16| {
        p.push(b'M');
        p.extend(v.to_le_bytes());
    };
    let mut p = b"\x80\x02}X".to_vec();
    p.extend((name.len() as u32).to_le_bytes());
    p.extend(name.as_bytes());
    p.extend(b"ctorch._utils\n_rebuild_tensor_v2\n(");
    p.extend(
        b"(X\x07\x00\x00\x00storagectorch\nFloatStorage\nX\x01\x00\x00\x000X\x03\x00\x00\x00cpuJ",
    );
    p.extend((rows as u32 * cols as u32).to_le_bytes());
    p.extend(b"tQK\x00(");
    bin2(&mut p, rows);
    bin2(&mut p, cols);
    p.extend(b"t(K\x01");
    bin2(&mut p, rows);
    p.extend(b"t\x89}tRs.");
    let mut buf = std::io::Cursor::new(Vec::new());
    let mut z = zip::ZipWriter::new(&mut buf);
    let opts =
        zip::write::SimpleFileOptions::default().compression_method(zip::CompressionMethod::Stored);
    z.start_file("archive/data.pkl", opts).unwrap();
    z.write_all(&p).unwrap();
    z.start_file("archive/data/0", opts).unwrap();
    let storage: Vec<u8> = (0..rows as u32 * cols as u32)
        .flat_map(|i| (i as f32).to_le_bytes())
        .collect();
    z.write_all(&storage).unwrap();
    z.finish().unwrap();
    buf.into_inner()
}

#[test]
fn a_large_strided_view_is_gathered_in_chunks() {
    let (rows, cols) = (1024u16, 768u16);
    let dir = tmp();
    let input = dir.path().join("t.pt");
    std::fs::write(&input, transposed_zip(rows, cols)).unwrap();
    let out = dir.path().join("o.safetensors");
    let r = passthrough(&input, &out, &["--memory-budget", "16MiB"]);
    let nbytes = rows as u64 * cols as u64 * 4;
    assert_eq!(
        r["bytes"]["copied_through_memory"].as_u64(),
        Some(nbytes),
        "{r}"
    );
    assert!(r["chunk_bytes"].as_u64().unwrap() < nbytes, "{r}");
    let got = read_safetensors(&out);
    let (dtype, shape, data) = &got["w"];
    assert_eq!(
        (dtype.as_str(), shape.as_slice()),
        ("F32", &[rows as usize, cols as usize][..])
    );
    for (k, c) in data.chunks_exact(4).enumerate() {
        let (i, j) = (k / cols as usize, k % cols as usize);
        let want = (i + j * rows as usize) as f32;
        assert_eq!(
            f32::from_le_bytes(c.try_into().unwrap()),
            want,
            "w[{i}][{j}]"
        );
    }
}

/// NVFP4 of a weight an earlier section computes from a strided view (not runs of bytes, so its
/// amax cannot be evaluated piecewise before its first block): refused naming the file and the
/// weight, before any output exists.
#[test]
fn nvfp4_of_a_weight_computed_from_a_strided_view_is_refused_before_output() {
    let dir = tmp();
    let input = dir.path().join("t.pt");
    let name = "model.layers.0.mlp.up_proj.weight";
    std::fs::write(&input, transposed_zip_named(name, 64, 32)).unwrap();
    let out = dir.path().join("out");
    let err = fails(&[
        "run",
        "-i",
        s(&input),
        "-o",
        s(&out),
        "-q",
        "--dtype-cast",
        "bf16",
        "--quantize",
        "--scheme",
        "NVFP4A16",
    ]);
    assert_refused(
        &err,
        &["t.pt", name, "cannot be read piecewise", "then quantise it"],
        &out,
    );
    assert_eq!(listing(dir.path()), ["t.pt"]);
}

#[test]
fn a_bin_folder_without_index_skips_trainer_state() {
    let dir = tmp();
    let model = dir.path().join("model");
    std::fs::create_dir(&model).unwrap();
    for e in std::fs::read_dir(torch_fixture("bin/hf-sharded")).unwrap() {
        let p = e.unwrap().path();
        if p.extension().is_some_and(|x| x == "bin") {
            std::fs::copy(&p, model.join(p.file_name().unwrap())).unwrap();
        }
    }
    std::fs::write(model.join("training_args.bin"), "not a checkpoint").unwrap();
    std::fs::write(model.join("optimizer.pt"), "not a checkpoint").unwrap();
    let out = dir.path().join("out");
    let o = tftf_ok(&["passthrough", s(&model), "-o", s(&out)]);
    assert_mentions(&stderr(&o), &["`training_args.bin` skipped"]);
    assert_eq!(
        read_safetensors(&out),
        read_safetensors(&torch_fixture("bin/hf-sharded/expected/model.safetensors"))
    );
}

#[test]
fn safetensors_beside_an_fsdp_checkpoint_win() {
    let dir = tmp();
    let tensors = small_model(dir.path());
    let fsdp = dir.path().join("pytorch_model_fsdp_0");
    std::fs::create_dir(&fsdp).unwrap();
    for e in std::fs::read_dir(torch_fixture("dcp/full-2rank/pytorch_model_fsdp_0")).unwrap() {
        let p = e.unwrap().path();
        std::fs::copy(&p, fsdp.join(p.file_name().unwrap())).unwrap();
    }
    let o = tftf_ok(&["info", "--dtype-summary", s(dir.path())]);
    assert_mentions(&stdout(&o), &["format: safetensors (2 files)"]);
    assert!(stdout(&o).contains(&format!("{} tensors", tensors.len())));
    // Named directly, the DCP folder is read, with the config one level up.
    let o = tftf_ok(&["info", "--dtype-summary", s(&fsdp)]);
    assert_mentions(&stdout(&o), &["format: PyTorch DCP (2 files)"]);
}
