//! `--part K/N`, `--resume` and `tftf finalize`: one conversion split into independent jobs
//! (Slurm arrays, Kubernetes Indexed Jobs) that write into one output directory, each shard
//! committed on its own so a killed job loses only the shard it was writing.
//!
//! Every part computes the same plan and layout (they depend only on the inputs and the
//! arguments), then the same assignment of output shards to parts, balanced by the work each
//! shard costs. Part K writes only its shards, each under a temporary name, renamed into place
//! when complete, then recorded in `.tftf-parts/shard-IIIII.json` (size, SHA-256 per file and
//! per tensor). Its header `.tftf-parts/part-KKKKK-of-NNNNN.json`, written before any shard,
//! holds the run's fingerprint and the shards assigned to it, and says `complete` at the end.
//! Part 1 also stages the side files (the edited config, tokenizer…) in `.tftf-parts/side/`.
//! No part writes the index: until finalize writes it, the directory is not a loadable
//! multi-shard checkpoint. Finalize checks every part's record against the others and writes
//! the index, side files and checksums through the journalled commit, whose last step removes
//! `.tftf-parts`: a kill at any instant leaves either the records (finalize runs again) or a
//! journal that `recover`, `finalize` or the next run rolls forward.
//!
//! Locks are lease files created with `O_EXCL` (atomic on local filesystems and on NFS v3+,
//! Lustre and GPFS), not `flock`, which network filesystems do not all honour. A holder
//! refreshes its lock's mtime every [`HEARTBEAT`]; a lock is stale when its holder ran on this
//! host and is gone, or when it has not been refreshed for [`LEASE`] (this assumes the nodes'
//! clocks agree to within a few minutes, as NTP keeps them). A stale lock is taken over by
//! renaming it away first, so two jobs cannot both take it over.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::mpsc::{channel, RecvTimeoutError, Sender};
use std::time::{Duration, SystemTime};

use serde_json::{json, Value};
use sha2::{Digest, Sha256};

use super::checksum::{
    hash_bytes, hash_file, manifest_json, sums_text, tensors_json, FileSum, TensorRange,
    MANIFEST_NAME, SUMS_NAME,
};
use super::commit::{
    finish_interrupted_commit, interrupted_commit_retires, remove_temporaries, temp_name, OutputSet,
};
use super::lock::OutputLock;
use super::names::{is_model_file_name, name_from_json, name_json, INDEX_NAME};
use crate::error::{Error, Result};
use crate::format::checkpoint::Checkpoint;
use crate::plan::{Plan, Recipe};
use crate::sink::Layout;

/// The hidden directory holding the parts' records while a partitioned run is unfinished.
pub const PARTS_DIR: &str = ".tftf-parts";
const RECORD_VERSION: u64 = 1;
pub const LEASE: Duration = Duration::from_secs(300);
pub const HEARTBEAT: Duration = Duration::from_secs(30);
/// Computed bytes cost this many times a copied byte when parts are balanced: a copy is one
/// read and one write (or a clone), a computed tensor also passes through the CPU or GPU.
const COMPUTE_WEIGHT: u64 = 4;

/// `--part K/N`, 1-based.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PartSpec {
    pub k: usize,
    pub n: usize,
}

impl PartSpec {
    pub fn parse(s: &str) -> Result<PartSpec> {
        let bad = || {
            Error::Usage(format!(
                "--part {s}: give K/N with 1 <= K <= N, e.g. --part 2/8 (an index counting from 0, as JOB_COMPLETION_INDEX does, needs +1)"
            ))
        };
        let (k, n) = s.split_once('/').ok_or_else(bad)?;
        let k: usize = k.trim().parse().map_err(|_| bad())?;
        let n: usize = n.trim().parse().map_err(|_| bad())?;
        if k == 0 || n == 0 || k > n || n > 99_999 {
            return Err(bad());
        }
        Ok(PartSpec { k, n })
    }

    pub fn label(&self) -> String {
        format!("part {}/{}", self.k, self.n)
    }

    fn file_stem(&self) -> String {
        format!("part-{:05}-of-{:05}", self.k, self.n)
    }
}

pub fn parts_dir(dir: &Path) -> PathBuf {
    dir.join(PARTS_DIR)
}

fn header_path(dir: &Path, p: PartSpec) -> PathBuf {
    parts_dir(dir).join(format!("{}.json", p.file_stem()))
}

pub fn lock_path(dir: &Path, p: PartSpec) -> PathBuf {
    parts_dir(dir).join(format!("{}.lock", p.file_stem()))
}

fn finalize_lock_path(dir: &Path) -> PathBuf {
    parts_dir(dir).join("finalize.lock")
}

fn shard_record_path(dir: &Path, index: usize) -> PathBuf {
    parts_dir(dir).join(format!("shard-{index:05}.json"))
}

pub fn staged_side_dir(dir: &Path) -> PathBuf {
    parts_dir(dir).join("side")
}

fn hex(d: &[u8]) -> String {
    d.iter().map(|b| format!("{b:02x}")).collect()
}

fn now_unix() -> u64 {
    SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

fn hostname() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: the buffer is valid for its length; gethostname NUL-terminates within it or
    // truncates, and the last byte stays 0.
    let rc = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len() - 1) };
    if rc != 0 {
        return "unknown-host".into();
    }
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    String::from_utf8_lossy(&buf[..end]).into_owned()
}

fn pid_alive(pid: i32) -> bool {
    // SAFETY: signal 0 only checks that the process exists.
    let rc = unsafe { libc::kill(pid, 0) };
    rc == 0 || std::io::Error::last_os_error().raw_os_error() == Some(libc::EPERM)
}

/// Writes `bytes` to `path` atomically and durably: a temporary beside it, fsync, rename,
/// fsync of the directory.
fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let dir = path.parent().expect("record paths have a parent");
    let name = path
        .file_name()
        .expect("record paths have a name")
        .to_string_lossy();
    let tmp = dir.join(temp_name(&name));
    let write = || -> std::io::Result<()> {
        let mut f = OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .open(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
        std::fs::rename(&tmp, path)?;
        File::open(dir)?.sync_all()
    };
    write().map_err(|e| {
        let _ = std::fs::remove_file(&tmp);
        Error::io(path, e)
    })
}

fn read_json(path: &Path) -> Result<Value> {
    let text = crate::sys::read_regular_to_string(path).map_err(|e| Error::io(path, e))?;
    serde_json::from_str(&text).map_err(|e| {
        Error::Other(format!(
            "{}: damaged part record ({e}); remove it and rerun that part",
            path.display()
        ))
    })
}

// ---------------------------------------------------------------------------------------------
// Lease locks

/// Who holds a lock file, as it says.
#[derive(Debug)]
enum Holder {
    /// Alive or not known to be dead: (description).
    Live(String),
    Stale(String),
    /// The file vanished while we looked.
    Gone,
}

fn inspect(path: &Path) -> Holder {
    let Ok(meta) = std::fs::metadata(path) else {
        return Holder::Gone;
    };
    // Something else in the lock's place (a FIFO, a device) is nobody's lock, and is never read:
    // it counts as held, so nothing takes it over or removes it.
    if let Err(e) = crate::sys::refuse_special(path, &meta) {
        return Holder::Live(e.to_string());
    }
    let text = crate::sys::read_regular_to_string(path).unwrap_or_default();
    let mut host = "";
    let mut pid = None;
    let mut words = text.split_whitespace();
    while let Some(w) = words.next() {
        match w {
            "host" => host = words.next().unwrap_or(""),
            "pid" => pid = words.next().and_then(|p| p.parse::<i32>().ok()),
            _ => {}
        }
    }
    let desc = match pid {
        Some(p) => format!("host {host}, pid {p}"),
        None => "an unknown holder".into(),
    };
    let age = SystemTime::now()
        .duration_since(meta.modified().unwrap_or(SystemTime::UNIX_EPOCH))
        .unwrap_or_default();
    let dead_here = host == hostname() && pid.is_some_and(|p| p > 0 && !pid_alive(p));
    if dead_here || age > LEASE {
        Holder::Stale(desc)
    } else {
        Holder::Live(format!("{desc}, refreshed {} s ago", age.as_secs()))
    }
}

/// Whether a live job holds the lock at `path`; its description if so.
pub fn live_holder(path: &Path) -> Option<String> {
    match inspect(path) {
        Holder::Live(d) => Some(d),
        _ => None,
    }
}

/// An exclusive lease on a lock file, refreshed by a heartbeat thread while held.
pub struct LeaseLock {
    path: PathBuf,
    file: File,
    stop: Option<Sender<()>>,
    beat: Option<std::thread::JoinHandle<()>>,
    /// What taking the lock over from a dead holder said.
    pub note: Option<String>,
}

impl LeaseLock {
    /// Takes the lock at `path` for `what` (e.g. "part 2/8"), taking over a stale one.
    pub fn acquire(path: &Path, what: &str) -> Result<LeaseLock> {
        let mut note = None;
        for _ in 0..4 {
            match OpenOptions::new()
                .read(true)
                .write(true)
                .create_new(true)
                .open(path)
            {
                Ok(mut file) => {
                    let text = format!("host {} pid {} started {}\n", hostname(), std::process::id(), now_unix());
                    file.write_all(text.as_bytes())
                        .and_then(|_| file.sync_all())
                        .map_err(|e| {
                            let _ = std::fs::remove_file(path);
                            Error::io(path, e)
                        })?;
                    let beat_file = file.try_clone().map_err(|e| Error::io(path, e))?;
                    let (stop, stopped) = channel::<()>();
                    let beat = std::thread::Builder::new()
                        .name("tftf-lease".into())
                        .spawn(move || {
                            while let Err(RecvTimeoutError::Timeout) =
                                stopped.recv_timeout(HEARTBEAT)
                            {
                                refresh(&beat_file);
                            }
                        })
                        .ok();
                    return Ok(LeaseLock {
                        path: path.to_path_buf(),
                        file,
                        stop: Some(stop),
                        beat,
                        note,
                    });
                }
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => match inspect(path) {
                    Holder::Live(desc) => {
                        return Err(Error::Other(format!(
                            "{what} is already running ({desc}; lock {}). If that job is dead on another machine, remove the lock, or wait {} min for it to go stale",
                            path.display(),
                            LEASE.as_secs() / 60
                        )))
                    }
                    Holder::Stale(desc) => {
                        // Renaming is atomic: of two jobs taking over, one moves the lock and
                        // the other finds it gone and retries the create.
                        let aside = path.with_extension(format!(
                            "stale-{}-{}",
                            hostname(),
                            std::process::id()
                        ));
                        if std::fs::rename(path, &aside).is_ok() {
                            let _ = std::fs::remove_file(&aside);
                            note = Some(format!(
                                "took over the lock of {what} from a job that stopped ({desc})"
                            ));
                        }
                    }
                    Holder::Gone => {}
                },
                Err(e) => return Err(Error::io(path, e)),
            }
        }
        Err(Error::Other(format!(
            "{}: could not take the lock of {what}: other jobs keep taking it",
            path.display()
        )))
    }
}

fn refresh(file: &File) {
    use std::os::unix::io::AsRawFd;
    // SAFETY: a valid fd and a null `times`, meaning "now" (the server's time on NFS).
    unsafe {
        libc::futimens(file.as_raw_fd(), std::ptr::null());
    }
}

impl Drop for LeaseLock {
    fn drop(&mut self) {
        drop(self.stop.take());
        if let Some(b) = self.beat.take() {
            let _ = b.join();
        }
        // Only our own file: a job that judged us stale may have replaced it.
        let ours = self.file.metadata().ok();
        let there = std::fs::metadata(&self.path).ok();
        if let (Some(a), Some(b)) = (ours, there) {
            if a.dev() == b.dev() && a.ino() == b.ino() {
                let _ = std::fs::remove_file(&self.path);
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Fingerprint

/// What a partitioned or resumable run must share with the runs whose output it continues.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Fingerprint {
    pub version: String,
    /// The command and every argument that can change the output, canonical.
    pub arguments: String,
    /// Input files' names, sizes and mtimes, and every tensor's name, dtype, shape and place.
    pub inputs: String,
    /// The output layout: file names, headers, tensor recipes, config and side files.
    pub plan: String,
}

impl Fingerprint {
    pub fn new(
        arguments: &str,
        ckpt: &Checkpoint,
        sides: &[PathBuf],
        plan: &Plan,
        layout: &Layout,
        config_text: Option<&str>,
    ) -> Fingerprint {
        let mut h = Sha256::new();
        let mut file = |p: &Path| {
            let name = p.file_name().unwrap_or_default().to_string_lossy();
            h.update(name.as_bytes());
            h.update([0]);
            if let Ok(m) = std::fs::metadata(p) {
                h.update(m.len().to_le_bytes());
                h.update(m.mtime().to_le_bytes());
                h.update(m.mtime_nsec().to_le_bytes());
            }
        };
        for s in &ckpt.shards {
            file(&s.path);
        }
        for p in ckpt
            .extra_inputs
            .iter()
            .chain(ckpt.index_path.iter())
            .chain(sides)
        {
            file(p);
        }
        for t in &ckpt.tensors {
            h.update(format!("{:?}\n", t).as_bytes());
        }
        let inputs = hex(&h.finalize());

        let mut h = Sha256::new();
        for s in &layout.shards {
            h.update(s.file_name.as_bytes());
            h.update(s.len.to_le_bytes());
            h.update(Sha256::digest(&s.header));
            h.update(format!("{:?}{:?}{:?}", s.tensors, s.offsets, s.clone_from).as_bytes());
        }
        for t in &plan.tensors {
            let recipe = match &t.recipe {
                Recipe::Copy { src } => format!("copy {src}"),
                Recipe::Compute { op, inputs, extra } => {
                    format!("{} {inputs:?} {extra:?}", op.name())
                }
                Recipe::Produced { by } => format!("by {by}"),
            };
            h.update(format!("{}\t{}\t{recipe}\n", t.name, t.source_index).as_bytes());
        }
        h.update(config_text.unwrap_or("").as_bytes());
        for p in sides {
            h.update(
                p.file_name()
                    .unwrap_or_default()
                    .to_string_lossy()
                    .as_bytes(),
            );
            h.update([0]);
        }
        for (name, text) in &plan.generated_files {
            h.update(name.as_bytes());
            h.update([0]);
            h.update(text.as_bytes());
            h.update([0]);
        }
        let plan_hash = hex(&h.finalize());
        Fingerprint {
            version: env!("CARGO_PKG_VERSION").into(),
            arguments: arguments.into(),
            inputs,
            plan: plan_hash,
        }
    }

    pub fn digest(&self) -> String {
        let mut h = Sha256::new();
        for part in [&self.version, &self.arguments, &self.inputs, &self.plan] {
            h.update(part.as_bytes());
            h.update([0]);
        }
        hex(&h.finalize())
    }

    fn to_json(&self) -> Value {
        json!({
            "digest": self.digest(),
            "tftf_version": self.version,
            "arguments": self.arguments,
            "inputs": self.inputs,
            "plan": self.plan,
        })
    }

    fn from_json(v: &Value) -> Option<Fingerprint> {
        Some(Fingerprint {
            version: v["tftf_version"].as_str()?.into(),
            arguments: v["arguments"].as_str()?.into(),
            inputs: v["inputs"].as_str()?.into(),
            plan: v["plan"].as_str()?.into(),
        })
    }

    /// What differs from `other`, in words.
    pub fn differences(&self, other: &Fingerprint) -> String {
        let mut why = Vec::new();
        if self.version != other.version {
            why.push(format!(
                "tftf version {} vs {}",
                other.version, self.version
            ));
        }
        if self.arguments != other.arguments {
            let a: Vec<&str> = other.arguments.lines().collect();
            let b: Vec<&str> = self.arguments.lines().collect();
            let changed: Vec<String> = b
                .iter()
                .filter(|l| !a.contains(l))
                .chain(a.iter().filter(|l| !b.contains(l)))
                .filter_map(|l| l.split('=').next())
                .map(String::from)
                .collect::<std::collections::BTreeSet<_>>()
                .into_iter()
                .collect();
            why.push(format!("the arguments differ ({})", changed.join(", ")));
        }
        if self.inputs != other.inputs {
            why.push("the input files differ (names, sizes, mtimes or tensors)".into());
        }
        if self.plan != other.plan && why.is_empty() {
            why.push("the planned output differs".into());
        }
        why.join("; ")
    }
}

// ---------------------------------------------------------------------------------------------
// Assignment

/// Output shards that must be written by the same job: an op's extra outputs can land in
/// another shard than its main one, and one job computes both. Groups in layout order.
pub fn shard_groups(plan: &Plan, layout: &Layout) -> Vec<Vec<usize>> {
    let n = layout.shards.len();
    let mut shard_of = vec![usize::MAX; plan.tensors.len()];
    for (si, s) in layout.shards.iter().enumerate() {
        for &t in &s.tensors {
            shard_of[t] = si;
        }
    }
    let mut parent: Vec<usize> = (0..n).collect();
    fn root(parent: &mut [usize], mut x: usize) -> usize {
        while parent[x] != x {
            parent[x] = parent[parent[x]];
            x = parent[x];
        }
        x
    }
    for (t, pt) in plan.tensors.iter().enumerate() {
        let linked: Vec<usize> = match &pt.recipe {
            Recipe::Compute { extra, .. } => extra.iter().flatten().copied().collect(),
            Recipe::Produced { by } => vec![*by],
            Recipe::Copy { .. } => Vec::new(),
        };
        for other in linked {
            let (a, b) = (shard_of[t], shard_of[other]);
            if a == usize::MAX || b == usize::MAX {
                continue;
            }
            let (ra, rb) = (root(&mut parent, a), root(&mut parent, b));
            if ra != rb {
                parent[ra.max(rb)] = ra.min(rb);
            }
        }
    }
    let mut groups: Vec<Vec<usize>> = Vec::new();
    let mut group_of_root = std::collections::HashMap::new();
    for s in 0..n {
        let r = root(&mut parent, s);
        let g = *group_of_root.entry(r).or_insert_with(|| {
            groups.push(Vec::new());
            groups.len() - 1
        });
        groups[g].push(s);
    }
    groups
}

/// Work a shard costs: bytes copied, plus computed bytes (inputs and outputs) weighted.
pub fn shard_cost(ckpt: &Checkpoint, plan: &Plan, layout: &Layout, si: usize) -> u64 {
    let s = &layout.shards[si];
    if s.clone_from.is_some() {
        return s.len;
    }
    s.tensors
        .iter()
        .map(|&t| {
            let pt = &plan.tensors[t];
            match &pt.recipe {
                Recipe::Copy { .. } => pt.nbytes,
                Recipe::Compute { inputs, .. } => {
                    let read: u64 = inputs.iter().map(|&i| ckpt.tensors[i].info.nbytes()).sum();
                    COMPUTE_WEIGHT * (read + pt.nbytes)
                }
                Recipe::Produced { .. } => COMPUTE_WEIGHT * pt.nbytes,
            }
        })
        .sum::<u64>()
        .max(1)
}

/// The part (0-based) of each shard: groups, costliest first, each to the least loaded part
/// (ties to the lowest part, then the earliest group), the same in every job.
pub fn assign(ckpt: &Checkpoint, plan: &Plan, layout: &Layout, n: usize) -> Vec<usize> {
    let groups = shard_groups(plan, layout);
    let mut costed: Vec<(u64, usize)> = groups
        .iter()
        .enumerate()
        .map(|(g, shards)| {
            let c = shards
                .iter()
                .map(|&s| shard_cost(ckpt, plan, layout, s))
                .sum();
            (c, g)
        })
        .collect();
    costed.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
    let mut load = vec![0u64; n];
    let mut part_of = vec![0; layout.shards.len()];
    for (cost, g) in costed {
        let p = (0..n).min_by_key(|&p| (load[p], p)).expect("n >= 1");
        load[p] += cost;
        for &s in &groups[g] {
            part_of[s] = p;
        }
    }
    part_of
}

// ---------------------------------------------------------------------------------------------
// Records

/// A part's header record.
#[derive(Clone, Debug)]
pub struct PartRecord {
    pub part: PartSpec,
    pub fingerprint: Fingerprint,
    pub checksums: bool,
    pub shards_total: usize,
    /// Whether the output is a safetensors checkpoint directory: finalize then writes its index
    /// (of two shards or more) and removes the model files of an earlier output. GGUF files sit
    /// among other files and carry their own split keys: neither.
    pub safetensors: bool,
    /// (layout index, file name) of the shards assigned to this part.
    pub assigned: Vec<(usize, String)>,
    /// Side files (part 1 stages them); the same list in every part.
    /// Their names byte for byte.
    pub side_files: Vec<std::ffi::OsString>,
    pub complete: bool,
}

impl PartRecord {
    pub fn write(&self, dir: &Path) -> Result<()> {
        let v = json!({
            "tftf_part": RECORD_VERSION,
            "part": self.part.k,
            "parts": self.part.n,
            "fingerprint": self.fingerprint.to_json(),
            "checksums": self.checksums,
            "shards_total": self.shards_total,
            "safetensors": self.safetensors,
            "assigned": self.assigned.iter().map(|(i, n)| json!({"index": i, "name": n})).collect::<Vec<_>>(),
            "side_files": self.side_files.iter().map(|n| name_json(n)).collect::<Vec<_>>(),
            "complete": self.complete,
        });
        let mut text = serde_json::to_string_pretty(&v).expect("JSON value");
        text.push('\n');
        write_atomic(&header_path(dir, self.part), text.as_bytes())
    }

    fn read(path: &Path) -> Result<PartRecord> {
        let v = read_json(path)?;
        let bad = |what: &str| {
            Error::Other(format!(
                "{}: damaged part record ({what}); remove it and rerun that part",
                path.display()
            ))
        };
        if v["tftf_part"].as_u64() != Some(RECORD_VERSION) {
            return Err(bad("unknown `tftf_part` version"));
        }
        let k = v["part"].as_u64().ok_or_else(|| bad("no `part`"))? as usize;
        let n = v["parts"].as_u64().ok_or_else(|| bad("no `parts`"))? as usize;
        if k == 0 || k > n {
            return Err(bad("`part` out of range"));
        }
        let fingerprint =
            Fingerprint::from_json(&v["fingerprint"]).ok_or_else(|| bad("no `fingerprint`"))?;
        let assigned = v["assigned"]
            .as_array()
            .ok_or_else(|| bad("no `assigned`"))?
            .iter()
            .map(|a| {
                let i = a["index"].as_u64().ok_or_else(|| bad("shard index"))? as usize;
                let name = a["name"].as_str().ok_or_else(|| bad("shard name"))?;
                if !plain_name(name) {
                    return Err(bad("a shard name with a path"));
                }
                Ok((i, name.to_string()))
            })
            .collect::<Result<Vec<_>>>()?;
        let side_files = v["side_files"]
            .as_array()
            .ok_or_else(|| bad("no `side_files`"))?
            .iter()
            .map(|n| name_from_json(n).ok_or_else(|| bad("a side file name with a path")))
            .collect::<Result<Vec<_>>>()?;
        Ok(PartRecord {
            part: PartSpec { k, n },
            fingerprint,
            checksums: v["checksums"]
                .as_bool()
                .ok_or_else(|| bad("no `checksums`"))?,
            shards_total: v["shards_total"]
                .as_u64()
                .ok_or_else(|| bad("no `shards_total`"))? as usize,
            // Records written before GGUF parts are safetensors ones.
            safetensors: v["safetensors"].as_bool().unwrap_or(true),
            assigned,
            side_files,
            complete: v["complete"].as_bool().unwrap_or(false),
        })
    }
}

fn plain_name(n: &str) -> bool {
    !n.is_empty() && !n.contains('/') && n != "." && n != ".."
}

/// A committed shard's record: its sums (hashes `None` under `--checksums=off`).
#[derive(Clone, Debug)]
pub struct ShardRecord {
    pub index: usize,
    pub digest: String,
    pub size: u64,
    pub sha256: Option<String>,
    pub name: String,
    pub tensors: Vec<(TensorRange, Option<String>)>,
}

impl ShardRecord {
    pub fn write(&self, dir: &Path) -> Result<()> {
        let v = json!({
            "tftf_part_shard": RECORD_VERSION,
            "index": self.index,
            "fingerprint": self.digest,
            "name": self.name,
            "size": self.size,
            "sha256": self.sha256,
            "tensors": tensors_json(&self.tensors),
        });
        let text = serde_json::to_string(&v).expect("JSON value");
        write_atomic(&shard_record_path(dir, self.index), text.as_bytes())
    }

    /// Removes shard `index`'s record, if any: before its file is replaced.
    pub fn remove(dir: &Path, index: usize) -> Result<()> {
        let path = shard_record_path(dir, index);
        match std::fs::remove_file(&path) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(Error::io(&path, e)),
            _ => Ok(()),
        }
    }

    pub fn read(dir: &Path, index: usize) -> Result<Option<ShardRecord>> {
        let path = shard_record_path(dir, index);
        if !path.exists() {
            return Ok(None);
        }
        let v = read_json(&path)?;
        let bad = |what: &str| {
            Error::Other(format!(
                "{}: damaged shard record ({what}); remove it and rerun the part that wrote it",
                path.display()
            ))
        };
        if v["tftf_part_shard"].as_u64() != Some(RECORD_VERSION)
            || v["index"].as_u64() != Some(index as u64)
        {
            return Err(bad("wrong version or index"));
        }
        let opt_str = |x: &Value| -> Result<Option<String>> {
            match x {
                Value::Null => Ok(None),
                Value::String(s) if s.len() == 64 => Ok(Some(s.clone())),
                _ => Err(bad("a hash is not a SHA-256")),
            }
        };
        let tensors = v["tensors"]
            .as_array()
            .ok_or_else(|| bad("no `tensors`"))?
            .iter()
            .map(|t| {
                Ok((
                    TensorRange {
                        name: t["name"].as_str().ok_or_else(|| bad("tensor name"))?.into(),
                        offset: t["offset"].as_u64().ok_or_else(|| bad("tensor offset"))?,
                        len: t["len"].as_u64().ok_or_else(|| bad("tensor len"))?,
                    },
                    opt_str(&t["sha256"])?,
                ))
            })
            .collect::<Result<Vec<_>>>()?;
        let name = v["name"].as_str().ok_or_else(|| bad("no `name`"))?;
        if !plain_name(name) {
            return Err(bad("a name with a path"));
        }
        Ok(Some(ShardRecord {
            index,
            digest: v["fingerprint"]
                .as_str()
                .ok_or_else(|| bad("no `fingerprint`"))?
                .into(),
            size: v["size"].as_u64().ok_or_else(|| bad("no `size`"))?,
            sha256: opt_str(&v["sha256"])?,
            name: name.into(),
            tensors,
        }))
    }

    pub fn file_sum(&self) -> Option<FileSum> {
        Some(FileSum {
            name: self.name.clone().into(),
            size: self.size,
            sha256: self.sha256.clone()?,
            tensors: self
                .tensors
                .iter()
                .map(|(t, h)| Some((t.clone(), h.clone()?)))
                .collect::<Option<Vec<_>>>()?,
        })
    }
}

/// Every part header record in `dir`'s parts directory, by file name.
pub fn read_part_records(dir: &Path) -> Result<Vec<(PathBuf, PartRecord)>> {
    part_files(dir, ".json")
        .into_iter()
        .map(|p| PartRecord::read(&p).map(|r| (p, r)))
        .collect()
}

/// Lock files of parts (`part-*.lock`) in the parts directory.
pub fn part_locks(dir: &Path) -> Vec<PathBuf> {
    part_files(dir, ".lock")
}

/// The files `part-*{suffix}` in the parts directory, sorted (none without the directory).
fn part_files(dir: &Path, suffix: &str) -> Vec<PathBuf> {
    let Ok(rd) = std::fs::read_dir(parts_dir(dir)) else {
        return Vec::new();
    };
    let mut v: Vec<PathBuf> = rd
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            let n = p.file_name().unwrap_or_default().to_string_lossy();
            n.starts_with("part-") && n.ends_with(suffix)
        })
        .collect();
    v.sort();
    v
}

/// Refuses while a finalize is running in `dir`.
pub fn refuse_while_finalizing(dir: &Path) -> Result<()> {
    match live_holder(&finalize_lock_path(dir)) {
        Some(h) => Err(Error::Other(format!(
            "{}: finalize is running ({h}); wait for it",
            dir.display()
        ))),
        None => Ok(()),
    }
}

pub fn finalize_lock(dir: &Path) -> Result<LeaseLock> {
    LeaseLock::acquire(&finalize_lock_path(dir), "finalize")
}

/// What finalize did.
#[derive(Debug, Default)]
pub struct Finalized {
    pub parts: usize,
    pub shards: usize,
    /// Files finalize wrote (index, side files, checksums).
    pub written: Vec<String>,
    /// Model files of an earlier output removed under `--force`.
    pub deleted: Vec<String>,
    pub bytes: u64,
    /// Set when this finalize only finished the commit a killed finalize had journalled: what
    /// it did.
    pub finished_interrupted: Option<String>,
}

/// Why finalize cannot run yet (another part unfinished or running), as opposed to an error.
#[derive(Debug)]
pub enum NotReady {
    Waiting(String),
    /// Another job is finalizing or has finalized.
    Elsewhere(String),
}

/// Finalize, or say why it must wait: for `--finalize` on the part that may be the last.
pub fn try_finalize(dir: &Path, force: bool) -> Result<std::result::Result<Finalized, NotReady>> {
    if !parts_dir(dir).is_dir() {
        return Ok(Err(NotReady::Elsewhere(
            "another part finalized the output".into(),
        )));
    }
    let lock = match finalize_lock(dir) {
        Ok(l) => l,
        Err(_) => {
            return Ok(Err(NotReady::Elsewhere(
                "another part is finalizing".into(),
            )))
        }
    };
    match done_parts(dir)? {
        Ok(records) => finalize_locked(dir, force, lock, records).map(Ok),
        Err(why) => Ok(Err(NotReady::Waiting(why))),
    }
}

/// `tftf finalize DIR`.
pub fn finalize(dir: &Path, force: bool) -> Result<Finalized> {
    if let Some(note) = finish_interrupted_finalize(dir)? {
        return Ok(Finalized {
            finished_interrupted: Some(note),
            ..Finalized::default()
        });
    }
    if !parts_dir(dir).is_dir() {
        return Err(Error::Other(format!(
            "{}: nothing to finalize: no {PARTS_DIR} directory (run the parts with --part K/N first; a finalized output has none)",
            dir.display()
        )));
    }
    let lock = finalize_lock(dir)?;
    match done_parts(dir)? {
        Ok(records) => finalize_locked(dir, force, lock, records),
        Err(why) => Err(Error::Other(format!(
            "{}: cannot finalize: {why}",
            dir.display()
        ))),
    }
}

/// Rolls forward the commit a killed finalize journalled in `dir` (its files written, the
/// parts directory still to be removed), under the directory's lock and finalize's lease.
/// Returns what was done, or `None` when no finalize was interrupted there.
pub fn finish_interrupted_finalize(dir: &Path) -> Result<Option<String>> {
    if interrupted_commit_retires(dir).as_deref() != Some(PARTS_DIR) {
        return Ok(None);
    }
    let _output = OutputLock::acquire(dir)?;
    // Until the journal retires it, the parts directory holds finalize's lease.
    let _lease = match parts_dir(dir).is_dir() {
        true => Some(finalize_lock(dir)?),
        false => None,
    };
    Ok(finish_interrupted_commit(dir)?
        .map(|note| format!("a finalize was killed while committing; {note}")))
}

/// `tftf recover` on a partitioned run that is not finalized: with no part and no finalize
/// running, removes the temporaries killed jobs left (finalize's and the parts'), then says
/// what the run still needs. The parts' records and committed shards stay for `--resume` and
/// `tftf finalize`.
pub fn recover_unfinished(dir: &Path) -> Result<Vec<String>> {
    let lease = finalize_lock(dir)?;
    if let Some(why) = running_part(dir) {
        return Err(Error::Other(format!(
            "{}: {why}; wait for it",
            dir.display()
        )));
    }
    let mut notes: Vec<String> = lease.note.iter().cloned().collect();
    let orphans = remove_temporaries(dir)?;
    if !orphans.is_empty() {
        notes.push(format!(
            "removed {} temporary file(s) left by killed jobs of the partitioned run",
            orphans.len()
        ));
    }
    let state = match done_parts(dir)? {
        Ok(_) => "every part is done; run".to_string(),
        Err(why) => format!("{why}; when every part is done, run"),
    };
    notes.push(format!(
        "the partitioned run is not finalized: {state} `tftf finalize {}`",
        dir.display()
    ));
    Ok(notes)
}

/// Part records with the files they were read from.
type Records = Vec<(PathBuf, PartRecord)>;

/// Every part's record when all parts are done; otherwise the first reason they are not: one
/// running, missing or unfinished.
fn done_parts(dir: &Path) -> Result<std::result::Result<Records, String>> {
    if let Some(why) = running_part(dir) {
        return Ok(Err(why));
    }
    let records = read_part_records(dir)?;
    let Some((first_path, first)) = records.first() else {
        return Ok(Err(format!(
            "no part has started (no records in {PARTS_DIR})"
        )));
    };
    for (p, r) in &records {
        if r.part.n != first.part.n {
            return Err(Error::Other(format!(
                "{} belongs to a run in {} parts, {} to one in {}: remove the older run's records",
                p.display(),
                r.part.n,
                first_path.display(),
                first.part.n
            )));
        }
        if r.fingerprint != first.fingerprint {
            return Err(Error::Other(format!(
                "{} and {}: the parts were run with different arguments or inputs ({}); rerun them with one command line",
                first_path.display(),
                p.display(),
                r.fingerprint.differences(&first.fingerprint)
            )));
        }
    }
    let n = first.part.n;
    for k in 1..=n {
        let label = PartSpec { k, n }.label();
        match records.iter().find(|(_, r)| r.part.k == k) {
            None => return Ok(Err(format!("{label} has not run"))),
            Some((_, r)) if !r.complete => {
                return Ok(Err(format!(
                    "{label} has not finished (killed? rerun it with --resume)"
                )))
            }
            Some(_) => {}
        }
    }
    Ok(Ok(records))
}

/// "part K/N is still running (holder)" for the first part whose lock is live.
fn running_part(dir: &Path) -> Option<String> {
    part_locks(dir).into_iter().find_map(|l| {
        let h = live_holder(&l)?;
        let stem = l.file_stem().unwrap_or_default().to_string_lossy();
        Some(format!("{} is still running ({h})", part_label(&stem)))
    })
}

fn part_label(stem: &str) -> String {
    let parse = |s: &str| s.parse::<usize>().ok();
    stem.strip_prefix("part-")
        .and_then(|r| r.split_once("-of-"))
        .and_then(|(k, n)| {
            Some(
                PartSpec {
                    k: parse(k)?,
                    n: parse(n)?,
                }
                .label(),
            )
        })
        .unwrap_or_else(|| stem.to_string())
}

fn finalize_locked(
    dir: &Path,
    force: bool,
    lock: LeaseLock,
    records: Records,
) -> Result<Finalized> {
    let first = records[0].1.clone();
    let names = assigned_shard_names(&records)?;
    let shard_records = written_shard_records(dir, &records, &names)?;
    let side_dir = staged_side_dir(dir);
    check_side_files_staged(&side_dir, &first)?;
    let foreign = if first.safetensors {
        foreign_model_files(dir, &names, &first, force)?
    } else {
        Vec::new()
    };
    let mut out = OutputSet::new(dir.to_path_buf(), Vec::new(), OutputLock::acquire(dir)?);
    finish_interrupted_commit(dir)?;
    remove_temporaries(dir)?;
    let written = add_finished_files(&mut out, dir, &first, &shard_records, &side_dir)?;
    // The records go last, in the journalled commit: a kill before the journal leaves them
    // for finalize to run again; one after it, a journal that recover or finalize finishes.
    out.retire_after_commit(PARTS_DIR);
    out.commit(&foreign)?;
    drop(lock);
    Ok(Finalized {
        parts: first.part.n,
        shards: first.shards_total,
        written,
        deleted: foreign,
        bytes: shard_records.iter().map(|r| r.size).sum(),
        finished_interrupted: None,
    })
}

/// Each output shard's name, from the parts' assignments, once every part's record agrees with
/// the first on the shards, checksums and side files and no shard is assigned twice. A shard
/// no part was assigned stays `None`.
fn assigned_shard_names(records: &Records) -> Result<Vec<Option<String>>> {
    let first = &records[0].1;
    let mut names: Vec<Option<String>> = vec![None; first.shards_total];
    for (p, r) in records {
        if r.shards_total != first.shards_total
            || r.checksums != first.checksums
            || r.side_files != first.side_files
        {
            return Err(Error::Other(format!(
                "{}: disagrees with the other parts' records on the output's shards, checksums or side files; rerun the parts with one command line",
                p.display()
            )));
        }
        for (i, name) in &r.assigned {
            match names.get_mut(*i) {
                Some(slot @ None) => *slot = Some(name.clone()),
                _ => {
                    return Err(Error::Other(format!(
                        "{}: shard {i} ({name}) is out of range or assigned twice",
                        p.display()
                    )))
                }
            }
        }
    }
    Ok(names)
}

/// The record of every shard, each checked to be this run's and to match the file's size on
/// disk; an error names the part to rerun.
fn written_shard_records(
    dir: &Path,
    records: &Records,
    names: &[Option<String>],
) -> Result<Vec<ShardRecord>> {
    let digest = records[0].1.fingerprint.digest();
    let owner = |i: usize| {
        records
            .iter()
            .find(|(_, r)| r.assigned.iter().any(|(j, _)| *j == i))
            .map(|(_, r)| r.part.label())
            .unwrap_or_default()
    };
    let mut shard_records = Vec::with_capacity(names.len());
    for (i, name) in names.iter().enumerate() {
        let Some(name) = name else {
            return Err(Error::Other(format!(
                "{}: no part was assigned shard {i}; the records are incomplete",
                dir.display()
            )));
        };
        let rerun = || format!("rerun {} with --resume", owner(i));
        let rec = match ShardRecord::read(dir, i)? {
            Some(r) if r.digest == digest && &r.name == name => r,
            _ => {
                return Err(Error::Other(format!(
                    "{}: {name} has no record of being written by this run; {}",
                    dir.display(),
                    rerun()
                )))
            }
        };
        let path = dir.join(name);
        let size = std::fs::metadata(&path).map(|m| m.len()).ok();
        if size != Some(rec.size) {
            return Err(Error::Other(format!(
                "{}: {}, but {} recorded {} bytes; {}",
                path.display(),
                size.map_or("missing".to_string(), |s| format!("{s} bytes")),
                owner(i),
                rec.size,
                rerun()
            )));
        }
        shard_records.push(rec);
    }
    Ok(shard_records)
}

/// Every side file part 1 was to stage is there.
fn check_side_files_staged(side_dir: &Path, first: &PartRecord) -> Result<()> {
    for s in &first.side_files {
        if !side_dir.join(s).is_file() {
            return Err(Error::Other(format!(
                "{}: side file {} was not staged by part 1/{}; rerun part 1 with --resume",
                side_dir.display(),
                crate::escape::path(Path::new(s)),
                first.part.n
            )));
        }
    }
    Ok(())
}

/// Model files in `dir` that are not this run's (sorted), which the commit deletes; an error
/// unless `force`. Our own files from an interrupted finalize are simply replaced.
fn foreign_model_files(
    dir: &Path,
    names: &[Option<String>],
    first: &PartRecord,
    force: bool,
) -> Result<Vec<String>> {
    let ours: std::collections::HashSet<String> = names
        .iter()
        .flatten()
        .cloned()
        .chain(
            first
                .side_files
                .iter()
                .filter_map(|n| n.to_str())
                .map(String::from),
        )
        .chain([
            INDEX_NAME.to_string(),
            SUMS_NAME.to_string(),
            MANIFEST_NAME.to_string(),
        ])
        .collect();
    let mut foreign = Vec::new();
    for e in std::fs::read_dir(dir)
        .map_err(|e| Error::io(dir, e))?
        .flatten()
    {
        let name = e.file_name().to_string_lossy().into_owned();
        if name.starts_with('.') || ours.contains(&name) || e.path().is_dir() {
            continue;
        }
        if is_model_file_name(&name) {
            foreign.push(name);
        }
    }
    foreign.sort();
    if !foreign.is_empty() && !force {
        return Err(Error::Other(format!(
            "{}: holds model files that are not this run's: {}; pass --force to remove them",
            dir.display(),
            foreign.join(", ")
        )));
    }
    Ok(foreign)
}

/// Adds what finalize writes beside the shards to `out`: the index (of two or more shards),
/// the staged side files and, when the run keeps checksums, the sums and manifest of every
/// file. Returns their names.
fn add_finished_files(
    out: &mut OutputSet,
    dir: &Path,
    first: &PartRecord,
    shard_records: &[ShardRecord],
    side_dir: &Path,
) -> Result<Vec<String>> {
    let mut sums = Vec::new();
    let mut written = Vec::new();
    if first.checksums {
        for r in shard_records {
            sums.push(r.file_sum().ok_or_else(|| {
                Error::Other(format!(
                    "{}: the record of {} has no checksums, the others do; rerun its part",
                    dir.display(),
                    r.name
                ))
            })?);
        }
    }
    if first.safetensors && first.shards_total >= 2 {
        let index = index_of(shard_records);
        if first.checksums {
            sums.push(hash_bytes(INDEX_NAME, index.as_bytes()));
        }
        out.add_bytes(INDEX_NAME, index.as_bytes())?;
        written.push(INDEX_NAME.to_string());
    }
    for s in &first.side_files {
        let staged = side_dir.join(s);
        if first.checksums {
            sums.push(hash_file(&staged, s, Vec::new())?);
        }
        out.add_copy(s, &staged)?;
        written.push(crate::escape::path(Path::new(s)).to_string());
    }
    if first.checksums {
        out.add_bytes(SUMS_NAME, &sums_text(&sums))?;
        let mut manifest =
            serde_json::to_string_pretty(&manifest_json(&sums)).expect("JSON object");
        manifest.push('\n');
        out.add_bytes(MANIFEST_NAME, manifest.as_bytes())?;
        written.extend([SUMS_NAME.to_string(), MANIFEST_NAME.to_string()]);
    }
    Ok(written)
}

/// The index of a multi-shard output, from the shards' records.
fn index_of(shard_records: &[ShardRecord]) -> String {
    let pairs: Vec<(&str, &str)> = shard_records
        .iter()
        .flat_map(|r| {
            r.tensors
                .iter()
                .map(move |(t, _)| (t.name.as_str(), r.name.as_str()))
        })
        .collect();
    let total = shard_records
        .iter()
        .flat_map(|r| r.tensors.iter().map(|(t, _)| t.len))
        .sum();
    crate::sink::index_text(pairs, total)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn part_spec_parsing() {
        assert_eq!(PartSpec::parse("2/8").unwrap(), PartSpec { k: 2, n: 8 });
        assert_eq!(PartSpec::parse(" 1 / 1 ").unwrap(), PartSpec { k: 1, n: 1 });
        for bad in ["0/3", "4/3", "3", "a/b", "1/0", "-1/2", ""] {
            let e = PartSpec::parse(bad).unwrap_err().to_string();
            assert!(e.contains("give K/N"), "{bad}: {e}");
        }
    }

    #[test]
    fn lease_lock_is_exclusive_and_taken_over_when_its_holder_is_gone() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("x.lock");
        let held = LeaseLock::acquire(&p, "part 1/2").unwrap();
        let e = LeaseLock::acquire(&p, "part 1/2")
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("part 1/2 is already running"), "{e}");
        drop(held);
        assert!(!p.exists());
        // A holder on this host whose pid is gone.
        std::fs::write(
            &p,
            format!("host {} pid {} started 0\n", hostname(), i32::MAX - 7),
        )
        .unwrap();
        let taken = LeaseLock::acquire(&p, "part 1/2").unwrap();
        assert!(taken.note.as_deref().unwrap().contains("took over"));
        drop(taken);
        // A holder elsewhere, refreshed just now, is live.
        std::fs::write(&p, "host another-node pid 1 started 0\n").unwrap();
        assert!(LeaseLock::acquire(&p, "part 1/2").is_err());
        assert!(live_holder(&p).unwrap().contains("another-node"));
        // The same holder, not refreshed for longer than the lease, is stale.
        let old = SystemTime::now() - LEASE - Duration::from_secs(5);
        File::options()
            .write(true)
            .open(&p)
            .unwrap()
            .set_modified(old)
            .unwrap();
        assert!(live_holder(&p).is_none());
        assert!(LeaseLock::acquire(&p, "part 1/2").is_ok());
    }
}
