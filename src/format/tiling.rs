//! DCP chunks tiling a tensor: the check that they do, and the lookup of the chunk holding an
//! element.
//!
//! A tensor may arrive in tens of thousands of chunks (65,536 one-element chunks are a valid
//! save), so neither may compare chunks pairwise: that took over a minute for one such tensor.
//! Instead the chunks' boundaries cut each dimension once (sorted, deduplicated), which cuts
//! the tensor into a grid of cells; every chunk covers a block of cells, and marking them finds
//! an overlap at the first cell marked twice. For the grids that FSDP and tensor parallelism
//! write, each chunk is exactly one cell, so the check is O(n log n) and the lookup (a binary
//! search per dimension) O(rank · log n). Layouts whose boundaries cut the tensor into more
//! than [`MAX_CELLS_PER_CHUNK`] cells per chunk (no real save) are refused rather than indexed.

use super::dtype::element_count;
use super::source::Region;

/// Grid cells per chunk beyond which a layout is refused: a grid has one per chunk, a
/// staggered ("brick wall") tiling about two.
pub const MAX_CELLS_PER_CHUNK: u64 = 16;
/// Cells always allowed, whatever the chunk count.
const MIN_CELL_LIMIT: u64 = 1 << 12;
/// A cell no chunk covers (yet).
const NO_REGION: u32 = u32::MAX;

/// The grid the chunks' boundaries cut a tensor into, and the chunk covering each cell.
pub struct RegionGrid {
    /// Per dimension, the sorted distinct boundaries (0 and the extent included).
    cuts: Vec<Vec<u64>>,
    /// Row-major over the cells: the index of the region covering it.
    cell_region: Vec<u32>,
}

impl RegionGrid {
    /// Checks that `regions` tile `shape` exactly (each inside it, none overlapping, together
    /// covering every element) and indexes them.
    pub fn new(shape: &[u64], regions: &[Region]) -> Result<RegionGrid, String> {
        let total = element_count(shape).ok_or("element count overflows")?;
        let mut covered = 0u64;
        for (k, r) in regions.iter().enumerate() {
            if r.offsets.len() != shape.len() || r.sizes.len() != shape.len() {
                return Err(format!(
                    "chunk {k} has rank {} but the tensor has rank {}",
                    r.offsets.len(),
                    shape.len()
                ));
            }
            let inside = (0..shape.len()).all(|d| {
                r.offsets[d]
                    .checked_add(r.sizes[d])
                    .is_some_and(|e| e <= shape[d])
            });
            if !inside {
                return Err(format!(
                    "chunk {k} (offsets {:?}, sizes {:?}) lies outside shape {shape:?}",
                    r.offsets, r.sizes
                ));
            }
            covered = covered
                .checked_add(element_count(&r.sizes).ok_or("element count overflows")?)
                .ok_or("element count overflows")?;
        }
        let filled = |r: &&Region| element_count(&r.sizes) != Some(0);
        let cuts: Vec<Vec<u64>> = (0..shape.len())
            .map(|d| {
                let mut c: Vec<u64> = [0, shape[d]]
                    .into_iter()
                    .chain(
                        regions
                            .iter()
                            .filter(filled)
                            .flat_map(|r| [r.offsets[d], r.offsets[d] + r.sizes[d]]),
                    )
                    .collect();
                c.sort_unstable();
                c.dedup();
                c
            })
            .collect();
        let limit = (regions.len() as u64)
            .saturating_mul(MAX_CELLS_PER_CHUNK)
            .max(MIN_CELL_LIMIT);
        let cells = cuts
            .iter()
            .try_fold(1u64, |n, c| n.checked_mul(c.len() as u64 - 1))
            .filter(|&n| n <= limit)
            .ok_or_else(|| {
                format!(
                    "its {} chunks do not form a grid: their boundaries cut it into more than \
                     {limit} cells",
                    regions.len()
                )
            })?;
        let mut grid = RegionGrid {
            cuts,
            cell_region: vec![NO_REGION; cells as usize],
        };
        for (k, r) in regions.iter().enumerate().filter(|(_, r)| filled(r)) {
            grid.mark(k, r)?;
        }
        if covered != total {
            return Err(format!("chunks cover {covered} of its {total} elements"));
        }
        Ok(grid)
    }

    /// Marks the cells of region `k`; a cell marked before is an overlap.
    fn mark(&mut self, k: usize, r: &Region) -> Result<(), String> {
        // The block of cells `[lo, hi)` per dimension (region bounds are cuts).
        let (lo, hi): (Vec<usize>, Vec<usize>) = self
            .cuts
            .iter()
            .enumerate()
            .map(|(d, c)| {
                let at = |v: u64| c.partition_point(|&x| x < v);
                (at(r.offsets[d]), at(r.offsets[d] + r.sizes[d]))
            })
            .unzip();
        let mut cell = lo.clone();
        loop {
            let i = self.linear(&cell);
            match self.cell_region[i] {
                NO_REGION => self.cell_region[i] = k as u32,
                m => return Err(format!("chunks {m} and {k} overlap")),
            }
            // Next cell of the block, row-major.
            let mut d = cell.len();
            loop {
                if d == 0 {
                    return Ok(());
                }
                d -= 1;
                cell[d] += 1;
                if cell[d] < hi[d] {
                    break;
                }
                cell[d] = lo[d];
            }
        }
    }

    fn linear(&self, cell: &[usize]) -> usize {
        cell.iter()
            .zip(&self.cuts)
            .fold(0, |acc, (i, c)| acc * (c.len() - 1) + i)
    }

    /// The index of the region holding element `idx` (a multi-index inside the shape).
    pub fn find(&self, idx: &[u64]) -> Option<usize> {
        if idx.len() != self.cuts.len() {
            return None;
        }
        let mut cell = Vec::with_capacity(idx.len());
        for (i, c) in idx.iter().zip(&self.cuts) {
            let at = c.partition_point(|&x| x <= *i);
            if at == 0 || at == c.len() {
                return None;
            }
            cell.push(at - 1);
        }
        match self.cell_region.get(self.linear(&cell)) {
            Some(&NO_REGION) | None => None,
            Some(&k) => Some(k as usize),
        }
    }
}

/// Checks that `regions` tile `shape` exactly: each inside it, none overlapping, together
/// covering every element ([`RegionGrid::new`]).
pub fn check_regions_tile(shape: &[u64], regions: &[Region]) -> Result<(), String> {
    RegionGrid::new(shape, regions).map(|_| ())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::source::Placement;

    fn region(offsets: [u64; 2], sizes: [u64; 2]) -> Region {
        Region {
            offsets: offsets.to_vec(),
            sizes: sizes.to_vec(),
            placement: Placement::Contiguous {
                file: 0,
                offset: 0,
                len: 0,
            },
        }
    }

    #[test]
    fn a_staggered_tiling_is_checked_and_found() {
        // row 0: [0, 2) [2, 4); row 1: [0, 1) [1, 3) [3, 4)
        let regions = [
            region([0, 0], [1, 2]),
            region([0, 2], [1, 2]),
            region([1, 0], [1, 1]),
            region([1, 1], [1, 2]),
            region([1, 3], [1, 1]),
        ];
        let grid = RegionGrid::new(&[2, 4], &regions).unwrap();
        let found: Vec<usize> = (0..8)
            .map(|i| grid.find(&[i / 4, i % 4]).unwrap())
            .collect();
        assert_eq!(found, [0, 0, 1, 1, 2, 3, 3, 4]);
        let mut overlapping = regions.to_vec();
        overlapping[3] = region([1, 0], [1, 3]);
        assert_eq!(
            RegionGrid::new(&[2, 4], &overlapping).err().unwrap(),
            "chunks 2 and 3 overlap"
        );
    }

    #[test]
    fn boundaries_that_cut_far_more_cells_than_chunks_are_refused() {
        // row i split at column i: 200 chunks cutting a 100 × 100 tensor into 10^4 cells
        let n = 100;
        let regions: Vec<Region> = (0..n)
            .flat_map(|i| [region([i, 0], [1, i]), region([i, i], [1, n - i])])
            .collect();
        let err = RegionGrid::new(&[n, n], &regions).err().unwrap();
        assert!(err.contains("200 chunks do not form a grid"), "{err}");
    }
}
