//! Messages and exit codes a user can act on: empty results refused unless `--allow-empty`,
//! `validate`'s semantic checks, structure errors that say what is wrong, hostile file names,
//! progress lines in logs, and what is (and is not) an error after a successful commit.

mod common;

use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use common::*;
use tftf::format::dtype::DType;

/// A one-shard model of BF16 tensors `a.weight` and `b.weight` in `dir`.
fn bf16_model(dir: &Path) {
    std::fs::create_dir_all(dir).unwrap();
    let mut rng = Rng(21);
    Model::new()
        .rand(&mut rng, "a.weight", DType::BF16, &[8, 8])
        .rand(&mut rng, "b.weight", DType::BF16, &[8])
        .write(dir);
}

/// A temporary folder with [`bf16_model`] in `in/`: (folder, `in/`, `out/` (not made)).
fn bf16_in_tmp() -> (tempfile::TempDir, PathBuf, PathBuf) {
    let (d, src) = tmp_in();
    bf16_model(&src);
    let out = d.path().join("out");
    (d, src, out)
}

#[test]
fn filter_keeping_no_tensor_is_refused_unless_allow_empty() {
    let (_d, src, out) = bf16_in_tmp();
    let args = cmd("passthrough", &src, &out, &["-q", "--include", "model.*"]);
    let err = fails(&args);
    assert_eq!(
        err,
        "error: the filters (--include/--exclude, --key-filter/--key-exclude) keep none of the 2 input tensors: nothing to write; pass --allow-empty to write the output anyway\n"
    );
    assert!(!out.exists());
    // validate's dry plan of a pipe says the same.
    let (code, text, _) = exit_code(&["validate", s(&src), "--pipe", "filter:model.*"]);
    assert_eq!(code, Some(1));
    assert_starts(&text, "problem: pipe: the filters (--include/--exclude, --key-filter/--key-exclude) keep none of the 2 input tensors: nothing to write\n");
    // Allowed, the output is one loadable shard without tensors.
    tftf_ok(&[&args[..], &["--allow-empty"]].concat());
    assert_eq!(listing(&out), ["model.safetensors"]);
    assert!(load_all(&out).is_empty());
}

#[test]
fn dequant_fp8_without_fp8_tensors_is_refused_unless_allow_empty() {
    let (_d, src, out) = bf16_in_tmp();
    let args = cmd("dequant-fp8", &src, &out, &["-q"]);
    let err = fails(&args);
    assert_eq!(
        err,
        format!("error: {}: dequant found no quantised weight (no FP8, NVFP4, MXFP4, MXFP8, pack-quantized int, GPTQ or BitNet weight), so there is nothing to dequantise; pass --allow-empty to write the output anyway\n", src.display())
    );
    assert!(!out.exists());
    tftf_ok(&[&args[..], &["--allow-empty"]].concat());
    assert_eq!(load_all(&out).len(), 2);
}

#[test]
fn report_that_cannot_be_written_after_commit_is_a_warning() {
    let (d, src, out) = bf16_in_tmp();
    let report = d.path().join("no-such-dir").join("report.json");
    let (code, stdout, err) = exit_code(&cmd(
        "passthrough",
        &src,
        &out,
        &["--no-progress", "--report", s(&report)],
    ));
    assert_eq!(code, Some(0), "{err}");
    assert!(stdout.starts_with("wrote 1 file(s), 2 tensors"), "{stdout}");
    assert_eq!(
        err,
        format!(
            "warning: the output was written, but not the report: {}: No such file or directory (os error 2)\n",
            report.display()
        )
    );
    assert_eq!(load_all(&out).len(), 2);
}

#[test]
fn reflink_fallback_is_a_one_line_info_only_with_verbose() {
    let (d, src) = tmp_in();
    // Big enough for a block-aligned middle, so a clone is tried.
    Model::new()
        .rand(&mut Rng(22), "w", DType::U8, &[1 << 20])
        .write(&src);
    let out = d.path().join("out");
    let report = d.path().join("r.json");
    let args = cmd("passthrough", &src, &out, &["-q", "--report", s(&report)]);
    let (code, _, err) = exit_code(&args);
    assert_eq!(code, Some(0), "{err}");
    assert_eq!(err, "", "nothing on stderr without -v");
    let r = read_json(&report);
    if r["reflink_unavailable"].is_null() {
        println!("SKIPPED the -v half: this filesystem shares extents, so there is nothing to say");
        return;
    }
    let fs = r["reflink_unavailable"].as_str().unwrap().to_string();
    std::fs::remove_dir_all(&out).unwrap();
    let o = passthrough_ok(&src, &out, &["-v", "--no-progress"]);
    let err = stderr(&o);
    let fs_name = fs
        .rsplit_once(" on ")
        .and_then(|(head, _)| head.rsplit_once('('))
        .map(|(_, name)| name.to_string())
        .unwrap();
    assert_eq!(
        err,
        format!("info: untouched tensors were copied; the output filesystem ({fs_name}) cannot share extents with the input\n"),
        "report said: {fs}"
    );
}

#[test]
fn progress_lines_when_stderr_is_not_a_terminal() {
    let (d, src) = tmp_in();
    let mut rng = Rng(23);
    let big: Vec<u8> = (0..24 << 18)
        .flat_map(|_| (rng.next_u32() as f32).to_le_bytes())
        .collect();
    Model::new()
        .tensor("big", DType::F32, &[24 << 18], big)
        .write(&src);
    let out = d.path().join("out");
    let line = regex::Regex::new(
        r"^progress: (passthrough|validate) model\.safetensors: [0-9.]+ (B|KiB|MiB) of (24|12)\.00 MiB \(\d{1,3}%\), [0-9.]+ (B|KiB|MiB|GiB)/s, ETA (unknown|\d+s|\d+m\d\ds)$",
    )
    .unwrap();
    // Every line of `err` is a progress line and starts with `prefix`.
    let progress_lines = |err: &str, prefix: &str| {
        for l in err.lines() {
            assert!(line.is_match(l), "unexpected line: {l:?}");
            assert!(l.starts_with(prefix), "{l}");
        }
    };
    let (budget, often) = (
        ["--memory-budget", "16MiB"],
        ["--progress-interval", "0.001"],
    );
    let cast = [&["--dtype", "bf16", "--threads", "1"][..], &budget, &often].concat();
    let o = passthrough_ok(&src, &out, &cast);
    let err = stderr(&o);
    assert!(
        err.starts_with(
            "progress: passthrough model.safetensors: 0 B of 12.00 MiB (0%), 0 B/s, ETA unknown\n"
        ),
        "the first line comes at once: {err}"
    );
    progress_lines(&err, "progress: passthrough ");
    let validate = ["validate", s(&src), "--check-values"];
    let o = tftf_ok(&[&validate[..], &budget, &often].concat());
    let err = stderr(&o);
    assert!(!err.is_empty(), "no progress line");
    progress_lines(&err, "progress: validate ");
    // --no-progress and -q silence it; a zero interval is a usage error.
    let o = tftf(&[&validate[..], &["--no-progress"], &often].concat());
    assert_eq!(stderr(&o), "");
    std::fs::remove_dir_all(&out).unwrap();
    let o = passthrough(&src, &out, &[&["-q"][..], &often].concat());
    assert_eq!(stderr(&o), "");
    let err = usage_error(&cmd(
        "passthrough",
        &src,
        &d.path().join("o2"),
        &["--progress-interval", "0"],
    ));
    assert_eq!(
        err,
        "error: --progress-interval `0`: give a positive number of seconds, e.g. 30 or 0.5\n"
    );
}

/// Runs `validate` on `dir`, expects exit 1 and the given problem lines, and the same
/// findings (check names) in `--json`.
fn validate_problems(dir: &Path, problems: &[&str], checks: &[&str]) {
    let (code, out, err) = exit_code(&["validate", s(dir)]);
    assert_eq!(code, Some(1), "{out}{err}");
    let expected: String = problems.iter().map(|p| format!("problem: {p}\n")).collect();
    assert_eq!(
        out,
        format!(
            "{expected}invalid: {} — {} problem(s)\n",
            dir.display(),
            problems.len()
        )
    );
    let (code, out, _) = exit_code(&["validate", s(dir), "--json"]);
    assert_eq!(code, Some(1));
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let got: Vec<&str> = v["findings"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| f["check"].as_str().unwrap())
        .collect();
    assert_eq!(got, checks);
    assert_eq!(v["problems"].as_array().unwrap().len(), problems.len());
}

#[test]
fn validate_finds_quantised_weights_without_scales() {
    use DType::I8;
    let (_d, src) = tmp_in();
    let mut rng = Rng(24);
    Model::new()
        .rand(&mut rng, "q.weight", DType::F8_E4M3, &[4, 4])
        .rand(&mut rng, "k.weight", DType::F8_E4M3, &[4, 4])
        .rand(&mut rng, "k.weight_scale_inv", DType::F32, &[1])
        .rand(&mut rng, "layers.0.ffn.experts.0.w1.weight", I8, &[4, 16])
        .write(&src);
    validate_problems(
        &src,
        &[
            "1 FP8 weight(s) without a scale (`X.weight_scale_inv`, `X.weight_scale` or `X.scale`): `q.weight`; the weights cannot be decoded",
            "1 MXFP4 expert weight(s) without their E8M0 scale (`<expert>.<proj>.scale`, or `X.weight_scale` for NVFP4): `layers.0.ffn.experts.0.w1.weight`; the weights cannot be decoded",
        ],
        &["missing-scale", "missing-scale"],
    );
}

#[test]
fn validate_finds_a_quantization_config_the_tensors_do_not_match() {
    let (_d, src) = tmp_in();
    bf16_model(&src);
    let cfg = r#"{"torch_dtype": "bfloat16", "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}"#;
    std::fs::write(src.join("config.json"), cfg).unwrap();
    validate_problems(
        &src,
        &["config.json: quantization_config (quant_method `fp8`) promises F8_E4M3 or F8_E5M2 tensors, but the checkpoint has none; loaders will mis-read it: remove quantization_config (or convert with a tftf command, which updates it)"],
        &["quantization-config"],
    );
    // FP8 weights whose scale grid is not the configured block size.
    let mut rng = Rng(25);
    Model::new()
        .rand(&mut rng, "w.weight", DType::F8_E4M3, &[256, 256])
        .rand(&mut rng, "w.weight_scale_inv", DType::F32, &[4, 4])
        .rand(&mut rng, "n.weight", DType::BF16, &[256])
        .write(&src);
    validate_problems(
        &src,
        &["config.json: quantization_config.weight_block_size [128, 128] does not fit the scales of 1 FP8 weight(s): `w.weight`"],
        &["quantization-config"],
    );
}

#[test]
fn validate_finds_a_torch_dtype_no_tensor_has() {
    let (_d, src) = tmp_in();
    bf16_model(&src);
    std::fs::write(src.join("config.json"), r#"{"torch_dtype": "float32"}"#).unwrap();
    validate_problems(
        &src,
        &["config.json: torch_dtype is `float32` but no tensor is F32 (the float tensors are mostly BF16): set torch_dtype to `bfloat16`"],
        &["torch-dtype"],
    );
    std::fs::write(src.join("config.json"), r#"{"torch_dtype": "bfloat16"}"#).unwrap();
    tftf_ok(&["validate", s(&src)]);
}

/// Issue #24 item 18: a stale index `total_size` (llm-compressor's `save_pretrained` writes
/// them) loads everywhere, so `validate` notes it and passes.
#[test]
fn validate_notes_a_wrong_index_total_size_and_passes() {
    let (d, src) = tmp_in();
    // Two shards of U8 tensors `a` [4] and `b` [6], drawn in that order.
    let mut rng = Rng(26);
    let (a, b) = (rng.bytes(4), rng.bytes(6));
    let model = Model::new().tensor("a", DType::U8, &[4], a);
    model.shard().tensor("b", DType::U8, &[6], b).write(&src);
    let (_, clean, _) = exit_code(&["validate", s(&src)]);
    assert!(!clean.contains("total_size"), "{clean}");
    let index = src.join("model.safetensors.index.json");
    let text = std::fs::read_to_string(&index)
        .unwrap()
        .replace("\"total_size\":10", "\"total_size\":20");
    std::fs::write(&index, text).unwrap();
    let note = format!(
        "{}: metadata.total_size is 20 but the tensors it lists hold 10 bytes; loaders read only weight_map, so the checkpoint loads (tftf writes the sum)",
        index.display()
    );
    let (code, out, err) = exit_code(&["validate", s(&src)]);
    assert_eq!(code, Some(0), "{out}{err}");
    assert!(out.starts_with(&format!("note: {note}\nok: ")), "{out}");
    let (code, out, _) = exit_code(&["validate", s(&src), "--json"]);
    assert_eq!(code, Some(0));
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["ok"], true);
    assert_eq!(v["findings"], serde_json::json!([]));
    assert_eq!(v["notes"], serde_json::json!([note]));
    // The small model of the other tests is clean.
    let clean = d.path().join("clean");
    small_model(&clean);
    tftf_ok(&["validate", s(&clean)]);
}

#[test]
fn metadata_of_non_strings_says_so() {
    let (_d, src) = tmp_in();
    std::fs::create_dir_all(&src).unwrap();
    let header = r#"{"__metadata__":{"format":"pt","step":1000},"w":{"dtype":"U8","shape":[2],"data_offsets":[0,2]}}"#;
    let file = src.join("model.safetensors");
    std::fs::write(&file, raw_safetensors(header, &[1, 2])).unwrap();
    let err = fails(&["info", s(&file)]);
    assert_eq!(
        err,
        format!(
            "error: {}: invalid header: `__metadata__` values must be strings (`step` is 1000)\n",
            file.display()
        )
    );
}

#[test]
fn fifos_and_devices_as_input_say_what_they_are() {
    let d = tmp();
    let fifo = d.path().join("pipe.safetensors");
    let c = std::ffi::CString::new(fifo.as_os_str().as_bytes()).unwrap();
    // SAFETY: mkfifo(3) on a NUL-terminated path we own.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
    let out = d.path().join("out");
    let err = fails(&cmd("passthrough", &fifo, &out, &[]));
    assert_eq!(
        err,
        format!("error: {}: is a FIFO (named pipe), not a regular file: tftf reads tensors at the offsets its header gives, so it needs a .safetensors file on disk (save the stream to a file first)\n", fifo.display())
    );
    // A FIFO among the shards of a directory, found before anything is opened.
    let dir = d.path().join("m");
    bf16_model(&dir);
    std::fs::rename(&fifo, dir.join("model-extra.safetensors")).unwrap();
    let err = fails(&["info", s(&dir)]);
    assert_starts(
        &err,
        &format!(
            "error: {}: is a FIFO (named pipe), not a regular file",
            dir.join("model-extra.safetensors").display()
        ),
    );
    let err = fails(&["info", "/dev/null"]);
    assert_starts(
        &err,
        "error: /dev/null: is a character device, not a regular file",
    );
    assert!(!out.exists());
}

#[test]
fn hidden_appledouble_files_are_ignored_with_a_note() {
    let (d, src) = tmp_in();
    bf16_model(&src);
    std::fs::write(
        src.join("._model.safetensors"),
        b"\x00\x05\x16\x07 Mac OS X",
    )
    .unwrap();
    let out = d.path().join("out");
    let o = passthrough_ok(&src, &out, &["--no-progress"]);
    assert_eq!(
        stderr(&o),
        format!(
            "note: {}: ignored `._model.safetensors`: a hidden `._*` file (macOS metadata), not a shard\n",
            src.display()
        )
    );
    assert_eq!(load_all(&out).len(), 2);
    assert!(!out.join("._model.safetensors").exists());
    let (code, out, _) = exit_code(&["validate", s(&src)]);
    assert_eq!(code, Some(0));
    assert_starts(&out, "note: ignored `._model.safetensors`");
}

#[test]
fn non_utf8_shard_names_work_and_print_escaped() {
    let (d, src) = tmp_in();
    std::fs::create_dir_all(&src).unwrap();
    let name = std::ffi::OsStr::from_bytes(b"gewichte-\xe4\x01.safetensors");
    Model::new()
        .rand(&mut Rng(27), "a.weight", DType::BF16, &[4])
        .write_file(&src.join(name));
    let o = tftf_ok(&["info", s(&src), "--json"]);
    let v: serde_json::Value = serde_json::from_str(&stdout(&o)).unwrap();
    assert_eq!(v["total_tensors"], 1);
    let out = d.path().join("out");
    let report = d.path().join("r.json");
    passthrough_ok(&src, &out, &["-q", "--report", s(&report)]);
    assert_eq!(load_all(&out).len(), 1);
    let r = read_json(&report);
    assert!(
        r["input"]["shards"][0]
            .as_str()
            .unwrap()
            .ends_with("gewichte-\u{fffd}\u{1}.safetensors"),
        "{r}"
    );
    // A broken shard beside it is named escaped.
    std::fs::write(
        src.join(std::ffi::OsStr::from_bytes(b"b\xff\n.safetensors")),
        [1, 2],
    )
    .unwrap();
    let err = fails(&["info", s(&src)]);
    assert_eq!(
        err,
        format!(
            "error: {}/b\\xff\\n.safetensors: file is 2 bytes, shorter than the 8-byte safetensors length prefix\n",
            src.display()
        )
    );
}

#[test]
fn control_characters_in_names_are_printed_escaped() {
    let (d, src) = tmp_in();
    let evil = "x\r\u{1b}[2Jy.weight";
    Model::new()
        .rand(&mut Rng(28), evil, DType::F8_E4M3, &[4, 4])
        .write(&src);
    let text = stdout(&tftf(&["info", s(&src)]));
    assert!(!text.contains('\u{1b}') && !text.contains('\r'), "{text:?}");
    assert!(text.contains("x\\r\\u{1b}[2Jy.weight  F8_E4M3"), "{text}");
    let out = d.path().join("out");
    let err = fails(&cmd("dequant-fp8", &src, &out, &[]));
    assert_eq!(
        err,
        format!(
            "error: {}: FP8 weight `x\\r\\u{{1b}}[2Jy.weight` has no scale (looked for `x\\r\\u{{1b}}[2Jy.weight_scale_inv`, `x\\r\\u{{1b}}[2Jy.weight_scale`, `x\\r\\u{{1b}}[2Jy.scale`); pass --allow-unscaled-fp8 to decode such weights without one\n",
            src.join("model.safetensors").display()
        )
    );
    let (_, out, _) = exit_code(&["validate", s(&src)]);
    assert!(!out.contains('\u{1b}') && !out.contains('\r'), "{out:?}");
}
