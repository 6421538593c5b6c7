//! `--io-threads`: several reader and writer threads must give the same output bytes as one,
//! whatever the compute threads, chunk size (memory budget) and copy method, on copies, casts
//! and LoRA merges; an I/O error in one reader thread fails the run cleanly.

mod common;

use std::path::{Path, PathBuf};

use common::*;
use tftf::format::dtype::DType;

/// A three-shard model whose big tensors span many chunks at a 16 MiB budget (so the chunks of
/// one tensor are read by different threads), plus a LoRA adapter for two of them.
fn model(dir: &Path) -> (PathBuf, PathBuf) {
    let mut rng = Rng(16);
    let base = Model::new()
        .rands(
            &mut rng,
            &[
                ("model.embed_tokens.weight", DType::BF16, &[512, 1024]),
                (
                    "model.layers.0.self_attn.q_proj.weight",
                    DType::F32,
                    &[1024, 1024],
                ),
                ("model.layers.0.input_layernorm.weight", DType::F32, &[1024]),
            ],
        )
        .shard()
        .rands(
            &mut rng,
            &[
                (
                    "model.layers.0.self_attn.v_proj.weight",
                    DType::BF16,
                    &[2048, 1024],
                ),
                (
                    "model.layers.0.mlp.up_proj.weight",
                    DType::F32,
                    &[1536, 1024],
                ),
            ],
        )
        .shard()
        .rands(
            &mut rng,
            &[
                ("model.norm.weight", DType::F32, &[1024]),
                ("lm_head.weight", DType::BF16, &[768, 1024]),
            ],
        )
        .config(SMALL_CONFIG)
        .write(&dir.join("base"));
    let r = 4;
    let lora = |name: &str, out: u64, rng: &mut Rng| {
        [
            rand_t(
                rng,
                &format!("base_model.model.{name}.lora_A.weight"),
                DType::F32,
                &[r, 1024],
            ),
            rand_t(
                rng,
                &format!("base_model.model.{name}.lora_B.weight"),
                DType::F32,
                &[out, r],
            ),
        ]
    };
    let adapter = Model::adapter()
        .tensors(lora("model.layers.0.self_attn.q_proj", 1024, &mut rng))
        .tensors(lora("model.layers.0.self_attn.v_proj", 2048, &mut rng))
        .file("adapter_config.json", r#"{"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}"#)
        .write(&dir.join("adapter"));
    (base, adapter)
}

/// Every file of the output folder `dir` with its bytes.
fn files(dir: &Path) -> Vec<(String, Vec<u8>)> {
    listing(dir)
        .into_iter()
        .map(|n| {
            let bytes = std::fs::read(dir.join(&n)).unwrap();
            (n, bytes)
        })
        .collect()
}

#[test]
fn output_bytes_do_not_depend_on_io_threads() {
    let d = tmp();
    let (base, adapter) = model(d.path());
    let cases: [(&str, Vec<&str>); 4] = [
        ("copy", vec!["passthrough", "-i", s(&base)]),
        (
            "copy-user",
            vec!["passthrough", "-i", s(&base), "--no-reflink"],
        ),
        (
            "cast",
            vec!["passthrough", "-i", s(&base), "--dtype", "bf16"],
        ),
        (
            "lora",
            vec!["merge-lora", "-b", s(&base), "-a", s(&adapter)],
        ),
    ];
    for (name, args) in &cases {
        let mut reference: Option<Vec<(String, Vec<u8>)>> = None;
        for (io, threads, budget) in [
            ("1", "1", "16MiB"),
            ("2", "1", "16MiB"),
            ("4", "3", "16MiB"),
            ("4", "1", "64MiB"),
            ("auto", "2", "16MiB"),
            ("3", "4", "1GiB"),
        ] {
            let out = d.path().join(format!("{name}-{io}-{threads}-{budget}"));
            let report = d
                .path()
                .join(format!("{name}-{io}-{threads}-{budget}.json"));
            let mut a = args.clone();
            a.extend([
                "-o",
                s(&out),
                "-q",
                "--device",
                "cpu",
                "--io-threads",
                io,
                "--threads",
                threads,
                "--memory-budget",
                budget,
                "--report",
                s(&report),
            ]);
            tftf_ok(&a);
            let rep = read_json(&report);
            if io != "auto" {
                assert_eq!(rep["io_threads"], io.parse::<u64>().unwrap(), "{name}");
            }
            assert!(
                rep["pool_peak_bytes"].as_u64().unwrap()
                    <= rep["memory_budget_bytes"].as_u64().unwrap(),
                "{name} {io}: memory stays within the budget"
            );
            let got = files(&out);
            match &reference {
                None => reference = Some(got),
                Some(want) => assert!(
                    want == &got,
                    "{name}: --io-threads {io} --threads {threads} --memory-budget {budget} \
                     differs from --io-threads 1"
                ),
            }
        }
    }
}

#[test]
fn a_read_error_in_one_reader_thread_fails_cleanly() {
    let d = tmp();
    let (base, adapter) = model(d.path());
    for (io, n) in [("4", "3"), ("1", "2"), ("2", "7")] {
        for args in [
            vec!["passthrough", "-i", s(&base), "--dtype", "bf16"],
            vec!["merge-lora", "-b", s(&base), "-a", s(&adapter)],
        ] {
            let out = d.path().join(format!("out-{io}-{n}"));
            let mut a = args.clone();
            a.extend([
                "-o",
                s(&out),
                "-q",
                "--io-threads",
                io,
                "--memory-budget",
                "16MiB",
            ]);
            let o = std::process::Command::new(env!("CARGO_BIN_EXE_tftf"))
                .args(&a)
                .env("TFTF_TEST_READ_ERROR_AT", n)
                .output()
                .unwrap();
            assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
            let err = stderr(&o);
            assert!(
                err.starts_with("error: ")
                    && err.contains(s(d.path()))
                    && err.contains("Input/output error"),
                "--io-threads {io}: {err}"
            );
            assert!(!err.contains("panicked"), "{err}");
            assert!(!out.exists(), "--io-threads {io}: no partial output");
            let left: Vec<String> = listing(d.path())
                .into_iter()
                .filter(|n| n != "base" && n != "adapter")
                .collect();
            assert!(left.is_empty(), "--io-threads {io}: left behind {left:?}");
        }
    }
}

#[test]
fn io_threads_must_be_auto_or_a_positive_number() {
    let d = tmp();
    let (base, _) = model(d.path());
    for bad in ["0", "many"] {
        let out = d.path().join("o");
        let err = usage_error(&cmd("passthrough", &base, &out, &["--io-threads", bad]));
        assert!(err.contains("--io-threads"), "{bad}: {err}");
        assert!(!out.exists());
    }
}
