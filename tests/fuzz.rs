//! Fuzzing on stable Rust, bounded so it runs with `cargo test --release` in CI (about 35 s on
//! two cores).
//!
//! - `generated_checkpoints_never_panic`: proptest builds whole inputs — headers with odd
//!   dtypes, shapes (0, 1, ragged, 2^40, near `u64::MAX`), offsets with gaps and overlaps,
//!   metadata of the wrong type, index files, `config.json` quantisation settings (FP8 ones and
//!   GPTQ/NVFP4 ones that FP8 tensors contradict), fused FP8 expert scales and LoRA adapters
//!   with odd ranks, some on fused experts over per-expert tensors — and drives every command
//!   over them in-process, a rename to a group its regex lacks included (always a usage error),
//!   and `gguf` where there is a tokenizer.
//! - `mutated_corpus_never_panics`: a fixed-seed mutator flips, overwrites, inserts and deletes
//!   bytes (and swaps JSON numbers for extreme ones) in the real files of `tests/fuzz-corpus/`.
//!
//! Every command must end with exit 0, 1 or 2 and an error message; a panic fails the test with
//! the input that caused it (`catch_unwind` only detects the panic here, it fixes nothing). Every
//! output written with exit 0 must load with the `safetensors` crate. `TFTF_FUZZ_CASES` and
//! `TFTF_FUZZ_MUTATIONS` raise the bounds (300 and 600) and `TFTF_FUZZ_SEED` changes the fixed
//! seed for a longer local run. Each panic found becomes a
//! named test in `tests/panics.rs`; proptest keeps its failing seeds in
//! `tests/fuzz.proptest-regressions`.

mod common;

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};

use clap::CommandFactory;
use proptest::prelude::*;
use serde_json::{json, Value};

use common::{copy_dir, Rng};

/// The seed of both tests: fixed, so CI explores the same inputs every run; `TFTF_FUZZ_SEED`
/// explores others.
fn seed() -> u64 {
    std::env::var("TFTF_FUZZ_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0x7f7f_2026)
}

fn bound(var: &str, default: u32) -> u32 {
    std::env::var(var)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// A command that runs longer than this on inputs of a few KiB is hung.
const COMMAND_LIMIT: std::time::Duration = std::time::Duration::from_secs(60);

/// Runs one command in-process as `main` would, on a thread of its own so a hang is reported
/// too; returns the exit code, or the panic (or hang) as a message.
fn exit_code(args: &[String]) -> Result<i32, String> {
    let argv: Vec<String> = std::iter::once("tftf".to_string())
        .chain(args.iter().cloned())
        .collect();
    let (argv, sections) = tftf::commands::run_sections::split(
        argv.into_iter().map(std::ffi::OsString::from).collect(),
    );
    let matches = match tftf::cli::Cli::command().try_get_matches_from(argv) {
        Ok(m) => m,
        Err(e) => return Ok(if e.use_stderr() { 2 } else { 0 }),
    };
    // Judged by exit codes: thousands of commands' lines would only bury the test's output.
    tftf::console::set_silent(true);
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let cancel = tftf::pipeline::Cancel::default();
        let result = catch_unwind(AssertUnwindSafe(|| {
            tftf::commands::dispatch(&matches, &sections, &cancel)
        }));
        let _ = tx.send(match result {
            Ok(Ok(code)) => Ok(code),
            Ok(Err(e)) if e.to_string().trim().is_empty() => {
                Err(format!("error without a message: {e:?}"))
            }
            Ok(Err(e)) => Ok(e.exit_code()),
            Err(p) => Err(p
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_else(|| "panic".into())),
        });
    });
    rx.recv_timeout(COMMAND_LIMIT)
        .unwrap_or_else(|_| Err(format!("no result within {COMMAND_LIMIT:?}")))
}

/// Every `.safetensors` file under `out` loads with the reference implementation.
fn outputs_load(out: &Path) -> Result<(), String> {
    let files: Vec<PathBuf> = if out.is_dir() {
        std::fs::read_dir(out)
            .unwrap()
            .flatten()
            .map(|e| e.path())
            .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
            .collect()
    } else {
        vec![out.to_path_buf()]
    };
    for f in files {
        // A FIFO would block this read forever (the special-file cases put one here).
        if !std::fs::metadata(&f).is_ok_and(|m| m.is_file()) {
            return Err(format!("{} is not a regular file", f.display()));
        }
        let bytes = std::fs::read(&f).map_err(|e| e.to_string())?;
        safetensors::SafeTensors::deserialize(&bytes)
            .map_err(|e| format!("{} does not load: {e:?}", f.display()))?;
    }
    Ok(())
}

/// Runs every command over the model at `model` (and the adapter at `adapter`); returns a
/// description of the first failure.
fn exercise(model: &Path, adapter: Option<&Path>, scratch: &Path) -> Result<(), String> {
    // Outputs must load wherever the inputs do (tftf also accepts dtypes such as C64 that the
    // reference crate does not know).
    let check_outputs = outputs_load(model).is_ok();
    let m = model.to_str().unwrap();
    let write = [
        "--threads",
        "2",
        "--memory-budget",
        "16MiB",
        "--device",
        "cpu",
        "-q",
        "--no-progress",
    ];
    let mut commands: Vec<Vec<&str>> = vec![
        vec!["info", m],
        vec!["info", m, "--json"],
        // Outputs in the corpus (checksums, parts, a killed finalize): checked, recovered and
        // finalized in place, then converted like any input.
        vec!["verify", m],
        vec!["recover", m],
        vec!["finalize", m],
        vec!["validate", m, "--check-values", "--pipe", "dtype:f16"],
        vec!["passthrough", m, "--dtype", "bf16", "--cast-ints"],
        vec!["dequant-fp8", "-i", m],
        vec![
            "dequant-fp8",
            "-i",
            m,
            "--scale-mode",
            "divide",
            "--dtype",
            "f16",
        ],
        vec![
            "dequant-fp8",
            "-i",
            m,
            "--allow-nonfinite",
            "--allow-unscaled-fp8",
        ],
        vec!["repack-fp4", "--src", m],
        vec![
            "run",
            "-i",
            m,
            "--dtype-cast",
            "f16",
            "--repack-fp4",
            "--dequant-fp8",
            "f32",
        ],
    ];
    // A replacement naming a group the regex lacks: a usage error, whatever the input.
    commands.push(vec![
        "passthrough",
        m,
        "--rename",
        r"^(model)\.",
        r"\g<gone>.",
    ]);
    // GGUF conversion where the model has a tokenizer (its config, chat templates, shapes,
    // quantised weights dequantised on the fly), at a k-quant mix, and with its importance
    // matrix where it has one.
    let imatrix = model.join("imatrix.dat");
    let im = imatrix.to_str().unwrap();
    if model.join("tokenizer.json").is_file() {
        commands.push(vec!["gguf", m, "--vocab-pre", "llama-bpe"]);
        commands.push(vec![
            "gguf",
            m,
            "--vocab-pre",
            "llama-bpe",
            "--outtype",
            "q4_k_m",
        ]);
    }
    if imatrix.is_file() {
        for mix in ["q4_0", "q2_k_s"] {
            let pre = ["--vocab-pre", "llama-bpe"];
            commands.push([&["gguf", m, "--outtype", mix, "--imatrix", im][..], &pre].concat());
        }
    }
    if let Some(a) = adapter.and_then(Path::to_str) {
        commands.push(vec![
            "merge-lora",
            "-i",
            m,
            "--adapter",
            a,
            "--dtype",
            "f32",
        ]);
        commands.push(vec![
            "run",
            "-i",
            m,
            "--dequant-fp8",
            "f32",
            "--merge-lora",
            a,
        ]);
    }
    // The adapter file twice, as the two FSDP rank slices of one adapter.
    let ranks = adapter.map(|a| a.join("adapter_model.safetensors"));
    let config = adapter.map(|a| a.join("adapter_config.json"));
    if let (Some(r), Some(c)) = (&ranks, &config) {
        let (r, c) = (r.to_str().unwrap(), c.to_str().unwrap());
        commands.push(vec![
            "merge-fsdp-lora",
            "-i",
            m,
            "-s",
            r,
            "-s",
            r,
            "--adapter-config",
            c,
        ]);
    }
    for (k, cmd) in commands.iter().enumerate() {
        let writes = !matches!(
            cmd[0],
            "info" | "validate" | "verify" | "recover" | "finalize"
        );
        let gguf = cmd[0] == "gguf";
        let out = scratch.join(format!("out{k}{}", if gguf { ".gguf" } else { "" }));
        let mut args: Vec<String> = cmd.iter().map(|s| s.to_string()).collect();
        if writes {
            args.extend(["-o".into(), out.to_str().unwrap().into()]);
            args.extend(write.iter().map(|s| s.to_string()));
        }
        let code =
            exit_code(&args).map_err(|p| format!("`tftf {}` failed: {p}", args.join(" ")))?;
        if !(0..=2).contains(&code) {
            return Err(format!("`tftf {}` exited {code}", args.join(" ")));
        }
        if cmd[0] == "passthrough" && cmd.contains(&"--rename") && code != 2 {
            return Err(format!("`tftf {}` exited {code}, not 2", args.join(" ")));
        }
        if writes && !gguf && code == 0 && check_outputs {
            outputs_load(&out).map_err(|e| format!("`tftf {}`: {e}", args.join(" ")))?;
        }
        let _ = std::fs::remove_dir_all(&out);
        let _ = std::fs::remove_file(&out);
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Generated checkpoints.

const NAMES: &[&str] = &[
    "model.layers.0.mlp.up_proj.weight",
    "model.layers.0.mlp.up_proj.weight_scale_inv",
    "model.layers.0.mlp.up_proj.weight_scale",
    "model.layers.0.mlp.up_proj.scale",
    "layers.0.ffn.experts.0.w1.weight",
    "layers.0.ffn.experts.0.w1.scale",
    "model.layers.0.mlp.experts.0.gate_proj.weight",
    "model.layers.0.mlp.experts.1.up_proj.weight",
    "model.layers.0.block_sparse_moe.experts.0.w2.weight",
    "layers.0.engram.embed.weight",
    "layers.0.engram.embed.scale",
    "model.embed_tokens.weight",
    "lm_head.weight",
    // transformers' fused FineGrainedFP8 experts: the scale is named after the parameter.
    "model.layers.0.mlp.experts.down_proj",
    "model.layers.0.mlp.experts.down_proj_scale_inv",
    "x",
];

const DTYPES: &[&str] = &[
    "F8_E4M3", "F8_E5M2", "F8_E8M0", "F32", "BF16", "F16", "F64", "U8", "I8", "I64", "BOOL", "F4",
    "C64", "Q4",
];

fn dim() -> impl Strategy<Value = u64> {
    prop_oneof![
        6 => prop::sample::select(vec![0u64, 1, 2, 3, 4, 8, 16, 32, 33, 64, 128, 129]),
        1 => prop::sample::select(vec![1u64 << 40, u64::MAX / 2, u64::MAX]),
    ]
}

/// Interesting f32 values for scale-like tensors.
const FLOATS: &[f32] = &[
    0.0,
    -0.0,
    1.0,
    -2.0,
    0.5,
    1e38,
    f32::MAX,
    1e-45,
    5.877_472e-39,
    65520.0,
    f32::INFINITY,
    f32::NAN,
];

#[derive(Debug, Clone)]
struct GenTensor {
    name: String,
    dtype: &'static str,
    shape: Vec<u64>,
    /// 0: exact offsets; otherwise shifts the end by this much (gaps, overlaps, truncation).
    skew: i8,
    /// Seed of the data bytes.
    seed: u64,
}

fn tensor(names: &'static [&'static str]) -> impl Strategy<Value = GenTensor> {
    (
        prop::sample::select(names),
        prop::sample::select(DTYPES),
        prop::collection::vec(dim(), 0..4),
        prop_oneof![8 => Just(0i8), 1 => -3i8..4],
        any::<u64>(),
    )
        .prop_map(|(name, dtype, shape, skew, seed)| GenTensor {
            name: name.to_string(),
            dtype,
            shape,
            skew,
            seed,
        })
}

fn bytes_of(t: &GenTensor) -> Vec<u8> {
    let n = t
        .shape
        .iter()
        .try_fold(1u64, |a, &d| a.checked_mul(d))
        .unwrap_or(u64::MAX);
    let bits = match t.dtype {
        "F32" | "I32" => 32,
        "BF16" | "F16" => 16,
        "F64" | "I64" | "C64" => 64,
        "F4" => 4,
        _ => 8,
    };
    let len = n.saturating_mul(bits).div_ceil(8);
    let len = (len as i64 + t.skew as i64).clamp(0, 4096) as usize;
    let mut rng = Rng(t.seed);
    if t.dtype == "F32" {
        (0..len / 4)
            .flat_map(|_| FLOATS[rng.next_u32() as usize % FLOATS.len()].to_le_bytes())
            .chain(std::iter::repeat_n(0, len % 4))
            .collect()
    } else {
        rng.bytes(len)
    }
}

/// A safetensors file of `tensors`, back to back, with `metadata` as `__metadata__`.
fn st_bytes(tensors: &[GenTensor], metadata: &Option<Value>) -> Vec<u8> {
    let mut header = serde_json::Map::new();
    if let Some(m) = metadata {
        header.insert("__metadata__".into(), m.clone());
    }
    let mut data = Vec::new();
    for t in tensors {
        let b = bytes_of(t);
        header.insert(
            t.name.clone(),
            json!({"dtype": t.dtype, "shape": t.shape, "data_offsets": [data.len(), data.len() + b.len()]}),
        );
        data.extend(b);
    }
    let h = serde_json::to_vec(&Value::Object(header)).unwrap();
    let mut out = (h.len() as u64).to_le_bytes().to_vec();
    out.extend(h);
    out.extend(data);
    out
}

fn odd_value() -> impl Strategy<Value = Value> {
    prop::sample::select(vec![
        json!(0),
        json!(1),
        json!(-1),
        json!(2),
        json!(128),
        json!(1u64 << 40),
        json!(u64::MAX),
        json!(1e308),
        json!(0.5),
        json!("128"),
        json!(null),
        json!([]),
        json!([0, 128]),
        json!([128, 0]),
        json!([128, 128]),
        json!([1, 1]),
        json!([u64::MAX, 1]),
        json!([128]),
        json!({"a": 1}),
    ])
}

fn config() -> impl Strategy<Value = Option<Value>> {
    prop::option::of(
        (odd_value(), odd_value(), 0u8..4).prop_map(|(a, b, kind)| match kind {
            0 => json!({"quantization_config": {"quant_method": "compressed-tensors",
                "config_groups": {"g": {"weights": {"block_structure": a}}}}, "torch_dtype": b}),
            1 => json!({"quantization_config": {"quant_method": "fp8", "weight_block_size": a,
                "fmt": "e4m3"}, "torch_dtype": "bfloat16", "x": b}),
            // Configs that name no FP8 scheme: FP8 tensors contradict them.
            2 => json!({"quantization_config": {"quant_method": "gptq", "bits": a,
                "group_size": b}}),
            _ => json!({"quantization_config": {"quant_method": "modelopt",
                "quant_algo": "NVFP4", "group_size": a}, "torch_dtype": b}),
        }),
    )
}

const ADAPTER_NAMES: &[&str] = &[
    "base_model.model.model.layers.0.mlp.up_proj.lora_A.weight",
    "base_model.model.model.layers.0.mlp.up_proj.lora_B.weight",
    "base_model.model.model.layers.0.mlp.up_proj.lora_magnitude_vector",
    "base_model.model.model.embed_tokens.lora_embedding_A",
    "base_model.model.model.embed_tokens.lora_embedding_B",
    "base_model.model.lm_head.weight",
    "base_model.model.model.layers.0.mlp.experts.lora_A.weight",
    "base_model.model.model.layers.0.mlp.experts.base_layer.lora_B.weight",
];

fn adapter() -> impl Strategy<Value = Option<(Vec<GenTensor>, Value)>> {
    prop::option::of((
        prop::collection::vec(tensor(ADAPTER_NAMES), 0..4),
        (odd_value(), odd_value(), any::<[bool; 4]>(), odd_value()),
    ))
    .prop_map(|a| {
        a.map(|(t, (r, alpha, [rslora, fan, dora, experts], pattern))| {
            // Fused expert parameters, which a base stored per expert has only as its parts.
            let params = experts.then(|| json!(["mlp.experts.gate_up_proj", "experts.down_proj"]));
            (
                t,
                json!({"r": r, "lora_alpha": alpha, "use_rslora": rslora, "fan_in_fan_out": fan,
                    "use_dora": dora, "rank_pattern": {"up_proj": pattern},
                    "modules_to_save": ["lm_head"], "target_parameters": params}),
            )
        })
    })
}

#[derive(Debug, Clone)]
struct GenModel {
    tensors: Vec<GenTensor>,
    metadata: Option<Value>,
    /// Tensors from this position on go to a second shard, listed in an index.
    split: Option<usize>,
    /// Index entries made wrong: a missing shard, a non-string, a path.
    bad_index: u8,
    config: Option<Value>,
    adapter: Option<(Vec<GenTensor>, Value)>,
}

fn model() -> impl Strategy<Value = GenModel> {
    (
        prop::collection::vec(tensor(NAMES), 0..6),
        prop::option::of(prop_oneof![
            Just(json!({"format": "pt"})),
            Just(json!({"format": 1})),
            Just(json!([])),
            Just(json!({"total_size": "12"})),
        ]),
        prop::option::of(0usize..6),
        prop_oneof![6 => Just(0u8), 1 => 1u8..4],
        config(),
        adapter(),
    )
        .prop_map(
            |(tensors, metadata, split, bad_index, config, adapter)| GenModel {
                tensors,
                metadata,
                split,
                bad_index,
                config,
                adapter,
            },
        )
}

fn write_model(g: &GenModel, dir: &Path) -> (PathBuf, Option<PathBuf>) {
    let model = dir.join("model");
    std::fs::create_dir_all(&model).unwrap();
    match g.split {
        None => std::fs::write(
            model.join("model.safetensors"),
            st_bytes(&g.tensors, &g.metadata),
        )
        .unwrap(),
        Some(at) => {
            let at = at.min(g.tensors.len());
            let parts = [&g.tensors[..at], &g.tensors[at..]];
            let mut map = serde_json::Map::new();
            for (i, part) in parts.iter().enumerate() {
                let name = format!("model-{:05}-of-00002.safetensors", i + 1);
                std::fs::write(model.join(&name), st_bytes(part, &g.metadata)).unwrap();
                for t in *part {
                    map.insert(t.name.clone(), Value::from(name.clone()));
                }
            }
            let wrong = match g.bad_index {
                1 => Some(json!("model-00009-of-00009.safetensors")),
                2 => Some(json!(3)),
                3 => Some(json!("../model-00001-of-00002.safetensors")),
                _ => None,
            };
            if let (Some(w), Some(first)) = (wrong, map.keys().next().cloned()) {
                map.insert(first, w);
            }
            let index = json!({"metadata": {"total_size": 0}, "weight_map": map});
            std::fs::write(
                model.join("model.safetensors.index.json"),
                index.to_string(),
            )
            .unwrap();
        }
    }
    if let Some(c) = &g.config {
        std::fs::write(model.join("config.json"), c.to_string()).unwrap();
    }
    let adapter = g.adapter.as_ref().map(|(tensors, cfg)| {
        let a = dir.join("adapter");
        std::fs::create_dir_all(&a).unwrap();
        std::fs::write(
            a.join("adapter_model.safetensors"),
            st_bytes(tensors, &None),
        )
        .unwrap();
        std::fs::write(a.join("adapter_config.json"), cfg.to_string()).unwrap();
        a
    });
    (model, adapter)
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: bound("TFTF_FUZZ_CASES", 300),
        rng_seed: proptest::test_runner::RngSeed::Fixed(seed()),
        failure_persistence: Some(Box::new(
            proptest::test_runner::FileFailurePersistence::SourceParallel("proptest-regressions"),
        )),
        ..ProptestConfig::default()
    })]

    #[test]
    fn generated_checkpoints_never_panic(g in model()) {
        let d = tempfile::tempdir().unwrap();
        let (model, adapter) = write_model(&g, d.path());
        let result = exercise(&model, adapter.as_deref(), d.path());
        prop_assert!(result.is_ok(), "{}", result.unwrap_err());
    }
}

// ---------------------------------------------------------------------------------------------
// Byte-level mutation of the committed corpus.

const CORPUS: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fuzz-corpus");

/// Numbers that break size arithmetic when they replace one in a JSON header.
const EXTREME_NUMBERS: &[&str] = &[
    "0",
    "1",
    "18446744073709551615",
    "9223372036854775808",
    "4294967296",
    "-1",
    "1e400",
    "0.5",
    "99999999999999999999999",
];

/// One random edit of `bytes`.
fn mutate(rng: &mut Rng, bytes: &mut Vec<u8>) {
    let pick = |rng: &mut Rng, n: usize| rng.next_u32() as usize % n.max(1);
    match rng.next_u32() % 7 {
        0 if !bytes.is_empty() => {
            let i = pick(rng, bytes.len());
            bytes[i] ^= 1 << (rng.next_u32() % 8);
        }
        1 if !bytes.is_empty() => {
            let i = pick(rng, bytes.len());
            bytes[i] = [0x00, 0xFF, 0x7F, 0x80, b'"', b'{', b'}', b'0', b'9'][pick(rng, 9)];
        }
        2 => {
            let i = pick(rng, bytes.len() + 1);
            let n = 1 + pick(rng, 16);
            let fill = rng.bytes(n);
            bytes.splice(i..i, fill);
        }
        3 if !bytes.is_empty() => {
            let i = pick(rng, bytes.len());
            let n = (1 + pick(rng, 16)).min(bytes.len() - i);
            bytes.drain(i..i + n);
        }
        4 if bytes.len() >= 8 => {
            // The header length prefix.
            let n = [0u64, 1, 2, 7, u64::MAX, 100_000_001, bytes.len() as u64][pick(rng, 7)];
            bytes[..8].copy_from_slice(&n.to_le_bytes());
        }
        _ => {
            // Replace one JSON number by an extreme one (the length prefix is kept in step
            // for safetensors files, so the header still parses as far as the number).
            let text_start = if bytes.len() > 8 && bytes[8] == b'{' {
                8
            } else {
                0
            };
            let digits: Vec<usize> = (text_start..bytes.len())
                .filter(|&i| {
                    bytes[i].is_ascii_digit() && (i == 0 || !bytes[i - 1].is_ascii_digit())
                })
                .filter(|&i| i < 4096 + text_start)
                .collect();
            if digits.is_empty() {
                return;
            }
            let at = digits[pick(rng, digits.len())];
            let end = (at..bytes.len())
                .find(|&i| !bytes[i].is_ascii_digit())
                .unwrap_or(bytes.len());
            let new = EXTREME_NUMBERS[pick(rng, EXTREME_NUMBERS.len())].as_bytes();
            let delta = new.len() as i64 - (end - at) as i64;
            bytes.splice(at..end, new.iter().copied());
            if text_start == 8 {
                let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as i64 + delta;
                bytes[..8].copy_from_slice(&(n.max(0) as u64).to_le_bytes());
            }
        }
    }
}

fn files_under(dir: &Path) -> Vec<PathBuf> {
    let mut v = Vec::new();
    for e in std::fs::read_dir(dir).unwrap().flatten() {
        let p = e.path();
        if p.is_dir() {
            v.extend(files_under(&p));
        } else {
            v.push(p);
        }
    }
    v.sort();
    v
}

/// The case directories of `tests/fuzz-corpus`, sorted.
fn corpus_cases() -> Vec<PathBuf> {
    let mut cases: Vec<PathBuf> = std::fs::read_dir(CORPUS)
        .expect("tests/fuzz-corpus")
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.is_dir())
        .collect();
    cases.sort();
    cases
}

/// Runs [`exercise`] over the copy of a case in `work` (its `model/` and, where there is one,
/// `adapter/`), writing into `scratch`.
fn exercise_case(work: &Path, scratch: &Path) -> Result<(), String> {
    let adapter = work.join("adapter");
    let adapter = adapter.is_dir().then_some(adapter.as_path());
    exercise(&work.join("model"), adapter, scratch)
}

#[test]
fn mutated_corpus_never_panics() {
    let cases = corpus_cases();
    assert!(cases.len() >= 5, "corpus has {} cases", cases.len());
    let mut rng = Rng(seed());
    let iterations = bound("TFTF_FUZZ_MUTATIONS", 600);
    for it in 0..iterations {
        let case = &cases[it as usize % cases.len()];
        let d = tempfile::tempdir().unwrap();
        let work = d.path().join("case");
        copy_dir(case, &work);
        let files = files_under(&work);
        let edits = 1 + rng.next_u32() % 3;
        let mut edited = Vec::new();
        for _ in 0..edits {
            let f = &files[rng.next_u32() as usize % files.len()];
            let mut bytes = std::fs::read(f).unwrap();
            mutate(&mut rng, &mut bytes);
            std::fs::write(f, &bytes).unwrap();
            edited.push(f.strip_prefix(&work).unwrap().display().to_string());
        }
        if let Err(e) = exercise_case(&work, d.path()) {
            panic!(
                "iteration {it} on {} (edited {edited:?}): {e}",
                case.file_name().unwrap().to_string_lossy()
            );
        }
    }
}

/// What the special-file cases put in place of an input file.
const SPECIAL_FILES: &[&str] = &[
    "fifo",
    "/dev/zero",
    "/dev/urandom",
    "/dev/null",
    "directory",
];

/// Replaces `path` with the special file `kind` (one of [`SPECIAL_FILES`]).
fn make_special(path: &Path, kind: &str) {
    std::fs::remove_file(path).unwrap();
    match kind {
        "fifo" => {
            let c = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).unwrap();
            // SAFETY: mkfifo reads a NUL-terminated path.
            assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o644) }, 0, "mkfifo");
        }
        "directory" => std::fs::create_dir(path).unwrap(),
        device => std::os::unix::fs::symlink(device, path).unwrap(),
    }
}

/// Issue 24: a FIFO or a device in place of a shard, an index, a config or a side file
/// blocked a run forever or passed for an empty file. Every file of every corpus case is
/// replaced in turn by one of [`SPECIAL_FILES`] (drawn with the fixed seed), and every command
/// must end — with exit 0, 1 or 2 and no panic — within [`COMMAND_LIMIT`].
#[test]
fn special_files_in_place_of_inputs_never_hang_or_panic() {
    let cases = corpus_cases();
    let mut rng = Rng(seed() ^ 0x5bec_1a1f);
    for case in &cases {
        let count = files_under(case).len();
        for k in 0..count {
            let d = tempfile::tempdir().unwrap();
            let work = d.path().join("case");
            copy_dir(case, &work);
            let file = &files_under(&work)[k];
            let kind = SPECIAL_FILES[rng.next_u32() as usize % SPECIAL_FILES.len()];
            make_special(file, kind);
            if let Err(e) = exercise_case(&work, d.path()) {
                panic!(
                    "{} with {} as {kind}: {e}",
                    case.file_name().unwrap().to_string_lossy(),
                    file.strip_prefix(&work).unwrap().display()
                );
            }
        }
    }
}
