//! The names tftf gives the files of a checkpoint it writes. They sit apart from the output
//! set and the partitioned runs because both need them: which files a run writes, and which
//! files in an output directory `--force` may replace.

use std::ffi::{OsStr, OsString};
use std::os::unix::ffi::{OsStrExt, OsStringExt};

use serde_json::{json, Value};

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

/// A file name in tftf's JSON (commit journal, part records, manifest): the string when it is
/// UTF-8, else `{"hex": "…"}` of its bytes. A Unix file name is bytes, and a side file may be
/// named in another encoding; it is copied under those bytes, not a lossy decoding of them.
pub fn name_json(name: &OsStr) -> Value {
    match name.to_str() {
        Some(s) => Value::from(s),
        None => {
            json!({ "hex": name.as_bytes().iter().map(|b| format!("{b:02x}")).collect::<String>() })
        }
    }
}

/// The file name [`name_json`] wrote, if `v` is one and a plain name (not empty, no `/`, not
/// `.` or `..`).
pub fn name_from_json(v: &Value) -> Option<OsString> {
    let bytes = match v {
        Value::String(s) => s.as_bytes().to_vec(),
        Value::Object(o) => {
            let hex = o.get("hex")?.as_str()?;
            if hex.len() % 2 != 0 || !hex.is_ascii() {
                return None;
            }
            (0..hex.len())
                .step_by(2)
                .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).ok())
                .collect::<Option<Vec<u8>>>()?
        }
        _ => return None,
    };
    let plain = !bytes.is_empty() && !bytes.contains(&b'/') && bytes != b"." && bytes != b"..";
    plain.then(|| OsString::from_vec(bytes))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_through_json_as_bytes() {
        for raw in [
            &b"config.json"[..],
            b"tok\xffen.json",
            b"\xe9t\xe9.txt",
            b"a\nb",
        ] {
            let name = OsStr::from_bytes(raw);
            assert_eq!(name_from_json(&name_json(name)).as_deref(), Some(name));
        }
        assert_eq!(
            name_json(OsStr::from_bytes(b"x\xff")),
            json!({"hex": "78ff"})
        );
        for bad in [
            json!("a/b"),
            json!(".."),
            json!(""),
            json!({"hex": "2f"}),
            json!({"hex": "7"}),
            json!(3),
        ] {
            assert!(name_from_json(&bad).is_none(), "{bad}");
        }
    }
}
