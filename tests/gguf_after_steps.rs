//! GGUF output after other steps, in one pass (issue 27 §5): `tftf run --merge CONFIG …
//! --gguf --outtype T -o OUT.gguf`, and `--gguf` after any other section, write the bytes of
//! writing those steps' checkpoint first and converting it with `tftf gguf` — tensors,
//! metadata, the merged `config.json` (a frankenmerge's layer count) and tokenizer (a union
//! vocabulary) — with no intermediate copy.

mod common;

use std::path::{Path, PathBuf};

use common::gguf::*;
use common::*;

const PRE: &str = "llama-bpe";

/// `tftf gguf -i MODEL -o OUT --vocab-pre PRE EXTRA -q`, succeeding.
fn gguf_of(model: &Path, out: &Path, extra: &[&str]) {
    let args = [&["--vocab-pre", PRE][..], extra, &["-q"]].concat();
    ok(&tftf(&gguf_args(model, out, &args)));
}

/// Asserts that the one-pass GGUF `one` holds what the two-step one `two` holds: every
/// metadata key and value in the same order (both named after the same stem, as
/// `general.name` is), every tensor's name, shape, type and bytes. The tensors' order may
/// differ: the one pass lays them out in name order, as converting a one-file checkpoint does,
/// where the checkpoint the two steps write may be cut into several files.
fn assert_same_gguf(one: &Path, two: &Path, tag: &str) {
    let (a, b) = (parse(one), parse(two));
    assert!(a.tensors.len() > 10, "{tag}: {} tensors", a.tensors.len());
    assert!(a.kvs == b.kvs, "{tag}: metadata differs");
    assert_eq!(
        a.tensors.keys().collect::<Vec<_>>(),
        b.tensors.keys().collect::<Vec<_>>(),
        "{tag}: tensor names"
    );
    for (name, t) in &a.tensors {
        assert!(*t == b.tensors[name], "{tag}: {name} differs");
    }
    assert_eq!(
        std::fs::metadata(one).unwrap().len(),
        std::fs::metadata(two).unwrap().len(),
        "{tag}: file length"
    );
}

/// A merge config of `method` over `models` (the first the base), with `extra` lines.
fn merge_config(dir: &Path, tag: &str, method: &str, models: &[&Path], extra: &str) -> PathBuf {
    let mut text = format!(
        "merge_method: {method}\nbase_model: {}\n",
        models[0].display()
    );
    text.push_str("models:\n");
    for (k, m) in models.iter().enumerate() {
        text.push_str(&format!("  - model: {}\n", m.display()));
        let (w, d) = [(0.6, 0.5), (0.4, 0.7)][k % 2];
        match method {
            "model_stock" => {}
            "linear" => text.push_str(&format!("    parameters: {{weight: {w}}}\n")),
            _ if k > 0 => {
                text.push_str(&format!("    parameters: {{weight: {w}, density: {d}}}\n"))
            }
            _ => {}
        }
    }
    text.push_str("dtype: bfloat16\n");
    text.push_str(extra);
    let path = dir.join(format!("{tag}.yml"));
    std::fs::write(&path, text).unwrap();
    path
}

/// `tftf merge CONFIG`, then `tftf gguf` of the merge, against `tftf run --merge CONFIG --gguf`
/// in one pass with `run_extra` (a small budget, one thread).
fn assert_merge_then_gguf(dir: &Path, tag: &str, cfg: &Path, gguf: &[&str], run_extra: &[&str]) {
    let two = dir.join(format!("two-{tag}"));
    let merged = two.join("m");
    ok(&tftf(&["merge", s(cfg), s(&merged), "-q"]));
    gguf_of(&merged, &two.join("m.gguf"), gguf);
    let one = dir.join(format!("one-{tag}/m.gguf"));
    let mut args = vec!["run", "-o", s(&one), "-q", "--merge", s(cfg), "--gguf"];
    args.extend(gguf);
    args.extend(["--vocab-pre", PRE]);
    args.extend(run_extra);
    ok(&tftf(&args));
    assert_same_gguf(&one, &two.join("m.gguf"), tag);
    assert_listing(one.parent().unwrap(), "m.gguf");
}

/// Merges of three Llamas whose weights take several chunks each under a 16 MiB budget: a
/// weighted average (no statistics), TIES (its magnitude cut gathered in passes over each
/// weight before the GGUF encoder reads it), model_stock (angles) and a frankenmerge that
/// stacks layer ranges (a new layer count in `config.json`), into Q8_0, the k-quant mix
/// Q4_K_M and BF16.
#[test]
fn a_merge_written_as_gguf_in_one_pass_is_the_merge_then_gguf() {
    let cases = [
        GgufCase::wide_llama(101),
        GgufCase::wide_llama(102),
        GgufCase::wide_llama(103),
    ];
    let models: Vec<&Path> = cases.iter().map(|c| c.model.as_path()).collect();
    let dir = tmp();
    let d = dir.path();
    let small = ["--memory-budget", "16MiB", "--threads", "1"];
    let cfg = merge_config(d, "linear", "linear", &models, "");
    assert_merge_then_gguf(d, "linear", &cfg, &["--outtype", "q8_0"], &small);
    let cfg = merge_config(d, "ties", "ties", &models, "");
    assert_merge_then_gguf(d, "ties", &cfg, &["--outtype", "q4_k_m"], &small);
    let cfg = merge_config(d, "model_stock", "model_stock", &models, "");
    assert_merge_then_gguf(d, "model_stock", &cfg, &["--outtype", "q8_0"], &[]);
    let slices = format!(
        "merge_method: passthrough\nslices:\n  - sources:\n      - model: {}\n        layer_range: [0, 2]\n  - sources:\n      - model: {}\n        layer_range: [1, 2]\ndtype: bfloat16\n",
        models[0].display(),
        models[1].display()
    );
    let cfg = d.join("passthrough.yml");
    std::fs::write(&cfg, slices).unwrap();
    assert_merge_then_gguf(d, "passthrough", &cfg, &["--outtype", "bf16"], &small);
    let g = parse(&d.join("one-passthrough/m.gguf"));
    assert_eq!(g.u32("llama.block_count"), 3);
    assert_eq!(g.str("general.name"), "m");
}

/// A merge with `tokenizer_source: union` and a chat template: the GGUF's vocabulary is the
/// merged tokenizer the merge writes, not the donor's.
#[test]
fn a_merged_vocabulary_reaches_the_gguf() {
    let dir = tmp();
    let cfg = fixture("merge/tokenizer/configs/union_linear.yml");
    let two = dir.path().join("two");
    ok(&tftf(&["merge", s(&cfg), s(&two.join("m")), "-q"]));
    let pre = ["--vocab-pre", "gpt-2", "-q"];
    ok(&tftf(
        &[
            &gguf_args(&two.join("m"), &two.join("m.gguf"), &[])[..],
            &pre,
        ]
        .concat(),
    ));
    let one = dir.path().join("one/m.gguf");
    ok(&tftf(
        &[
            &["run", "-o", s(&one), "--merge", s(&cfg), "--gguf"][..],
            &pre,
        ]
        .concat(),
    ));
    assert_same_gguf(&one, &two.join("m.gguf"), "union");
    let g = parse(&one);
    let donor = parse(&{
        let p = dir.path().join("donor.gguf");
        let model = fixture("merge/tokenizer/models/a");
        ok(&tftf(&[&gguf_args(&model, &p, &[])[..], &pre].concat()));
        p
    });
    assert_ne!(
        g.kv("tokenizer.ggml.tokens"),
        donor.kv("tokenizer.ggml.tokens"),
        "the union vocabulary, not the donor's"
    );
    assert!(g.kv("tokenizer.chat_template").is_some());
}

/// `--gguf` after other sections: a cast (which edits `config.json`'s dtype), a LoRA merge
/// (an adapter `extract-lora` made from two of the models) and a rename that leaves the names
/// as they were, each the bytes of `run` into safetensors, then `gguf`.
#[test]
fn sections_before_gguf_are_the_run_then_gguf() {
    let (base, tuned) = (GgufCase::dense(61, "llama3"), GgufCase::dense(62, "llama3"));
    let dir = tmp();
    let d = dir.path();
    let adapter = d.join("adapter");
    ok(&tftf(&[
        "extract-lora",
        "--base",
        s(&base.model),
        "--model",
        s(&tuned.model),
        "-r",
        "4",
        "-o",
        s(&adapter),
        "-q",
    ]));
    let cases: [(&str, Vec<&str>, &str); 3] = [
        ("cast", vec!["--dtype-cast", "--dtype", "f16"], "auto"),
        (
            "lora",
            vec!["--merge-lora", "--adapter", s(&adapter), "--scale", "0.5"],
            "q8_0",
        ),
        (
            "rename",
            vec!["--key-rename", "--rule", "^model\\.norm\\.", "model.norm."],
            "q4_0",
        ),
    ];
    for (tag, sections, outtype) in cases {
        let two = d.join(format!("two-{tag}"));
        let written = two.join("m");
        let mut args = vec!["run", "-i", s(&base.model), "-o", s(&written), "-q"];
        args.extend(&sections);
        ok(&tftf(&args));
        gguf_of(&written, &two.join("m.gguf"), &["--outtype", outtype]);
        let one = d.join(format!("one-{tag}/m.gguf"));
        let mut args = vec!["run", "-i", s(&base.model), "-o", s(&one), "-q"];
        args.extend(&sections);
        args.extend(["--gguf", "--outtype", outtype, "--vocab-pre", PRE]);
        ok(&tftf(&args));
        assert_same_gguf(&one, &two.join("m.gguf"), tag);
    }
    // The LoRA merge changed the weights it targets.
    let plain = d.join("plain.gguf");
    gguf_of(&base.model, &plain, &["--outtype", "q8_0"]);
    let (a, b) = (parse(&plain), parse(&d.join("one-lora/m.gguf")));
    assert_ne!(
        a.tensor("blk.0.attn_q.weight").2,
        b.tensor("blk.0.attn_q.weight").2
    );
}

/// `--gguf` comes last, once, and takes float weights: a quantising section before it, or a
/// section after it, is refused naming the section, before any output exists.
#[test]
fn gguf_sections_that_cannot_apply_are_refused_before_any_output() {
    let c = GgufCase::dense(63, "llama3");
    let out = c.path("out/m.gguf");
    let base = ["run", "-i", s(&c.model), "-o", s(&out)];
    for (sections, needles) in [
        (
            &["--quantize", "--scheme", "FP8_BLOCK", "--gguf"][..],
            &["--quantize", "writes quantised tensors", "--outtype"][..],
        ),
        (
            &[
                "--gguf",
                "--outtype",
                "q8_0",
                "--dtype-cast",
                "--dtype",
                "f16",
            ],
            &["--gguf", "must be the last section"],
        ),
        (
            &["--gguf", "--gguf"],
            &["--gguf", "must be the last section, and the only one"],
        ),
        (
            &["--gguf", "--outtype", "q9_9"],
            &["--gguf", "--outtype `q9_9`"],
        ),
    ] {
        let err = usage_error(&[&base[..], sections].concat());
        assert_mentions(&err, needles);
        assert!(!c.path("out").exists(), "{sections:?}: {err}");
    }
}

/// A tokenizer the GGUF cannot take after a merge is refused naming the file as the user
/// knows it: the donor's own tokenizer by its path, a merged one as the merge writes it. No
/// output exists, and the folder the merged tokenizer files were staged in is gone.
#[test]
fn a_tokenizer_refused_after_a_merge_is_named_as_the_user_knows_it() {
    let dir = tmp();
    let staging = dir.path().join("tmp");
    std::fs::create_dir_all(&staging).unwrap();
    let donor = std::fs::canonicalize(fixture("merge/models/a_bf16/tokenizer.json")).unwrap();
    let donor_bytes = std::fs::read(&donor).unwrap();
    for (cfg, named) in [
        ("merge/configs/ties.yml", donor.display().to_string()),
        (
            "merge/tokenizer/configs/union_linear.yml",
            "tokenizer.json (as the earlier steps write it)".to_string(),
        ),
    ] {
        let out = dir.path().join("out/m.gguf");
        let o = std::process::Command::new(env!("CARGO_BIN_EXE_tftf"))
            .args(["run", "-o", s(&out), "--merge", s(&fixture(cfg)), "--gguf"])
            .env("TMPDIR", &staging)
            .output()
            .unwrap();
        assert_eq!(o.status.code(), Some(1), "{cfg}: {}", stderr(&o));
        let err = stderr(&o);
        assert_starts(
            &err,
            &format!("error: {named}: the pre-tokenizer is not one llama.cpp knows"),
        );
        assert!(!dir.path().join("out").exists(), "{cfg}");
        // The staged links are gone, the donor's files they pointed to are not.
        assert_listing(&staging, "");
        assert_eq!(std::fs::read(&donor).unwrap(), donor_bytes, "{cfg}");
    }
}

/// `tftf merge CONFIG OUT.gguf --outtype T` is `tftf run --merge CONFIG --gguf --outtype T`
/// (the short LoRA form too); GGUF options beside another output, and mergekit's shard size
/// beside a GGUF, are refused before any output exists.
#[test]
fn merge_into_a_gguf_file_is_run_merge_gguf() {
    let dir = tmp();
    let d = dir.path();
    let cfg = fixture("merge/configs/ties.yml");
    let pre = ["--vocab-pre", "gpt-2", "-q"];
    let merged = d.join("merge/m.gguf");
    ok(&tftf(
        &[
            &["merge", s(&cfg), s(&merged), "--outtype", "f16"][..],
            &pre,
        ]
        .concat(),
    ));
    let run = d.join("run/m.gguf");
    let args = [
        "run",
        "-o",
        s(&run),
        "--merge",
        s(&cfg),
        "--gguf",
        "--outtype",
        "f16",
    ];
    ok(&tftf(&[&args[..], &pre].concat()));
    assert_eq!(
        std::fs::read(&merged).unwrap(),
        std::fs::read(&run).unwrap()
    );
    assert_listing(&d.join("merge"), "m.gguf");
    let out = d.join("bad/m");
    let err = usage_error(&["merge", s(&cfg), s(&out), "--outtype", "q8_0"]);
    assert_mentions(&err, &["GGUF options apply to a GGUF output", "OUT.gguf"]);
    let gguf = d.join("bad/m.gguf");
    let err = usage_error(&["merge", s(&cfg), s(&gguf), "--out-shard-size", "1B"]);
    assert_mentions(&err, &["--out-shard-size", "--split-max-size"]);
    assert!(!d.join("bad").exists());
    // The dry run lists each tensor computed by the merge as the encoder reads it.
    let dry = d.join("dry/m.gguf");
    let o = tftf(&[
        "merge",
        s(&cfg),
        s(&dry),
        "--vocab-pre",
        "gpt-2",
        "--dry-run",
    ]);
    ok(&o);
    assert_mentions(&stdout(&o), &["blk.0.attn_k.weight", "computed + rows"]);
    assert!(!d.join("dry").exists());
}

/// The output policy applies to a merged GGUF as to any output: two `--part` jobs and
/// `finalize`, a `--resume` run and a `--checksums` run all write the one run's file, and
/// nothing beside it but the checksums (none of the merge's side files: a GGUF carries its
/// config and tokenizer inside).
#[test]
fn a_merged_gguf_takes_parts_resume_and_checksums() {
    let dir = tmp();
    let d = dir.path();
    let cfg = fixture("merge/configs/ties.yml");
    let run = |out: &Path, extra: &[&str]| {
        let args = [
            "run",
            "-o",
            s(out),
            "--merge",
            s(&cfg),
            "--gguf",
            "--outtype",
            "q8_0",
        ];
        ok(&tftf(
            &[&args[..], &["--vocab-pre", "gpt-2", "-q"], extra].concat(),
        ));
    };
    let one = d.join("one/m.gguf");
    run(&one, &[]);
    let parts = d.join("parts/m.gguf");
    run(&parts, &["--part", "1/2"]);
    run(&parts, &["--part", "2/2"]);
    ok(&tftf(&["finalize", s(&d.join("parts")), "-q"]));
    let resumed = d.join("resume/m.gguf");
    run(&resumed, &["--resume"]);
    let sums = d.join("sums/m.gguf");
    run(&sums, &["--checksums"]);
    let want = std::fs::read(&one).unwrap();
    for (out, listing) in [
        (&parts, "SHA256SUMS m.gguf tftf-manifest.json"),
        (&resumed, "SHA256SUMS m.gguf tftf-manifest.json"),
        (&sums, "SHA256SUMS m.gguf tftf-manifest.json"),
    ] {
        assert!(std::fs::read(out).unwrap() == want, "{}", out.display());
        assert_listing(out.parent().unwrap(), listing);
    }
    assert_listing(&d.join("one"), "m.gguf");
}
