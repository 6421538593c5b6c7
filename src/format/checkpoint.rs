//! Opening a checkpoint: one `.safetensors` file, a directory with an index, a directory of
//! shards without one, or an index file; or a PyTorch checkpoint (a torch.save `.bin`/`.pt`/
//! `.pth` file, a folder of `.bin` shards, a Distributed Checkpoint), described through
//! [`crate::format::torch`]. Only headers (and pickles) are read; every structural check that
//! can fail later is done here, so a bad input fails before any output exists.
//!
//! Whatever the format, a tensor is a name, dtype, shape and a [`Placement`] in the
//! checkpoint's files ([`Checkpoint::shards`]). Only [`Placement::Contiguous`] bytes can be
//! moved by the kernel; other placements are gathered through
//! [`crate::format::source::OpenSource`] in bounded chunks.

use std::fs::File;
use std::path::{Path, PathBuf};

use serde_json::{Map, Value};

use super::header::{read_header, Header, TensorInfo};
use super::source::{OpenSource, Placement, Region, SourceDesc};
use super::torch;
use crate::error::{Error, Result};

/// The journal of an output commit in progress (`.tftf-commit.json`, written and replayed by
/// the output module). It lives here, below the output module, because opening a directory
/// that holds one must refuse it: its files are a mix of two runs until the commit finishes.
pub const JOURNAL_NAME: &str = ".tftf-commit.json";

/// What kind of input a checkpoint was read from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SourceFormat {
    Safetensors,
    /// torch.save zip archives (`.bin`, `.pt`, `.pth`; transformers' `pytorch_model*.bin`).
    TorchZip,
    /// torch.save's pre-1.6 non-zip stream.
    TorchLegacy,
    /// torch.save files of both kinds.
    TorchMixed,
    /// `torch.distributed.checkpoint`: `.metadata` plus `*.distcp` files.
    Dcp,
}

impl SourceFormat {
    pub fn name(self) -> &'static str {
        match self {
            SourceFormat::Safetensors => "safetensors",
            SourceFormat::TorchZip => "torch.save zip",
            SourceFormat::TorchLegacy => "torch.save legacy (pre-1.6)",
            SourceFormat::TorchMixed => "torch.save (zip and legacy)",
            SourceFormat::Dcp => "PyTorch DCP",
        }
    }

    pub fn is_safetensors(self) -> bool {
        self == SourceFormat::Safetensors
    }
}

/// One input file of the checkpoint (a safetensors shard, a torch.save file, a `.distcp`).
#[derive(Debug)]
pub struct Shard {
    pub path: PathBuf,
    pub file: File,
    /// The parsed header; its tensors move to [`Checkpoint::tensors`] once the checkpoint is
    /// open (one copy of each name and shape, not two). Empty (no metadata, `data_start` 0)
    /// for files of other formats.
    pub header: Header,
    /// How many tensors the header held.
    pub tensor_count: usize,
    /// Where this shard's tensors sit in [`Checkpoint::tensors`], in file order, when all of
    /// them are there (none left out by the index).
    pub span: Option<std::ops::Range<usize>>,
}

/// A tensor of the checkpoint: its name, dtype and shape (`info`; `begin`/`end` are only
/// meaningful within a safetensors header), and where its elements lie in the checkpoint's
/// files (`placement`, file indices into [`Checkpoint::shards`]).
#[derive(Clone, Debug)]
pub struct TensorRef {
    pub info: TensorInfo,
    pub placement: Placement,
}

impl TensorRef {
    pub fn name(&self) -> &str {
        &self.info.name
    }

    /// The file holding the tensor's first byte (for messages and progress).
    pub fn shard(&self) -> usize {
        super::source::SourceTensor::first_of(&self.placement).0
    }

    /// (file, absolute offset) when the tensor is one row-major byte range: the only kind
    /// that may be cloned or moved with `copy_file_range` as it stands.
    pub fn contiguous(&self) -> Option<(usize, u64)> {
        match self.placement {
            Placement::Contiguous { file, offset, .. } => Some((file, offset)),
            _ => None,
        }
    }

    /// The tensor as byte ranges to concatenate, when it is one: a contiguous tensor, or
    /// chunks split along dim 0 only (FSDP rank slices) each stored contiguously, in order.
    pub fn pieces(&self) -> Option<Vec<(usize, u64, u64)>> {
        match &self.placement {
            Placement::Contiguous { file, offset, len } => Some(vec![(*file, *offset, *len)]),
            Placement::Strided { .. } => None,
            Placement::Regions(regions) => {
                let shape = &self.info.shape;
                let mut regions: Vec<&Region> = regions.iter().collect();
                regions.sort_by_key(|r| r.offsets.first().copied().unwrap_or(0));
                let mut row = 0u64;
                let mut out = Vec::with_capacity(regions.len());
                for r in regions {
                    if shape.is_empty()
                        || r.offsets.len() != shape.len()
                        || r.sizes.len() != shape.len()
                        || r.offsets[0] != row
                        || r.offsets[1..].iter().any(|&o| o != 0)
                        || r.sizes[1..] != shape[1..]
                    {
                        return None;
                    }
                    row += r.sizes[0];
                    match r.placement {
                        Placement::Contiguous { file, offset, len } => {
                            if len > 0 {
                                out.push((file, offset, len))
                            }
                        }
                        _ => return None,
                    }
                }
                (row == shape[0]).then_some(out)
            }
        }
    }
}

#[derive(Debug)]
pub struct Checkpoint {
    /// The path the user gave.
    pub input: PathBuf,
    /// The format the model was read from.
    pub format: SourceFormat,
    /// The directory the model lives in (the input itself, or its parent).
    pub dir: PathBuf,
    pub index_path: Option<PathBuf>,
    pub shards: Vec<Shard>,
    /// Every tensor, in shard order then offset order; the first `base_count` are the model's,
    /// the rest belong to attached inputs (adapters).
    pub tensors: Vec<TensorRef>,
    pub base_count: usize,
    /// Indices of the model's tensors sorted by name, for [`Checkpoint::get`]: 4 bytes a tensor
    /// where a map of owned names took ~80.
    by_name: Vec<u32>,
    /// Files read besides the shards and the index (an adapter's config), which no output
    /// may replace.
    pub extra_inputs: Vec<PathBuf>,
    /// Problems that do not stop a conversion (tensors a shard holds but the index omits).
    pub warnings: Vec<String>,
    /// Facts worth a line that are not problems (files that look like shards but are not).
    pub notes: Vec<String>,
}

impl Checkpoint {
    /// The file name of each shard, in shard order (lossy where not UTF-8).
    pub fn shard_names(&self) -> Vec<String> {
        self.shards
            .iter()
            .map(|s| {
                s.path
                    .file_name()
                    .unwrap_or_default()
                    .to_string_lossy()
                    .into_owned()
            })
            .collect()
    }

    pub fn open(input: &Path) -> Result<Checkpoint> {
        Self::open_all_errors(input).map_err(|mut errs| errs.swap_remove(0))
    }

    /// Like [`Checkpoint::open`] but reports every broken shard, not only the first.
    pub fn open_all_errors(input: &Path) -> Result<Checkpoint, Vec<Error>> {
        let layout = Layout::discover(input).map_err(|e| vec![e])?;
        if let Some(kind) = layout.torch {
            return Self::open_torch(input, layout, kind).map_err(|e| vec![e]);
        }
        let mut errors = Vec::new();
        let mut shards = Vec::new();
        for path in &layout.shard_paths {
            match open_shard(path) {
                Ok(s) => shards.push(s),
                Err(e) => errors.push(e),
            }
        }
        if !errors.is_empty() {
            return Err(errors);
        }
        let mut warnings = Vec::new();
        let total: usize = shards.iter().map(|s| s.header.tensors.len()).sum();
        if u32::try_from(total).is_err() {
            return Err(vec![Error::NoModel {
                path: input.into(),
                msg: format!(
                    "{total} tensors are more than this tool supports ({})",
                    u32::MAX
                ),
            }]);
        }
        let mut tensors = Vec::with_capacity(total);
        for (si, shard) in shards.iter_mut().enumerate() {
            tensors.extend(
                std::mem::take(&mut shard.header.tensors)
                    .into_iter()
                    .map(|info| TensorRef {
                        placement: Placement::Contiguous {
                            file: si,
                            offset: shard.header.data_start + info.begin,
                            len: info.nbytes(),
                        },
                        info,
                    }),
            );
        }
        let mut by_name = sorted_by_name(&tensors);
        // Equal names sit next to each other, in the order they were read.
        for pair in by_name.windows(2) {
            let (first, second) = (pair[0] as usize, pair[1] as usize);
            if tensors[first].info.name == tensors[second].info.name {
                errors.push(Error::DuplicateTensor {
                    tensor: tensors[second].info.name.clone(),
                    first: shards[tensors[first].shard()].path.clone(),
                    second: shards[tensors[second].shard()].path.clone(),
                });
            }
        }
        if let Some(map) = &layout.weight_map {
            for (tensor, shard_name) in map {
                let shard_name = shard_name
                    .as_str()
                    .expect("checked when the index was read");
                let found = find(&tensors, &by_name, tensor)
                    .is_some_and(|i| shards[tensors[i].shard()].path.ends_with(shard_name));
                if !found {
                    errors.push(Error::TensorNotInShard {
                        shard: layout.dir.join(shard_name),
                        tensor: tensor.clone(),
                    });
                }
            }
            let before = tensors.len();
            tensors.retain(|t| map.contains_key(&t.info.name));
            if tensors.len() != before {
                warnings.push(format!(
                    "{} tensor(s) present in shards but not listed in the index are ignored, as loaders ignore them",
                    before - tensors.len()
                ));
                by_name = sorted_by_name(&tensors);
            }
        }
        if !errors.is_empty() {
            return Err(errors);
        }
        let mut counts = vec![0usize; shards.len()];
        for (i, t) in tensors.iter().enumerate() {
            let shard = &mut shards[t.shard()];
            shard.span = Some(shard.span.as_ref().map_or(i..i + 1, |r| r.start..i + 1));
            counts[t.shard()] += 1;
        }
        for (shard, n) in shards.iter_mut().zip(counts) {
            if n != shard.tensor_count {
                shard.span = None;
            }
        }
        let mut ckpt = Self::model(
            input,
            SourceFormat::Safetensors,
            layout,
            shards,
            tensors,
            by_name,
        );
        ckpt.warnings = warnings;
        Ok(ckpt)
    }

    /// The checkpoint of a model alone (no attached inputs): `tensors` in `shards`, found
    /// through `by_name`; no extra inputs or warnings yet, and the layout's notes.
    fn model(
        input: &Path,
        format: SourceFormat,
        layout: Layout,
        shards: Vec<Shard>,
        tensors: Vec<TensorRef>,
        by_name: Vec<u32>,
    ) -> Checkpoint {
        Checkpoint {
            input: input.to_path_buf(),
            format,
            dir: layout.dir,
            index_path: layout.index_path,
            shards,
            base_count: tensors.len(),
            tensors,
            by_name,
            extra_inputs: Vec::new(),
            warnings: Vec::new(),
            notes: layout.notes,
        }
    }

    /// A PyTorch checkpoint, described by [`torch`]: every file opened once, every tensor
    /// placed in them.
    fn open_torch(input: &Path, layout: Layout, kind: TorchKind) -> Result<Checkpoint> {
        let desc: SourceDesc = match kind {
            TorchKind::File => torch::describe_file(input)?,
            TorchKind::Sharded => torch::describe_sharded(&layout.torch_root)?,
            TorchKind::Dcp => torch::dcp::describe_dcp(&layout.torch_root)?,
        };
        let mut shards = Vec::with_capacity(desc.files.len());
        let (mut zips, mut legacy) = (0, 0);
        for f in &desc.files {
            let file = crate::sys::open_regular(&f.path).map_err(|e| Error::io(&f.path, e))?;
            if kind != TorchKind::Dcp {
                let mut magic = [0u8; 4];
                use std::os::unix::fs::FileExt;
                let is_zip = file.read_exact_at(&mut magic, 0).is_ok() && magic == *b"PK\x03\x04";
                if is_zip {
                    zips += 1;
                } else {
                    legacy += 1;
                }
            }
            shards.push(Shard {
                path: f.path.clone(),
                file,
                header: Header {
                    metadata: None,
                    tensors: Vec::new(),
                    data_start: 0,
                    file_len: f.len,
                },
                tensor_count: 0,
                span: None,
            });
        }
        let format = match (kind, zips, legacy) {
            (TorchKind::Dcp, _, _) => SourceFormat::Dcp,
            (_, _, 0) => SourceFormat::TorchZip,
            (_, 0, _) => SourceFormat::TorchLegacy,
            _ => SourceFormat::TorchMixed,
        };
        if u32::try_from(desc.tensors.len()).is_err() {
            return Err(Error::NoModel {
                path: input.into(),
                msg: format!(
                    "{} tensors are more than this tool supports ({})",
                    desc.tensors.len(),
                    u32::MAX
                ),
            });
        }
        let tensors: Vec<TensorRef> = desc
            .tensors
            .into_iter()
            .map(|t| {
                let nbytes = t
                    .dtype
                    .byte_len(t.elements())
                    .ok_or_else(|| Error::TensorData {
                        path: desc.files[super::source::SourceTensor::first_of(&t.placement).0]
                            .path
                            .clone(),
                        tensor: t.name.clone(),
                        msg: "byte size overflows".into(),
                    })?;
                Ok(TensorRef {
                    info: TensorInfo {
                        name: t.name,
                        dtype: t.dtype,
                        shape: t.shape,
                        begin: 0,
                        end: nbytes,
                    },
                    placement: t.placement,
                })
            })
            .collect::<Result<_>>()?;
        let by_name = sorted_by_name(&tensors);
        for pair in by_name.windows(2) {
            let (first, second) = (pair[0] as usize, pair[1] as usize);
            if tensors[first].info.name == tensors[second].info.name {
                return Err(Error::DuplicateTensor {
                    tensor: tensors[second].info.name.clone(),
                    first: shards[tensors[first].shard()].path.clone(),
                    second: shards[tensors[second].shard()].path.clone(),
                });
            }
        }
        // A Distributed Checkpoint's `.metadata` is read too.
        let metadata =
            (kind == TorchKind::Dcp).then(|| layout.torch_root.join(torch::dcp::METADATA_NAME));
        let mut ckpt = Self::model(input, format, layout, shards, tensors, by_name);
        ckpt.notes.extend(desc.notes);
        ckpt.extra_inputs.extend(metadata);
        Ok(ckpt)
    }

    /// `format: …` for `tftf info`: the format, and how many files when more than one.
    pub fn format_line(&self) -> String {
        match self.shards.len() {
            1 => self.format.name().to_string(),
            n => format!("{} ({n} files)", self.format.name()),
        }
    }

    /// Adds another checkpoint's shards and tensors as extra inputs (an adapter). They are not
    /// part of the output unless a step uses them, and are not found by [`Checkpoint::get`].
    /// Returns the index of the first attached tensor.
    pub fn attach(&mut self, other: Checkpoint) -> usize {
        let shard_base = self.shards.len();
        let first = self.tensors.len();
        self.tensors.extend(other.tensors.into_iter().map(|mut t| {
            shift_files(&mut t.placement, shard_base);
            t
        }));
        self.shards.extend(other.shards.into_iter().map(|mut s| {
            s.span = s.span.map(|r| r.start + first..r.end + first);
            s
        }));
        first
    }

    /// Adds a tensor placed in attached files (for instance dim-0 slices concatenated, as
    /// [`Placement::Regions`]). Returns its index.
    pub fn push_assembled(&mut self, info: TensorInfo, placement: Placement) -> usize {
        self.tensors.push(TensorRef { info, placement });
        self.tensors.len() - 1
    }

    /// Reads `buf.len()` bytes of tensor `t` from byte `at` of the tensor, across pieces if it
    /// is assembled, and drops the pages read from the cache.
    pub fn read_tensor_at(&self, t: &TensorRef, at: u64, buf: &mut [u8]) -> Result<()> {
        self.read_tensor_at_cached(t, at, buf, false)
    }

    /// [`Checkpoint::read_tensor_at`], leaving the pages cached when `keep_cached` (for data
    /// read twice in short order, such as the scales `repack-fp4` inspects before writing).
    pub fn read_tensor_at_cached(
        &self,
        t: &TensorRef,
        at: u64,
        buf: &mut [u8],
        keep_cached: bool,
    ) -> Result<()> {
        use std::os::unix::fs::FileExt;
        let Some(pieces) = t.pieces() else {
            return self.gather(t, at, buf);
        };
        let (mut pos, mut done) = (0u64, 0usize);
        for (shard, off, len) in pieces {
            let want_start = at + done as u64;
            if done == buf.len() {
                break;
            }
            if want_start >= pos + len {
                pos += len;
                continue;
            }
            let from = want_start - pos;
            let n = ((len - from) as usize).min(buf.len() - done);
            let s = &self.shards[shard];
            s.file
                .read_exact_at(&mut buf[done..done + n], off + from)
                .map_err(|e| Error::io(&s.path, e))?;
            if !keep_cached {
                crate::sys::drop_cache(&s.file, off + from, n as u64);
            }
            done += n;
            pos += len;
        }
        if done != buf.len() {
            return Err(Error::Other(format!(
                "tensor `{}`: read past its end ({} of {} bytes)",
                t.info.name,
                done,
                buf.len()
            )));
        }
        Ok(())
    }

    /// Drops from the page cache every byte a tensor that is not a plain range may have read
    /// (its storages, its chunks), once it has been gathered whole: chunk by chunk would evict
    /// storage lines the next chunk reads again (a transpose touches every line per chunk).
    pub fn drop_gathered_cache(&self, t: &TensorRef) {
        fn walk(ckpt: &Checkpoint, p: &Placement) {
            match p {
                Placement::Contiguous { file, offset, len } => {
                    crate::sys::drop_cache(&ckpt.shards[*file].file, *offset, *len)
                }
                Placement::Strided {
                    file,
                    storage_start,
                    storage_len,
                    ..
                } => crate::sys::drop_cache(&ckpt.shards[*file].file, *storage_start, *storage_len),
                Placement::Regions(regions) => {
                    for r in regions {
                        walk(ckpt, &r.placement);
                    }
                }
            }
        }
        if t.pieces().is_none() {
            walk(self, &t.placement);
        }
    }

    /// Reads bytes `at .. at + buf.len()` of a strided or chunked tensor through the element
    /// gatherer (bounded buffers; never the whole tensor unless `buf` is).
    fn gather(&self, t: &TensorRef, at: u64, buf: &mut [u8]) -> Result<()> {
        if buf.is_empty() {
            return Ok(());
        }
        let es = t.info.dtype.size().ok_or_else(|| Error::TensorData {
            path: self.shards[t.shard()].path.clone(),
            tensor: t.info.name.clone(),
            msg: format!("{} is not a whole-byte dtype", t.info.dtype),
        })? as u64;
        let src = OpenSource::borrowed(self.shards.iter().map(|s| (s.path.as_path(), &s.file)));
        let first = at / es;
        let last = (at + buf.len() as u64).div_ceil(es);
        let read = |first: u64, out: &mut [u8]| {
            src.read_placed(
                &t.info.name,
                t.info.dtype,
                &t.info.shape,
                &t.placement,
                first,
                out.len() as u64 / es,
                out,
            )
        };
        if at.is_multiple_of(es) && (buf.len() as u64).is_multiple_of(es) {
            return read(first, buf);
        }
        // Unaligned (never from the pipeline, whose chunks are whole elements): read the
        // covering elements and cut.
        let mut tmp = vec![0u8; ((last - first) * es) as usize];
        read(first, &mut tmp)?;
        let skip = (at - first * es) as usize;
        buf.copy_from_slice(&tmp[skip..skip + buf.len()]);
        Ok(())
    }

    pub fn get(&self, name: &str) -> Option<&TensorRef> {
        find(&self.tensors, &self.by_name, name).map(|i| &self.tensors[i])
    }

    /// Position of tensor `name` in [`Checkpoint::tensors`].
    pub fn index_of(&self, name: &str) -> Option<usize> {
        find(&self.tensors, &self.by_name, name)
    }

    /// Bytes of the model's own tensors.
    pub fn total_bytes(&self) -> u64 {
        self.tensors[..self.base_count]
            .iter()
            .map(|t| t.info.nbytes())
            .sum()
    }

    /// Absolute file offset of a tensor's first byte (for ordering and messages; the first
    /// byte read, for tensors that are not one range).
    pub fn file_offset(&self, t: &TensorRef) -> u64 {
        super::source::SourceTensor::first_of(&t.placement).1
    }

    /// `__metadata__` of the first shard, if any.
    pub fn metadata(&self) -> Option<&Map<String, Value>> {
        self.shards.first().and_then(|s| s.header.metadata.as_ref())
    }

    /// `config.json` beside the weights, parsed, if present.
    pub fn config(&self) -> Result<Option<Map<String, Value>>> {
        let path = self.dir.join("config.json");
        // A FIFO or a device in its place is refused by the read, not taken for no config.
        if !path.exists() || !self.has_model_dir() {
            return Ok(None);
        }
        let text = crate::sys::read_regular_to_string(&path).map_err(|e| Error::io(&path, e))?;
        match serde_json::from_str(&text) {
            Ok(Value::Object(m)) => Ok(Some(m)),
            Ok(_) => Err(Error::Other(format!(
                "{}: not a JSON object",
                path.display()
            ))),
            Err(e) => Err(Error::Other(format!(
                "{}: invalid JSON: {e}",
                path.display()
            ))),
        }
    }

    /// A single-file input counts as a model directory only when `config.json` sits beside it;
    /// otherwise its neighbours are unrelated files.
    pub fn has_model_dir(&self) -> bool {
        self.input.is_dir() || self.index_path.is_some() || self.dir.join("config.json").is_file()
    }
}

/// Adds `base` to every file index of a placement (files appended after others).
fn shift_files(p: &mut Placement, base: usize) {
    match p {
        Placement::Contiguous { file, .. } | Placement::Strided { file, .. } => *file += base,
        Placement::Regions(regions) => {
            for r in regions {
                shift_files(&mut r.placement, base);
            }
        }
    }
}

/// Indices of `tensors` sorted by name (equal names in index order: the sort is stable).
fn sorted_by_name(tensors: &[TensorRef]) -> Vec<u32> {
    let mut v: Vec<u32> = (0..tensors.len() as u32).collect();
    v.sort_by(|&a, &b| {
        tensors[a as usize]
            .info
            .name
            .cmp(&tensors[b as usize].info.name)
    });
    v
}

/// The index of the tensor named `name`, through `by_name` from [`sorted_by_name`].
fn find(tensors: &[TensorRef], by_name: &[u32], name: &str) -> Option<usize> {
    by_name
        .binary_search_by(|&i| tensors[i as usize].info.name.as_str().cmp(name))
        .ok()
        .map(|k| by_name[k] as usize)
}

fn open_shard(path: &Path) -> Result<Shard> {
    let file = crate::sys::open_regular(path).map_err(|e| Error::io(path, e))?;
    let header = read_header(path, &file)?;
    Ok(Shard {
        path: path.to_path_buf(),
        file,
        tensor_count: header.tensors.len(),
        header,
        span: None,
    })
}

struct Layout {
    dir: PathBuf,
    index_path: Option<PathBuf>,
    shard_paths: Vec<PathBuf>,
    weight_map: Option<Map<String, Value>>,
    notes: Vec<String>,
    /// A PyTorch input, described from `torch_root` (the file, the folder of `.bin` shards, or
    /// the DCP folder holding `.metadata`).
    torch: Option<TorchKind>,
    torch_root: PathBuf,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum TorchKind {
    File,
    Sharded,
    Dcp,
}

/// What a path is when it is neither a regular file nor a directory, for the error.
fn special_kind(meta: &std::fs::Metadata) -> Option<&'static str> {
    use std::os::unix::fs::FileTypeExt;
    let t = meta.file_type();
    if t.is_fifo() {
        Some("FIFO (named pipe)")
    } else if t.is_char_device() {
        Some("character device")
    } else if t.is_block_device() {
        Some("block device")
    } else if t.is_socket() {
        Some("socket")
    } else {
        None
    }
}

/// Refuses a FIFO, device or socket where a shard or model is expected: tensors are read at
/// header offsets, which a stream cannot serve (and opening a FIFO would block).
fn refuse_special(path: &Path, meta: &std::fs::Metadata) -> Result<()> {
    match special_kind(meta) {
        Some(kind) => Err(Error::NoModel {
            path: path.into(),
            msg: format!(
                "is a {kind}, not a regular file: tftf reads tensors at the offsets its header gives, so it needs a .safetensors file on disk (save the stream to a file first)"
            ),
        }),
        None => Ok(()),
    }
}

impl Layout {
    fn discover(input: &Path) -> Result<Layout> {
        use std::os::unix::ffi::OsStrExt;
        let meta = std::fs::metadata(input).map_err(|e| Error::io(input, e))?;
        refuse_special(input, &meta)?;
        let dir = if meta.is_dir() {
            input.to_path_buf()
        } else {
            parent_dir(input)
        };
        if dir.join(JOURNAL_NAME).exists() {
            return Err(Error::NoModel {
                path: dir.clone(),
                msg: format!(
                    "a tftf run was killed while committing its output here, so the files are a mix of two runs; run `tftf recover {}` to finish the commit",
                    dir.display()
                ),
            });
        }
        if meta.is_file() {
            let dir = parent_dir(input);
            let name = input.file_name().map(|n| n.as_bytes()).unwrap_or_default();
            if name == torch::dcp::METADATA_NAME.as_bytes() || name.ends_with(b".distcp") {
                return Ok(Self::dcp(dir, Vec::new()));
            }
            if name == torch::BIN_INDEX_NAME.as_bytes() {
                return Ok(Self::torch_sharded(dir, Vec::new()));
            }
            if input.as_os_str().as_bytes().ends_with(b".json") {
                return Self::from_index(dir, input);
            }
            if name.ends_with(b".bin") || name.ends_with(b".pt") || name.ends_with(b".pth") {
                return Ok(Layout {
                    dir: dir.clone(),
                    index_path: None,
                    shard_paths: Vec::new(),
                    weight_map: None,
                    notes: Vec::new(),
                    torch: Some(TorchKind::File),
                    torch_root: input.to_path_buf(),
                });
            }
            return Ok(Layout {
                dir,
                index_path: None,
                shard_paths: vec![input.to_path_buf()],
                weight_map: None,
                notes: Vec::new(),
                torch: None,
                torch_root: PathBuf::new(),
            });
        }
        let mut indexes = Vec::new();
        let mut shards = Vec::new();
        let mut notes = Vec::new();
        let mut torch_files = 0usize;
        // Names are bytes: a shard whose name is not UTF-8 is still a shard.
        for entry in std::fs::read_dir(input).map_err(|e| Error::io(input, e))? {
            let entry = entry.map_err(|e| Error::io(input, e))?;
            let name = entry.file_name();
            let bytes = name.as_bytes();
            let is_index = bytes.ends_with(b".safetensors.index.json");
            let is_shard = bytes.ends_with(b".safetensors") && !bytes.starts_with(b"adapter_model");
            if !is_index && !is_shard {
                if bytes == torch::BIN_INDEX_NAME.as_bytes() || torch::is_weight_file_name(bytes) {
                    torch_files += 1;
                }
                continue;
            }
            let path = entry.path();
            // macOS writes `._NAME` AppleDouble files beside every file it copies to a
            // foreign filesystem: metadata, not safetensors.
            if bytes.starts_with(b"._") {
                notes.push(format!(
                    "ignored `{}`: a hidden `._*` file (macOS metadata), not a shard",
                    crate::escape::bytes(bytes)
                ));
                continue;
            }
            let meta = std::fs::metadata(&path).map_err(|e| Error::io(&path, e))?;
            refuse_special(&path, &meta)?;
            if !meta.is_file() {
                continue;
            }
            if is_index {
                indexes.push(name);
            } else {
                shards.push(path);
            }
        }
        indexes.sort();
        shards.sort();
        // Safetensors weights win over any PyTorch ones beside them (as before this reader
        // existed); without them: a DCP folder, accelerate's FSDP output, `.bin` shards.
        if indexes.is_empty() && shards.is_empty() {
            if input.join(torch::dcp::METADATA_NAME).is_file() {
                return Ok(Self::dcp(input.to_path_buf(), notes));
            }
            let fsdp = input.join(torch::dcp::FSDP_MODEL_DIR);
            if fsdp.join(torch::dcp::METADATA_NAME).is_file() {
                return Ok(Self::dcp(fsdp, notes));
            }
            if torch_files > 0 {
                return Ok(Self::torch_sharded(input.to_path_buf(), notes));
            }
        }
        // Beside safetensors weights, PyTorch files are the same model in the older format
        // (transformers writes both): the safetensors ones are read, as before, silently.
        let mut layout = match indexes.len() {
            0 if shards.is_empty() => Err(Error::NoModel {
                path: input.into(),
                msg: "no model found: no *.safetensors files or index, no PyTorch *.bin/*.pt/*.pth files, no DCP `.metadata`".into(),
            }),
            0 => Ok(Layout {
                dir: input.into(),
                index_path: None,
                shard_paths: shards,
                weight_map: None,
                notes: Vec::new(),
                torch: None,
                torch_root: PathBuf::new(),
            }),
            1 => Self::from_index(input.into(), &input.join(&indexes[0])),
            _ if indexes.iter().any(|n| n == "model.safetensors.index.json") => {
                Self::from_index(input.into(), &input.join("model.safetensors.index.json"))
            }
            _ => Err(Error::NoModel {
                path: input.into(),
                msg: format!(
                    "several indexes ({}); pass the one to use as the input path",
                    indexes
                        .iter()
                        .map(|n| crate::escape::bytes(n.as_bytes()).into_owned())
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            }),
        }?;
        layout.notes.extend(notes);
        Ok(layout)
    }

    /// A Distributed Checkpoint in `root`. Side files (`config.json`) are looked for beside
    /// the weights, or one level up when `root` is accelerate's `pytorch_model_fsdp_N/`.
    fn dcp(root: PathBuf, notes: Vec<String>) -> Layout {
        let in_fsdp_dir = root
            .file_name()
            .is_some_and(|n| n.to_string_lossy().starts_with("pytorch_model_fsdp_"));
        let dir = if in_fsdp_dir {
            parent_dir(&root)
        } else {
            root.clone()
        };
        Layout {
            dir,
            index_path: None,
            shard_paths: Vec::new(),
            weight_map: None,
            notes,
            torch: Some(TorchKind::Dcp),
            torch_root: root,
        }
    }

    fn torch_sharded(dir: PathBuf, notes: Vec<String>) -> Layout {
        let index = dir.join(torch::BIN_INDEX_NAME);
        Layout {
            index_path: index.is_file().then_some(index),
            shard_paths: Vec::new(),
            weight_map: None,
            notes,
            torch: Some(TorchKind::Sharded),
            torch_root: dir.clone(),
            dir,
        }
    }

    fn from_index(dir: PathBuf, index: &Path) -> Result<Layout> {
        let invalid = |msg: String| Error::InvalidIndex {
            path: index.into(),
            msg,
        };
        let text = crate::sys::read_regular_to_string(index).map_err(|e| Error::io(index, e))?;
        let value: Value = serde_json::from_str(&text).map_err(|e| invalid(e.to_string()))?;
        let map = value
            .get("weight_map")
            .and_then(Value::as_object)
            .ok_or_else(|| invalid("no `weight_map` object".into()))?
            .clone();
        let mut names: Vec<String> = Vec::new();
        for (tensor, shard) in &map {
            let shard = shard.as_str().ok_or_else(|| {
                invalid(format!("weight_map entry for `{tensor}` is not a string"))
            })?;
            if shard.is_empty() || shard.contains('/') || shard.contains('\\') || shard == ".." {
                return Err(invalid(format!(
                    "weight_map entry for `{tensor}` names `{shard}`, which is not a file in this directory"
                )));
            }
            if !names.iter().any(|n| n == shard) {
                if let Ok(meta) = std::fs::metadata(dir.join(shard)) {
                    refuse_special(&dir.join(shard), &meta)?;
                }
                if !dir.join(shard).is_file() {
                    return Err(Error::MissingShard {
                        index: index.into(),
                        shard: shard.into(),
                        tensor: tensor.clone(),
                    });
                }
                names.push(shard.to_string());
            }
        }
        names.sort();
        Ok(Layout {
            shard_paths: names.iter().map(|n| dir.join(n)).collect(),
            dir,
            index_path: Some(index.into()),
            weight_map: Some(map),
            notes: Vec::new(),
            torch: None,
            torch_root: PathBuf::new(),
        })
    }
}

fn parent_dir(p: &Path) -> PathBuf {
    match p.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => PathBuf::from("."),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::dtype::DType;

    fn tensor(shape: &[u64], placement: Placement) -> TensorRef {
        TensorRef {
            info: TensorInfo {
                name: "w".into(),
                dtype: DType::F32,
                shape: shape.to_vec(),
                begin: 0,
                end: 4 * shape.iter().product::<u64>(),
            },
            placement,
        }
    }

    fn region(offsets: &[u64], sizes: &[u64], file: usize, offset: u64) -> Region {
        Region {
            offsets: offsets.to_vec(),
            sizes: sizes.to_vec(),
            placement: Placement::Contiguous {
                file,
                offset,
                len: 4 * sizes.iter().product::<u64>(),
            },
        }
    }

    /// A tensor of `shape` stored as two regions.
    fn split(shape: &[u64], a: Region, b: Region) -> TensorRef {
        tensor(shape, Placement::Regions(vec![a, b]))
    }

    #[test]
    fn only_ranges_and_dim0_slices_are_pieces() {
        let plain = tensor(
            &[2, 3],
            Placement::Contiguous {
                file: 1,
                offset: 64,
                len: 24,
            },
        );
        assert_eq!(plain.contiguous(), Some((1, 64)));
        assert_eq!(plain.pieces(), Some(vec![(1, 64, 24)]));
        // Dim-0 slices over two files, listed out of order: concatenated in row order.
        let slices = split(
            &[4, 3],
            region(&[2, 0], &[2, 3], 1, 0),
            region(&[0, 0], &[2, 3], 0, 100),
        );
        assert_eq!(slices.pieces(), Some(vec![(0, 100, 24), (1, 0, 24)]));
        assert_eq!(slices.contiguous(), None);
        assert_eq!(slices.shard(), 0);
        // A column split is a grid: gathered, not concatenated.
        let grid = split(
            &[2, 4],
            region(&[0, 0], &[2, 2], 0, 0),
            region(&[0, 2], &[2, 2], 1, 0),
        );
        assert_eq!(grid.pieces(), None);
        let strided = tensor(
            &[2, 2],
            Placement::Strided {
                file: 0,
                storage_start: 0,
                storage_len: 16,
                storage_offset: 0,
                strides: vec![1, 2],
            },
        );
        assert_eq!((strided.contiguous(), strided.pieces()), (None, None));
    }

    #[test]
    fn attached_placements_shift_every_file_index() {
        let mut p = Placement::Regions(vec![region(&[0], &[1], 0, 0), region(&[1], &[1], 2, 0)]);
        shift_files(&mut p, 3);
        let Placement::Regions(r) = p else {
            unreachable!()
        };
        assert!(matches!(
            r[0].placement,
            Placement::Contiguous { file: 3, .. }
        ));
        assert!(matches!(
            r[1].placement,
            Placement::Contiguous { file: 5, .. }
        ));
    }
}
