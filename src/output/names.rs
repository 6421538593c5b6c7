//! The names tftf gives the files of a checkpoint it writes. They sit apart from the output
//! set and the partitioned runs because both need them: which files a run writes, and which
//! files in an output directory `--force` may replace.

use super::checksum::{MANIFEST_NAME, SUMS_NAME};

/// The index of a multi-shard output.
pub const INDEX_NAME: &str = "model.safetensors.index.json";

/// Names tftf gives shards, indexes and checksums: `model.safetensors`,
/// `model-0000i-of-0000N.safetensors`, `model.safetensors.index.json`, `SHA256SUMS`,
/// `tftf-manifest.json`.
pub(crate) fn is_model_file_name(name: &str) -> bool {
    if name == "model.safetensors"
        || name == INDEX_NAME
        || name == SUMS_NAME
        || name == MANIFEST_NAME
    {
        return true;
    }
    let Some(mid) = name
        .strip_prefix("model-")
        .and_then(|n| n.strip_suffix(".safetensors"))
    else {
        return false;
    };
    match mid.split_once("-of-") {
        Some((i, n)) => [i, n]
            .iter()
            .all(|p| p.len() >= 5 && p.bytes().all(|b| b.is_ascii_digit())),
        None => false,
    }
}
