//! `--checksums` and `tftf verify`: SHA-256 of every output file and of every tensor in it.
//!
//! After the data is written and before the commit publishes it, each file is read back once
//! (the cost: one extra sequential read of the output; extent-shared ranges are read from the
//! blocks they share) and hashed whole and tensor by tensor. `SHA256SUMS` (the `sha256sum -c`
//! format) holds the file hashes; `tftf-manifest.json` adds sizes and each tensor's range and
//! hash, so `tftf verify` can name the first tensor that changed, not just the file.

use std::ffi::{OsStr, OsString};
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::os::unix::fs::FileExt;
use std::path::Path;

use serde_json::{json, Value};
use sha2::{Digest, Sha256};

use super::names::{name_from_json, name_json};
use crate::error::{Error, Result};

pub const SUMS_NAME: &str = "SHA256SUMS";
pub const MANIFEST_NAME: &str = "tftf-manifest.json";
/// Version of the manifest layout.
const MANIFEST_VERSION: u64 = 1;
const READ_BYTES: usize = 8 << 20;

/// A tensor's byte range in its file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorRange {
    pub name: String,
    pub offset: u64,
    pub len: u64,
}

/// One hashed file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FileSum {
    /// The file's name, byte for byte.
    pub name: OsString,
    pub size: u64,
    pub sha256: String,
    /// Tensors in file order with their hashes.
    pub tensors: Vec<(TensorRange, String)>,
}

fn hex(d: &[u8]) -> String {
    d.iter().map(|b| format!("{b:02x}")).collect()
}

/// Hashes `path` whole and each range of `tensors` (sorted by offset, not overlapping), in one
/// sequential read.
pub fn hash_file(
    path: &Path,
    name: impl AsRef<OsStr>,
    mut tensors: Vec<TensorRange>,
) -> Result<FileSum> {
    let f = crate::sys::open_regular(path).map_err(|e| Error::io(path, e))?;
    let size = f.metadata().map_err(|e| Error::io(path, e))?.len();
    tensors.sort_by_key(|t| t.offset);
    let mut whole = Sha256::new();
    let mut sums = Vec::with_capacity(tensors.len());
    let mut next = 0; // the tensor being hashed or next to start
    let mut current: Option<Sha256> = None;
    let mut buf = vec![0u8; READ_BYTES];
    let mut pos = 0u64;
    while pos < size {
        let n = (size - pos).min(READ_BYTES as u64) as usize;
        f.read_exact_at(&mut buf[..n], pos)
            .map_err(|e| Error::io(path, e))?;
        crate::sys::drop_cache(&f, pos, n as u64);
        whole.update(&buf[..n]);
        let end = pos + n as u64;
        // Feed every tensor overlapping [pos, end).
        let mut at = pos;
        while next < tensors.len() && at < end {
            let t = &tensors[next];
            let (ts, te) = (t.offset, t.offset + t.len);
            if te <= at && current.is_none() {
                // An empty tensor (or one already passed).
                sums.push((t.clone(), hex(&Sha256::digest([]))));
                next += 1;
                continue;
            }
            if ts >= end {
                break;
            }
            let from = ts.max(at);
            let to = te.min(end);
            let h = current.get_or_insert_with(Sha256::new);
            h.update(&buf[(from - pos) as usize..(to - pos) as usize]);
            at = to;
            if to == te {
                let h = current.take().expect("started");
                sums.push((t.clone(), hex(&h.finalize())));
                next += 1;
            }
        }
        pos = end;
    }
    for t in &tensors[next..] {
        if t.offset + t.len > size {
            return Err(Error::Other(format!(
                "{}: tensor `{}` ends at byte {} of a {size}-byte file",
                path.display(),
                t.name,
                t.offset + t.len
            )));
        }
        sums.push((t.clone(), hex(&Sha256::digest([]))));
    }
    Ok(FileSum {
        name: name.as_ref().to_os_string(),
        size,
        sha256: hex(&whole.finalize()),
        tensors: sums,
    })
}

/// The sum of a file written from memory (index, edited config).
pub fn hash_bytes(name: &str, bytes: &[u8]) -> FileSum {
    FileSum {
        name: name.into(),
        size: bytes.len() as u64,
        sha256: hex(&Sha256::digest(bytes)),
        tensors: Vec::new(),
    }
}

/// `SHA256SUMS`: `HASH  NAME` per file, as GNU `sha256sum` writes it: names byte for byte,
/// except that a name holding a backslash, newline or carriage return is written with those as
/// `\\`, `\n`, `\r` and the line starts with a backslash, so that `sha256sum -c` reads every
/// name back.
pub fn sums_text(files: &[FileSum]) -> Vec<u8> {
    let mut out = Vec::new();
    for f in files {
        let name = f.name.as_bytes();
        if name.iter().any(|b| matches!(b, b'\\' | b'\n' | b'\r')) {
            out.push(b'\\');
        }
        out.extend_from_slice(f.sha256.as_bytes());
        out.extend_from_slice(b"  ");
        for &b in name {
            match b {
                b'\\' => out.extend_from_slice(b"\\\\"),
                b'\n' => out.extend_from_slice(b"\\n"),
                b'\r' => out.extend_from_slice(b"\\r"),
                b => out.push(b),
            }
        }
        out.push(b'\n');
    }
    out
}

/// The (name, hash) entries of a `SHA256SUMS` file, escaped names decoded; an error names the
/// first line that is not `HASH  NAME` (or `HASH *NAME`).
fn parse_sums(path: &Path, text: &[u8]) -> Result<Vec<(OsString, String)>> {
    let mut entries = Vec::new();
    let text = text.strip_suffix(b"\n").unwrap_or(text);
    for (i, line) in text.split(|&b| b == b'\n').enumerate() {
        let bad = |what: &str| {
            Error::Other(format!(
                "{}: line {} is not `HASH  NAME` ({what})",
                path.display(),
                i + 1
            ))
        };
        let (escaped, line) = match line.strip_prefix(b"\\") {
            Some(rest) => (true, rest),
            None => (false, line),
        };
        let (hash, name) = line.split_at_checked(64).ok_or_else(|| bad("too short"))?;
        if !hash.iter().all(u8::is_ascii_hexdigit) {
            return Err(bad("the hash is not 64 hex digits"));
        }
        let name = name
            .strip_prefix(b"  ")
            .or_else(|| name.strip_prefix(b" *"))
            .ok_or_else(|| bad("no two-space separator"))?;
        let name = if escaped {
            unescape_sums_name(name).ok_or_else(|| bad("a bad escape in the name"))?
        } else {
            name.to_vec()
        };
        let hash = String::from_utf8_lossy(hash).to_ascii_lowercase();
        entries.push((OsString::from_vec(name), hash));
    }
    Ok(entries)
}

/// Decodes a `SHA256SUMS` name written with `\\`, `\n` and `\r` escapes.
fn unescape_sums_name(name: &[u8]) -> Option<Vec<u8>> {
    let mut out = Vec::with_capacity(name.len());
    let mut bytes = name.iter();
    while let Some(&b) = bytes.next() {
        out.push(match b {
            b'\\' => match bytes.next()? {
                b'\\' => b'\\',
                b'n' => b'\n',
                b'r' => b'\r',
                _ => return None,
            },
            b => b,
        });
    }
    Some(out)
}

pub fn manifest_json(files: &[FileSum]) -> Value {
    json!({
        "tftf_manifest": MANIFEST_VERSION,
        "tftf_version": env!("CARGO_PKG_VERSION"),
        "files": files.iter().map(|f| json!({
            "name": name_json(&f.name),
            "size": f.size,
            "sha256": f.sha256,
            "tensors": tensors_json(&f.tensors),
        })).collect::<Vec<_>>(),
    })
}

/// The `tensors` list of a manifest entry or a part's shard record: name, offset, length and
/// hash (`null` where there is none) of each tensor.
pub fn tensors_json<H: serde::Serialize>(tensors: &[(TensorRange, H)]) -> Value {
    json!(tensors
        .iter()
        .map(|(t, h)| json!({
            "name": t.name, "offset": t.offset, "len": t.len, "sha256": h,
        }))
        .collect::<Vec<_>>())
}

fn parse_manifest(path: &Path, v: &Value) -> Result<Vec<FileSum>> {
    let bad =
        |what: &str| Error::Other(format!("{}: not a tftf manifest ({what})", path.display()));
    if v["tftf_manifest"].as_u64() != Some(MANIFEST_VERSION) {
        return Err(bad("unknown `tftf_manifest` version"));
    }
    let files = v["files"].as_array().ok_or_else(|| bad("no `files`"))?;
    files
        .iter()
        .map(|f| {
            let s = |k: &str| f[k].as_str().map(String::from).ok_or_else(|| bad(k));
            let tensors = f["tensors"]
                .as_array()
                .ok_or_else(|| bad("no `tensors`"))?
                .iter()
                .map(|t| {
                    let range = TensorRange {
                        name: t["name"].as_str().ok_or_else(|| bad("tensor name"))?.into(),
                        offset: t["offset"].as_u64().ok_or_else(|| bad("tensor offset"))?,
                        len: t["len"].as_u64().ok_or_else(|| bad("tensor len"))?,
                    };
                    let h = t["sha256"].as_str().ok_or_else(|| bad("tensor sha256"))?;
                    Ok((range, h.to_string()))
                })
                .collect::<Result<Vec<_>>>()?;
            let name = name_from_json(&f["name"]).ok_or_else(|| bad("a file name with a path"))?;
            Ok(FileSum {
                name,
                size: f["size"].as_u64().ok_or_else(|| bad("size"))?,
                sha256: s("sha256")?,
                tensors,
            })
        })
        .collect()
}

/// What `tftf verify` found.
#[derive(Debug, Default)]
pub struct Verified {
    pub files: usize,
    pub bytes: u64,
    /// One line per problem: the file and, where the manifest allows, the first tensor.
    pub problems: Vec<String>,
}

/// Re-hashes every file `DIR/tftf-manifest.json` and `DIR/SHA256SUMS` list and compares;
/// checks that the two lists agree and that every data file in `DIR` is on them.
pub fn verify(dir: &Path) -> Result<Verified> {
    let want = read_manifest(dir)?;
    let mut out = Verified::default();
    for w in &want {
        check_file(dir, w, &mut out)?;
    }
    let spath = dir.join(SUMS_NAME);
    let sums = match crate::sys::read_regular(&spath) {
        Ok(b) => parse_sums(&spath, &b)?,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            out.problems.push(format!(
                "{SUMS_NAME}: missing (--checksums writes it beside {MANIFEST_NAME})"
            ));
            Vec::new()
        }
        Err(e) => return Err(Error::io(&spath, e)),
    };
    compare_sums(dir, &want, &sums, &mut out)?;
    let listed: Vec<&OsStr> = want
        .iter()
        .map(|w| w.name.as_os_str())
        .chain(sums.iter().map(|(n, _)| n.as_os_str()))
        .collect();
    for name in super::unlisted_data_files(dir, &listed)? {
        out.problems.push(format!(
            "{}: a data file that neither {SUMS_NAME} nor {MANIFEST_NAME} lists (added, or its entries removed, after the checksums were written)",
            crate::escape::bytes(&name)
        ));
    }
    Ok(out)
}

fn read_manifest(dir: &Path) -> Result<Vec<FileSum>> {
    let mpath = dir.join(MANIFEST_NAME);
    let text = crate::sys::read_regular_to_string(&mpath).map_err(|e| match e.kind() {
        std::io::ErrorKind::NotFound => Error::Other(format!(
            "{}: no {MANIFEST_NAME}; write the checkpoint with --checksums to make one",
            dir.display()
        )),
        _ => Error::io(&mpath, e),
    })?;
    let v: Value = serde_json::from_str(&text)
        .map_err(|e| Error::Other(format!("{}: invalid JSON: {e}", mpath.display())))?;
    parse_manifest(&mpath, &v)
}

/// Re-hashes the manifest's file `w` and records what differs.
fn check_file(dir: &Path, w: &FileSum, out: &mut Verified) -> Result<()> {
    let shown = crate::escape::bytes(w.name.as_bytes());
    let path = dir.join(&w.name);
    let size = match std::fs::metadata(&path) {
        Ok(m) => match crate::sys::refuse_special(&path, &m) {
            Ok(()) => m.len(),
            // A FIFO would block the hashing forever; `/dev/urandom` passed for an empty file.
            Err(e) => {
                out.problems.push(format!("{shown}: {e}"));
                return Ok(());
            }
        },
        Err(_) => {
            out.problems.push(format!("{shown}: missing"));
            return Ok(());
        }
    };
    if size != w.size {
        out.problems.push(format!(
            "{shown}: {size} bytes, the manifest says {}",
            w.size
        ));
        return Ok(());
    }
    let ranges = w.tensors.iter().map(|(t, _)| t.clone()).collect();
    let got = hash_file(&path, &w.name, ranges)?;
    out.files += 1;
    out.bytes += size;
    if got.sha256 == w.sha256 {
        return Ok(());
    }
    let first = w
        .tensors
        .iter()
        .zip(&got.tensors)
        .find(|((_, a), (_, b))| a != b)
        .map(|((t, _), _)| t);
    out.problems.push(match first {
        Some(t) => format!(
            "{shown}: tensor `{}` (bytes {}..{}) differs from the manifest",
            crate::escape::name(&t.name),
            t.offset,
            t.offset + t.len
        ),
        None => format!("{shown}: the header differs from the manifest"),
    });
    Ok(())
}

/// Compares `SHA256SUMS` with the manifest, entry by entry; a file only `SHA256SUMS` lists is
/// re-hashed against it.
fn compare_sums(
    dir: &Path,
    want: &[FileSum],
    sums: &[(OsString, String)],
    out: &mut Verified,
) -> Result<()> {
    for (name, hash) in sums {
        let shown = crate::escape::bytes(name.as_bytes());
        if let Some(w) = want.iter().find(|w| &w.name == name) {
            if &w.sha256 != hash {
                out.problems.push(format!(
                    "{shown}: {SUMS_NAME} and {MANIFEST_NAME} give different hashes"
                ));
            }
            continue;
        }
        out.problems.push(format!(
            "{shown}: in {SUMS_NAME} but not in {MANIFEST_NAME}"
        ));
        let path = dir.join(name);
        if !path.is_file() {
            out.problems.push(format!("{shown}: missing"));
            continue;
        }
        let got = hash_file(&path, name, Vec::new())?;
        out.files += 1;
        out.bytes += got.size;
        if &got.sha256 != hash {
            out.problems
                .push(format!("{shown}: differs from its hash in {SUMS_NAME}"));
        }
    }
    for w in want {
        if !sums.iter().any(|(n, _)| n == &w.name) {
            out.problems.push(format!(
                "{}: in {MANIFEST_NAME} but not in {SUMS_NAME}",
                crate::escape::bytes(w.name.as_bytes())
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn per_tensor_hashes_match_hashing_each_range_alone() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("f");
        let data: Vec<u8> = (0..(READ_BYTES * 2 + 100))
            .map(|i| (i * 7 % 251) as u8)
            .collect();
        std::fs::write(&p, &data).unwrap();
        let r = |name: &str, offset: u64, len: u64| TensorRange {
            name: name.into(),
            offset,
            len,
        };
        // Ranges crossing read boundaries, an empty one, one ending the file.
        let ranges = vec![
            r("c", READ_BYTES as u64 - 10, READ_BYTES as u64 + 20),
            r("a", 8, 100),
            r("e", 200, 0),
            r("z", data.len() as u64 - 50, 50),
        ];
        let got = hash_file(&p, "f", ranges.clone()).unwrap();
        assert_eq!(got.sha256, hex(&Sha256::digest(&data)));
        let mut sorted = ranges;
        sorted.sort_by_key(|t| t.offset);
        for ((t, h), want) in got.tensors.iter().zip(&sorted) {
            assert_eq!(t, want);
            let slice = &data[t.offset as usize..(t.offset + t.len) as usize];
            assert_eq!(h, &hex(&Sha256::digest(slice)), "{}", t.name);
        }
        assert_eq!(got.tensors.len(), 4);
    }
}
