//! `tftf gguf` as a job on the shared pipeline: the same bytes whatever the threads, readers,
//! writers and chunk sizes; the output policy every writing command has (checksums, report,
//! device, `--part K/N` + `finalize`, `--resume`).

mod common;
use common::gguf::*;
use common::*;

use serde_json::Value as Json;
use tftf::format::dtype::DType;

#[test]
fn threads_readers_writers_and_chunk_sizes_change_no_byte() {
    let c = GgufCase::wide_llama(23);
    for outtype in ["q8_0", "f16"] {
        let runs: [&[&str]; 4] = [
            &[],
            &[
                "--threads",
                "1",
                "--io-threads",
                "1",
                "--memory-budget",
                "16MiB",
            ],
            &[
                "--threads",
                "3",
                "--io-threads",
                "4",
                "--memory-budget",
                "16MiB",
            ],
            &["--threads", "2", "--device", "cpu", "--no-reflink"],
        ];
        let mut first: Option<Vec<u8>> = None;
        for (k, extra) in runs.iter().enumerate() {
            let out = c.path(&format!("{outtype}-{k}.gguf"));
            let args = [&["--outtype", outtype][..], extra].concat();
            c.convert(&format!("{outtype}-{k}.gguf"), "llama-bpe", &args);
            let bytes = std::fs::read(&out).unwrap();
            match &first {
                None => first = Some(bytes),
                Some(want) => assert!(bytes == *want, "{outtype}: run {k} ({extra:?}) differs"),
            }
        }
    }
}

#[test]
fn the_smallest_budget_streams_a_tensor_in_several_chunks() {
    let c = GgufCase::wide_llama(23);
    let report = c.path("r.json");
    c.convert(
        "q.gguf",
        "llama-bpe",
        &[
            "--outtype",
            "q8_0",
            "--memory-budget",
            "16MiB",
            "--report",
            s(&report),
        ],
    );
    let r = read_json(&report);
    let chunk = r["chunk_bytes"].as_u64().unwrap();
    // q_proj is 2 MiB of BF16: more than one chunk, so chunks really were cut mid-tensor.
    assert!(chunk < 2 << 20, "{r}");
    assert!(r["pool_peak_bytes"].as_u64().unwrap() <= 16 << 20, "{r}");
    assert_eq!(r["device"], "cpu", "{r}");
}

#[test]
fn checksums_go_beside_the_gguf_and_verify_checks_them() {
    let c = GgufCase::dense(5, "qwen3");
    let out = c.path("out/m.gguf");
    c.convert("out/m.gguf", "qwen2", &["--checksums", "--outtype", "q8_0"]);
    assert_listing(&c.path("out"), "SHA256SUMS m.gguf tftf-manifest.json");
    let sums = std::fs::read_to_string(c.path("out/SHA256SUMS")).unwrap();
    assert!(sums.contains("  m.gguf"), "{sums}");
    let manifest: Json = read_json(&c.path("out/tftf-manifest.json"));
    assert!(
        manifest.to_string().contains("blk.0.attn_q.weight"),
        "{manifest}"
    );
    tftf_ok(&["verify", s(&c.path("out"))]);
    // One flipped byte in the last tensor: verify names the file and fails.
    let mut bytes = std::fs::read(&out).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 1;
    std::fs::write(&out, bytes).unwrap();
    let (code, stdout, _) = exit_code(&["verify", s(&c.path("out"))]);
    assert_eq!(code, Some(1));
    assert_mentions(&stdout, &["m.gguf"]);
}

/// The split files of `dir` and their bytes, by name.
fn split_files(dir: &std::path::Path) -> Vec<(String, Vec<u8>)> {
    listing(dir)
        .into_iter()
        .filter(|n| n.ends_with(".gguf"))
        .map(|n| {
            let bytes = std::fs::read(dir.join(&n)).unwrap();
            (n, bytes)
        })
        .collect()
}

#[test]
fn split_files_written_as_parts_and_finalized_equal_one_run() {
    let c = GgufCase::dense(6, "qwen3");
    let split = ["--split-max-size", "20K", "--outtype", "q8_0"];
    let quiet = [&split[..], &["--vocab-pre", "qwen2", "-q"]].concat();
    tftf_ok(&gguf_args(&c.model, &c.path("one/m.gguf"), &quiet));
    let want = split_files(&c.path("one"));
    assert!(
        want.len() >= 3,
        "{:?}",
        want.iter().map(|f| &f.0).collect::<Vec<_>>()
    );
    // Two jobs of an array, then finalize; and one resumable run.
    let out = c.path("parts/m.gguf");
    for part in ["1/2", "2/2"] {
        let args = [&split[..], &["--vocab-pre", "qwen2", "--part", part, "-q"]].concat();
        tftf_ok(&gguf_args(&c.model, &out, &args));
    }
    assert!(c.path("parts/.tftf-parts").is_dir());
    tftf_ok(&["finalize", s(&c.path("parts")), "-q"]);
    let resumed = c.path("resumed/m.gguf");
    let args = [&split[..], &["--vocab-pre", "qwen2", "--resume", "-q"]].concat();
    tftf_ok(&gguf_args(&c.model, &resumed, &args));
    for dir in ["parts", "resumed"] {
        assert!(
            split_files(&c.path(dir)) == want,
            "{dir}: the split files differ"
        );
        // No safetensors index beside GGUF split files; checksums are on for parts.
        let mut names: Vec<String> = want.iter().map(|f| f.0.clone()).collect();
        names.extend(["SHA256SUMS".into(), "tftf-manifest.json".into()]);
        names.sort();
        assert_eq!(listing(&c.path(dir)), names, "{dir}");
        tftf_ok(&["verify", s(&c.path(dir))]);
    }
}

#[test]
fn the_report_counts_what_was_copied_and_computed() {
    let c = GgufCase::dense(8, "qwen3");
    let report = c.path("r.json");
    c.convert("m.gguf", "qwen2", &["--report", s(&report)]);
    let r = read_json(&report);
    let bytes = &r["bytes"];
    // BF16 weights stay BF16 (copied); the norms become F32 (computed).
    assert!(bytes["copied_unchanged"].as_u64().unwrap() > 0, "{r}");
    assert!(bytes["computed"].as_u64().unwrap() > 0, "{r}");
    assert_eq!(
        bytes["tensors"].as_u64().unwrap(),
        bytes["copied_unchanged"].as_u64().unwrap() + bytes["computed"].as_u64().unwrap(),
        "{r}"
    );
    assert_eq!(r["input"]["format"], "safetensors", "{r}");
    assert!(r["io_threads"].as_u64().unwrap() >= 1, "{r}");
}

#[test]
fn gguf_parts_leave_the_files_beside_them_alone() {
    let c = GgufCase::dense(9, "qwen3");
    let dir = c.path("out");
    std::fs::create_dir_all(&dir).unwrap();
    // Another model's files in the same folder: not this run's to remove, even with --force.
    for (name, text) in [("model.safetensors", "other model"), ("notes.txt", "mine")] {
        std::fs::write(dir.join(name), text).unwrap();
    }
    let out = dir.join("m.gguf");
    let split = [
        "--split-max-size",
        "20K",
        "--vocab-pre",
        "qwen2",
        "-q",
        "--force",
    ];
    for part in ["1/2", "2/2"] {
        let args = [&split[..], &["--part", part]].concat();
        tftf_ok(&gguf_args(&c.model, &out, &args));
    }
    tftf_ok(&["finalize", s(&dir), "--force", "-q"]);
    assert_eq!(
        std::fs::read_to_string(dir.join("model.safetensors")).unwrap(),
        "other model"
    );
    assert_eq!(
        std::fs::read_to_string(dir.join("notes.txt")).unwrap(),
        "mine"
    );
    assert!(listing(&dir)
        .iter()
        .any(|n| n == "m-00001-of-00002.gguf" || n.starts_with("m-00001-of-")));
    tftf_ok(&["verify", s(&dir)]);
    // A split file whose entries are removed from both lists is named; the other model's
    // files beside the GGUF are not.
    let second = listing(&dir)
        .into_iter()
        .find(|n| n.starts_with("m-00002-of-"))
        .unwrap();
    let sums = std::fs::read_to_string(dir.join("SHA256SUMS")).unwrap();
    let kept: String = sums
        .lines()
        .filter(|l| !l.ends_with(&second))
        .map(|l| format!("{l}\n"))
        .collect();
    std::fs::write(dir.join("SHA256SUMS"), kept).unwrap();
    let mut m = read_json(&dir.join("tftf-manifest.json"));
    m["files"]
        .as_array_mut()
        .unwrap()
        .retain(|f| f["name"] != second.as_str());
    std::fs::write(dir.join("tftf-manifest.json"), m.to_string()).unwrap();
    let o = tftf(&["verify", s(&dir)]);
    assert_eq!(o.status.code(), Some(1));
    assert_mentions(
        &stdout(&o),
        &[&format!("{second}: a data file that neither")],
    );
    assert!(!stdout(&o).contains("model.safetensors"), "{}", stdout(&o));
}

#[test]
fn a_gguf_part_does_not_replace_an_existing_file_without_force() {
    let c = GgufCase::dense(10, "qwen3");
    let dir = c.path("out");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("m.gguf"), "an earlier file").unwrap();
    let args = ["--vocab-pre", "qwen2", "--part", "1/1"];
    let err = fails(&gguf_args(&c.model, &dir.join("m.gguf"), &args));
    assert_mentions(&err, &["m.gguf", "exists", "--force"]);
    assert_eq!(
        std::fs::read_to_string(dir.join("m.gguf")).unwrap(),
        "an earlier file"
    );
    assert_listing(&dir, "m.gguf");
}

#[test]
fn a_directory_named_as_the_gguf_output_is_refused() {
    let c = GgufCase::dense(11, "qwen3");
    let dir = c.path("out.gguf");
    std::fs::create_dir_all(&dir).unwrap();
    let err = fails(&gguf_args(&c.model, &dir, &["--vocab-pre", "qwen2"]));
    assert_mentions(&err, &["out.gguf", "is a directory"]);
    assert_listing(&dir, "");
}

/// The library's GGUF writer applies the pipes before it as `tftf run … --gguf` does (a cast
/// to F16 then `--outtype auto`: the bytes of the command line); a quantising pipe, whose
/// tensors a GGUF cannot take, is refused naming the GGUF type to give instead, and nothing is
/// written.
#[test]
fn api_gguf_writer_applies_its_pipes_as_run_does() {
    let c = GgufCase::dense(11, "llama3");
    let out = c.path("out/m.gguf");
    let err = tftf::Pipeline::new(
        tftf::Reader::from_path(&c.model),
        tftf::Pipe::quantize("FP8_BLOCK", "compressed-tensors"),
        tftf::Writer::gguf(&out).vocab_pre("test-pre"),
    )
    .run()
    .unwrap_err()
    .to_string();
    assert_mentions(
        &err,
        &["--quantize", "GGUF output does not take", "--outtype"],
    );
    assert!(!out.exists() && !c.path("out").exists(), "{err}");
    // The library's GGUF of the model through `pipe`, at `path`.
    let api_gguf = |pipe: tftf::Pipe, path: &std::path::Path| {
        let report = tftf::Pipeline::new(
            tftf::Reader::from_path(&c.model),
            pipe,
            tftf::Writer::gguf(path).vocab_pre("test-pre"),
        )
        .run()
        .unwrap();
        assert!(report.ok());
        std::fs::read(path).unwrap()
    };
    let (cast, cli) = (c.path("cast/m.gguf"), c.path("cli/m.gguf"));
    ok(&tftf(&[
        "run",
        "-i",
        s(&c.model),
        "-o",
        s(&cli),
        "-q",
        "--dtype-cast",
        "--dtype",
        "f16",
        "--gguf",
        "--vocab-pre",
        "test-pre",
    ]));
    let f16 = api_gguf(tftf::Pipe::dtype_cast(DType::F16), &cast);
    assert_eq!(f16, std::fs::read(&cli).unwrap());
    assert_eq!(parse(&cast).tensor("blk.0.attn_q.weight").1, 1, "F16");
    let plain = c.path("cli.gguf");
    ok(&tftf(&[
        "gguf",
        s(&c.model),
        "-o",
        s(&plain),
        "--vocab-pre",
        "test-pre",
        "-q",
    ]));
    assert_eq!(
        api_gguf(tftf::Pipe::new(), &out),
        std::fs::read(&plain).unwrap()
    );
}
