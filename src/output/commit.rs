//! Atomic output as a set: files are written under hidden temporary names beside their final
//! ones; the commit first makes a journal durable (`.tftf-commit.json`: every rename and
//! deletion it is about to make), then renames (the index last) and deletes, then removes the
//! journal. A crash before the journal is durable leaves the old output plus temporaries, which
//! the next run on the directory removes; a crash after it leaves a journal, which the next run
//! (or `tftf recover`) rolls forward. So after a crash at any instant the output is the old one
//! or, once finished, the new one — never a mix that a loader would take for a checkpoint.
//!
//! A commit may also retire a hidden bookkeeping directory (finalize's `.tftf-parts`): the
//! journal names it, and applying the journal renames it aside, then empties and removes it,
//! before the journal goes. So the bookkeeping outlives the commit by no instant that a rerun
//! or `tftf recover` cannot finish.
//!
//! Dropping an uncommitted `OutputSet` (an error, a panic unwinding, Ctrl-C) removes every
//! temporary, then the directories this run created for the output, where empty.

use std::ffi::{OsStr, OsString};
use std::fs::{File, OpenOptions};
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::path::{Path, PathBuf};

use serde_json::{json, Value};

use super::lock::OutputLock;
use super::names::{name_from_json, name_json};
use crate::error::{Error, Result};

pub use crate::format::checkpoint::JOURNAL_NAME;

/// Removes directories a run created, deepest first, where they are still empty.
pub(crate) fn remove_dirs(created: &[PathBuf]) {
    for d in created {
        let _ = std::fs::remove_dir(d);
    }
}

/// The longest file name Linux filesystems take (`NAME_MAX`), in bytes.
const NAME_MAX_BYTES: usize = 255;
/// Bytes a temporary's name adds to its stem: `.`, `.tftf-`, a pid of up to 10 digits, `.tmp`.
const TEMP_OVERHEAD_BYTES: usize = 1 + 6 + 10 + 4;
/// Hex digits of the final name's SHA-256 that stand in for the cut-off end of a long name.
const TEMP_HASH_DIGITS: usize = 16;

/// The part of a temporary's name that stands for its final name: the name itself, or, where
/// that would make the temporary longer than `NAME_MAX` (a legal 240-byte name), its head and
/// `~` and a hash of the whole name. Bytes, as names need not be UTF-8; a UTF-8 name is cut at a
/// character boundary, so its stem stays UTF-8.
fn temp_stem(name: &[u8]) -> std::borrow::Cow<'_, [u8]> {
    let room = NAME_MAX_BYTES - TEMP_OVERHEAD_BYTES;
    if name.len() <= room {
        return name.into();
    }
    use sha2::Digest;
    let digest = sha2::Sha256::digest(name);
    let hash: String = digest.iter().map(|b| format!("{b:02x}")).collect();
    let mut cut = room - 1 - TEMP_HASH_DIGITS;
    if let Ok(text) = std::str::from_utf8(name) {
        while !text.is_char_boundary(cut) {
            cut -= 1;
        }
    }
    let mut stem = name[..cut].to_vec();
    stem.push(b'~');
    stem.extend_from_slice(&hash.as_bytes()[..TEMP_HASH_DIGITS]);
    stem.into()
}

/// Temporary name of a file that becomes `name` on commit: hidden, marked with the pid, and
/// never longer than `NAME_MAX` when `name` is not.
pub fn temp_name(name: &str) -> String {
    String::from_utf8(temp_os_name(OsStr::new(name)).into_vec())
        .expect("the stem of a UTF-8 name is UTF-8")
}

/// [`temp_name`] of a name that may not be UTF-8, byte for byte.
pub(crate) fn temp_os_name(name: &OsStr) -> OsString {
    let mut b = vec![b'.'];
    b.extend_from_slice(&temp_stem(name.as_bytes()));
    b.extend_from_slice(format!(".tftf-{}.tmp", std::process::id()).as_bytes());
    OsString::from_vec(b)
}

/// Whether the tftf temporary `tmp` (`.STEM.tftf-PID.tmp`, any pid) is one for `name`.
pub fn is_temp_for(tmp: &str, name: &str) -> bool {
    if !is_temp_name(tmp) {
        return false;
    }
    let rest = &tmp[1..tmp.len() - 4];
    rest.rfind(".tftf-")
        .is_some_and(|at| rest.as_bytes()[..at] == *temp_stem(name.as_bytes()))
}

/// Whether a directory entry is a tftf temporary (`.NAME.tftf-PID.tmp`).
pub fn is_temp_name(name: &str) -> bool {
    is_temp_bytes(name.as_bytes())
}

/// [`is_temp_name`] of a name as bytes (NAME need not be UTF-8).
fn is_temp_bytes(name: &[u8]) -> bool {
    let Some(rest) = name
        .strip_prefix(b".")
        .and_then(|n| n.strip_suffix(b".tmp"))
    else {
        return false;
    };
    let marker = b".tftf-";
    match rest.windows(marker.len()).rposition(|w| w == marker) {
        Some(at) => {
            let pid = &rest[at + marker.len()..];
            at > 0 && !pid.is_empty() && pid.iter().all(u8::is_ascii_digit)
        }
        None => false,
    }
}

pub struct OutputSet {
    dir: PathBuf,
    /// Directories this run created for the output, deepest first.
    created_dirs: Vec<PathBuf>,
    /// (temporary path, final name), in the order added.
    files: Vec<(PathBuf, OsString)>,
    committed: bool,
    lock: Option<OutputLock>,
    /// A directory in `dir` the commit removes after its renames and deletions.
    retire: Option<String>,
}

impl OutputSet {
    /// An output set in `dir`, which exists and whose lock `lock` is.
    pub fn new(dir: PathBuf, created_dirs: Vec<PathBuf>, lock: OutputLock) -> OutputSet {
        OutputSet {
            dir,
            created_dirs,
            files: Vec::new(),
            committed: false,
            lock: Some(lock),
            retire: None,
        }
    }

    /// Makes the commit remove the hidden directory `name` (`.tftf-…`, a plain name in the
    /// output directory) once every file is in place, as part of the journalled commit.
    pub fn retire_after_commit(&mut self, name: &str) {
        self.retire = Some(name.to_string());
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Opens a new temporary file that becomes `name` on commit (an error names `name`: the
    /// temporary is ours, not the user's).
    pub fn add(&mut self, name: impl AsRef<OsStr>) -> Result<(File, PathBuf)> {
        let name = name.as_ref();
        let tmp = self.dir.join(temp_os_name(name));
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(&tmp)
            .map_err(|e| Error::io(self.dir.join(name), e))?;
        crate::signals::remove_on_exit(&tmp);
        self.files.push((tmp.clone(), name.to_os_string()));
        crash_point("tmp");
        Ok((file, tmp))
    }

    /// Writes a whole small file (index, config).
    pub fn add_bytes(&mut self, name: impl AsRef<OsStr>, bytes: &[u8]) -> Result<()> {
        let (file, tmp) = self.add(name)?;
        use std::io::Write;
        let mut w = std::io::BufWriter::new(file);
        w.write_all(bytes).map_err(|e| Error::io(&tmp, e))?;
        w.into_inner()
            .map_err(|e| Error::io(&tmp, e.into_error()))?
            .sync_all()
            .map_err(|e| Error::io(&tmp, e))
    }

    /// Copies a side file: shared with the input where the filesystem can, else copied in the
    /// kernel. `name` is taken byte for byte.
    pub fn add_copy(&mut self, name: impl AsRef<OsStr>, src: &Path) -> Result<()> {
        let name = name.as_ref();
        let (mut dst, _) = self.add(name)?;
        let mut from = crate::sys::open_regular(src).map_err(|e| Error::io(src, e))?;
        if crate::sys::clone_file(&from, &dst).is_err() {
            std::io::copy(&mut from, &mut dst).map_err(|e| Error::io(self.dir.join(name), e))?;
        }
        Ok(())
    }

    /// Flushes everything, then journals, renames into place (indexes last) and deletes the
    /// stale files `delete` (names in the directory). Returns the final paths.
    pub fn commit(mut self, delete: &[String]) -> Result<Vec<PathBuf>> {
        crash_point("written");
        for (tmp, _) in &self.files {
            let f = File::open(tmp).map_err(|e| Error::io(tmp, e))?;
            f.sync_all().map_err(|e| Error::io(tmp, e))?;
        }
        // Loaders find a checkpoint through its index: it appears only after its shards.
        self.files
            .sort_by_key(|(_, name)| name.as_bytes().ends_with(b".index.json"));
        let journal = Journal {
            pid: std::process::id(),
            renames: self
                .files
                .iter()
                .map(|(tmp, name)| {
                    (
                        tmp.file_name()
                            .expect("temporaries have names")
                            .to_os_string(),
                        name.clone(),
                    )
                })
                .collect(),
            deletes: delete.to_vec(),
            retire: self.retire.clone(),
        };
        // From the journal on, the temporaries belong to the commit (a later run finishes it):
        // a signal ending the process must not remove them.
        self.keep_on_exit();
        journal.write(&self.dir)?;
        crash_point("journal");
        journal.apply(&self.dir)?;
        self.committed = true;
        remove_journal(&self.dir)?;
        Ok(self
            .files
            .iter()
            .map(|(_, name)| self.dir.join(name))
            .collect())
    }
}

impl OutputSet {
    /// Forgets the temporaries and created directories registered for removal at a signal.
    fn keep_on_exit(&self) {
        for p in self
            .files
            .iter()
            .map(|(tmp, _)| tmp)
            .chain(&self.created_dirs)
        {
            crate::signals::keep_on_exit(p);
        }
    }
}

impl Drop for OutputSet {
    fn drop(&mut self) {
        if !self.committed {
            for (tmp, _) in &self.files {
                let _ = std::fs::remove_file(tmp);
            }
        }
        drop(self.lock.take());
        if !self.committed {
            remove_dirs(&self.created_dirs);
        }
        self.keep_on_exit();
    }
}

/// The renames and deletions a commit makes, written down before it makes them.
struct Journal {
    pid: u32,
    /// (temporary name, final name), as bytes.
    renames: Vec<(OsString, OsString)>,
    deletes: Vec<String>,
    /// A hidden directory removed last ([`OutputSet::retire_after_commit`]).
    retire: Option<String>,
}

impl Journal {
    fn write(&self, dir: &Path) -> Result<()> {
        let value = json!({
            "tftf_commit": 1,
            "pid": self.pid,
            "renames": self.renames.iter().map(|(t, f)| [name_json(t), name_json(f)]).collect::<Vec<_>>(),
            "deletes": self.deletes,
            "retire": self.retire,
        });
        let path = dir.join(JOURNAL_NAME);
        let tmp = dir.join(temp_name(JOURNAL_NAME));
        let text = serde_json::to_string_pretty(&value).expect("JSON value");
        let file = OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&tmp)
            .map_err(|e| Error::io(&tmp, e))?;
        use std::io::Write;
        (&file)
            .write_all(text.as_bytes())
            .and_then(|_| file.sync_all())
            .map_err(|e| Error::io(&tmp, e))?;
        std::fs::rename(&tmp, &path).map_err(|e| Error::io(&path, e))?;
        sync_dir(dir)
    }

    fn read(dir: &Path) -> Result<Journal> {
        let path = dir.join(JOURNAL_NAME);
        let bad = |msg: &str| {
            Error::Other(format!(
                "{}: interrupted-commit journal is damaged ({msg}); compare the directory with the run's report and remove the journal by hand",
                path.display()
            ))
        };
        let text = crate::sys::read_regular_to_string(&path).map_err(|e| Error::io(&path, e))?;
        let v: Value = serde_json::from_str(&text).map_err(|_| bad("not JSON"))?;
        let names = |key: &str| -> Result<Vec<Value>> {
            v.get(key)
                .and_then(Value::as_array)
                .cloned()
                .ok_or_else(|| bad(&format!("no `{key}` list")))
        };
        let plain = |n: &Value| -> Result<String> {
            match n.as_str() {
                Some(s) if !s.is_empty() && !s.contains('/') && s != "." && s != ".." => {
                    Ok(s.to_string())
                }
                _ => Err(bad("an entry is not a file name in this directory")),
            }
        };
        let plain_os = |n: &Value| {
            name_from_json(n).ok_or_else(|| bad("an entry is not a file name in this directory"))
        };
        let mut renames = Vec::new();
        for pair in names("renames")? {
            match pair.as_array().map(Vec::as_slice) {
                Some([tmp, fin]) => {
                    let tmp = plain_os(tmp)?;
                    if !is_temp_bytes(tmp.as_bytes()) {
                        return Err(bad("a rename source is not a tftf temporary"));
                    }
                    renames.push((tmp, plain_os(fin)?));
                }
                _ => return Err(bad("a rename is not a pair")),
            }
        }
        let deletes = names("deletes")?
            .iter()
            .map(plain)
            .collect::<Result<Vec<_>>>()?;
        let retire = match v.get("retire") {
            None | Some(Value::Null) => None,
            Some(d) => match plain(d)? {
                d if d.starts_with(".tftf-") => Some(d),
                _ => return Err(bad("the directory to retire is not tftf's")),
            },
        };
        Ok(Journal {
            pid: v.get("pid").and_then(Value::as_u64).unwrap_or(0) as u32,
            renames,
            deletes,
            retire,
        })
    }

    /// Makes every rename and deletion; idempotent, so a rerun after a crash finishes the job.
    fn apply(&self, dir: &Path) -> Result<()> {
        for (tmp, fin) in &self.renames {
            let (from, to) = (dir.join(tmp), dir.join(fin));
            match std::fs::rename(&from, &to) {
                Ok(()) => crash_point("rename"),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound && to.exists() => {}
                Err(e) => return Err(Error::io(&to, e)),
            }
        }
        for name in &self.deletes {
            let p = dir.join(name);
            match std::fs::remove_file(&p) {
                Ok(()) => crash_point("delete"),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(Error::io(&p, e)),
            }
        }
        if let Some(name) = &self.retire {
            retire_dir(dir, name)?;
        }
        sync_dir(dir)?;
        crash_point("applied");
        Ok(())
    }
}

/// Removes the directory `name` in `dir`: renamed aside to `NAME.retired` first (one atomic
/// step: no reader sees it half emptied), then emptied and removed. Idempotent.
fn retire_dir(dir: &Path, name: &str) -> Result<()> {
    let live = dir.join(name);
    let aside = dir.join(format!("{name}.retired"));
    if live.is_dir() {
        remove_tree(&aside)?;
        std::fs::rename(&live, &aside).map_err(|e| Error::io(&live, e))?;
        sync_dir(dir)?;
        crash_point("retire");
    }
    remove_tree(&aside)
}

/// Removes `path` and everything under it, symlinks as links; a missing entry is no error.
fn remove_tree(path: &Path) -> Result<()> {
    let gone = |e: &std::io::Error| e.kind() == std::io::ErrorKind::NotFound;
    let entries = match std::fs::read_dir(path) {
        Ok(rd) => rd,
        Err(e) if gone(&e) => return Ok(()),
        Err(e) => return Err(Error::io(path, e)),
    };
    for entry in entries {
        let entry = entry.map_err(|e| Error::io(path, e))?;
        let p = entry.path();
        if entry.file_type().is_ok_and(|t| t.is_dir()) {
            remove_tree(&p)?;
            continue;
        }
        match std::fs::remove_file(&p) {
            Ok(()) => crash_point("unrecord"),
            Err(e) if gone(&e) => {}
            Err(e) => return Err(Error::io(&p, e)),
        }
    }
    match std::fs::remove_dir(path) {
        Err(e) if !gone(&e) => Err(Error::io(path, e)),
        _ => Ok(()),
    }
}

fn remove_journal(dir: &Path) -> Result<()> {
    let path = dir.join(JOURNAL_NAME);
    std::fs::remove_file(&path).map_err(|e| Error::io(&path, e))?;
    sync_dir(dir)
}

fn sync_dir(dir: &Path) -> Result<()> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| Error::io(dir, e))
}

/// The directory the commit journalled in `dir` retires (finalize's), if there is such a
/// journal: a commit that finalize began.
pub fn interrupted_commit_retires(dir: &Path) -> Option<String> {
    if !dir.join(JOURNAL_NAME).exists() {
        return None;
    }
    Journal::read(dir).ok()?.retire
}

/// Finishes the commit a killed run left journalled in `dir` (call with the lock held).
/// Returns a note saying what was done, or `None` when there was nothing to finish.
pub fn finish_interrupted_commit(dir: &Path) -> Result<Option<String>> {
    if !dir.join(JOURNAL_NAME).exists() {
        return Ok(None);
    }
    let journal = Journal::read(dir)?;
    journal.apply(dir)?;
    remove_journal(dir)?;
    let retired = journal
        .retire
        .as_ref()
        .map_or(String::new(), |d| format!(", {d} removed"));
    Ok(Some(format!(
        "finished the commit that tftf pid {} was making when it stopped ({} file(s) renamed into place, {} removed{retired})",
        journal.pid,
        journal.renames.len(),
        journal.deletes.len()
    )))
}

/// tftf temporaries in `dir` (names, sorted, as they are printed). With the directory's lock
/// held they are orphans of killed runs.
pub fn temporaries(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = raw_temporaries(dir)
        .iter()
        .map(|n| crate::escape::bytes(n.as_bytes()).into_owned())
        .collect();
    v.sort();
    v
}

fn raw_temporaries(dir: &Path) -> Vec<OsString> {
    std::fs::read_dir(dir)
        .map(|rd| {
            rd.flatten()
                .map(|e| e.file_name())
                .filter(|n| is_temp_bytes(n.as_bytes()))
                .collect()
        })
        .unwrap_or_default()
}

/// Removes the tftf temporaries in `dir` (call with its lock held: they are orphans of killed
/// runs); returns their names as printed, sorted.
pub fn remove_temporaries(dir: &Path) -> Result<Vec<String>> {
    let mut removed = Vec::new();
    for name in raw_temporaries(dir) {
        let p = dir.join(&name);
        match std::fs::remove_file(&p) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(Error::io(&p, e)),
            _ => removed.push(crate::escape::bytes(name.as_bytes()).into_owned()),
        }
    }
    removed.sort();
    Ok(removed)
}

/// Test hooks: `TFTF_TEST_CRASH_AT=POINT[:N]` kills the process with SIGKILL (no destructors,
/// no cleanup, as the OOM killer or a power cut would) the N-th time (default 1st) it reaches
/// `POINT`: `tmp` (a temporary created), `written` (all data written, nothing committed),
/// `journal` (journal durable), `rename`, `delete`, `retire` (the retired directory renamed
/// aside), `unrecord` (a file in it removed), `applied` (all done but the journal's removal). `TFTF_TEST_STOP_AT=POINT[:N]` stops it (SIGSTOP) there instead, holding the
/// output's lock, so a test can start a second run against a live one.
pub fn crash_point(point: &str) {
    use std::sync::atomic::{AtomicU32, Ordering};
    static HITS: [AtomicU32; 2] = [AtomicU32::new(0), AtomicU32::new(0)];
    for (k, (var, signal)) in [
        ("TFTF_TEST_CRASH_AT", libc::SIGKILL),
        ("TFTF_TEST_STOP_AT", libc::SIGSTOP),
    ]
    .into_iter()
    .enumerate()
    {
        let Ok(spec) = std::env::var(var) else {
            continue;
        };
        let (name, nth) = match spec.split_once(':') {
            Some((n, k)) => (n, k.parse().unwrap_or(1)),
            None => (spec.as_str(), 1),
        };
        if name == point && HITS[k].fetch_add(1, Ordering::SeqCst) + 1 == nth {
            // SAFETY: sending a signal to our own pid.
            unsafe {
                libc::kill(libc::getpid(), signal);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn temp_names() {
        assert!(is_temp_name(&temp_name("model.safetensors")));
        assert!(is_temp_name(".x.tftf-12.tmp"));
        assert!(is_temp_for(".x.tftf-12.tmp", "x"));
        assert!(!is_temp_for(".x.tftf-12.tmp", "y"));
        for not in [
            "x.tftf-12.tmp",
            ".tftf-12.tmp",
            ".x.tftf-.tmp",
            ".x.tftf-1a.tmp",
            ".x.tmp",
            ".tftf.lock",
            JOURNAL_NAME,
        ] {
            assert!(!is_temp_name(not), "{not}");
        }
    }

    #[test]
    fn temporaries_of_names_up_to_name_max_fit_in_name_max() {
        // Issue 24: a legal 240-byte name made a temporary longer than NAME_MAX.
        for len in [200, 234, 235, 240, 255] {
            let name = format!("{}.safetensors", "w".repeat(len - 12));
            let tmp = temp_name(&name);
            assert!(tmp.len() <= NAME_MAX_BYTES, "{len}: {} bytes", tmp.len());
            assert!(is_temp_name(&tmp) && is_temp_for(&tmp, &name), "{tmp}");
            let other = format!("{}.safetensors", "v".repeat(len - 12));
            assert!(!is_temp_for(&tmp, &other), "{tmp}");
        }
        // Two long names that differ only past the cut get different temporaries.
        let a = format!("{}a", "w".repeat(250));
        let b = format!("{}b", "w".repeat(250));
        assert_ne!(temp_name(&a), temp_name(&b));
        assert!(!is_temp_for(&temp_name(&a), &b));
        // A cut inside a multi-byte character moves back to its start.
        let wide = "é".repeat(127);
        assert!(temp_name(&wide).len() <= NAME_MAX_BYTES);
        assert!(is_temp_for(&temp_name(&wide), &wide));
    }

    #[test]
    fn a_journal_retires_only_a_tftf_directory_and_finishing_it_twice_is_harmless() {
        let d = tempfile::tempdir().unwrap();
        let dir = d.path();
        std::fs::create_dir_all(dir.join("weights")).unwrap();
        let journal = |retire: &str| {
            let text = format!(
                r#"{{"tftf_commit": 1, "pid": 7, "renames": [], "deletes": [], "retire": "{retire}"}}"#
            );
            std::fs::write(dir.join(JOURNAL_NAME), text).unwrap();
        };
        journal("weights");
        let e = finish_interrupted_commit(dir).unwrap_err().to_string();
        assert!(e.contains("the directory to retire is not tftf's"), "{e}");
        assert!(dir.join("weights").is_dir());
        // A retired directory half removed by a killed commit, with nested files.
        std::fs::create_dir_all(dir.join(".tftf-parts.retired/side")).unwrap();
        std::fs::write(dir.join(".tftf-parts.retired/side/config.json"), "{}").unwrap();
        journal(".tftf-parts");
        assert_eq!(
            interrupted_commit_retires(dir).as_deref(),
            Some(".tftf-parts")
        );
        let note = finish_interrupted_commit(dir).unwrap().unwrap();
        assert!(note.contains(".tftf-parts removed"), "{note}");
        assert!(!dir.join(".tftf-parts.retired").exists());
        assert!(!dir.join(JOURNAL_NAME).exists());
        assert!(finish_interrupted_commit(dir).unwrap().is_none());
    }
}
