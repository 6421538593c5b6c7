//! One error type for the whole crate: a variant per kind of hostile input or failed action,
//! each carrying the file and, where there is one, the tensor, so every message tells the user
//! what to fix. `main` maps `Usage` to exit code 2 and everything else to 1.

use std::path::PathBuf;

pub type Result<T, E = Error> = std::result::Result<T, E>;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    #[error("{}: file is {len} bytes, shorter than the 8-byte safetensors length prefix", path.display())]
    FileTooShort { path: PathBuf, len: u64 },

    #[error("{}: header length {len} exceeds the limit of {max} bytes (not a safetensors file?)", path.display())]
    HeaderTooLarge { path: PathBuf, len: u64, max: u64 },

    #[error("{}: header needs {needed} bytes but only {available} follow the length prefix (file truncated?)", path.display())]
    HeaderTruncated {
        path: PathBuf,
        needed: u64,
        available: u64,
    },

    #[error("{}: header is not valid JSON: {msg}", path.display())]
    InvalidHeader { path: PathBuf, msg: String },

    #[error("{}: tensor `{tensor}`: {msg}", path.display())]
    InvalidTensor {
        path: PathBuf,
        tensor: String,
        msg: String,
    },

    #[error("{}: tensor `{tensor}` has unknown dtype `{dtype}`", path.display())]
    UnknownDtype {
        path: PathBuf,
        tensor: String,
        dtype: String,
    },

    #[error("{}: tensor `{tensor}`: {layout} needs {expected} bytes but its data_offsets span {actual}", path.display())]
    TensorSizeMismatch {
        path: PathBuf,
        tensor: String,
        /// `shape [2, 3] of BF16`
        layout: String,
        expected: String,
        actual: u64,
    },

    #[error("{}: tensor `{tensor}` starts at data offset {begin} but the previous tensor ends at {expected}: tensors must tile the data buffer without holes or overlaps", path.display())]
    TensorOffsetGap {
        path: PathBuf,
        tensor: String,
        begin: u64,
        expected: u64,
    },

    #[error("{}: data buffer is {actual} bytes but the tensors need {expected} (file truncated)", path.display())]
    DataTruncated {
        path: PathBuf,
        expected: u64,
        actual: u64,
    },

    #[error("{}: {extra} trailing bytes after the last tensor (file padded or corrupt)", path.display())]
    TrailingBytes { path: PathBuf, extra: u64 },

    #[error("tensor `{tensor}` is defined twice: in {} and in {}", first.display(), second.display())]
    DuplicateTensor {
        tensor: String,
        first: PathBuf,
        second: PathBuf,
    },

    #[error("{}: invalid index: {msg}", path.display())]
    InvalidIndex { path: PathBuf, msg: String },

    #[error("{}: shard `{shard}` (holding `{tensor}`) is missing", index.display())]
    MissingShard {
        index: PathBuf,
        shard: String,
        tensor: String,
    },

    #[error("{}: index maps tensor `{tensor}` to this shard, but the shard does not contain it", shard.display())]
    TensorNotInShard { shard: PathBuf, tensor: String },

    #[error("{}: {msg}", path.display())]
    NoModel { path: PathBuf, msg: String },

    #[error("output {} is the input or inside it; write to a directory outside {}", output.display(), input.display())]
    OutputInsideInput { output: PathBuf, input: PathBuf },

    #[error("output directory {} is not empty (it holds {entries}); pass --force to replace its model files", dir.display())]
    OutputNotEmpty { dir: PathBuf, entries: String },

    #[error("refusing to {action} {}: it is (or is a hard link to) the input file {}; choose another path", path.display(), input.display())]
    WouldTouchInput {
        path: PathBuf,
        input: PathBuf,
        action: &'static str,
    },

    #[error("output {} is being written by another tftf run ({holder}); wait for it to finish, or stop it", dir.display())]
    OutputLocked { dir: PathBuf, holder: String },

    #[error("renaming `{first}` and `{second}` both give `{target}`; change the --rename rules")]
    NameCollision {
        first: String,
        second: String,
        target: String,
    },

    #[error("not enough space in {}: the output needs {needed} bytes, {available} are free", path.display())]
    NoSpace {
        path: PathBuf,
        needed: u64,
        available: u64,
    },

    #[error("{}: tensor `{tensor}`: {msg}", path.display())]
    TensorData {
        path: PathBuf,
        tensor: String,
        msg: String,
    },

    #[error("{}: {} `{tensor}` has no scale (looked for {looked}){more}; {}", path.display(), of.kind(), of.hint())]
    MissingScale {
        path: PathBuf,
        of: ScaleOf,
        tensor: String,
        looked: String,
        /// `" (and N more weights)"` or empty.
        more: String,
    },

    #[error("{}: scale `{tensor}` has no FP8 weight to apply to (expected `{weight}`)", path.display())]
    OrphanScale {
        path: PathBuf,
        tensor: String,
        weight: String,
    },

    #[error("{}: scale `{tensor}` of `{weight}`: {msg}", path.display())]
    BadScale {
        path: PathBuf,
        tensor: String,
        weight: String,
        msg: String,
    },

    #[error("{}: {msg}", path.display())]
    Adapter { path: PathBuf, msg: String },

    #[error("{}: {count} adapter tensor(s) match nothing in the base model: {list}; pass --allow-unmatched to merge the rest anyway", path.display())]
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

    #[error("{0}")]
    Other(String),

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
            _ => 1,
        }
    }
}

/// What kind of tensor lacks its scale, for the message and its advice.
#[derive(Debug, Clone, Copy)]
pub enum ScaleOf {
    Fp8Weight,
    Mxfp4Expert,
    EngramTable,
}

impl ScaleOf {
    fn kind(self) -> &'static str {
        match self {
            ScaleOf::Fp8Weight => "FP8 weight",
            ScaleOf::Mxfp4Expert => "MXFP4 expert weight",
            ScaleOf::EngramTable => "Engram table",
        }
    }
    fn hint(self) -> &'static str {
        match self {
            ScaleOf::Fp8Weight => "pass --allow-unscaled-fp8 to decode such weights without one",
            ScaleOf::Mxfp4Expert => "pass --experts keep to leave the experts as they are",
            ScaleOf::EngramTable => "pass --engram keep to leave the tables as they are",
        }
    }
}
