//! The output of a run, resolved once: which directory and files it writes, what the commit
//! replaces and deletes, and the input files none of that may touch.
//!
//! A run owns only what it writes. Every input file (shards, index, side files, adapter files)
//! is identified by device and inode, so a symlink, a `..`, a bind mount or a hard link cannot
//! disguise one; every path the run renames over, deletes or writes in place (shards, index,
//! side files, stale model files under `--force`, the report) is checked against them before
//! anything is created. `--force` replaces one file for a `.safetensors` output, and in a
//! directory only the model files of a checkpoint layout: shards named as tftf names them or
//! as the old index lists them, the index, and the side files the run writes.

pub mod checksum;
pub mod commit;
pub mod lock;
pub mod names;
pub mod parts;

use std::collections::HashMap;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use serde_json::Value;

use crate::error::{Error, Result};
use crate::format::checkpoint::Checkpoint;
pub use crate::format::side_files::{is_side_file, side_files};
use crate::sink::{output_dir, output_kind_for, Layout, OutputKind};
pub use commit::OutputSet;
use commit::{
    finish_interrupted_commit, is_temp_name, remove_dirs, remove_temporaries, temporaries,
    JOURNAL_NAME,
};
use lock::{OutputLock, LOCK_FILE_NAME};
use names::is_model_file_name;
pub use names::INDEX_NAME;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct FileId {
    dev: u64,
    ino: u64,
}

impl FileId {
    /// The file a path leads to, through symlinks.
    fn of(path: &Path) -> Option<FileId> {
        std::fs::metadata(path).ok().map(|m| FileId {
            dev: m.dev(),
            ino: m.ino(),
        })
    }
}

/// Every file a run reads, by identity.
#[derive(Debug, Default)]
pub struct InputFiles {
    ids: HashMap<FileId, PathBuf>,
}

impl InputFiles {
    pub fn of(ckpt: &Checkpoint, sides: &[PathBuf]) -> InputFiles {
        let mut ids = HashMap::new();
        let paths = ckpt
            .shards
            .iter()
            .map(|s| &s.path)
            .chain(&ckpt.index_path)
            .chain(&ckpt.extra_inputs)
            .chain(sides);
        for p in paths {
            if let Some(id) = FileId::of(p) {
                ids.entry(id).or_insert_with(|| p.clone());
            }
        }
        InputFiles { ids }
    }

    /// The input that `path` is (or is a hard link to), if any. A symlink at `path` is not
    /// followed: renaming over or deleting it leaves its target alone.
    fn input_at(&self, path: &Path) -> Option<&PathBuf> {
        let m = std::fs::symlink_metadata(path).ok()?;
        if m.file_type().is_symlink() {
            return None;
        }
        self.ids.get(&FileId {
            dev: m.dev(),
            ino: m.ino(),
        })
    }

    /// Refuses to `action` at `path` when it holds an input.
    fn refuse_input(&self, path: &Path, action: &'static str) -> Result<()> {
        match self.input_at(path) {
            Some(input) => Err(Error::WouldTouchInput {
                path: path.to_path_buf(),
                input: input.clone(),
                action,
            }),
            None => Ok(()),
        }
    }
}

/// What the commit does to files already in the output directory.
#[derive(Debug, Default)]
pub struct Claim {
    /// Existing files the new output's files replace.
    pub replaced: Vec<String>,
    /// Model files of an earlier output that the new one does not include (`--force`).
    pub deleted: Vec<String>,
    /// Temporaries of killed runs, removed before writing.
    pub orphans: Vec<String>,
    /// A commit a killed run journalled but did not finish; finished before writing.
    pub interrupted_commit: bool,
}

pub struct OutputTarget<'a> {
    /// As the user gave it.
    pub path: PathBuf,
    pub kind: OutputKind,
    /// The directory holding the output files.
    pub dir: PathBuf,
    pub inputs: &'a InputFiles,
}

impl<'a> OutputTarget<'a> {
    /// Resolves the output of a run reading `ckpt`, whose files are `inputs`, and refuses an
    /// output equal to or inside the input's directory.
    pub fn resolve(
        path: &Path,
        ckpt: &Checkpoint,
        inputs: &'a InputFiles,
    ) -> Result<OutputTarget<'a>> {
        Self::resolve_as(path, output_kind_for(path), ckpt, inputs)
    }

    /// [`OutputTarget::resolve`] for an output whose kind does not follow from its extension
    /// (`tftf gguf`'s `.gguf` files are always [`OutputKind::File`]).
    pub fn resolve_as(
        path: &Path,
        kind: OutputKind,
        ckpt: &Checkpoint,
        inputs: &'a InputFiles,
    ) -> Result<OutputTarget<'a>> {
        let dir = output_dir(path, &kind);
        let inside = |input_dir: &Path| {
            let Some(input) = FileId::of(input_dir) else {
                return false;
            };
            let abs = resolve(&dir);
            abs.ancestors().any(|a| FileId::of(a) == Some(input))
        };
        let clash = if ckpt.has_model_dir() {
            inside(&ckpt.dir) && !beside_single_file(&dir, ckpt)
        } else {
            matches!(kind, OutputKind::File) && inputs.input_at(path).is_some()
        };
        if clash {
            return Err(Error::OutputInsideInput {
                output: path.into(),
                input: if ckpt.has_model_dir() {
                    ckpt.dir.clone()
                } else {
                    ckpt.input.clone()
                },
            });
        }
        if matches!(kind, OutputKind::File) && path.is_dir() {
            return Err(Error::Other(format!(
                "output {} is a directory; name a file (or, for safetensors, drop the extension)",
                path.display()
            )));
        }
        if matches!(kind, OutputKind::Dir) && path.exists() && !path.is_dir() {
            return Err(Error::Other(format!(
                "output {} exists and is not a directory",
                path.display()
            )));
        }
        Ok(OutputTarget {
            path: path.to_path_buf(),
            kind,
            dir,
            inputs,
        })
    }

    fn is_file(&self) -> bool {
        matches!(self.kind, OutputKind::File)
    }

    /// Name of the output file of a single-file output.
    pub fn file_name(&self) -> Option<String> {
        self.is_file().then(|| {
            self.path
                .file_name()
                .expect("a .safetensors path has a file name")
                .to_string_lossy()
                .into_owned()
        })
    }

    /// Names of the files a plan writes into the directory, shard `i` first.
    pub fn names(&self, layout: &Layout, sides: &[PathBuf]) -> Vec<String> {
        if let Some(f) = self.file_name() {
            return vec![f];
        }
        let mut v: Vec<String> = layout.shards.iter().map(|s| s.file_name.clone()).collect();
        if layout.has_index() {
            v.push(INDEX_NAME.into());
        }
        v.extend(sides.iter().map(|p| {
            p.file_name()
                .unwrap_or_default()
                .to_string_lossy()
                .into_owned()
        }));
        v
    }

    /// A claim on the directory as a killed run left it: its orphaned temporaries and whether
    /// a commit was interrupted; `None` while there is no directory.
    fn leftovers(&self) -> Option<Claim> {
        if !self.dir.is_dir() {
            return None;
        }
        Some(Claim {
            orphans: temporaries(&self.dir),
            interrupted_commit: self.dir.join(JOURNAL_NAME).exists(),
            ..Claim::default()
        })
    }

    /// What committing files `names` does to the directory's current contents, refusing when
    /// that would replace or delete an input, or when the output is not empty and `force` is
    /// not given. Read-only.
    pub fn claim(&self, names: &[String], force: bool) -> Result<Claim> {
        let Some(mut claim) = self.leftovers() else {
            return Ok(Claim::default());
        };
        if let Some(f) = self.file_name() {
            if self.path.exists() {
                if !force {
                    return Err(Error::Other(format!(
                        "output file {} exists; pass --force to replace it",
                        self.path.display()
                    )));
                }
                self.inputs.refuse_input(&self.path, "replace")?;
                claim.replaced.push(f);
            }
            return Ok(claim);
        }
        let present = self.entries_unless_forced(
            |n| n != LOCK_FILE_NAME && n != JOURNAL_NAME && !is_temp_name(n),
            force,
        )?;
        if present.is_empty() {
            return Ok(claim);
        }
        for name in names {
            let p = self.dir.join(name);
            if std::fs::symlink_metadata(&p).is_ok() {
                if p.is_dir() && !p.is_symlink() {
                    return Err(Error::Other(format!(
                        "{} is a directory, where the output needs to write a file; move it away",
                        p.display()
                    )));
                }
                self.inputs.refuse_input(&p, "replace")?;
                claim.replaced.push(name.clone());
            }
        }
        let old_index = old_index_shards(&self.dir.join(INDEX_NAME));
        for name in present {
            let ours = is_model_file_name(&name) || old_index.contains(&name);
            let p = self.dir.join(&name);
            let is_file = std::fs::symlink_metadata(&p).is_ok_and(|m| !m.is_dir());
            if ours && is_file && !names.contains(&name) {
                self.inputs.refuse_input(&p, "delete")?;
                claim.deleted.push(name);
            }
        }
        Ok(claim)
    }

    /// [`OutputTarget::claim`] for a set of named files in the output directory that need not
    /// be a checkpoint layout (split GGUF files): existing ones are replaced only with `force`
    /// and never when they are inputs; nothing else in the directory is touched.
    pub fn claim_files(&self, names: &[String], force: bool) -> Result<Claim> {
        let Some(mut claim) = self.leftovers() else {
            return Ok(Claim::default());
        };
        for name in names {
            let p = self.dir.join(name);
            if std::fs::symlink_metadata(&p).is_err() {
                continue;
            }
            if p.is_dir() && !p.is_symlink() {
                return Err(Error::Other(format!(
                    "{} is a directory, where the output needs to write a file; move it away",
                    p.display()
                )));
            }
            if !force {
                return Err(Error::Other(format!(
                    "output file {} exists; pass --force to replace it",
                    p.display()
                )));
            }
            self.inputs.refuse_input(&p, "replace")?;
            claim.replaced.push(name.clone());
        }
        Ok(claim)
    }

    /// Starts writing: creates the directory if needed, takes its lock, finishes a commit a
    /// killed run left half done and removes killed runs' temporaries. Returns the empty output
    /// set and notes on what was cleaned up.
    pub fn begin(&self) -> Result<(OutputSet, Vec<String>)> {
        let mut notes: Vec<String> = parts::finish_interrupted_finalize(&self.dir)?
            .into_iter()
            .collect();
        refuse_partitioned(&self.dir)?;
        let created_dirs = create_dirs(&self.dir)?;
        let lock = match OutputLock::acquire(&self.dir) {
            Ok(l) => l,
            Err(e) => {
                remove_dirs(&created_dirs);
                return Err(e);
            }
        };
        let set = OutputSet::new(self.dir.clone(), created_dirs, lock);
        if let Some(note) = finish_interrupted_commit(&self.dir)? {
            notes.push(note);
        }
        let orphans = remove_temporaries(&self.dir)?;
        if !orphans.is_empty() {
            notes.push(format!(
                "removed {} temporary file(s) left by a killed run: {}",
                orphans.len(),
                listing_excerpt(&orphans)
            ));
        }
        Ok((set, notes))
    }

    /// Refuses a report path that is an input, one of the output's files, or an existing file
    /// that is not an earlier tftf report.
    pub fn check_report(&self, report: &Path, names: &[String]) -> Result<()> {
        check_report_path(report, Some(self.inputs))?;
        let parent = resolve(report)
            .parent()
            .map(Path::to_path_buf)
            .unwrap_or_default();
        let same_dir = match (FileId::of(&parent), FileId::of(&self.dir)) {
            (Some(a), Some(b)) => a == b,
            _ => parent == resolve(&self.dir),
        };
        let name = report
            .file_name()
            .unwrap_or_default()
            .to_string_lossy()
            .into_owned();
        if same_dir && names.contains(&name) {
            return Err(Error::Usage(format!(
                "--report {} is one of the output's own files; write the report elsewhere",
                report.display()
            )));
        }
        Ok(())
    }
}

/// Whether output directory `dir`, inside the directory of `ckpt`, is a subdirectory beside a
/// single-file input that no read of that input (or of its folder) can pick up: the input is
/// one weight file read alone (not an index, a DCP or a shard set), `dir` is not the folder
/// itself, and the entry it occupies in the folder is not named like a weight file, an index
/// or a GGUF file. `cd model && tftf convert model.pt --format gguf --outdir ./converted` is
/// then allowed; every file the run replaces or deletes is still checked against the inputs.
fn beside_single_file(dir: &Path, ckpt: &Checkpoint) -> bool {
    let [shard] = ckpt.shards.as_slice() else {
        return false;
    };
    let single = ckpt.index_path.is_none()
        && !ckpt.input.is_dir()
        && FileId::of(&shard.path).is_some()
        && FileId::of(&shard.path) == FileId::of(&ckpt.input);
    let (Some(input_dir), out) = (FileId::of(&ckpt.dir), resolve(dir)) else {
        return false;
    };
    if !single || FileId::of(&out) == Some(input_dir) {
        return false;
    }
    // The entry of the input's folder that holds the output: the ancestor of `out` whose
    // parent is the folder.
    let entry = out
        .ancestors()
        .find(|a| a.parent().and_then(FileId::of) == Some(input_dir));
    entry
        .and_then(Path::file_name)
        .is_some_and(|n| !looks_like_weights(&n.to_string_lossy()))
}

/// Names a directory read of a checkpoint folder takes for weights or an index (or that a
/// user would take for a model file): `*.safetensors`, `*.json` indexes, torch weight files,
/// DCP files, `*.gguf`.
fn looks_like_weights(name: &str) -> bool {
    const SUFFIXES: [&str; 7] = [
        ".safetensors",
        ".index.json",
        ".bin",
        ".pt",
        ".pth",
        ".distcp",
        ".gguf",
    ];
    name == crate::format::torch::dcp::METADATA_NAME || SUFFIXES.iter().any(|s| name.ends_with(s))
}

/// A run that is not one of the parts must not clean up (or write over) a partitioned run's
/// directory: its temporaries belong to live jobs.
fn refuse_partitioned(dir: &Path) -> Result<()> {
    if parts::parts_dir(dir).is_dir() {
        return Err(Error::Other(format!(
            "{} holds an unfinished partitioned run ({}): finish its parts and run `tftf finalize`, or continue it with the same --part/--resume command; to discard it, remove {} and rerun with --force",
            dir.display(),
            parts::PARTS_DIR,
            parts::parts_dir(dir).display()
        )));
    }
    Ok(())
}

impl OutputTarget<'_> {
    /// For a part: creates the output directory (and the parts directory in it), returning the
    /// directories created.
    pub fn create_for_parts(&self) -> Result<Vec<PathBuf>> {
        let created = create_dirs(&self.dir)?;
        let pd = parts::parts_dir(&self.dir);
        match std::fs::create_dir(&pd) {
            Ok(()) => Ok(created),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists && pd.is_dir() => Ok(created),
            Err(e) => {
                remove_dirs(&created);
                Err(Error::io(&pd, e))
            }
        }
    }

    /// The names of the directory's entries that `counts` accepts, sorted; when there are any
    /// and `force` is not given, the output is not empty and that is an error naming them.
    fn entries_unless_forced(
        &self,
        counts: impl Fn(&str) -> bool,
        force: bool,
    ) -> Result<Vec<String>> {
        let mut entries: Vec<String> = std::fs::read_dir(&self.dir)
            .map_err(|e| Error::io(&self.dir, e))?
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| counts(n))
            .collect();
        entries.sort();
        if !entries.is_empty() && !force {
            return Err(Error::OutputNotEmpty {
                dir: self.dir.clone(),
                entries: listing_excerpt(&entries),
            });
        }
        Ok(entries)
    }

    /// For a part: the directory's visible entries other than `ok` (this run's shards). Without
    /// `force` any of them is refused; with it, model files of an earlier output (the old index
    /// first of all) are deleted at once, before any shard of this run lands beside them, and
    /// other files are left for finalize to replace.
    pub fn claim_for_part(
        &self,
        ok: &std::collections::HashSet<String>,
        force: bool,
    ) -> Result<Vec<String>> {
        let mut foreign =
            self.entries_unless_forced(|n| !n.starts_with('.') && !ok.contains(n), force)?;
        if foreign.is_empty() {
            return Ok(foreign);
        }
        let old_index = old_index_shards(&self.dir.join(INDEX_NAME));
        let mut deleted = Vec::new();
        // The index first: without it the directory is no longer a checkpoint a loader would
        // take for a mix of old and new shards.
        foreign.sort_by_key(|n| n != INDEX_NAME);
        for name in foreign {
            let p = self.dir.join(&name);
            let is_file = std::fs::symlink_metadata(&p).is_ok_and(|m| !m.is_dir());
            if is_file && (is_model_file_name(&name) || old_index.contains(&name)) {
                self.inputs.refuse_input(&p, "delete")?;
                match std::fs::remove_file(&p) {
                    Ok(()) => deleted.push(name),
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                    Err(e) => return Err(Error::io(&p, e)),
                }
            }
        }
        Ok(deleted)
    }
}

/// Refuses a report path that holds an input or an existing file other than a tftf report.
pub fn check_report_path(report: &Path, inputs: Option<&InputFiles>) -> Result<()> {
    if let Some(input) = inputs.and_then(|i| i.input_at(report)) {
        return Err(Error::WouldTouchInput {
            path: report.to_path_buf(),
            input: input.clone(),
            action: "write the report over",
        });
    }
    if report.is_dir() {
        return Err(Error::Usage(format!(
            "--report {} is a directory; name a file",
            report.display()
        )));
    }
    if report.exists() && !is_tftf_report(report) {
        return Err(Error::Usage(format!(
            "--report {} exists and is not a tftf report; remove it or choose another path",
            report.display()
        )));
    }
    Ok(())
}

fn is_tftf_report(path: &Path) -> bool {
    crate::sys::read_regular(path)
        .ok()
        .and_then(|b| serde_json::from_slice::<Value>(&b).ok())
        .is_some_and(|v| v.get("tftf_version").is_some() && v.get("status").is_some())
}

/// Writes a report atomically (a temporary beside it, then a rename).
pub fn write_report(path: &Path, report: &Value) -> Result<()> {
    let mut text = serde_json::to_string_pretty(report).expect("JSON value");
    text.push('\n');
    let name = path
        .file_name()
        .ok_or_else(|| Error::Usage(format!("--report {} names no file", path.display())))?
        .to_string_lossy()
        .into_owned();
    let tmp = path.with_file_name(commit::temp_name(&name));
    std::fs::write(&tmp, text).map_err(|e| {
        let _ = std::fs::remove_file(&tmp);
        Error::io(path, e)
    })?;
    std::fs::rename(&tmp, path).map_err(|e| {
        let _ = std::fs::remove_file(&tmp);
        Error::io(path, e)
    })
}

/// Finishes an interrupted commit in `dir` (a finalize's too) and removes killed runs'
/// temporaries, under the directory's lock (`tftf recover`); in a partitioned run that is not
/// finalized, only the temporaries. Returns what was done.
pub fn recover(dir: &Path) -> Result<Vec<String>> {
    if !dir.is_dir() {
        return Err(Error::Usage(format!(
            "{} is not a directory",
            dir.display()
        )));
    }
    if parts::parts_dir(dir).is_dir()
        && commit::interrupted_commit_retires(dir).as_deref() != Some(parts::PARTS_DIR)
    {
        return parts::recover_unfinished(dir);
    }
    let no_inputs = InputFiles::default();
    let target = OutputTarget {
        path: dir.to_path_buf(),
        kind: OutputKind::Dir,
        dir: dir.to_path_buf(),
        inputs: &no_inputs,
    };
    let (set, notes) = target.begin()?;
    drop(set);
    Ok(notes)
}

/// Names (as bytes) of the data files in `dir` that `listed` (an output's checksummed files)
/// does not hold. A safetensors checkpoint directory is the output's own: there every weight
/// file of any format, index, adapter file and file the index lists counts. GGUF files sit
/// among other files: there only the split files of a listed split GGUF (`STEM-NNNNN-of-
/// MMMMM.gguf`, the same stem and count) count. Hidden files never do.
pub(crate) fn unlisted_data_files(dir: &Path, listed: &[&std::ffi::OsStr]) -> Result<Vec<Vec<u8>>> {
    let listed_str: Vec<&str> = listed.iter().filter_map(|n| n.to_str()).collect();
    let checkpoint_dir = listed_str
        .iter()
        .any(|n| n.ends_with(".safetensors") || *n == INDEX_NAME);
    let splits: Vec<(&str, &str)> = listed_str.iter().filter_map(|n| gguf_split(n)).collect();
    let indexed = old_index_shards(&dir.join(INDEX_NAME));
    let mut v = Vec::new();
    for e in std::fs::read_dir(dir)
        .map_err(|e| Error::io(dir, e))?
        .flatten()
    {
        let raw = e.file_name();
        let name = raw.to_string_lossy();
        let data = (checkpoint_dir && (!is_side_file(&name) || indexed.iter().any(|i| *i == name)))
            || gguf_split(&name).is_some_and(|k| splits.contains(&k));
        let unlisted = !listed.contains(&raw.as_os_str());
        if data && unlisted && !name.starts_with('.') && !e.path().is_dir() {
            v.push(std::os::unix::ffi::OsStrExt::as_bytes(raw.as_os_str()).to_vec());
        }
    }
    v.sort();
    Ok(v)
}

/// (stem, count) of a split GGUF file name `STEM-NNNNN-of-MMMMM.gguf`.
fn gguf_split(name: &str) -> Option<(&str, &str)> {
    let rest = name.strip_suffix(".gguf")?;
    let (head, count) = rest.rsplit_once("-of-")?;
    let (stem, index) = head.rsplit_once('-')?;
    let digits = |s: &str| s.len() == 5 && s.bytes().all(|b| b.is_ascii_digit());
    (digits(index) && digits(count)).then_some((stem, count))
}

/// Shard names an existing index lists (plain names only).
fn old_index_shards(index: &Path) -> Vec<String> {
    let Some(v) = crate::sys::read_regular(index)
        .ok()
        .and_then(|b| serde_json::from_slice::<Value>(&b).ok())
    else {
        return Vec::new();
    };
    let mut names: Vec<String> = v
        .get("weight_map")
        .and_then(Value::as_object)
        .map(|m| {
            m.values()
                .filter_map(Value::as_str)
                .filter(|s| !s.is_empty() && !s.contains('/') && *s != "." && *s != "..")
                .map(String::from)
                .collect()
        })
        .unwrap_or_default();
    names.sort();
    names.dedup();
    names
}

/// Up to five names, then how many more.
fn listing_excerpt(names: &[String]) -> String {
    let mut s: Vec<String> = names.iter().take(5).map(|n| format!("`{n}`")).collect();
    if names.len() > 5 {
        s.push(format!("and {} more", names.len() - 5));
    }
    s.join(", ")
}

/// Creates `dir` and any missing parents; returns the directories this call created, deepest
/// first, so a failed run can remove exactly those.
fn create_dirs(dir: &Path) -> Result<Vec<PathBuf>> {
    let missing: Vec<PathBuf> = dir
        .ancestors()
        .filter(|a| !a.as_os_str().is_empty())
        .take_while(|a| !a.exists())
        .map(Path::to_path_buf)
        .collect();
    let mut created = Vec::new();
    for d in missing.iter().rev() {
        match std::fs::create_dir(d) {
            Ok(()) => {
                crate::signals::remove_on_exit(d);
                created.push(d.clone());
            }
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists && d.is_dir() => {}
            Err(e) => {
                remove_dirs(&created);
                return Err(Error::io(d, e));
            }
        }
    }
    created.reverse();
    Ok(created)
}

/// After a part failed: removes the parts directory and the directories the part created,
/// where they are empty (a part that wrote its record leaves it for `--resume`).
pub fn remove_dirs_if_empty(dir: &Path, created: &[PathBuf]) {
    let _ = std::fs::remove_dir(parts::parts_dir(dir));
    remove_dirs(created);
}

/// Absolute form of a path that may not exist yet: its deepest existing ancestor resolved,
/// the rest appended.
pub fn resolve(path: &Path) -> PathBuf {
    let abs = if path.is_absolute() {
        path.to_path_buf()
    } else {
        std::env::current_dir().unwrap_or_default().join(path)
    };
    let mut existing = abs.as_path();
    let mut rest = Vec::new();
    loop {
        if let Ok(c) = existing.canonicalize() {
            let mut out = c;
            for part in rest.iter().rev() {
                out.push(part);
            }
            return out;
        }
        match (existing.parent(), existing.file_name()) {
            (Some(p), Some(name)) => {
                rest.push(name.to_os_string());
                existing = p;
            }
            _ => return abs,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn side_file_rules() {
        for keep in [
            "config.json",
            "tokenizer.json",
            "tokenizer.model",
            "generation_config.json",
            "chat_template.jinja",
            "modeling_deepseek.py",
            "README.md",
            "merges.txt",
        ] {
            assert!(is_side_file(keep), "{keep}");
        }
        for skip in [
            "model-00001-of-00002.safetensors",
            "model.safetensors.index.json",
            "pytorch_model.bin",
            "model.gguf",
            "adapter_config.json",
            "adapter_model.safetensors",
            "consolidated.00.pth",
            ".gitattributes",
        ] {
            assert!(!is_side_file(skip), "{skip}");
        }
    }
}
