//! `--imatrix FILE`: llama-imatrix's importance matrix, read as llama-quantize reads it
//! (`common/imatrix-loader.cpp`, `load_imatrix` and `prepare_imatrix` in
//! `tools/quantize/quantize.cpp`, llama.cpp 0c1e570).
//!
//! Two formats. The GGUF one llama-imatrix writes today: per weight `NAME.in_sum2` (F32, `cols`
//! per expert) and `NAME.counts` (F32, one per expert), with `imatrix.datasets`,
//! `imatrix.chunk_count` and `imatrix.chunk_size` KVs; the weight of column `i` of expert `j` is
//! `in_sum2[j*cols + i] / count[j]`, or 1 where that expert saw no token. The legacy `.dat`:
//! `i32 n_entries`, then per entry `i32 len, name, i32 ncall, i32 nval, f32 sums[nval]`, then
//! optionally `i32 chunk_count, i32 len, dataset`; a weight is `sums[i] / ncall` (unchanged when
//! `ncall` ≤ 0). All in f32, as the reference divides. Every size read is checked against the
//! file's length before anything is allocated for it.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

use crate::error::{Error, Result};

/// The importance weights of a model, by GGUF tensor name: `cols × n_expert` floats each.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Imatrix {
    /// The path as given, for `quantize.imatrix.file`.
    pub file: String,
    pub datasets: Vec<String>,
    /// llama-quantize's `m_last_call`: written as `quantize.imatrix.chunks_count` when > 0.
    pub chunk_count: i32,
    pub entries: BTreeMap<String, Arc<[f32]>>,
}

/// The KV strings llama-quantize writes are cut to 127 bytes (`strncpy(val_str, s, 127)`).
const MAX_KV_STR_BYTES: usize = 127;

/// Cut `s` to llama-quantize's 127 bytes (at a character boundary, so the KV stays UTF-8).
pub fn kv_str(s: &str) -> String {
    let mut end = s.len().min(MAX_KV_STR_BYTES);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    s[..end].to_string()
}

/// Reads `path`, keeps the entries `include`/`exclude` select (llama-quantize's
/// `--include-weights`/`--exclude-weights`: a name containing any of the strings), and
/// refuses non-finite weights.
pub fn load(path: &Path, include: &[String], exclude: &[String]) -> Result<Imatrix> {
    let err = |msg: String| Error::GgufImatrix {
        path: path.to_path_buf(),
        msg,
    };
    let bytes = std::fs::read(path).map_err(|e| err(format!("cannot read it: {e}")))?;
    let mut m = if bytes.starts_with(b"GGUF") {
        read_gguf(&bytes).map_err(err)?
    } else {
        read_legacy(&bytes).map_err(|e| err(format!("{NOT_AN_IMATRIX}: {e}")))?
    };
    m.file = path.to_string_lossy().into_owned();
    m.entries
        .retain(|name, _| !exclude.iter().any(|x| name.contains(x.as_str())));
    if !include.is_empty() {
        m.entries
            .retain(|name, _| include.iter().any(|x| name.contains(x.as_str())));
    }
    for (name, w) in &m.entries {
        if let Some(f) = w.iter().find(|f| !f.is_finite()) {
            return Err(err(format!("entry `{name}` has a non-finite value {f}")));
        }
    }
    Ok(m)
}

type Parsed<T> = std::result::Result<T, String>;

/// A bounds-checked little-endian reader.
struct Cursor<'a> {
    b: &'a [u8],
    at: usize,
}

impl<'a> Cursor<'a> {
    fn take(&mut self, n: u64, what: &str) -> Parsed<&'a [u8]> {
        let n = usize::try_from(n).map_err(|_| format!("{what}: size {n} is too large"))?;
        let end = self
            .at
            .checked_add(n)
            .filter(|&e| e <= self.b.len())
            .ok_or_else(|| format!("truncated: {what} at byte {} needs {n} bytes", self.at))?;
        let s = &self.b[self.at..end];
        self.at = end;
        Ok(s)
    }
    fn u32(&mut self, what: &str) -> Parsed<u32> {
        Ok(u32::from_le_bytes(self.take(4, what)?.try_into().unwrap()))
    }
    fn i32(&mut self, what: &str) -> Parsed<i32> {
        Ok(self.u32(what)? as i32)
    }
    fn u64(&mut self, what: &str) -> Parsed<u64> {
        Ok(u64::from_le_bytes(self.take(8, what)?.try_into().unwrap()))
    }
    fn str_of(&mut self, len: u64, what: &str) -> Parsed<String> {
        let b = self.take(len, what)?;
        String::from_utf8(b.to_vec()).map_err(|_| format!("{what} is not UTF-8"))
    }
    fn f32s(&mut self, n: u64, what: &str) -> Parsed<Vec<f32>> {
        let b = self.take(n.checked_mul(4).ok_or("size overflow")?, what)?;
        Ok(b.chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect())
    }
}

/// What a file that fails to parse as a legacy `.dat` (and does not start as a GGUF) is.
const NOT_AN_IMATRIX: &str =
    "not an importance matrix (neither llama-imatrix's GGUF nor a legacy .dat)";

fn read_legacy(b: &[u8]) -> Parsed<Imatrix> {
    let mut c = Cursor { b, at: 0 };
    let n = c.i32("entry count")?;
    if n < 1 {
        return Err(format!("it holds {n} entries"));
    }
    let mut m = Imatrix::default();
    for i in 0..n {
        let len = c.i32("name length")?;
        let len = u64::try_from(len).map_err(|_| format!("entry {i}: name length {len}"))?;
        let name = c.str_of(len, "entry name")?;
        let ncall = c.i32("ncall")?;
        let nval = c.i32("value count")?;
        if nval < 1 {
            return Err(format!("entry `{name}`: {nval} values"));
        }
        let sums = c.f32s(nval as u64, "entry values")?;
        let w: Vec<f32> = if ncall > 0 {
            sums.iter().map(|s| s / ncall as f32).collect()
        } else {
            sums
        };
        m.entries.insert(name, w.into());
    }
    if c.at < b.len() {
        m.chunk_count = c.i32("chunk count")?;
        if let Ok(len) = c.i32("dataset length") {
            if len > 0 {
                m.datasets.push(c.str_of(len as u64, "dataset name")?);
            }
        }
    }
    Ok(m)
}

/// GGUF value type ids (gguf.h): fixed sizes, 8 = string, 9 = array.
fn scalar_bytes(ty: u32) -> Option<u64> {
    match ty {
        0 | 1 | 7 => Some(1),
        2 | 3 => Some(2),
        4..=6 => Some(4),
        10..=12 => Some(8),
        _ => None,
    }
}

/// One KV value: the u32 it holds, or the strings of a string array; others skipped.
enum Kv {
    U32(u32),
    Strings(Vec<String>),
    Other,
}

fn read_value(c: &mut Cursor, ty: u32, key: &str) -> Parsed<Kv> {
    match ty {
        4 => Ok(Kv::U32(c.u32(key)?)),
        8 => {
            let len = c.u64(key)?;
            c.take(len, key)?;
            Ok(Kv::Other)
        }
        9 => {
            let (ety, n) = (c.u32(key)?, c.u64(key)?);
            if ety == 8 {
                let mut v = Vec::new();
                for _ in 0..n {
                    let len = c.u64(key)?;
                    v.push(c.str_of(len, key)?);
                }
                return Ok(Kv::Strings(v));
            }
            let size = scalar_bytes(ety).ok_or_else(|| format!("`{key}`: array of type {ety}"))?;
            c.take(n.checked_mul(size).ok_or("size overflow")?, key)?;
            Ok(Kv::Other)
        }
        t => {
            let size = scalar_bytes(t).ok_or_else(|| format!("`{key}`: value type {t}"))?;
            c.take(size, key)?;
            Ok(Kv::Other)
        }
    }
}

/// A tensor's name, element count, type and offset in the data section.
struct TensorInfo {
    name: String,
    elems: u64,
    ty: u32,
    offset: u64,
}

fn read_gguf(b: &[u8]) -> Parsed<Imatrix> {
    let mut c = Cursor { b, at: 4 };
    let version = c.u32("version")?;
    if version != 3 && version != 2 {
        return Err(format!(
            "GGUF version {version}; imatrix files are version 3"
        ));
    }
    let (n_tensors, n_kv) = (c.u64("tensor count")?, c.u64("KV count")?);
    let mut m = Imatrix::default();
    let (mut have, mut alignment) = ([false; 3], 32u64);
    for _ in 0..n_kv {
        let len = c.u64("key")?;
        let key = c.str_of(len, "key")?;
        let ty = c.u32(&key)?;
        match (key.as_str(), read_value(&mut c, ty, &key)?) {
            ("imatrix.datasets", Kv::Strings(v)) => (m.datasets, have[0]) = (v, true),
            ("imatrix.chunk_count", Kv::U32(v)) => (m.chunk_count, have[1]) = (v as i32, true),
            ("imatrix.chunk_size", Kv::U32(_)) => have[2] = true,
            ("general.alignment", Kv::U32(v)) if v > 0 && v % 8 == 0 => alignment = v as u64,
            (k, _) if k.starts_with("imatrix.") || k == "general.alignment" => {
                return Err(format!("`{k}` has the wrong type"))
            }
            _ => {}
        }
    }
    if have != [true; 3] {
        return Err("a GGUF without imatrix.datasets, imatrix.chunk_count and imatrix.chunk_size: not an importance matrix llama-imatrix wrote".into());
    }
    let mut infos = Vec::new();
    for _ in 0..n_tensors {
        let len = c.u64("tensor name")?;
        let name = c.str_of(len, "tensor name")?;
        let n_dims = c.u32(&name)?;
        if n_dims > 4 {
            return Err(format!("tensor `{name}`: {n_dims} dimensions"));
        }
        let mut elems = 1u64;
        for _ in 0..n_dims {
            elems = elems.checked_mul(c.u64(&name)?).ok_or("size overflow")?;
        }
        let (ty, offset) = (c.u32(&name)?, c.u64(&name)?);
        infos.push(TensorInfo {
            name,
            elems,
            ty,
            offset,
        });
    }
    if infos.is_empty() {
        return Err("the GGUF holds no tensors: not an importance matrix".into());
    }
    let data = (c.at as u64).div_ceil(alignment) * alignment;
    gguf_entries(b, data, &infos, &mut m)?;
    Ok(m)
}

/// Pairs `NAME.in_sum2` with `NAME.counts` and normalises, as `load_imatrix`.
fn gguf_entries(b: &[u8], data: u64, infos: &[TensorInfo], m: &mut Imatrix) -> Parsed<()> {
    let values = |t: &TensorInfo| -> Parsed<Vec<f32>> {
        if t.ty != 0 {
            return Err(format!("tensor `{}` is type {}, not F32", t.name, t.ty));
        }
        let at = data.checked_add(t.offset).ok_or("size overflow")?;
        let mut c = Cursor {
            b,
            at: usize::try_from(at).map_err(|_| "offset too large")?,
        };
        c.f32s(t.elems, &format!("tensor `{}` data", t.name))
    };
    let mut pairs: BTreeMap<&str, [Option<&TensorInfo>; 2]> = BTreeMap::new();
    for t in infos {
        if let Some(n) = t.name.strip_suffix(".in_sum2") {
            pairs.entry(n).or_default()[0] = Some(t);
        } else if let Some(n) = t.name.strip_suffix(".counts") {
            pairs.entry(n).or_default()[1] = Some(t);
        }
    }
    for (name, pair) in pairs {
        let [Some(s), Some(k)] = pair else {
            return Err(format!(
                "`{name}` has sums without counts or counts without sums"
            ));
        };
        let (sums, counts) = (values(s)?, values(k)?);
        if counts.is_empty() || sums.len() % counts.len() != 0 {
            return Err(format!(
                "`{name}`: {} sums are not a whole number of rows for {} counts",
                sums.len(),
                counts.len()
            ));
        }
        let cols = sums.len() / counts.len();
        let mut w = vec![1f32; sums.len()];
        for (j, &count) in counts.iter().enumerate() {
            let count = (count as f64).round() as i64 as f32;
            if count > 0.0 {
                for i in 0..cols {
                    w[j * cols + i] = sums[j * cols + i] / count;
                }
            }
        }
        m.entries.insert(name.to_string(), w.into());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn legacy(entries: &[(&str, i32, &[f32])], tail: Option<(i32, &str)>) -> Vec<u8> {
        let mut b = (entries.len() as i32).to_le_bytes().to_vec();
        for (name, ncall, v) in entries {
            b.extend((name.len() as i32).to_le_bytes());
            b.extend(name.as_bytes());
            b.extend(ncall.to_le_bytes());
            b.extend((v.len() as i32).to_le_bytes());
            v.iter().for_each(|f| b.extend(f.to_le_bytes()));
        }
        if let Some((chunks, ds)) = tail {
            b.extend(chunks.to_le_bytes());
            b.extend((ds.len() as i32).to_le_bytes());
            b.extend(ds.as_bytes());
        }
        b
    }

    fn load_bytes(b: &[u8], inc: &[&str], exc: &[&str]) -> Result<Imatrix> {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("m.dat");
        std::fs::write(&p, b).unwrap();
        let s = |v: &[&str]| v.iter().map(|x| x.to_string()).collect::<Vec<_>>();
        load(&p, &s(inc), &s(exc))
    }

    #[test]
    fn legacy_weights_are_sums_over_ncall_and_the_tail_is_read() {
        let b = legacy(
            &[("a.weight", 4, &[2.0, 6.0]), ("b.weight", 0, &[3.0])],
            Some((7, "wiki.txt")),
        );
        let m = load_bytes(&b, &[], &[]).unwrap();
        assert_eq!(&*m.entries["a.weight"], &[0.5, 1.5]);
        assert_eq!(&*m.entries["b.weight"], &[3.0]);
        assert_eq!(
            (m.chunk_count, m.datasets),
            (7, vec!["wiki.txt".to_string()])
        );
    }

    #[test]
    fn include_and_exclude_select_by_substring_as_llama_quantize() {
        let b = legacy(
            &[
                ("blk.0.attn_q.weight", 1, &[1.0]),
                ("blk.0.ffn_up.weight", 1, &[1.0]),
            ],
            None,
        );
        let names = |m: Imatrix| m.entries.keys().cloned().collect::<Vec<_>>();
        assert_eq!(
            names(load_bytes(&b, &[], &["attn"]).unwrap()),
            ["blk.0.ffn_up.weight"]
        );
        assert_eq!(
            names(load_bytes(&b, &["attn_q", "nothing"], &[]).unwrap()),
            ["blk.0.attn_q.weight"]
        );
    }

    #[test]
    fn hostile_files_are_refused_naming_the_file() {
        let text = load_bytes(b"hello, this is text", &[], &[]).unwrap_err();
        assert!(
            text.to_string()
                .contains("m.dat: importance matrix: not an importance matrix"),
            "{text}"
        );
        let mut cut = legacy(&[("a", 1, &[1.0, 2.0])], None);
        cut.truncate(cut.len() - 2);
        let e = load_bytes(&cut, &[], &[]).unwrap_err().to_string();
        assert!(e.contains("truncated: entry values"), "{e}");
        let huge = [1i32.to_le_bytes(), i32::MAX.to_le_bytes()].concat();
        let e = load_bytes(&huge, &[], &[]).unwrap_err().to_string();
        assert!(e.contains("truncated: entry name"), "{e}");
        let nan = legacy(&[("a", 1, &[f32::NAN])], None);
        let e = load_bytes(&nan, &[], &[]).unwrap_err().to_string();
        assert!(e.contains("entry `a` has a non-finite value NaN"), "{e}");
        let gguf = [
            &b"GGUF"[..],
            &3u32.to_le_bytes(),
            &0u64.to_le_bytes(),
            &0u64.to_le_bytes(),
        ]
        .concat();
        let e = load_bytes(&gguf, &[], &[]).unwrap_err().to_string();
        assert!(
            e.contains("not an importance matrix llama-imatrix wrote"),
            "{e}"
        );
    }

    #[test]
    fn kv_strings_are_cut_to_127_bytes_at_a_character() {
        assert_eq!(kv_str(&"a".repeat(200)).len(), 127);
        assert_eq!(kv_str(&format!("{}é", "a".repeat(126))).len(), 126);
    }
}
