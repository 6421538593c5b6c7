//! Helpers shared by the integration tests (`mod common; use common::*;`).
//!
//! - Write a checkpoint with [`Model`]:
//!   `Model::new().rand(&mut rng, "w", DType::BF16, &[4, 4]).config(json).write(&dir)`.
//!   One shard is `model.safetensors`; `.shard()` starts another, and several shards (or one,
//!   after `.indexed()`) are `model-0000i-of-0000n.safetensors` plus the index;
//!   `Model::adapter()` writes `adapter_model.safetensors`; `.file(name, text)` adds side files.
//!   Lower level: [`t`], [`rand_t`], [`write_file`], [`write_sharded`], [`raw_safetensors`]
//!   (a hand-made, possibly broken header). Ready-made: [`small_model`], [`tmp_small_model`].
//! - Run the binary: [`tftf`]`(&args)` returns the `Output` (any exit); [`ok`] asserts success;
//!   [`fails`] / [`usage_error`] assert exit 1 / 2 and return stderr; [`exit_code`] gives
//!   (code, stdout, stderr). Arguments: [`cmd`]`("passthrough", &src, &out, &["-q"])` is
//!   `passthrough -i SRC -o OUT -q`, [`convert`] runs it ([`passthrough`] for that command;
//!   [`converted`] loads what it wrote),
//!   [`merge_lora`] is `merge-lora -b BASE -a ADAPTER -o OUT ..`; [`s`] turns a path into an
//!   argument.
//! - Read results: [`load_all`] (name -> (dtype, shape, bytes) of a file or a folder of shards,
//!   via the `safetensors` crate; [`load_tensors`] without the `format=pt` check),
//!   [`read_json`], [`listing`], [`stdout`], [`stderr`].
//! - Check results: [`assert_mentions`] (every needle in a message), [`assert_refused`] (and no
//!   output left), [`assert_listing`] (the files of a folder), [`assert_same_tensors`] (names,
//!   dtypes and shapes, then the bytes).
//! - Misc: [`tmp`] (a temporary folder; [`tmp_in`] / [`tmp_out`] with the path `in` / `out`
//!   in it, [`tmp_model`] with a [`Model`] written to `in`), [`fixture`], [`copy_dir`],
//!   [`f32_bytes`], [`f32s_of`], [`Rng`], [`SCHEMES`].
//! - Submodules: [`fake_cuda`] (the fake CUDA driver and tftf run against it), [`gguf`] (the
//!   GGUF reader and `tftf gguf` models), [`interrupt`] (a slow run
//!   stopped by a signal), [`peft`] (PEFT's merge fixtures), [`xfs`] (a loop-mounted reflink
//!   XFS image).
#![allow(dead_code)]

pub mod fake_cuda;
pub mod gguf;
pub mod interrupt;
pub mod merge_fixtures;
pub mod peft;
pub mod xfs;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use tftf::format::dtype::DType;
use tftf::format::write_small;

pub type T = (String, DType, Vec<u64>, Vec<u8>);

/// `tests/fixtures/<rel>`, the golden data kept in the repository (its README says what made
/// it); panics naming the path when it is missing.
pub fn fixture(rel: &str) -> PathBuf {
    let path = Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures")).join(rel);
    if !path.exists() {
        panic!(
            "test fixture `{}` is missing (it is part of the repository: restore it with git)",
            path.display()
        );
    }
    path
}

/// The library's deterministic generator (also behind `tftf selftest`'s vectors).
pub use tftf::commands::selftest::table::Lcg as Rng;

pub fn t(name: &str, dtype: DType, shape: &[u64], data: Vec<u8>) -> T {
    (name.to_string(), dtype, shape.to_vec(), data)
}

/// A tensor of `dtype` with random bytes (floats made finite).
pub fn rand_t(rng: &mut Rng, name: &str, dtype: DType, shape: &[u64]) -> T {
    let n: u64 = shape.iter().product();
    let data = match dtype {
        DType::F32 => rng.f32s(n as usize),
        DType::BF16 | DType::F16 => (0..n)
            .flat_map(|_| ((rng.next_u32() as u16) & 0x3BFF).to_le_bytes())
            .collect(),
        _ => rng.bytes(dtype.byte_len(n).unwrap() as usize),
    };
    t(name, dtype, shape, data)
}

/// Writes `tensors` as one safetensors file at `path`.
pub fn write_file(path: &Path, tensors: &[T]) {
    write_small(path, tensors).unwrap();
}

/// Writes shards plus `model.safetensors.index.json` into `dir`.
pub fn write_sharded(dir: &Path, shards: &[Vec<T>]) {
    std::fs::create_dir_all(dir).unwrap();
    let n = shards.len();
    let mut map = serde_json::Map::new();
    let mut total = 0;
    for (i, tensors) in shards.iter().enumerate() {
        let name = format!("model-{:05}-of-{:05}.safetensors", i + 1, n);
        write_file(&dir.join(&name), tensors);
        for t in tensors {
            map.insert(t.0.clone(), name.clone().into());
            total += t.3.len();
        }
    }
    let index = serde_json::json!({"metadata": {"total_size": total}, "weight_map": map});
    std::fs::write(dir.join("model.safetensors.index.json"), index.to_string()).unwrap();
}

/// The config.json of [`small_model`].
pub const SMALL_CONFIG: &str = "{\n  \"architectures\": [\"LlamaForCausalLM\"],\n  \"torch_dtype\": \"float32\",\n  \"hidden_size\": 32\n}\n";

/// A small llama-like model of two shards with config and tokenizer files.
pub fn small_model(dir: &Path) -> Vec<T> {
    let mut rng = Rng(1);
    // Two shards of (name, dtype, shape), drawn in this order.
    let shards: [&[(&str, DType, &[u64])]; 2] = [
        &[
            ("model.embed_tokens.weight", DType::BF16, &[64, 32]),
            (
                "model.layers.0.self_attn.q_proj.weight",
                DType::F8_E4M3,
                &[32, 32],
            ),
            (
                "model.layers.0.self_attn.q_proj.weight_scale_inv",
                DType::F32,
                &[1, 1],
            ),
            ("model.layers.0.mlp.up_proj.weight", DType::BF16, &[64, 32]),
            ("model.layers.0.input_layernorm.weight", DType::F32, &[32]),
        ],
        &[
            ("model.layers.1.mlp.up_proj.weight", DType::F16, &[64, 32]),
            ("model.layers.1.input_layernorm.weight", DType::F32, &[32]),
            ("model.layers.1.experts.packed", DType::F4, &[16, 32]),
            ("model.layers.1.step", DType::I64, &[3]),
            ("model.norm.weight", DType::F32, &[32]),
            ("lm_head.weight", DType::BF16, &[64, 32]),
        ],
    ];
    let mut model = Model::new();
    for (k, shard) in shards.iter().enumerate() {
        if k > 0 {
            model = model.shard();
        }
        for &(name, dtype, shape) in shard.iter() {
            model = model.rand(&mut rng, name, dtype, shape);
        }
    }
    let model = model
        .config(SMALL_CONFIG)
        .file("tokenizer.json", "{}")
        .file("modeling_x.py", "# remote code\n")
        .file("pytorch_model.bin", "stale")
        .file("adapter_config.json", "{}");
    model.write(dir);
    model.all()
}

/// A model a run takes seconds over with [`SLOW_CAST`]: one 96 MiB F32 tensor, for tests that
/// signal or stall a run while it writes.
pub fn slow_cast_model(dir: &Path) {
    let mut rng = Rng(2);
    std::fs::create_dir_all(dir).unwrap();
    let big: Vec<u8> = (0..96 << 18)
        .flat_map(|_| (rng.next_u32() as f32).to_le_bytes())
        .collect();
    write_file(
        &dir.join("model.safetensors"),
        &[t("big", DType::F32, &[96 << 18], big)],
    );
}

/// A cast of [`slow_cast_model`] on one thread under a small budget: well over a second.
pub const SLOW_CAST: [&str; 6] = [
    "--dtype",
    "bf16",
    "--threads",
    "1",
    "--memory-budget",
    "16MiB",
];

/// A fresh [`tmp`] folder with [`small_model`] written into `in/`: (folder, `in/`, tensors).
pub fn tmp_small_model() -> (tempfile::TempDir, PathBuf, Vec<T>) {
    let d = tmp();
    let src = d.path().join("in");
    let tensors = small_model(&src);
    (d, src, tensors)
}

/// A [`tmp_small_model`] passed through to `out` (a name in the folder) with `extra`:
/// (folder, `in/`, the output, the tensors).
pub fn small_model_passed(
    out: &str,
    extra: &[&str],
) -> (tempfile::TempDir, PathBuf, PathBuf, Vec<T>) {
    let (d, src, tensors) = tmp_small_model();
    let out = d.path().join(out);
    passthrough_ok(&src, &out, extra);
    (d, src, out, tensors)
}

/// Runs the `tftf` binary with `args` (and `NO_COLOR=1`), any exit.
pub fn tftf(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_tftf"))
        .args(args)
        .env("NO_COLOR", "1")
        .output()
        .expect("run tftf")
}

pub fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}
pub fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

pub fn ok(o: &Output) {
    assert!(
        o.status.success(),
        "tftf failed: {}\n{}",
        stderr(o),
        stdout(o)
    );
}

/// Asserts that `text` (a message, an output) starts with `prefix`.
pub fn assert_starts(text: &str, prefix: &str) {
    assert!(text.starts_with(prefix), "{text}");
}

/// Asserts that `text` (a message, an output) contains every one of `needles`.
pub fn assert_mentions(text: &str, needles: &[&str]) {
    for needle in needles {
        assert!(text.contains(needle), "{needle:?} not in: {text}");
    }
}

/// Asserts that a refusal's message `msg` mentions every one of `needles` ([`assert_mentions`])
/// and that the refused command left no `out`.
pub fn assert_refused(msg: &str, needles: &[&str], out: &Path) {
    assert_mentions(msg, needles);
    assert!(!out.exists(), "{} exists after: {msg}", out.display());
}

/// A fresh temporary directory, removed when dropped.
pub fn tmp() -> tempfile::TempDir {
    tempfile::tempdir().unwrap()
}

/// Runs tftf, expects exit code `code` and returns stderr.
fn exits_with(code: i32, what: &str, args: &[&str]) -> String {
    let o = tftf(args);
    assert_eq!(
        o.status.code(),
        Some(code),
        "expected {what}: {}\n{}",
        stderr(&o),
        stdout(&o)
    );
    stderr(&o)
}

/// Runs tftf, expects exit code 1 and returns stderr.
pub fn fails(args: &[&str]) -> String {
    exits_with(1, "failure", args)
}

/// Runs tftf, expects a usage error (exit code 2) and returns stderr.
pub fn usage_error(args: &[&str]) -> String {
    exits_with(2, "a usage error", args)
}

/// The tensors of a file or folder as [`load_all`] reads them, as [`T`]s to edit and write back
/// with [`write_file`].
pub fn load_ts(path: &Path) -> Vec<T> {
    (load_all(path).into_iter())
        .map(|(name, (dtype, shape, bytes))| {
            let shape: Vec<u64> = shape.iter().map(|&x| x as u64).collect();
            t(&name, dtype.parse().unwrap(), &shape, bytes)
        })
        .collect()
}

/// All tensors of an output, read through the `safetensors` crate's strict loader; every file
/// must carry `format=pt` metadata.
pub fn load_all(path: &Path) -> Tensors {
    load_tensors(path, true)
}

/// Tensors of a safetensors file, or of every `.safetensors` file of a folder, through the
/// `safetensors` crate: name -> (dtype, shape, bytes). With `format_pt`, each file must carry
/// `format=pt` metadata.
pub fn load_tensors(
    path: &Path,
    format_pt: bool,
) -> std::collections::BTreeMap<String, (String, Vec<usize>, Vec<u8>)> {
    let mut files: Vec<PathBuf> = match std::fs::read_dir(path) {
        Ok(rd) if path.is_dir() => rd
            .map(|e| e.unwrap().path())
            .filter(|p| p.extension().is_some_and(|e| e == "safetensors"))
            .collect(),
        _ => vec![path.to_path_buf()],
    };
    files.sort();
    let mut out = std::collections::BTreeMap::new();
    for f in files {
        let bytes = std::fs::read(&f).unwrap();
        if format_pt {
            let (_, meta) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
            assert_eq!(
                meta.metadata()
                    .as_ref()
                    .and_then(|m| m.get("format"))
                    .map(String::as_str),
                Some("pt"),
                "{} lacks format=pt",
                f.display()
            );
        }
        let st = safetensors::SafeTensors::deserialize(&bytes)
            .unwrap_or_else(|e| panic!("{} rejected by safetensors: {e:?}", f.display()));
        for (name, view) in st.tensors() {
            let entry = (
                format!("{:?}", view.dtype()),
                view.shape().to_vec(),
                view.data().to_vec(),
            );
            assert!(out.insert(name.clone(), entry).is_none(), "{name} twice");
        }
    }
    out
}

/// Asserts that the names [`listing`] gives for `dir` are exactly the whitespace-separated
/// names of `want`, in order.
pub fn assert_listing(dir: &Path, want: &str) {
    assert_eq!(
        listing(dir),
        want.split_whitespace().collect::<Vec<_>>(),
        "files of {}",
        dir.display()
    );
}

/// Tensors as [`load_all`] gives them: name -> (dtype, shape, bytes).
pub type Tensors = std::collections::BTreeMap<String, (String, Vec<usize>, Vec<u8>)>;

/// Asserts that `got` has exactly the tensor names of `want`, each with `want`'s dtype and
/// shape (failures start with `what`), then calls `bytes(name, dtype, got, want)` with each
/// tensor's data, in name order.
pub fn assert_same_tensors(
    what: &str,
    got: &Tensors,
    want: &Tensors,
    mut bytes: impl FnMut(&str, &str, &[u8], &[u8]),
) {
    assert_eq!(
        got.keys().collect::<Vec<_>>(),
        want.keys().collect::<Vec<_>>(),
        "{what}: tensor names"
    );
    for (name, (dtype, shape, want_bytes)) in want {
        let (gd, gs, gb) = &got[name];
        assert_eq!((gd, gs), (dtype, shape), "{what}: `{name}` dtype and shape");
        bytes(name, dtype, gb, want_bytes);
    }
}

/// Files (recursively) under `dir`, relative names, sorted.
pub fn listing(dir: &Path) -> Vec<String> {
    let mut v = Vec::new();
    if let Ok(rd) = std::fs::read_dir(dir) {
        for e in rd.flatten() {
            v.push(e.file_name().to_string_lossy().into_owned());
        }
    }
    v.sort();
    v
}

pub fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// A checkpoint to write: tensors in one or more shards, plus side files (`config.json`, ...).
///
/// `Model::new().rand(&mut rng, "w", DType::BF16, &[4, 4]).config(CONFIG).write(&dir)`.
/// One shard is written as `model.safetensors` (`adapter_model.safetensors` for
/// [`Model::adapter`]); after [`Model::shard`] there are several,
/// written as `model-0000i-of-0000n.safetensors` with `model.safetensors.index.json` (as is
/// one after [`Model::indexed`]).
#[derive(Clone, Debug)]
pub struct Model {
    shards: Vec<Vec<T>>,
    files: Vec<(String, Vec<u8>)>,
    single: &'static str,
    indexed: bool,
}

impl Default for Model {
    fn default() -> Self {
        Self::new()
    }
}

impl Model {
    pub fn new() -> Self {
        Model {
            shards: vec![Vec::new()],
            files: Vec::new(),
            single: "model.safetensors",
            indexed: false,
        }
    }

    /// A PEFT adapter: one shard is written as `adapter_model.safetensors`.
    pub fn adapter() -> Self {
        Model {
            single: "adapter_model.safetensors",
            ..Self::new()
        }
    }

    /// Adds a tensor to the current (last) shard.
    pub fn tensor(self, name: &str, dtype: DType, shape: &[u64], data: Vec<u8>) -> Self {
        self.tensors([t(name, dtype, shape, data)])
    }

    /// Adds a tensor of random bytes (see [`rand_t`]) to the current shard.
    pub fn rand(self, rng: &mut Rng, name: &str, dtype: DType, shape: &[u64]) -> Self {
        self.tensors([rand_t(rng, name, dtype, shape)])
    }

    /// Adds tensors of random bytes (see [`rand_t`]) to the current shard, in the order
    /// given: `(name, dtype, shape)` each.
    pub fn rands(self, rng: &mut Rng, specs: &[(&str, DType, &[u64])]) -> Self {
        let tensors: Vec<T> = specs
            .iter()
            .map(|&(name, dtype, shape)| rand_t(rng, name, dtype, shape))
            .collect();
        self.tensors(tensors)
    }

    /// Adds tensors to the current shard.
    pub fn tensors(mut self, tensors: impl IntoIterator<Item = T>) -> Self {
        self.shards.last_mut().unwrap().extend(tensors);
        self
    }

    /// Starts a new shard.
    pub fn shard(mut self) -> Self {
        self.shards.push(Vec::new());
        self
    }

    /// Writes numbered shards with `model.safetensors.index.json` even for one shard.
    pub fn indexed(mut self) -> Self {
        self.indexed = true;
        self
    }

    /// Adds `config.json` with `json` as its text.
    pub fn config(self, json: &str) -> Self {
        self.file("config.json", json)
    }

    /// Adds a side file `name` (relative to the model folder).
    pub fn file(mut self, name: &str, contents: impl AsRef<[u8]>) -> Self {
        self.files
            .push((name.to_string(), contents.as_ref().to_vec()));
        self
    }

    /// Every tensor, in the order added.
    pub fn all(&self) -> Vec<T> {
        self.shards.concat()
    }

    /// Writes the one shard as the safetensors file `path` (side files are not written).
    pub fn write_file(&self, path: &Path) {
        let [one] = &self.shards[..] else {
            panic!("write_file takes a model of one shard")
        };
        write_file(path, one);
    }

    /// Writes the model into `dir` (created) and returns `dir`.
    pub fn write(&self, dir: &Path) -> PathBuf {
        std::fs::create_dir_all(dir).unwrap();
        if let ([one], false) = (&self.shards[..], self.indexed) {
            write_file(&dir.join(self.single), one);
        } else {
            write_sharded(dir, &self.shards);
        }
        for (name, contents) in &self.files {
            std::fs::write(dir.join(name), contents).unwrap();
        }
        dir.to_path_buf()
    }
}

/// A safetensors file of the header text `header` followed by `data`, written as given.
pub fn raw_safetensors(header: &str, data: &[u8]) -> Vec<u8> {
    let mut v = (header.len() as u64).to_le_bytes().to_vec();
    v.extend_from_slice(header.as_bytes());
    v.extend_from_slice(data);
    v
}

/// The arguments `CMD -i INPUT -o OUT EXTRA...`, for [`tftf`], [`fails`], [`exit_code`], ...
pub fn cmd<'a>(name: &'a str, input: &'a Path, out: &'a Path, extra: &[&'a str]) -> Vec<&'a str> {
    [&[name, "-i", s(input), "-o", s(out)][..], extra].concat()
}

/// The arguments `merge-lora -b BASE -a ADAPTER -o OUT EXTRA...`.
pub fn merge_lora<'a>(
    base: &'a Path,
    adapter: &'a Path,
    out: &'a Path,
    extra: &[&'a str],
) -> Vec<&'a str> {
    [
        &["merge-lora", "-b", s(base), "-a", s(adapter), "-o", s(out)][..],
        extra,
    ]
    .concat()
}

/// Runs `tftf merge-lora -b BASE -a ADAPTER -o OUT EXTRA...` ([`merge_lora`]), any exit.
pub fn lora_merge(base: &Path, adapter: &Path, out: &Path, extra: &[&str]) -> Output {
    tftf(&merge_lora(base, adapter, out, extra))
}

/// [`lora_merge`], asserting success ([`ok`]).
pub fn lora_merged(base: &Path, adapter: &Path, out: &Path, extra: &[&str]) -> Output {
    let o = lora_merge(base, adapter, out, extra);
    ok(&o);
    o
}

/// [`tftf`], asserting success ([`ok`]).
pub fn tftf_ok(args: &[&str]) -> Output {
    let o = tftf(args);
    ok(&o);
    o
}

/// [`convert`], asserting success ([`ok`]).
pub fn convert_ok(name: &str, input: &Path, out: &Path, extra: &[&str]) -> Output {
    tftf_ok(&cmd(name, input, out, extra))
}

/// [`convert_ok`], then the output's tensors ([`load_all`]).
pub fn converted(
    name: &str,
    input: &Path,
    out: &Path,
    extra: &[&str],
) -> std::collections::BTreeMap<String, (String, Vec<usize>, Vec<u8>)> {
    convert_ok(name, input, out, extra);
    load_all(out)
}

/// Runs `tftf CMD -i INPUT -o OUT EXTRA...`, any exit.
pub fn convert(name: &str, input: &Path, out: &Path, extra: &[&str]) -> Output {
    tftf(&cmd(name, input, out, extra))
}

/// Runs `tftf passthrough -i INPUT -o OUT EXTRA...`, any exit.
pub fn passthrough(input: &Path, out: &Path, extra: &[&str]) -> Output {
    convert("passthrough", input, out, extra)
}

/// A fresh [`tmp`] folder and the path `in` in it (not made).
pub fn tmp_in() -> (tempfile::TempDir, PathBuf) {
    let d = tmp();
    let src = d.path().join("in");
    (d, src)
}

/// [`tmp_in`] with `model` written to the path `in`.
pub fn tmp_model(model: Model) -> (tempfile::TempDir, PathBuf) {
    let (d, src) = tmp_in();
    model.write(&src);
    (d, src)
}

/// A fresh [`tmp`] folder and the path `out` in it (not made).
pub fn tmp_out() -> (tempfile::TempDir, PathBuf) {
    let d = tmp();
    let out = d.path().join("out");
    (d, out)
}

/// [`passthrough`], asserting success ([`ok`]).
pub fn passthrough_ok(input: &Path, out: &Path, extra: &[&str]) -> Output {
    convert_ok("passthrough", input, out, extra)
}

/// Runs tftf and returns its exit code, stdout and stderr.
pub fn exit_code(args: &[&str]) -> (Option<i32>, String, String) {
    let o = tftf(args);
    (o.status.code(), stdout(&o), stderr(&o))
}

/// The JSON file at `path`, parsed.
pub fn read_json(path: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

/// The strings of the JSON array `v` (a golden file's list of arguments or names).
pub fn json_strs(v: &serde_json::Value) -> Vec<&str> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_str().unwrap())
        .collect()
}

/// Copies the folder `from` to `to` (created), recursively, by reading and writing each file.
pub fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        let dst = to.join(e.file_name());
        if e.file_type().unwrap().is_dir() {
            copy_dir(&e.path(), &dst);
        } else {
            std::fs::write(&dst, std::fs::read(e.path()).unwrap()).unwrap();
        }
    }
}

/// Little-endian bytes of `v`.
pub fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// The f32 values of little-endian `bytes`.
pub fn f32s_of(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

/// The `quantize --scheme` presets, as the compressed-tensors format writes them.
pub const SCHEMES: [&str; 7] = [
    "FP8_DYNAMIC",
    "FP8_BLOCK",
    "W8A16",
    "W4A16",
    "NVFP4A16",
    "MXFP4A16",
    "MXFP8A16",
];

/// The presets `quantize --format modelopt` holds.
pub const MODELOPT_SCHEMES: [&str; 6] = [
    "FP8_BLOCK",
    "FP8_DYNAMIC",
    "NVFP4A16",
    "MXFP4A16",
    "MXFP8A16",
    "W4A16",
];

/// The modules `requant_adapter` targets in layer 0 of the `quantize` fixtures (with their
/// [out, in]). 320 rows and columns make ragged 128-blocks.
pub const REQUANT_TARGETS: [(&str, u64, u64); 4] = [
    ("self_attn.q_proj", 128, 256),
    ("self_attn.v_proj", 64, 256),
    ("mlp.gate_proj", 320, 256),
    ("mlp.down_proj", 256, 320),
];
pub const REQUANT_LAYER: &str = "model.layers.0";

/// A rank-4 F32 LoRA adapter on [`REQUANT_TARGETS`], factors in ±0.1, DoRA on gate_proj.
pub fn requant_adapter(dir: &Path) -> PathBuf {
    let mut rng = Rng(0x5eed);
    let mut small = |n: u64| -> Vec<u8> {
        let v: Vec<f32> = (0..n)
            .map(|_| (rng.next_u32() as f32 / u32::MAX as f32 - 0.5) * 0.2)
            .collect();
        f32_bytes(&v)
    };
    let mut m = Model::adapter();
    for (module, out, inp) in REQUANT_TARGETS {
        let p = format!("base_model.model.{REQUANT_LAYER}.{module}");
        m = m
            .tensor(
                &format!("{p}.lora_A.weight"),
                DType::F32,
                &[4, inp],
                small(4 * inp),
            )
            .tensor(
                &format!("{p}.lora_B.weight"),
                DType::F32,
                &[out, 4],
                small(out * 4),
            );
        // DoRA on gate_proj (ragged 320 rows): the merge rescales each row to a magnitude.
        if module == "mlp.gate_proj" {
            let mags: Vec<f32> = (0..out).map(|i| 0.5 + (i % 7) as f32 * 0.1).collect();
            m = m.tensor(
                &format!("{p}.lora_magnitude_vector"),
                DType::F32,
                &[out],
                f32_bytes(&mags),
            );
        }
    }
    m.file(
        "adapter_config.json",
        r#"{"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj", "gate_proj", "down_proj"]}"#,
    )
    .write(dir)
}

/// `got` holds `want`'s tensors, byte for byte.
pub fn assert_identical(what: &str, got: &Tensors, want: &Tensors) {
    assert_same_tensors(what, got, want, |name, _, g, w| {
        assert!(g == w, "{what}: `{name}` bytes differ")
    });
}
