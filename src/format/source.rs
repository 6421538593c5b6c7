//! Described checkpoints: where each tensor's bytes are, whatever the input format.
//!
//! A parser (safetensors, torch.save, DCP) turns its input into a [`SourceDesc`]: the files it
//! reads and, per tensor, a dtype, a shape and a [`Placement`]. The pipeline never sees the
//! format again; it asks [`OpenSource::read_elements`] for row-major element ranges, which
//! positioned reads serve from any placement. Contiguous bytes stay a plain
//! [`Placement::Contiguous`] range so that an untouched tensor can still be moved with
//! `copy_file_range` or a reflink. Strided views (a transposed tensor saved by torch.save) and
//! chunk grids (a DCP tensor split over ranks and files) are gathered through buffers of at most
//! [`MAX_GATHER_BUFFER_BYTES`] per call, never by loading a whole storage: a chunk grid is read
//! as one run per chunk row (or per whole chunk when it spans the later dimensions), and a
//! transposed view as one run per storage line, so reading a `[4096, 4096]` transpose in row
//! chunks costs 4096 reads per chunk, not one per element.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use super::dtype::{element_count, DType};
pub use super::tiling::check_regions_tile;
use super::tiling::RegionGrid;
use crate::error::{Error, Result};

/// A strided run whose storage span fits in this many bytes is read in one call and gathered;
/// wider runs are read element by element.
pub const MAX_GATHER_BUFFER_BYTES: u64 = 1 << 20;

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SourceFile {
    pub path: PathBuf,
    pub len: u64,
}

/// Where a tensor's (or a region's) elements lie.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Placement {
    /// Row-major bytes `[offset, offset + len)` of file `file`.
    Contiguous { file: usize, offset: u64, len: u64 },
    /// A torch view: element `i` (multi-index) lives at storage element
    /// `storage_offset + Σ i[d]·strides[d]`; the storage is the bytes
    /// `[storage_start, storage_start + storage_len)` of file `file`.
    Strided {
        file: usize,
        storage_start: u64,
        storage_len: u64,
        storage_offset: u64,
        strides: Vec<u64>,
    },
    /// Boxes of the tensor (DCP chunks) that tile it exactly, each placed on its own.
    Regions(Vec<Region>),
}

/// An N-d box `offsets .. offsets + sizes` of a tensor, laid out row-major over `sizes` by its
/// placement (never itself `Regions`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Region {
    pub offsets: Vec<u64>,
    pub sizes: Vec<u64>,
    pub placement: Placement,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SourceTensor {
    pub name: String,
    pub dtype: DType,
    pub shape: Vec<u64>,
    pub placement: Placement,
}

impl SourceTensor {
    pub fn elements(&self) -> u64 {
        element_count(&self.shape).unwrap_or(0)
    }

    /// The file and offset of the tensor's first byte, for ordering.
    pub fn position(&self) -> (usize, u64) {
        Self::first_of(&self.placement)
    }

    /// The file and offset of the first byte a placement reads.
    pub fn first_of(placement: &Placement) -> (usize, u64) {
        fn first(p: &Placement) -> (usize, u64) {
            match p {
                Placement::Contiguous { file, offset, .. } => (*file, *offset),
                Placement::Strided {
                    file,
                    storage_start,
                    ..
                } => (*file, *storage_start),
                Placement::Regions(r) => r
                    .iter()
                    .map(|r| first(&r.placement))
                    .min()
                    .unwrap_or((0, 0)),
            }
        }
        first(placement)
    }
}

/// A described checkpoint: its files, its tensors in file order, and what was skipped.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SourceDesc {
    pub files: Vec<SourceFile>,
    pub tensors: Vec<SourceTensor>,
    /// One line per skipped entry (`` `step` (int) skipped: not a tensor ``).
    pub notes: Vec<String>,
}

impl SourceDesc {
    pub fn tensor(&self, name: &str) -> Option<&SourceTensor> {
        self.tensors.iter().find(|t| t.name == name)
    }

    /// Opens every file once, for many reads.
    pub fn open(&self) -> Result<OpenSource<'_>> {
        let files = self
            .files
            .iter()
            .map(|f| crate::sys::open_regular(&f.path).map_err(|e| Error::io(&f.path, e)))
            .collect::<Result<Vec<_>>>()?;
        Ok(OpenSource {
            paths: self.files.iter().map(|f| f.path.as_path()).collect(),
            files: files.into_iter().map(FileHandle::Owned).collect(),
        })
    }

    /// Sorts tensors by their first byte's position (stable, so ties keep parse order).
    pub fn sort_by_position(&mut self) {
        self.tensors.sort_by_key(|t| t.position());
    }
}

/// Reads one element range of a tensor (opens the files for this call only; use
/// [`SourceDesc::open`] for repeated reads).
pub fn read_elements(
    desc: &SourceDesc,
    tensor: &SourceTensor,
    first_elem: u64,
    count: u64,
    out: &mut [u8],
) -> Result<()> {
    desc.open()?.read_elements(tensor, first_elem, count, out)
}

pub struct OpenSource<'a> {
    paths: Vec<&'a Path>,
    files: Vec<FileHandle<'a>>,
}

enum FileHandle<'a> {
    Owned(File),
    Borrowed(&'a File),
}

impl FileHandle<'_> {
    fn get(&self) -> &File {
        match self {
            FileHandle::Owned(f) => f,
            FileHandle::Borrowed(f) => f,
        }
    }
}

impl<'a> OpenSource<'a> {
    /// Reads through files someone else holds open (a checkpoint's), indexed as placements
    /// number them.
    pub fn borrowed(files: impl IntoIterator<Item = (&'a Path, &'a File)>) -> OpenSource<'a> {
        let (paths, files) = files
            .into_iter()
            .map(|(p, f)| (p, FileHandle::Borrowed(f)))
            .unzip();
        OpenSource { paths, files }
    }

    /// Fills `out` with elements `first_elem .. first_elem + count` of `tensor` in row-major
    /// order; `out` must be exactly `count` elements long.
    pub fn read_elements(
        &self,
        tensor: &SourceTensor,
        first_elem: u64,
        count: u64,
        out: &mut [u8],
    ) -> Result<()> {
        self.read_placed(
            &tensor.name,
            tensor.dtype,
            &tensor.shape,
            &tensor.placement,
            first_elem,
            count,
            out,
        )
    }

    /// [`OpenSource::read_elements`] for a tensor given by its parts.
    #[allow(clippy::too_many_arguments)]
    pub fn read_placed(
        &self,
        name: &str,
        dtype: DType,
        shape: &[u64],
        placement: &Placement,
        first_elem: u64,
        count: u64,
        out: &mut [u8],
    ) -> Result<()> {
        let first_file = SourceTensor::first_of(placement).0;
        let invalid = |msg: String| Error::TensorData {
            path: self
                .paths
                .get(first_file)
                .map(|p| p.to_path_buf())
                .unwrap_or_default(),
            tensor: name.to_string(),
            msg,
        };
        let es = dtype
            .size()
            .ok_or_else(|| invalid(format!("{dtype} is not a whole-byte dtype")))?
            as u64;
        let elements =
            element_count(shape).ok_or_else(|| invalid("element count overflows".into()))?;
        first_elem
            .checked_add(count)
            .filter(|&e| e <= elements)
            .ok_or_else(|| {
                invalid(format!(
                    "elements {first_elem}+{count} are out of range (it has {elements})"
                ))
            })?;
        if count.checked_mul(es) != Some(out.len() as u64) {
            return Err(invalid(format!(
                "buffer of {} bytes for {count} elements of {dtype}",
                out.len(),
            )));
        }
        self.read_placement(placement, shape, es, first_elem, out)
            .map_err(|e| match e {
                ReadError::Io(file, err) => Error::io(self.paths[file], err),
                ReadError::Layout(msg) => invalid(msg),
            })
    }

    fn file(&self, file: usize) -> Result<&File, ReadError> {
        self.files
            .get(file)
            .map(FileHandle::get)
            .ok_or_else(|| ReadError::Layout(format!("file index {file} out of range")))
    }

    fn read_at(&self, file: usize, buf: &mut [u8], offset: u64) -> Result<(), ReadError> {
        self.file(file)?
            .read_exact_at(buf, offset)
            .map_err(|e| ReadError::Io(file, e))
    }

    /// Reads `out.len() / es` elements from `first` (row-major over `shape`).
    fn read_placement(
        &self,
        placement: &Placement,
        shape: &[u64],
        es: u64,
        first: u64,
        out: &mut [u8],
    ) -> Result<(), ReadError> {
        if out.is_empty() {
            return Ok(());
        }
        match placement {
            Placement::Contiguous { file, offset, len } => {
                let start = first.checked_mul(es).ok_or_else(overflow)?;
                let stop = start.checked_add(out.len() as u64).ok_or_else(overflow)?;
                if stop > *len {
                    return Err(ReadError::Layout(format!(
                        "bytes {start}..{stop} lie past its {len}-byte range"
                    )));
                }
                self.read_at(*file, out, offset.checked_add(start).ok_or_else(overflow)?)
            }
            Placement::Strided {
                file,
                storage_start,
                storage_len,
                storage_offset,
                strides,
            } => self.read_strided(
                *file,
                *storage_start,
                *storage_len,
                *storage_offset,
                strides,
                shape,
                es,
                first,
                out,
            ),
            Placement::Regions(regions) => self.read_regions(regions, shape, es, first, out),
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn read_strided(
        &self,
        file: usize,
        storage_start: u64,
        storage_len: u64,
        storage_offset: u64,
        strides: &[u64],
        shape: &[u64],
        es: u64,
        first: u64,
        out: &mut [u8],
    ) -> Result<(), ReadError> {
        if strides.len() != shape.len() {
            return Err(ReadError::Layout("strides and shape differ in rank".into()));
        }
        let count = out.len() as u64 / es;
        let inner_len = shape.last().copied().unwrap_or(1);
        let inner_stride = strides.last().copied().unwrap_or(0);
        // A view whose storage runs along an earlier dimension (a transpose) is read along
        // that dimension's lines when the call covers at least one element per line.
        if inner_stride != 1 {
            if let Some(k) = (0..shape.len()).find(|&d| strides[d] == 1 && shape[d] > 1) {
                let lines = shape.iter().product::<u64>() / shape[k];
                if lines <= count {
                    let view = LineView {
                        file,
                        storage_start,
                        storage_len,
                        storage_offset,
                        strides,
                        shape,
                        es,
                    };
                    return self.read_lines(&view, k, first, out);
                }
            }
        }
        let mut idx = unravel(first, shape);
        let mut done = 0u64;
        let mut buf = Vec::new();
        while done < count {
            let col = idx.last().copied().unwrap_or(0);
            let run = (inner_len - col).min(count - done);
            let mut elem = storage_offset;
            for (i, s) in idx.iter().zip(strides) {
                elem = i
                    .checked_mul(*s)
                    .and_then(|x| x.checked_add(elem))
                    .ok_or_else(overflow)?;
            }
            let span = (run - 1)
                .checked_mul(inner_stride)
                .and_then(|x| x.checked_add(1))
                .and_then(|x| x.checked_mul(es))
                .ok_or_else(overflow)?;
            let byte0 = elem.checked_mul(es).ok_or_else(overflow)?;
            if byte0.checked_add(span).is_none_or(|e| e > storage_len) {
                return Err(ReadError::Layout(format!(
                    "view reaches storage byte {} of {storage_len}",
                    byte0.saturating_add(span)
                )));
            }
            let dst = &mut out[(done * es) as usize..((done + run) * es) as usize];
            if inner_stride == 1 {
                self.read_at(file, dst, storage_start + byte0)?;
            } else if span <= MAX_GATHER_BUFFER_BYTES {
                buf.resize(span as usize, 0);
                self.read_at(file, &mut buf, storage_start + byte0)?;
                for (k, d) in dst.chunks_exact_mut(es as usize).enumerate() {
                    let at = (k as u64 * inner_stride * es) as usize;
                    d.copy_from_slice(&buf[at..at + es as usize]);
                }
            } else {
                for (k, d) in dst.chunks_exact_mut(es as usize).enumerate() {
                    let at = storage_start + byte0 + k as u64 * inner_stride * es;
                    self.read_at(file, d, at)?;
                }
            }
            done += run;
            advance(&mut idx, shape, run);
        }
        Ok(())
    }

    /// Reads `[first, first + out.len() / es)` line by line along dimension `k` (storage
    /// stride 1): each line's part inside the range is one contiguous storage run, scattered
    /// into `out` at the row-major stride of `k`.
    fn read_lines(
        &self,
        v: &LineView,
        k: usize,
        first: u64,
        out: &mut [u8],
    ) -> Result<(), ReadError> {
        let es = v.es;
        let end = first + out.len() as u64 / es;
        let out_strides = contiguous_strides(v.shape);
        let len_k = v.shape[k];
        let os_k = out_strides[k];
        let mut other: Vec<u64> = vec![0; v.shape.len()];
        let max_run = (MAX_GATHER_BUFFER_BYTES / es).max(1);
        let mut buf = Vec::new();
        loop {
            // This line: elements (other with other[k] = t), t in 0..len_k.
            let base_out: u64 = other.iter().zip(&out_strides).map(|(i, s)| i * s).sum();
            let mut base_elem = v.storage_offset;
            for (i, s) in other.iter().zip(v.strides) {
                base_elem = i
                    .checked_mul(*s)
                    .and_then(|x| x.checked_add(base_elem))
                    .ok_or_else(overflow)?;
            }
            // t with first <= base_out + t * os_k < end
            let t0 = first.saturating_sub(base_out).div_ceil(os_k).min(len_k);
            let t1 = end.saturating_sub(base_out).div_ceil(os_k).min(len_k);
            let mut t = t0;
            while t < t1 {
                let n = (t1 - t).min(max_run);
                let byte0 = (base_elem + t).checked_mul(es).ok_or_else(overflow)?;
                if byte0 + n * es > v.storage_len {
                    return Err(ReadError::Layout(format!(
                        "view reaches storage byte {} of {}",
                        byte0 + n * es,
                        v.storage_len
                    )));
                }
                buf.resize((n * es) as usize, 0);
                self.read_at(v.file, &mut buf, v.storage_start + byte0)?;
                for (j, src) in buf.chunks_exact(es as usize).enumerate() {
                    let at = ((base_out + (t + j as u64) * os_k - first) * es) as usize;
                    out[at..at + es as usize].copy_from_slice(src);
                }
                t += n;
            }
            // next combination of the other dimensions
            let mut d = v.shape.len();
            loop {
                if d == 0 {
                    return Ok(());
                }
                d -= 1;
                if d == k {
                    continue;
                }
                other[d] += 1;
                if other[d] < v.shape[d] {
                    break;
                }
                other[d] = 0;
            }
        }
    }

    fn read_regions(
        &self,
        regions: &[Region],
        shape: &[u64],
        es: u64,
        first: u64,
        out: &mut [u8],
    ) -> Result<(), ReadError> {
        let count = out.len() as u64 / es;
        let grid = RegionGrid::new(shape, regions).map_err(ReadError::Layout)?;
        let mut idx = unravel(first, shape);
        let mut done = 0u64;
        while done < count {
            let region = grid.find(&idx).map(|k| &regions[k]).ok_or_else(|| {
                ReadError::Layout(format!("no chunk holds element index {idx:?}"))
            })?;
            // The run may cross rows while the region spans every later dimension whole.
            let rank = shape.len();
            let mut j = rank.saturating_sub(1);
            while j > 0 && region.offsets[j] == 0 && region.sizes[j] == shape[j] {
                j -= 1;
            }
            let run = if rank == 0 {
                1
            } else {
                let inner: u64 = shape[j + 1..].iter().product();
                let within = ravel(&idx[j + 1..], &shape[j + 1..]);
                (region.offsets[j] + region.sizes[j] - idx[j]) * inner - within
            }
            .min(count - done);
            let local: Vec<u64> = idx
                .iter()
                .zip(&region.offsets)
                .map(|(i, o)| i - o)
                .collect();
            let local_first = ravel(&local, &region.sizes);
            let dst = &mut out[(done * es) as usize..((done + run) * es) as usize];
            if matches!(region.placement, Placement::Regions(_)) {
                return Err(ReadError::Layout("nested regions".into()));
            }
            self.read_placement(&region.placement, &region.sizes, es, local_first, dst)?;
            done += run;
            advance(&mut idx, shape, run);
        }
        Ok(())
    }
}

/// A strided view, for [`OpenSource::read_lines`].
struct LineView<'a> {
    file: usize,
    storage_start: u64,
    storage_len: u64,
    storage_offset: u64,
    strides: &'a [u64],
    shape: &'a [u64],
    es: u64,
}

enum ReadError {
    Io(usize, std::io::Error),
    Layout(String),
}

fn overflow() -> ReadError {
    ReadError::Layout("offset arithmetic overflows".into())
}

/// Multi-index of row-major element `linear` (clamped into the shape).
fn unravel(mut linear: u64, shape: &[u64]) -> Vec<u64> {
    let mut idx = vec![0; shape.len()];
    for d in (0..shape.len()).rev() {
        if shape[d] > 0 {
            idx[d] = linear % shape[d];
            linear /= shape[d];
        }
    }
    idx
}

fn ravel(idx: &[u64], shape: &[u64]) -> u64 {
    idx.iter().zip(shape).fold(0, |acc, (i, s)| acc * s + i)
}

/// Moves `idx` forward by `n` row-major elements.
fn advance(idx: &mut [u64], shape: &[u64], n: u64) {
    let mut carry = n;
    for d in (0..shape.len()).rev() {
        if carry == 0 || shape[d] == 0 {
            return;
        }
        let v = idx[d] + carry;
        idx[d] = v % shape[d];
        carry = v / shape[d];
    }
}

/// Row-major strides of `shape`, in elements.
pub fn contiguous_strides(shape: &[u64]) -> Vec<u64> {
    let mut strides = vec![1u64; shape.len()];
    for d in (0..shape.len().saturating_sub(1)).rev() {
        strides[d] = strides[d + 1].saturating_mul(shape[d + 1]);
    }
    strides
}

/// The file's length, for [`SourceFile`].
pub fn source_file(path: &Path) -> Result<SourceFile> {
    let len = std::fs::metadata(path)
        .map_err(|e| Error::io(path, e))?
        .len();
    Ok(SourceFile {
        path: path.to_path_buf(),
        len,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn desc_with(bytes: &[u8], tensor: SourceTensor) -> (tempfile::NamedTempFile, SourceDesc) {
        let mut f = tempfile::NamedTempFile::new().unwrap();
        f.write_all(bytes).unwrap();
        let desc = SourceDesc {
            files: vec![source_file(f.path()).unwrap()],
            tensors: vec![tensor],
            notes: vec![],
        };
        (f, desc)
    }

    fn read_all(desc: &SourceDesc, chunk: u64) -> Vec<u8> {
        let t = &desc.tensors[0];
        let src = desc.open().unwrap();
        let n = t.elements();
        let es = t.dtype.size().unwrap() as u64;
        let mut out = vec![0u8; (n * es) as usize];
        let mut at = 0;
        while at < n {
            let c = chunk.min(n - at);
            src.read_elements(
                t,
                at,
                c,
                &mut out[(at * es) as usize..((at + c) * es) as usize],
            )
            .unwrap();
            at += c;
        }
        out
    }

    #[test]
    fn strided_transpose_in_odd_chunks() {
        // storage 0..12 as a [3, 4] matrix; the tensor is its transpose [4, 3]
        let storage: Vec<u8> = (0..12).collect();
        let t = SourceTensor {
            name: "t".into(),
            dtype: DType::U8,
            shape: vec![4, 3],
            placement: Placement::Strided {
                file: 0,
                storage_start: 0,
                storage_len: 12,
                storage_offset: 0,
                strides: vec![1, 4],
            },
        };
        let (_f, desc) = desc_with(&storage, t);
        let want = vec![0, 4, 8, 1, 5, 9, 2, 6, 10, 3, 7, 11];
        for chunk in [1, 2, 5, 7, 12] {
            assert_eq!(read_all(&desc, chunk), want, "chunk {chunk}");
        }
    }

    #[test]
    fn regions_grid_in_odd_chunks() {
        // a [2, 4] tensor of u8 split in a 2x2 grid of [1, 2] chunks stored one after another
        let file: Vec<u8> = vec![0, 1, 2, 3, 4, 5, 6, 7];
        let chunk = |o: [u64; 2], off: u64| Region {
            offsets: o.to_vec(),
            sizes: vec![1, 2],
            placement: Placement::Contiguous {
                file: 0,
                offset: off,
                len: 2,
            },
        };
        let regions = vec![
            chunk([0, 0], 0),
            chunk([0, 2], 2),
            chunk([1, 0], 4),
            chunk([1, 2], 6),
        ];
        check_regions_tile(&[2, 4], &regions).unwrap();
        let t = SourceTensor {
            name: "g".into(),
            dtype: DType::U8,
            shape: vec![2, 4],
            placement: Placement::Regions(regions),
        };
        let (_f, desc) = desc_with(&file, t);
        for c in [1, 3, 8] {
            assert_eq!(read_all(&desc, c), vec![0, 1, 2, 3, 4, 5, 6, 7]);
        }
    }

    #[test]
    fn descriptions_can_be_shared_across_reader_threads() {
        fn shareable<T: Send + Sync>() {}
        shareable::<SourceDesc>();
        shareable::<OpenSource<'static>>();
    }

    #[test]
    fn regions_must_tile() {
        let r = |o: u64, s: u64| Region {
            offsets: vec![o],
            sizes: vec![s],
            placement: Placement::Contiguous {
                file: 0,
                offset: 0,
                len: s,
            },
        };
        assert!(check_regions_tile(&[4], &[r(0, 2), r(1, 2)])
            .unwrap_err()
            .contains("overlap"));
        assert!(check_regions_tile(&[4], &[r(0, 2)])
            .unwrap_err()
            .contains("cover 2 of its 4"));
        assert!(check_regions_tile(&[4], &[r(3, 2)])
            .unwrap_err()
            .contains("outside"));
    }

    #[test]
    fn out_of_range_reads_are_refused() {
        let t = SourceTensor {
            name: "x".into(),
            dtype: DType::F32,
            shape: vec![2],
            placement: Placement::Contiguous {
                file: 0,
                offset: 0,
                len: 8,
            },
        };
        let (_f, desc) = desc_with(&[0; 8], t);
        let t = &desc.tensors[0];
        let err = read_elements(&desc, t, 1, 2, &mut [0; 8]).unwrap_err();
        assert!(err.to_string().contains("out of range"), "{err}");
        let err = read_elements(&desc, t, 0, 2, &mut [0; 4]).unwrap_err();
        assert!(err.to_string().contains("buffer"), "{err}");
    }

    /// A tiny deterministic generator for the property test below.
    struct Rng(u64);
    impl Rng {
        fn below(&mut self, n: u64) -> u64 {
            self.0 = self
                .0
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (self.0 >> 33) % n
        }
    }

    proptest::proptest! {
        /// Any chunk grid (some chunks stored transposed), read in any chunk size, gives the
        /// tensor's elements in row-major order.
        #[test]
        fn grids_read_row_major(seed in proptest::prelude::any::<u64>()) {
            let mut rng = Rng(seed);
            let rank = 1 + rng.below(3) as usize;
            let shape: Vec<u64> = (0..rank).map(|_| 1 + rng.below(5)).collect();
            // split every dimension into up to three parts
            let parts: Vec<Vec<(u64, u64)>> = shape
                .iter()
                .map(|&d| {
                    let mut cuts = vec![0, d];
                    for _ in 0..rng.below(3) {
                        cuts.push(rng.below(d + 1));
                    }
                    cuts.sort();
                    cuts.dedup();
                    cuts.windows(2).map(|w| (w[0], w[1] - w[0])).collect()
                })
                .collect();
            let strides = contiguous_strides(&shape);
            let mut file = Vec::new();
            let mut regions = Vec::new();
            let mut boxes: Vec<Vec<(u64, u64)>> = vec![vec![]];
            for p in &parts {
                boxes = boxes
                    .into_iter()
                    .flat_map(|b| p.iter().map(move |x| [b.clone(), vec![*x]].concat()))
                    .collect();
            }
            for b in boxes {
                let offsets: Vec<u64> = b.iter().map(|x| x.0).collect();
                let sizes: Vec<u64> = b.iter().map(|x| x.1).collect();
                let n = element_count(&sizes).unwrap();
                let value = |local: &[u64]| -> u8 {
                    local.iter().zip(&offsets).zip(&strides).map(|((l, o), s)| (l + o) * s).sum::<u64>() as u8
                };
                let start = file.len() as u64;
                let transposed = rank == 2 && rng.below(2) == 0;
                let placement = if transposed {
                    for c in 0..sizes[1] {
                        for r in 0..sizes[0] {
                            file.push(value(&[r, c]));
                        }
                    }
                    Placement::Strided {
                        file: 0,
                        storage_start: start,
                        storage_len: n,
                        storage_offset: 0,
                        strides: vec![1, sizes[0]],
                    }
                } else {
                    for k in 0..n {
                        file.push(value(&unravel(k, &sizes)));
                    }
                    Placement::Contiguous { file: 0, offset: start, len: n }
                };
                regions.push(Region { offsets, sizes, placement });
            }
            check_regions_tile(&shape, &regions).unwrap();
            let n = element_count(&shape).unwrap();
            let t = SourceTensor {
                name: "g".into(),
                dtype: DType::U8,
                shape,
                placement: Placement::Regions(regions),
            };
            let (_f, desc) = desc_with(&file, t);
            let chunk = 1 + rng.below(n);
            let want: Vec<u8> = (0..n).map(|v| v as u8).collect();
            proptest::prop_assert_eq!(read_all(&desc, chunk), want);
        }
    }
}
