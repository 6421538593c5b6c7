//! Python tftf 0.3's command-line tests (`tests/test_cli_run.py` and the command-line parts of
//! `tests/test_dcp_lora_merge.py`), ported as tests of the binary: same inputs, same arguments,
//! assertions of the same meaning. Where upstream checks the type of the pipe its parser built
//! (`isinstance(pipe, KeyFilterPipe)`), the port runs the command and checks what that pipe
//! does to the tensors. DCP adapters go through `merge-dcp-lora` on DCP checkpoints saved the
//! way upstream's helpers save them (the training-directory resolution is tested on a real
//! FSDP2 run in tests/dcp_lora.rs). Left out: upstream's exact wording (`"not one of"`) and
//! tests of Python internals (a pipe's `repr`, monkeypatched loaders); the README's
//! "Differences from Python tftf" lists them. The last tests pin the other
//! compatibility points: `-v` everywhere, float64, `dequant-fp8 --lora-*`, `merge-lora
//! --rename` before the merge, `--rank/--lora-alpha`, and a cast before a merge.

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use common::*;
use tftf::format::dtype::DType;
use tftf::ops::cast::{bf16_to_f32, f32_to_bf16};

const Q: &str = "model.layers.0.self_attn.q_proj.weight";
const V: &str = "model.layers.0.self_attn.v_proj.weight";
const NORM: &str = "model.norm.weight";

/// `_BASE_TENSORS`: q_proj and v_proj [64, 32] and norm [32], F32 (`torch.randn`).
fn base_tensors() -> Vec<T> {
    let mut rng = Rng(11);
    vec![
        rand_t(&mut rng, Q, DType::F32, &[64, 32]),
        rand_t(&mut rng, V, DType::F32, &[64, 32]),
        rand_t(&mut rng, NORM, DType::F32, &[32]),
    ]
}

/// `_make_base`: `dir/model.safetensors`.
fn make_base(dir: &Path) -> PathBuf {
    std::fs::create_dir_all(dir).unwrap();
    let path = dir.join("model.safetensors");
    write_file(&path, &base_tensors());
    path
}

fn ones(n: usize) -> Vec<u8> {
    (0..n).flat_map(|_| 1f32.to_le_bytes()).collect()
}

/// The adapter tensors of `_make_lora_adapter`: all-ones `lora_A` [r, 32] and `lora_B` [64, r]
/// for q_proj, keyed with the adapter name `default`.
fn lora_tensors(prefix: &str, rank: u64) -> Vec<T> {
    let r = rank as usize;
    vec![
        t(
            &format!("base_model.model.{prefix}.lora_A.default.weight"),
            DType::F32,
            &[rank, 32],
            ones(r * 32),
        ),
        t(
            &format!("base_model.model.{prefix}.lora_B.default.weight"),
            DType::F32,
            &[64, rank],
            ones(64 * r),
        ),
    ]
}

/// `_make_lora_adapter(directory, rank=4, alpha=8.0)`.
fn make_lora_adapter(dir: &Path) -> PathBuf {
    lora_adapter_on(dir, "model.layers.0.self_attn.q_proj", "8.0")
}

/// A rank-4 adapter of [`lora_tensors`] on `module` with `lora_alpha` `alpha` in `dir`.
fn lora_adapter_on(dir: &Path, module: &str, alpha: &str) -> PathBuf {
    Model::adapter()
        .tensors(lora_tensors(module, 4))
        .file(
            "adapter_config.json",
            format!(r#"{{"r": 4, "lora_alpha": {alpha}}}"#),
        )
        .write(dir)
}

/// `_make_regular_lora_checkpoint`: `adapter_config.json` at the training directory's top,
/// `checkpoint-N/adapter_model.safetensors` below it. Checkpoint N's `lora_B` is N (not 1), so
/// a merge shows which checkpoint it used.
fn make_regular_lora_checkpoint(dir: &Path, steps: &[u64]) -> PathBuf {
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(
        dir.join("adapter_config.json"),
        r#"{"r": 4, "lora_alpha": 8.0, "target_modules": ["q_proj"]}"#,
    )
    .unwrap();
    for step in steps {
        let ckpt = dir.join(format!("checkpoint-{step}"));
        std::fs::create_dir_all(&ckpt).unwrap();
        let mut tensors = lora_tensors("model.layers.0.self_attn.q_proj", 4);
        tensors[1].3 = (0..64 * 4)
            .flat_map(|_| (*step as f32).to_le_bytes())
            .collect();
        write_file(&ckpt.join("adapter_model.safetensors"), &tensors);
    }
    dir.to_path_buf()
}

fn base_map() -> BTreeMap<String, Vec<u8>> {
    base_tensors().into_iter().map(|t| (t.0, t.3)).collect()
}

/// `tftf run -i BASE -o OUT ARGS...`; returns the output (loaded) or panics with stderr.
fn run_ok(base: &Path, out: &Path, args: &[&str]) -> Tensors {
    tftf_ok(&[&cmd("run", base, out, &["-q"])[..], args].concat());
    load_all(out)
}

/// [`run_ok`] of `base` into `name` in the folder `d`.
fn run_to(d: &tempfile::TempDir, base: &Path, name: &str, args: &[&str]) -> Tensors {
    run_ok(base, &d.path().join(name), args)
}

/// A temporary folder with [`make_base`] in `base/`.
fn base_in_tmp() -> (tempfile::TempDir, PathBuf) {
    let d = tmp();
    let base = make_base(&d.path().join("base"));
    (d, base)
}

/// [`base_in_tmp`] plus [`make_lora_adapter`] in `adapter/`.
fn base_and_adapter() -> (tempfile::TempDir, PathBuf, PathBuf) {
    let (d, base) = base_in_tmp();
    let adapter = make_lora_adapter(&d.path().join("adapter"));
    (d, base, adapter)
}

/// A [`base_and_adapter`] folder to run `tftf run` on.
struct Lora {
    d: tempfile::TempDir,
    base: PathBuf,
    adapter: PathBuf,
}

impl Lora {
    fn new() -> Lora {
        let (d, base, adapter) = base_and_adapter();
        Lora { d, base, adapter }
    }

    /// [`run_to`] `name` with `args`, a command line split at spaces in which `ADAPTER` stands
    /// for the adapter's folder.
    fn run(&self, name: &str, args: &str) -> Tensors {
        let words: Vec<&str> = args
            .split_whitespace()
            .map(|w| if w == "ADAPTER" { s(&self.adapter) } else { w })
            .collect();
        run_to(&self.d, &self.base, name, &words)
    }
}

/// [`run_ok`] on a fresh [`make_base`].
fn run_base(args: &[&str]) -> Tensors {
    let (d, base) = base_in_tmp();
    run_to(&d, &base, "out", args)
}

/// `tftf run` that must be refused as a usage error (exit 2) before any output exists;
/// returns stderr.
fn run_usage_error(args: &[&str]) -> String {
    let (d, base) = base_in_tmp();
    let out = d.path().join("out");
    let err = usage_error(&[&cmd("run", &base, &out, &[])[..], args].concat());
    assert!(!out.exists(), "{args:?}");
    err
}

/// [`run_usage_error`] whose message contains `needle`.
fn usage_error_mentions(args: &[&str], needle: &str) {
    let err = run_usage_error(args);
    assert!(err.contains(needle), "{err}");
}

/// [`run_base`] with `args` writes every tensor as BF16.
fn assert_all_bf16(args: &[&str]) {
    let got = run_base(args);
    assert!(
        all_dtypes(&got, "BF16"),
        "{args:?}: {:?}",
        got.values().map(|v| &v.0).collect::<Vec<_>>()
    );
}

fn all_dtypes(t: &Tensors, want: &str) -> bool {
    !t.is_empty() && t.values().all(|v| v.0 == want)
}

fn names(t: &Tensors) -> Vec<&str> {
    t.keys().map(String::as_str).collect()
}

/// Upstream's rename tests: `--key-rename` with rules that match no name leaves every name as
/// it is; returns the output of the rules `matching` (both run on one fresh base).
fn renamed(no_match: &[&str], matching: &[&str]) -> Tensors {
    let (d, base) = base_in_tmp();
    let got = run_to(&d, &base, "out", no_match);
    assert_eq!(names(&got), [Q, V, NORM], "{no_match:?}");
    run_to(&d, &base, "out2", matching)
}

/// Keep q_proj, then cast to bfloat16: the start of upstream's chained-pipes tests.
const FILTER_THEN_CAST: [&str; 6] = [
    "--key-filter",
    "--include",
    "*q_proj*",
    "--dtype-cast",
    "--dtype",
    "bfloat16",
];

// ---------------------------------------------------------------------------------------------
// TestPipeChainParser: the section grammar, each parse run for real.
// ---------------------------------------------------------------------------------------------

#[test]
fn parser_empty_returns_passthrough() {
    let got = run_base(&[]);
    let want = base_map();
    assert_eq!(got.len(), want.len());
    for (k, v) in &want {
        assert_eq!(&got[k].2, v, "{k}");
    }
}

/// Also upstream's `TestRunCommand.test_dtype_cast_changes_all_dtypes`: the same command.
#[test]
fn parser_single_dtype_cast() {
    assert_all_bf16(&["--dtype-cast", "--dtype", "bfloat16"]);
}

/// Also upstream's `TestRunCommand.test_key_filter_keeps_only_matching`: the same command.
#[test]
fn parser_single_key_filter() {
    let got = run_base(&["--key-filter", "--include", "*q_proj*"]);
    assert_eq!(names(&got), [Q]);
}

#[test]
fn parser_two_pipes_returns_compound() {
    let got = run_base(&FILTER_THEN_CAST);
    assert_eq!(names(&got), [Q]);
    assert!(all_dtypes(&got, "BF16"));
}

#[test]
fn parser_multiple_include_flags_accumulated() {
    let got = run_base(&[
        "--key-filter",
        "--include",
        "*q_proj*",
        "--include",
        "*v_proj*",
    ]);
    assert_eq!(names(&got), [Q, V]);
}

#[test]
fn parser_key_rename_single_rule() {
    let got = renamed(
        &["--key-rename", "--rule", "^foo", "bar"],
        &["--key-rename", "--rule", "^model", "base"],
    );
    assert!(
        got.keys().all(|k| k.starts_with("base.")),
        "{:?}",
        names(&got)
    );
}

#[test]
fn parser_key_rename_multiple_rules() {
    let got = renamed(
        &[
            "--key-rename",
            "--rule",
            "^foo",
            "bar",
            "--rule",
            "^baz",
            "qux",
        ],
        &[
            "--key-rename",
            "--rule",
            "^model",
            "base",
            "--rule",
            "^base.norm",
            "final_norm",
        ],
    );
    assert!(got.contains_key("final_norm.weight"), "{:?}", names(&got));
    assert!(got.contains_key("base.layers.0.self_attn.q_proj.weight"));
}

#[test]
fn parser_token_before_any_pipe_flag_raises() {
    usage_error_mentions(&["--nonexistent-pipe"], "--nonexistent-pipe");
}

#[test]
fn parser_unknown_option_for_pipe_raises() {
    let err = run_usage_error(&["--dtype-cast", "--typo", "bfloat16"]);
    assert_mentions(&err, &["--dtype-cast", "'--typo'", "--dtype"]);
}

#[test]
fn parser_missing_required_arg_raises() {
    usage_error_mentions(&["--merge-lora"], "requires --adapter");
}

#[test]
fn parser_dtype_choices_validated() {
    usage_error_mentions(&["--dtype-cast", "--dtype", "not_a_dtype"], "not_a_dtype");
}

#[test]
fn parser_missing_value_for_flag_raises() {
    usage_error_mentions(&["--dtype-cast", "--dtype"], "--dtype");
}

#[test]
fn parser_three_pipes_chained() {
    let got = run_base(
        &[
            &FILTER_THEN_CAST[..],
            &["--key-rename", "--rule", "^model", "base"],
        ]
        .concat(),
    );
    assert_eq!(names(&got), ["base.layers.0.self_attn.q_proj.weight"]);
    assert!(all_dtypes(&got, "BF16"));
}

#[test]
fn parser_dtype_cast_positional() {
    assert_all_bf16(&["--dtype-cast", "bfloat16"]);
}

/// An FP8 (E4M3) q_proj with a per-tensor `weight_scale_inv`, beside F32 tensors.
fn make_fp8_base(dir: &Path) -> PathBuf {
    std::fs::create_dir_all(dir).unwrap();
    let path = dir.join("model.safetensors");
    let codes: Vec<u8> = (0..64 * 32).map(|k| (k % 0x7E) as u8).collect();
    let mut tensors = base_tensors();
    tensors[0] = t(Q, DType::F8_E4M3, &[64, 32], codes);
    tensors.push(t(
        "model.layers.0.self_attn.q_proj.weight_scale_inv",
        DType::F32,
        &[1, 1],
        0.5f32.to_le_bytes().to_vec(),
    ));
    write_file(&path, &tensors);
    path
}

#[test]
fn parser_dequant_fp8_positional_dtype() {
    let d = tmp();
    let base = make_fp8_base(&d.path().join("base"));
    let got = run_to(&d, &base, "out", &["--dequant-fp8", "fp16"]);
    assert_eq!(got[Q].0, "F16");
    assert!(!got.contains_key("model.layers.0.self_attn.q_proj.weight_scale_inv"));
}

#[test]
fn parser_dequant_fp8_positional_then_named() {
    let d = tmp();
    let base = make_fp8_base(&d.path().join("base"));
    let got = run_to(
        &d,
        &base,
        "out",
        &["--dequant-fp8", "fp16", "--block-size", "64"],
    );
    assert_eq!(got[Q].0, "F16");
    // The named option reached the section: a malformed block size is refused.
    let o = convert(
        "run",
        &base,
        &d.path().join("out2"),
        &["--dequant-fp8", "fp16", "--block-size", "1x2x3"],
    );
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains("1x2x3"), "{}", stderr(&o));
}

#[test]
fn parser_key_rename_positional_single_rule() {
    let got = renamed(
        &["--key-rename", "^foo", "bar"],
        &["--key-rename", "^model", "base"],
    );
    assert!(got.keys().all(|k| k.starts_with("base.")));
}

#[test]
fn parser_key_rename_positional_multiple_rules() {
    let got = renamed(
        &["--key-rename", "^foo", "bar", "^baz", "qux"],
        &["--key-rename", "^model", "base", "norm", "ln_f"],
    );
    assert!(got.contains_key("base.ln_f.weight"), "{:?}", names(&got));
}

#[test]
fn parser_key_filter_positional_include() {
    let got = run_base(&["--key-filter", "*q_proj*", "*v_proj*"]);
    assert_eq!(names(&got), [Q, V]);
}

#[test]
fn parser_positional_invalid_choice_raises() {
    usage_error_mentions(&["--dtype-cast", "not_a_dtype"], "not_a_dtype");
}

#[test]
fn parser_no_positional_for_pipe_raises() {
    usage_error_mentions(&["--dtype-cast", "bfloat16", "extra"], "extra");
}

// ---------------------------------------------------------------------------------------------
// TestRunCommand (its dtype-cast and key-filter tests run the commands of the parser tests
// above, which assert as much)
// ---------------------------------------------------------------------------------------------

#[test]
fn run_merge_lora_modifies_weights() {
    let lora = Lora::new();
    let got = lora.run("out", "--merge-lora --adapter ADAPTER");
    let want = base_map();
    assert_eq!(
        names(&got),
        want.keys().map(String::as_str).collect::<Vec<_>>()
    );
    // lora_A and lora_B are all ones, so q_proj changes.
    assert_ne!(got[Q].2, want[Q]);
    assert_eq!(got[V].2, want[V]);
}

#[test]
fn run_merge_lora_then_dtype_cast() {
    let got = Lora::new().run(
        "out",
        "--merge-lora --adapter ADAPTER --dtype-cast --dtype bfloat16",
    );
    assert!(all_dtypes(&got, "BF16"));
}

#[test]
fn run_no_pipes_is_passthrough() {
    let got = run_base(&[]);
    assert_eq!(names(&got), [Q, V, NORM]);
}

#[test]
fn run_dry_run_creates_no_output() {
    let (d, base) = base_in_tmp();
    let out = d.path().join("out");
    // `--dry-run` after the sections is still run's own option.
    convert_ok(
        "run",
        &base,
        &out,
        &["--dtype-cast", "--dtype", "bfloat16", "--dry-run"],
    );
    assert!(!out.exists());
}

#[test]
fn run_positional_adapter_path() {
    let lora = Lora::new();
    let got = lora.run("out", "--merge-lora ADAPTER");
    assert_eq!(names(&got), [Q, V, NORM]);
    let named = lora.run("named", "--merge-lora --adapter ADAPTER");
    assert_eq!(got, named);
}

#[test]
fn run_positional_dtype_cast() {
    assert_all_bf16(&["--dtype-cast", "bfloat16"]);
}

#[test]
fn run_unknown_pipe_flag_exits_nonzero() {
    run_usage_error(&["--no-such-pipe"]);
}

// ---------------------------------------------------------------------------------------------
// test_dcp_lora_merge.py: TestResolveAdapter and TestMergeLoraCLIAutoDetect, regular adapters
// ---------------------------------------------------------------------------------------------

fn merge(base: &Path, adapter: &Path, out: &Path) -> Tensors {
    lora_merged(base, adapter, out, &["-q"]);
    load_all(out)
}

/// q_proj + `alpha / r · (B @ A)` with all-ones A and B = `b`: every element gains
/// 2 · 4 · b.
fn assert_merged_with(got: &Tensors, b: f32) {
    let want: Vec<f32> = f32s_of(&base_map()[Q])
        .iter()
        .map(|w| w + 8.0 * b)
        .collect();
    assert_eq!(f32s_of(&got[Q].2), want);
}

#[test]
fn resolve_adapter_passthrough_plain_lora_file() {
    let (d, base, adapter) = base_and_adapter();
    let got = merge(
        &base,
        &adapter.join("adapter_model.safetensors"),
        &d.path().join("out"),
    );
    assert_merged_with(&got, 1.0);
}

#[test]
fn resolve_adapter_training_dir_with_regular_lora() {
    let (d, base) = base_in_tmp();
    let training = make_regular_lora_checkpoint(&d.path().join("training"), &[30, 60, 90]);
    let got = merge(&base, &training, &d.path().join("out"));
    assert_merged_with(&got, 90.0);
}

#[test]
fn resolve_adapter_training_dir_bad_content_raises() {
    let (d, base) = base_in_tmp();
    let training = d.path().join("training");
    std::fs::create_dir_all(training.join("checkpoint-1")).unwrap();
    std::fs::write(training.join("adapter_config.json"), "{}").unwrap();
    let out = d.path().join("out");
    let err = fails(&merge_lora(&base, &training, &out, &[]));
    assert_refused(&err, &["no adapter"], &out);
}

#[test]
fn merge_lora_training_dir_regular_lora_merges_correctly() {
    let (d, base) = base_in_tmp();
    let training = make_regular_lora_checkpoint(&d.path().join("training"), &[30, 90]);
    let got = merge(&base, &training, &d.path().join("merged"));
    assert_eq!(names(&got), [Q, V, NORM]);
    assert_ne!(got[Q].2, base_map()[Q]);
}

#[test]
fn merge_lora_extras_copied_from_base_dir() {
    let d = tmp();
    let base_dir = d.path().join("base");
    let base = make_base(&base_dir);
    std::fs::write(base_dir.join("config.json"), r#"{"model_type": "llama"}"#).unwrap();
    std::fs::write(base_dir.join("tokenizer.json"), "{}").unwrap();
    std::fs::write(base_dir.join("model.gguf"), "fake gguf").unwrap();
    let training = make_regular_lora_checkpoint(&d.path().join("training"), &[10]);
    let out = d.path().join("merged");
    merge(&base, &training, &out);
    assert!(out.join("config.json").exists());
    assert!(out.join("tokenizer.json").exists());
    assert!(!out.join("model.gguf").exists());
    // Upstream always writes model.safetensors.index.json; a one-shard output here is
    // model.safetensors alone, as transformers' save_pretrained writes it (README: Differences).
    // What the assertion guards holds: no index is copied from the base.
    assert_eq!(
        listing(&out),
        ["config.json", "model.safetensors", "tokenizer.json"]
    );
}

// ---------------------------------------------------------------------------------------------
// The rest of the compatibility list
// ---------------------------------------------------------------------------------------------

#[test]
fn verbose_is_accepted_by_every_command() {
    let (d, base) = base_in_tmp();
    for args in [
        &["info", s(&base), "-v"][..],
        &["validate", s(&base), "--verbose"],
        &["selftest", "--device", "cpu", "-q", "-v"],
        &["recover", s(&d.path().join("base")), "-v"],
        &cmd("passthrough", &base, &d.path().join("p"), &["-v", "-q"]),
        &cmd("run", &base, &d.path().join("r"), &["-q", "-v"]),
    ] {
        tftf_ok(args);
    }
}

#[test]
fn float64_casts_are_exact_everywhere() {
    let (d, base) = base_in_tmp();
    let want: Vec<u8> = f32s_of(&base_map()[Q])
        .iter()
        .flat_map(|v| (*v as f64).to_le_bytes())
        .collect();
    let out = d.path().join("p");
    passthrough_ok(&base, &out, &["--dtype", "float64", "-q"]);
    let got = load_all(&out);
    assert!(all_dtypes(&got, "F64"));
    assert_eq!(got[Q].2, want);
    let got = run_to(&d, &base, "r", &["--dtype-cast", "float64"]);
    assert_eq!(got[Q].2, want);
    tftf_ok(&["validate", s(&base), "--pipe", "dtype:float64"]);
    // A merged weight widens exactly too.
    let adapter = make_lora_adapter(&d.path().join("adapter"));
    let out = d.path().join("m");
    lora_merged(&base, &adapter, &out, &["--dtype", "float64", "-q"]);
    let got = load_all(&out);
    let merged: Vec<u8> = f32s_of(&base_map()[Q])
        .iter()
        .flat_map(|w| ((w + 8.0) as f64).to_le_bytes())
        .collect();
    assert_eq!(got[Q], ("F64".into(), vec![64, 32], merged));
    // FP8 dequantisation writes 16- or 32-bit floats only.
    let fp8 = make_fp8_base(&d.path().join("fp8"));
    for args in [
        &cmd(
            "dequant-fp8",
            &fp8,
            &d.path().join("x"),
            &["--dtype", "float64"],
        )[..],
        &cmd(
            "run",
            &fp8,
            &d.path().join("x"),
            &["--dequant-fp8", "--dtype-cast", "float64"],
        ),
    ] {
        let o = tftf(args);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {}", stderr(&o));
        assert!(stderr(&o).contains("float64"), "{}", stderr(&o));
    }
}

#[test]
fn dequant_fp8_takes_the_lora_spellings() {
    let d = tmp();
    let base = make_fp8_base(&d.path().join("base"));
    let adapter = make_lora_adapter(&d.path().join("adapter"));
    std::fs::rename(
        adapter.join("adapter_config.json"),
        d.path().join("cfg.json"),
    )
    .unwrap();
    let file = adapter.join("adapter_model.safetensors");
    let dequant = |out: &str, opts: &[&str]| {
        let out = d.path().join(out);
        tftf_ok(
            &[
                &cmd(
                    "dequant-fp8",
                    &base,
                    &out,
                    &["-q", "--merge-lora", s(&file)],
                )[..],
                opts,
            ]
            .concat(),
        );
        load_all(&out)
    };
    let cfg = d.path().join("cfg.json");
    let python = dequant(
        "py",
        &[
            "--lora-config",
            s(&cfg),
            "--lora-scale",
            "0.5",
            "--lora-adapter-name",
            "default",
        ],
    );
    let ours = dequant(
        "ours",
        &[
            "--adapter-config",
            s(&cfg),
            "--scale",
            "0.5",
            "--adapter-name",
            "default",
        ],
    );
    assert_eq!(python, ours);
    assert_ne!(python[Q], dequant("full", &["--lora-config", s(&cfg)])[Q]);
}

#[test]
fn merge_lora_renames_before_merging() {
    let d = tmp();
    let base_dir = d.path().join("base");
    std::fs::create_dir_all(&base_dir).unwrap();
    let base = base_dir.join("model.safetensors");
    let mut tensors = base_tensors();
    tensors[0].0 = "transformer.h.0.attn.q_proj.weight".into();
    write_file(&base, &tensors);
    // The adapter is keyed by the new names, as after the rename.
    let adapter = make_lora_adapter(&d.path().join("adapter"));
    let out = d.path().join("out");
    lora_merged(
        &base,
        &adapter,
        &out,
        &[
            "-q",
            "--rename",
            r"^transformer\.h\.(\d+)\.attn\.",
            r"model.layers.\1.self_attn.",
        ],
    );
    assert_merged_with(&load_all(&out), 1.0);
}

#[test]
fn rank_and_alpha_stand_in_for_a_missing_adapter_config() {
    let (d, base, adapter) = base_and_adapter();
    std::fs::remove_file(adapter.join("adapter_config.json")).unwrap();
    let out = d.path().join("out");
    let args = merge_lora(&base, &adapter, &out, &["-q"]);
    // Python tftf would assume r=8, alpha=8 here; tftf asks.
    let err = fails(&args);
    assert_mentions(
        &err,
        &["adapter_config.json not found", "--rank R --lora-alpha A"],
    );
    assert!(!out.exists());
    tftf_ok(&[&args[..], &["--rank", "4", "--lora-alpha", "8"]].concat());
    assert_merged_with(&load_all(&out), 1.0);
    let o = tftf(&[&args[..], &["--rank", "4"]].concat());
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
}

/// Sections apply strictly in order: a cast before a merge rounds the base first (as Python
/// tftf's pipes do), a cast after it rounds the merged value once.
#[test]
fn a_cast_before_a_merge_rounds_the_base_first() {
    let lora = Lora::new();
    let bf16 = |v: f32| f32_to_bf16(v).to_le_bytes();
    let w = f32s_of(&base_map()[Q]);
    let cast_first = lora.run("a", "--dtype-cast bf16 --merge-lora ADAPTER");
    let want: Vec<u8> = w
        .iter()
        .flat_map(|v| bf16(bf16_to_f32(f32_to_bf16(*v)) + 8.0))
        .collect();
    assert_eq!(cast_first[Q].2, want);
    let merge_first = lora.run("b", "--merge-lora ADAPTER --dtype-cast bf16");
    let want: Vec<u8> = w.iter().flat_map(|v| bf16(v + 8.0)).collect();
    assert_eq!(merge_first[Q].2, want);
    // Unmerged tensors are plain casts either way.
    assert_eq!(cast_first[V], merge_first[V]);
}

/// Several sections of one kind each keep their own options; an option outside its kind's
/// sections is a default for all of them (the older grammar).
#[test]
fn per_section_adapter_options() {
    let lora = Lora::new();
    let two = lora.run(
        "a",
        "--merge-lora --adapter ADAPTER --scale 0.5 --merge-lora ADAPTER --scale 0.25",
    );
    let want: Vec<f32> = f32s_of(&base_map()[Q])
        .iter()
        .map(|w| (w + 4.0) + 2.0)
        .collect();
    assert_eq!(f32s_of(&two[Q].2), want);
    let old_form = lora.run("b", "--scale 0.5 --merge-lora ADAPTER");
    let new_form = lora.run("c", "--merge-lora ADAPTER --scale 0.5");
    assert_eq!(old_form, new_form);
}

/// Two `--merge-lora` sections with different adapters: each merges its own modules once.
#[test]
fn two_adapters_merge_each_their_own_modules_once() {
    let (d, base) = base_in_tmp();
    let q = make_lora_adapter(&d.path().join("q"));
    let v = lora_adapter_on(
        &d.path().join("v"),
        "model.layers.0.self_attn.v_proj",
        "4.0",
    );
    let got = run_to(
        &d,
        &base,
        "out",
        &[
            "--merge-lora",
            s(&q),
            "--scale",
            "0.5",
            "--merge-lora",
            "--adapter",
            s(&v),
        ],
    );
    let plus = |name: &str, x: f32| -> Vec<f32> {
        f32s_of(&base_map()[name]).iter().map(|w| w + x).collect()
    };
    assert_eq!(f32s_of(&got[Q].2), plus(Q, 4.0));
    assert_eq!(f32s_of(&got[V].2), plus(V, 4.0));
}

// test_dcp_lora_merge.py: TestDCPLoRAMergePipe and TestDCPDoRAMergePipe, through
// `merge-dcp-lora` on DCP adapters saved as upstream's helpers save them
// (tests/fixtures/torch/dcp/upstream/generate.py). Upstream assumes r and alpha when
// adapter_config.json is missing; we require them, so the config-less cases pass
// `--rank 4 --lora-alpha 8`, upstream's defaults in those tests.

fn dcp_case(case: &str) -> PathBuf {
    fixture(&format!("torch/dcp/upstream/{case}"))
}

/// `merge-dcp-lora` of upstream case `case` into its base: the merged tensors and the base's.
fn dcp_merge(case: &str) -> (Floats, Floats) {
    let d = tmp();
    let out = d.path().join("merged");
    let base = dcp_case("base/model.safetensors");
    let dcp = dcp_case(&format!("{case}/pytorch_model_fsdp_0"));
    let mut args = vec![
        "merge-dcp-lora",
        "-b",
        s(&base),
        "-c",
        s(&dcp),
        "-o",
        s(&out),
        "-q",
    ];
    if !dcp_case(case).join("adapter_config.json").exists() {
        args.extend(["--rank", "4", "--lora-alpha", "8"]);
    }
    tftf_ok(&args);
    (floats_of(&out), floats_of(&base))
}

type Floats = std::collections::BTreeMap<String, Vec<f32>>;

fn floats_of(path: &Path) -> Floats {
    load_all(path)
        .into_iter()
        .map(|(k, (_, _, b))| (k, f32s_of(&b)))
        .collect()
}

fn allclose(a: &[f32], b: &[f32], atol: f32) -> bool {
    // torch.allclose's default rtol 1e-5 as well.
    a.len() == b.len()
        && a.iter()
            .zip(b)
            .all(|(x, y)| (x - y).abs() <= atol + 1e-5 * y.abs())
}

/// `case` (zero lora_B) merged: q_proj and v_proj are the base's within `atol`; returns
/// (merged, base).
fn assert_dcp_identity(case: &str, atol: f32) -> (Floats, Floats) {
    let (got, base) = dcp_merge(case);
    for k in [Q, V] {
        assert!(
            allclose(&got[k], &base[k], atol),
            "{case}: {k} changed despite zero lora_B (should be near-identity)"
        );
    }
    (got, base)
}

/// `case` (non-zero lora_B) merged: q_proj changes, the norm and the embeddings pass through
/// unchanged; returns the merged tensors.
fn assert_dcp_changes_q(case: &str) -> Floats {
    let (got, base) = dcp_merge(case);
    assert!(
        !allclose(&got[Q], &base[Q], 1e-8),
        "{case}: q_proj should have changed"
    );
    for k in ["model.norm.weight", "model.embed_tokens.weight"] {
        assert_eq!(got[k], base[k], "{case}: {k}");
    }
    got
}

/// `case` (target_modules: q_proj) merged: q_proj changes, v_proj does not.
fn assert_dcp_q_only(case: &str) {
    let (got, base) = dcp_merge(case);
    assert!(
        !allclose(&got[Q], &base[Q], 1e-8),
        "{case}: q_proj (in target_modules) should be merged"
    );
    assert!(
        allclose(&got[V], &base[V], 1e-8),
        "{case}: v_proj (not in target_modules) should be unchanged"
    );
}

#[test]
fn dcp_lora_zero_b_is_identity() {
    let (got, base) = assert_dcp_identity("lora-zero-b", 1e-5);
    assert_eq!(
        got.keys().collect::<Vec<_>>(),
        base.keys().collect::<Vec<_>>()
    );
}

#[test]
fn dcp_lora_nonzero_b_changes_weight_and_non_lora_keys_pass_through() {
    assert_dcp_changes_q("lora");
}

#[test]
fn dcp_lora_target_modules_respected() {
    assert_dcp_q_only("lora-q-only");
}

#[test]
fn dcp_dora_zero_b_is_identity() {
    assert_dcp_identity("dora-zero-b", 1e-4);
}

#[test]
fn dcp_dora_nonzero_b_changes_weight_and_non_dora_keys_unchanged() {
    let got = assert_dcp_changes_q("dora");
    // DoRA output differs from the plain LoRA merge of the same factors.
    let (lora, _) = dcp_merge("lora");
    assert!(!allclose(&got[Q], &lora[Q], 1e-6));
}

#[test]
fn dcp_dora_target_modules_respected() {
    assert_dcp_q_only("dora-q-only");
}
