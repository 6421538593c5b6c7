//! `tftf convert MODEL --format gguf|safetensors --outdir DIR` (issue #27 item 6): the bytes
//! of `gguf` / `passthrough`, run exactly as typed from inside the model's folder, and the
//! outputs inside an input that stay refused.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use common::gguf::GgufCase;
use common::*;

/// Runs tftf in `cwd`.
fn tftf_in(cwd: &Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_tftf"))
        .args(args)
        .current_dir(cwd)
        .env("NO_COLOR", "1")
        .output()
        .expect("run tftf")
}

fn ok_in(cwd: &Path, args: &[&str]) {
    ok(&tftf_in(cwd, args));
}

fn fails_in(cwd: &Path, args: &[&str]) -> String {
    let o = tftf_in(cwd, args);
    assert_eq!(o.status.code(), Some(1), "{}\n{}", stderr(&o), stdout(&o));
    stderr(&o)
}

/// A folder `model/` holding `model.pt` (the torch fixture `corners`) and a `config.json`.
fn torch_model_folder(root: &Path) -> PathBuf {
    let dir = root.join("model");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::copy(
        fixture("torch/bin/corners/pytorch_model.bin"),
        dir.join("model.pt"),
    )
    .unwrap();
    std::fs::write(dir.join("config.json"), "{\"model_type\": \"test\"}").unwrap();
    dir
}

#[test]
fn convert_gguf_from_inside_the_model_folder_gives_ggufs_bytes() {
    let c = GgufCase::dense(41, "llama3");
    let reference = c.path("reference.gguf");
    ok_in(
        &c.model,
        &[
            "gguf",
            "model.safetensors",
            "-o",
            s(&reference),
            "--vocab-pre",
            "test-pre",
            "-q",
        ],
    );
    ok_in(
        &c.model,
        &[
            "convert",
            "model.safetensors",
            "--format",
            "gguf",
            "--outdir",
            "./converted",
            "--vocab-pre",
            "test-pre",
            "-q",
        ],
    );
    let out = c.model.join("converted/model.gguf");
    assert_eq!(
        std::fs::read(&out).unwrap(),
        std::fs::read(&reference).unwrap()
    );
    assert_listing(&c.model.join("converted"), "model.gguf");
    // The folder read as a whole still finds only its own weights.
    let info = tftf(&["info", s(&c.model)]);
    ok(&info);
    assert!(!stdout(&info).contains("converted"), "{}", stdout(&info));
}

#[test]
fn convert_safetensors_from_inside_the_folder_of_a_pt_file_gives_passthroughs_bytes() {
    let d = tmp();
    let model = torch_model_folder(d.path());
    let reference = d.path().join("reference");
    ok_in(
        &model,
        &["passthrough", "model.pt", "-o", s(&reference), "-q"],
    );
    ok_in(
        &model,
        &[
            "convert",
            "model.pt",
            "--format",
            "safetensors",
            "--outdir",
            "./converted",
            "-q",
        ],
    );
    let out = model.join("converted");
    assert_listing(&out, "config.json model.safetensors");
    for f in ["model.safetensors", "config.json"] {
        assert_eq!(
            std::fs::read(out.join(f)).unwrap(),
            std::fs::read(reference.join(f)).unwrap(),
            "{f}"
        );
    }
    assert_same_tensors(
        "convert of model.pt",
        &load_all(&out),
        &load_tensors(
            &fixture("torch/bin/corners/expected/model.safetensors"),
            false,
        ),
        |name, _, got, want| assert_eq!(got, want, "{name}"),
    );
}

#[test]
fn convert_gguf_names_the_file_after_a_folder_input() {
    let c = GgufCase::dense(43, "llama3");
    let out = c.path("out");
    ok(&tftf(&[
        "convert",
        s(&c.model),
        "--format",
        "gguf",
        "--outdir",
        s(&out),
        "--vocab-pre",
        "test-pre",
        "-q",
    ]));
    assert_listing(&out, "llama3-model.gguf");
}

#[test]
fn outputs_a_later_read_of_the_input_would_pick_up_are_still_refused() {
    let d = tmp();
    let model = torch_model_folder(d.path());
    // The input's own folder, a folder named like a shard, a folder input's subfolder.
    let cases: [(&str, &[&str]); 3] = [
        ("model.pt", &["--outdir", "."]),
        ("model.pt", &["--outdir", "./shards.safetensors"]),
        (".", &["--outdir", "./converted"]),
    ];
    for (input, outdir) in cases {
        let args = [&["convert", input, "--format", "safetensors"][..], outdir].concat();
        let o = tftf_in(&model, &args);
        assert_ne!(o.status.code(), Some(0), "{args:?} was accepted");
        let msg = stderr(&o);
        assert!(
            msg.contains("inside") || msg.contains("name a directory"),
            "{args:?}: {msg}"
        );
    }
    assert_listing(&model, "config.json model.pt");
    // A folder named like a shard, holding the output further down.
    let msg = fails_in(
        &model,
        &["passthrough", "model.pt", "-o", "./x.safetensors/out"],
    );
    assert_mentions(&msg, &["is the input or inside it"]);
    assert_listing(&model, "config.json model.pt");
    // A safetensors file beside the input, and a folder input's new subfolder.
    let msg = fails_in(
        &model,
        &["passthrough", "model.pt", "-o", "./out.safetensors"],
    );
    assert_mentions(&msg, &["is the input or inside it"]);
    let msg = fails_in(
        &model,
        &[
            "convert",
            ".",
            "--format",
            "safetensors",
            "--outdir",
            "converted",
        ],
    );
    assert_mentions(&msg, &["is the input or inside it"]);
    assert_listing(&model, "config.json model.pt");
}

#[test]
fn options_of_the_other_format_are_refused() {
    let d = tmp();
    let model = torch_model_folder(d.path());
    let out = d.path().join("out");
    let pt = model.join("model.pt");
    for (format, option, value, refusal) in [
        (
            "safetensors",
            "--outtype",
            "q8_0",
            "--outtype applies to --format gguf",
        ),
        (
            "gguf",
            "--dtype",
            "f16",
            "--dtype applies to --format safetensors",
        ),
    ] {
        let msg = usage_error(&[
            "convert",
            s(&pt),
            "--format",
            format,
            "--outdir",
            s(&out),
            option,
            value,
        ]);
        assert_refused(&msg, &[refusal], &out);
    }
}

#[test]
fn help_lists_convert_and_extract_lora() {
    let o = tftf(&["--help"]);
    ok(&o);
    assert_mentions(&stdout(&o), &["convert", "extract-lora"]);
    let o = tftf(&["convert", "--help"]);
    ok(&o);
    assert_mentions(
        &stdout(&o),
        &["--format", "--outdir", "gguf", "safetensors"],
    );
}
