//! One error type for the whole crate: a variant per kind of hostile input or failed action,
//! each carrying the file and, where there is one, the tensor, so every message tells the user
//! what to fix. `main` exits with [`Error::exit_code`]: 2 for usage errors, 130 for an interrupt
//! (128 + SIGINT, what shells report for a process killed by Ctrl-C), 1 for everything else.
//! Names and paths from the input are printed through [`crate::escape`].

use std::path::PathBuf;

use crate::escape;

/// Exit code of an interrupted run: 128 + SIGINT.
pub const EXIT_INTERRUPTED: i32 = 130;

pub type Result<T, E = Error> = std::result::Result<T, E>;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{}: {source}", escape::path(path))]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    #[error(
        "{}: file is {len} bytes, shorter than the 8-byte safetensors length prefix",
        escape::path(path)
    )]
    FileTooShort { path: PathBuf, len: u64 },

    #[error(
        "{}: header length {len} exceeds the limit of {max} bytes (not a safetensors file?)",
        escape::path(path)
    )]
    HeaderTooLarge { path: PathBuf, len: u64, max: u64 },

    #[error("{}: header needs {needed} bytes but only {available} follow the length prefix (file truncated?)", escape::path(path))]
    HeaderTruncated {
        path: PathBuf,
        needed: u64,
        available: u64,
    },

    #[error("{}: invalid header: {msg}", escape::path(path))]
    InvalidHeader { path: PathBuf, msg: String },

    #[error("{}: tensor `{}`: {msg}", escape::path(path), escape::name(tensor))]
    InvalidTensor {
        path: PathBuf,
        tensor: String,
        msg: String,
    },

    #[error(
        "{}: tensor `{}` has unknown dtype `{}`",
        escape::path(path),
        escape::name(tensor),
        escape::name(dtype)
    )]
    UnknownDtype {
        path: PathBuf,
        tensor: String,
        dtype: String,
    },

    #[error(
        "{}: tensor `{}`: {layout} needs {expected} bytes but its data_offsets span {actual}",
        escape::path(path),
        escape::name(tensor)
    )]
    TensorSizeMismatch {
        path: PathBuf,
        tensor: String,
        /// `shape [2, 3] of BF16`
        layout: String,
        expected: String,
        actual: u64,
    },

    #[error("{}: tensor `{}` starts at data offset {begin} but the previous tensor ends at {expected}: tensors must tile the data buffer without holes or overlaps", escape::path(path), escape::name(tensor))]
    TensorOffsetGap {
        path: PathBuf,
        tensor: String,
        begin: u64,
        expected: u64,
    },

    #[error(
        "{}: data buffer is {actual} bytes but the tensors need {expected} (file truncated)",
        escape::path(path)
    )]
    DataTruncated {
        path: PathBuf,
        expected: u64,
        actual: u64,
    },

    #[error(
        "{}: {extra} trailing bytes after the last tensor (file padded or corrupt)",
        escape::path(path)
    )]
    TrailingBytes { path: PathBuf, extra: u64 },

    #[error(
        "tensor `{}` is defined twice: in {} and in {}",
        escape::name(tensor),
        escape::path(first),
        escape::path(second)
    )]
    DuplicateTensor {
        tensor: String,
        first: PathBuf,
        second: PathBuf,
    },

    #[error("{}: invalid index: {msg}", escape::path(path))]
    InvalidIndex { path: PathBuf, msg: String },

    #[error(
        "{}: shard `{}` (holding `{}`) is missing",
        escape::path(index),
        escape::name(shard),
        escape::name(tensor)
    )]
    MissingShard {
        index: PathBuf,
        shard: String,
        tensor: String,
    },

    #[error(
        "{}: index maps tensor `{}` to this shard, but the shard does not contain it",
        escape::path(shard),
        escape::name(tensor)
    )]
    TensorNotInShard { shard: PathBuf, tensor: String },

    /// A `config.json` (or other side file) whose content cannot be used.
    #[error("{}: {msg}", escape::path(path))]
    InvalidConfig { path: PathBuf, msg: String },

    #[error("{}: {msg}", escape::path(path))]
    NoModel { path: PathBuf, msg: String },

    #[error(
        "output {} is the input or inside it; write to a directory outside {}",
        escape::path(output),
        escape::path(input)
    )]
    OutputInsideInput { output: PathBuf, input: PathBuf },

    #[error("output directory {} is not empty (it holds {entries}); pass --force to replace its model files", escape::path(dir))]
    OutputNotEmpty { dir: PathBuf, entries: String },

    #[error(
        "refusing to {action} {}: it is (or is a hard link to) the input file {}; choose another path",
        escape::path(path),
        escape::path(input)
    )]
    WouldTouchInput {
        path: PathBuf,
        input: PathBuf,
        action: &'static str,
    },

    #[error("output {} is being written by another tftf run ({holder}); wait for it to finish, or stop it", escape::path(dir))]
    OutputLocked { dir: PathBuf, holder: String },

    #[error(
        "renaming `{}` and `{}` both give `{}`; change the --rename rules",
        escape::name(first),
        escape::name(second),
        escape::name(target)
    )]
    NameCollision {
        first: String,
        second: String,
        target: String,
    },

    #[error(
        "not enough space in {}: the output needs {needed} bytes, {available} are free",
        escape::path(path)
    )]
    NoSpace {
        path: PathBuf,
        needed: u64,
        available: u64,
    },

    #[error("the plan of {tensors} tensors holds about {} in memory (names, shapes, headers), more than half of --memory-budget {}; raise --memory-budget to at least {}", crate::size::human(*.needed), crate::size::human(*.budget), crate::size::human(2 * *.needed))]
    PlanOverBudget {
        tensors: usize,
        needed: u64,
        budget: u64,
    },

    #[error("{}: tensor `{}`: {msg}", escape::path(path), escape::name(tensor))]
    TensorData {
        path: PathBuf,
        tensor: String,
        msg: String,
    },

    #[error("{}: {} `{}` has no scale (looked for {looked}){more}; {}", escape::path(path), of.kind(), escape::name(tensor), of.hint())]
    MissingScale {
        path: PathBuf,
        of: ScaleOf,
        tensor: String,
        looked: String,
        /// `" (and N more weights)"` or empty.
        more: String,
    },

    #[error(
        "{}: scale `{}` has no FP8 weight to apply to (expected `{}`)",
        escape::path(path),
        escape::name(tensor),
        escape::name(weight)
    )]
    OrphanScale {
        path: PathBuf,
        tensor: String,
        weight: String,
    },

    #[error(
        "{}: scale `{}` of `{}`: {msg}",
        escape::path(path),
        escape::name(tensor),
        escape::name(weight)
    )]
    BadScale {
        path: PathBuf,
        tensor: String,
        weight: String,
        msg: String,
    },

    #[error("{}: {msg}", escape::path(path))]
    Adapter { path: PathBuf, msg: String },

    #[error("{}: {count} adapter tensor(s) match nothing in the base model: {list}; pass --allow-unmatched to merge the rest anyway", escape::path(path))]
    UnmatchedAdapter {
        path: PathBuf,
        count: usize,
        /// Up to ten names, backticked.
        list: String,
    },

    #[error("{0}")]
    Usage(String),

    /// A requested GPU that cannot be used, or a CUDA call that failed.
    #[error("{0}")]
    Device(String),

    #[error("interrupted; temporary output removed")]
    Cancelled,

    /// The command's printed output could not be written (a closed pipe, a full device), so
    /// what reached the reader is incomplete.
    #[error("cannot write to {stream}: {reason}; the output printed so far is incomplete")]
    OutputLost {
        stream: &'static str,
        reason: String,
    },

    /// A filter that keeps no tensor, or an op that finds nothing to do: almost surely the
    /// wrong input or pattern (`--allow-empty` accepts it).
    #[error("{0}; pass --allow-empty to write the output anyway")]
    NothingToDo(String),

    #[error("{0}")]
    Other(String),

    /// A GGUF output that cannot be laid out (name too long, too many dimensions, a size that
    /// is not a whole number of ggml blocks, a bad alignment).
    #[error("gguf: tensor `{tensor}`: {msg}")]
    GgufTensor { tensor: String, msg: String },

    #[error("gguf: architecture `{arch}` is not supported; supported: {supported}")]
    GgufUnsupportedArch { arch: String, supported: String },

    /// `config.json` lacks a value the architecture needs, or has one of the wrong type.
    #[error("{}: {msg}", path.display())]
    GgufConfig { path: PathBuf, msg: String },

    #[error("{}: the pre-tokenizer is not one llama.cpp knows (chkhsh {hash}); if you know which one it is (e.g. `llama-bpe`, `qwen2`), pass --vocab-pre NAME", path.display())]
    GgufUnknownPreTokenizer { path: PathBuf, hash: String },

    #[error("{}: tokenizer: {msg}", path.display())]
    GgufTokenizer { path: PathBuf, msg: String },

    /// `--imatrix FILE` that is not an importance matrix, or one for another model.
    #[error("{}: importance matrix: {msg}", path.display())]
    GgufImatrix { path: PathBuf, msg: String },

    #[error("{}: {msg}", path.display())]
    TorchArchive { path: PathBuf, msg: String },

    #[error("{}: bad pickle: {msg}", path.display())]
    BadPickle { path: PathBuf, msg: String },

    /// A pickle naming a global outside the allow-list (`posix.system`, `builtins.eval`, …).
    #[error("{}: refusing to load: its pickle calls `{global}`, which is not on the allow-list of tensor and container constructors (it could run code); nothing was executed", path.display())]
    UnsafePickle { path: PathBuf, global: String },

    #[error("{}: distributed checkpoint: {msg}", path.display())]
    Dcp { path: PathBuf, msg: String },
}

impl Error {
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io {
            path: path.into(),
            source,
        }
    }

    pub fn exit_code(&self) -> i32 {
        match self {
            Error::Usage(_) | Error::WouldTouchInput { .. } => 2,
            Error::Cancelled => EXIT_INTERRUPTED,
            _ => 1,
        }
    }
}

/// A size argument that does not parse is a usage error.
impl From<crate::size::BadSize> for Error {
    fn from(bad: crate::size::BadSize) -> Self {
        Error::Usage(bad.0)
    }
}

/// What kind of tensor lacks its scale, for the message and its advice.
#[derive(Debug, Clone, Copy)]
pub enum ScaleOf {
    Fp8Weight,
    Mxfp4Expert,
    EngramTable,
    QuantWeight,
}

impl ScaleOf {
    fn kind(self) -> &'static str {
        match self {
            ScaleOf::Fp8Weight => "FP8 weight",
            ScaleOf::Mxfp4Expert => "MXFP4 expert weight",
            ScaleOf::EngramTable => "Engram table",
            ScaleOf::QuantWeight => "quantised weight",
        }
    }
    fn hint(self) -> &'static str {
        match self {
            ScaleOf::Fp8Weight => "pass --allow-unscaled-fp8 to decode such weights without one",
            ScaleOf::Mxfp4Expert => "pass --experts keep to leave the experts as they are",
            ScaleOf::EngramTable => "pass --engram keep to leave the tables as they are",
            ScaleOf::QuantWeight => "its codes cannot be decoded without it (is a shard missing?)",
        }
    }
}
