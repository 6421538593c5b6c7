//! torch.save zip archives, anywhere inside a file.
//!
//! Since PyTorch 1.6 `torch.save` writes an uncompressed zip: `<prefix>/data.pkl` (the pickle),
//! `<prefix>/data/<key>` (one member per storage, its raw little-endian bytes, 64-byte
//! aligned), `<prefix>/byteorder`, `<prefix>/version`. A DCP `.distcp` file is a run of such
//! archives back to back, so the archive is read through a window `[start, start + len)` of
//! the file. Only the central directory and `data.pkl` are read; each storage becomes the
//! absolute file range of its member's bytes, never loaded. Compressed members (which
//! torch.save does not write) are refused: their bytes cannot be addressed in place.

use std::collections::HashMap;
use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::os::unix::fs::FileExt;
use std::path::Path;

use super::pickle::MAX_PICKLE_BYTES;
use crate::error::{Error, Result};

/// More members than this is not a torch.save archive (one per storage). Checked from the
/// end-of-central-directory record before the zip reader sizes its tables from it.
pub const MAX_ARCHIVE_MEMBERS: u64 = 1 << 18;
/// The end-of-central-directory record (22 bytes) may be followed by a comment this long.
const MAX_EOCD_SEARCH_BYTES: u64 = 22 + 0xffff;

/// A storage member's bytes: `[offset, offset + len)` of the file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MemberRange {
    pub offset: u64,
    pub len: u64,
}

pub struct Archive {
    /// The bytes of `<prefix>/data.pkl`.
    pub pickle: Vec<u8>,
    /// Storage key → its member's bytes.
    pub storages: HashMap<String, MemberRange>,
}

/// A `Read + Seek` window onto part of a file, for the zip reader.
#[derive(Clone)]
struct Window<'a> {
    file: &'a File,
    start: u64,
    len: u64,
    pos: u64,
}

impl Read for Window<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let left = self.len.saturating_sub(self.pos);
        let n = (buf.len() as u64).min(left) as usize;
        if n == 0 {
            return Ok(0);
        }
        let got = self.file.read_at(&mut buf[..n], self.start + self.pos)?;
        self.pos += got as u64;
        Ok(got)
    }
}

impl Seek for Window<'_> {
    fn seek(&mut self, to: SeekFrom) -> std::io::Result<u64> {
        let target = match to {
            SeekFrom::Start(p) => Some(p),
            SeekFrom::End(d) => self.len.checked_add_signed(d),
            SeekFrom::Current(d) => self.pos.checked_add_signed(d),
        };
        let Some(target) = target else {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                "seek before the start of the archive",
            ));
        };
        self.pos = target;
        Ok(target)
    }
}

/// Reads the archive in `[start, start + len)` of `file` (whole file: `0, file_len`).
pub fn read_archive(path: &Path, file: &File, start: u64, len: u64) -> Result<Archive> {
    let bad = |msg: String| Error::TorchArchive {
        path: path.into(),
        msg,
    };
    let announced = check_member_count(file, start, len).map_err(bad)?;
    let window = Window {
        file,
        start,
        len,
        pos: 0,
    };
    let mut zip = zip::ZipArchive::new(window)
        .map_err(|e| bad(format!("not a readable zip archive ({e}); file truncated?")))?;
    // The zip reader keeps one entry per name (the last): a repeated name shows as fewer
    // entries than the directory announces.
    if announced.is_some_and(|n| n > zip.len() as u64) {
        return Err(bad(repeated_member(&zip, announced.unwrap_or(0))));
    }
    let mut pickle = None;
    let mut members = Vec::with_capacity(zip.len());
    for i in 0..zip.len() {
        let entry = zip
            .by_index_raw(i)
            .map_err(|e| bad(format!("member {i}: {e}")))?;
        let name = entry.name().to_string();
        let stored = entry.compression() == zip::CompressionMethod::Stored;
        let size = entry.size();
        let data_start = entry
            .data_start()
            .ok_or_else(|| bad(format!("member `{name}` has no data offset")))?;
        let past_end = data_start.checked_add(size).is_none_or(|e| e > len);
        if stored && (past_end || entry.compressed_size() != size) {
            return Err(bad(format!(
                "member `{name}` ({size} bytes at {data_start}) runs past the archive's end at \
                 {len} (file truncated?)"
            )));
        }
        let Some((prefix, rest)) = name.split_once('/') else {
            continue;
        };
        let relevant = rest == "data.pkl" || rest.starts_with("data/");
        if relevant && !stored {
            return Err(bad(format!(
                "member `{name}` is compressed ({}); torch.save writes stored members, so this \
                 file was repacked: re-save it with torch.save",
                entry.compression()
            )));
        }
        if rest == "data.pkl" {
            if pickle.is_some() {
                return Err(bad("more than one `*/data.pkl` member".into()));
            }
            pickle = Some((prefix.to_string(), data_start, size));
        } else if let Some(key) = rest.strip_prefix("data/") {
            members.push((prefix.to_string(), key.to_string(), data_start, size));
        } else if rest == "byteorder" {
            let mut order = String::new();
            drop(entry);
            zip.by_index(i)
                .and_then(|mut e| {
                    e.by_ref()
                        .take(16)
                        .read_to_string(&mut order)
                        .map_err(Into::into)
                })
                .map_err(|e| bad(format!("member `{name}`: {e}")))?;
            if order.trim() != "little" {
                return Err(bad(format!(
                    "byte order is `{}`; only little-endian checkpoints are supported",
                    order.trim()
                )));
            }
        }
    }
    let Some((prefix, pkl_start, pkl_len)) = pickle else {
        return Err(bad(
            "no `*/data.pkl` member: not a torch.save archive".into()
        ));
    };
    if pkl_len > MAX_PICKLE_BYTES {
        return Err(bad(format!(
            "data.pkl is {pkl_len} bytes, more than the limit of {MAX_PICKLE_BYTES}"
        )));
    }
    let mut bytes = vec![0u8; pkl_len as usize];
    file.read_exact_at(&mut bytes, start + pkl_start)
        .map_err(|e| Error::io(path, e))?;
    let storages = members
        .into_iter()
        .filter(|(p, ..)| *p == prefix)
        .map(|(_, key, at, size)| {
            (
                key,
                MemberRange {
                    offset: start + at,
                    len: size,
                },
            )
        })
        .collect();
    Ok(Archive {
        pickle: bytes,
        storages,
    })
}

/// Why an archive whose directory lists more members than the zip reader kept is refused:
/// the first name listed twice. torch.load reads the first copy of a name and the zip reader
/// the last, so the same file would give other weights here than in torch.
fn repeated_member(zip: &zip::ZipArchive<Window<'_>>, announced: u64) -> String {
    let at = zip.central_directory_start();
    let reader = zip.clone().into_inner();
    let advice = "torch.load reads the first copy and other zip readers the last, so the \
                  weights are ambiguous; re-save the checkpoint with torch.save";
    match first_repeated_name(reader, at, announced) {
        Some(name) => {
            format!("member `{name}` appears more than once in the zip directory: {advice}")
        }
        None => format!(
            "its zip directory announces {announced} members but only {} distinct ones were \
             read: a member name is repeated ({advice})",
            zip.len()
        ),
    }
}

/// Walks `count` central-directory headers from `at` and returns the first name seen twice.
fn first_repeated_name(mut r: Window<'_>, at: u64, count: u64) -> Option<String> {
    r.seek(SeekFrom::Start(at)).ok()?;
    let mut seen = std::collections::HashSet::new();
    for _ in 0..count {
        let mut head = [0u8; 46];
        r.read_exact(&mut head).ok()?;
        if head[..4] != *b"PK\x01\x02" {
            return None;
        }
        let le16 = |i: usize| u16::from_le_bytes([head[i], head[i + 1]]) as usize;
        let mut name = vec![0u8; le16(28)];
        r.read_exact(&mut name).ok()?;
        r.seek(SeekFrom::Current((le16(30) + le16(32)) as i64))
            .ok()?;
        if !seen.insert(name.clone()) {
            return Some(crate::escape::bytes(&name).into_owned());
        }
    }
    None
}

/// Refuses an archive whose end-of-central-directory record (or its zip64 twin) announces more
/// than [`MAX_ARCHIVE_MEMBERS`] members, and returns the count announced. A record that cannot
/// be found is left to the zip reader to report.
fn check_member_count(
    file: &File,
    start: u64,
    len: u64,
) -> std::result::Result<Option<u64>, String> {
    // torch.save writes no archive comment, so the record normally ends the archive: try the
    // last 42 bytes (record and zip64 locator) before searching the longest comment's span.
    let read_tail = |n: u64| {
        let n = len.min(n);
        let mut tail = vec![0u8; n as usize];
        file.read_exact_at(&mut tail, start + len - n)
            .ok()
            .map(|_| tail)
    };
    let find = |tail: Vec<u8>| {
        (0..tail.len().saturating_sub(21))
            .rev()
            .find(|&i| tail[i..i + 4] == *b"PK\x05\x06")
            .map(|e| (tail, e))
    };
    let Some((tail, eocd)) = read_tail(42)
        .and_then(find)
        .or_else(|| read_tail(MAX_EOCD_SEARCH_BYTES).and_then(find))
    else {
        return Ok(None);
    };
    let le16 = |b: &[u8]| u16::from_le_bytes([b[0], b[1]]) as u64;
    let mut count = le16(&tail[eocd + 10..]);
    // A zip64 locator (20 bytes) right before the record points at the zip64 record, whose
    // 8-byte member count sits at byte 32.
    if eocd >= 20 && tail[eocd - 20..eocd - 16] == *b"PK\x06\x07" {
        let at = u64::from_le_bytes(tail[eocd - 12..eocd - 4].try_into().expect("8 bytes"));
        let mut rec = [0u8; 40];
        if at.checked_add(40).is_some_and(|e| e <= len)
            && file.read_exact_at(&mut rec, start + at).is_ok()
            && rec[..4] == *b"PK\x06\x06"
        {
            count = count.max(u64::from_le_bytes(rec[32..40].try_into().expect("8 bytes")));
        }
    }
    if count > MAX_ARCHIVE_MEMBERS {
        return Err(format!(
            "its zip directory announces {count} members, more than the limit of \
             {MAX_ARCHIVE_MEMBERS}"
        ));
    }
    Ok(Some(count))
}
