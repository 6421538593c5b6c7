//! The 8-dimensional lattices of the IQ2 and IQ1 types, and each one's map from 8 levels to a
//! grid point or, off the grid, to its nearest grid points, as ggml's `iq2xs_init_impl`
//! builds them.
//!
//! A group of 8 levels `l_i` in `0..=2` is coded `Σ l_i << 2i` (below [`MAP_CODES`]). A code
//! of a grid point maps to its index; every other code to its neighbours: all grid points at
//! the `nwant` smallest squared distances (1 for IQ2_S, 2 for IQ2_XXS/IQ2_XS, 3 for IQ1),
//! nearest first, ties by index. ggml sorts all grid points per code (`qsort` on `(d², j)`,
//! a total order); distances here are small integers, so one pass finds the `nwant` smallest
//! and a second collects their points in the same order. Built once per process on first use
//! (the IQ1 map, 41,644 codes × 2,048 points, in well under a second on all cores), shared.

use std::sync::OnceLock;

use super::grids::{KGRID_1BIT_2048, KGRID_2BIT_1024, KGRID_2BIT_256, KGRID_2BIT_512};

/// Codes of 8 levels in `0..=2` are below this (`kmap_size`, `0xAAAA + 2`).
const MAP_CODES: usize = 43_692;

/// Which lattice, with its `(grid, nwant)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Lattice {
    Iq2Xxs,
    Iq2Xs,
    Iq2S,
    Iq1,
}

/// One lattice: the points' coordinates (`2 l + 1`), and per code a grid index or a span of
/// `neighbours`.
pub(super) struct Grid {
    points: Vec<[i8; 8]>,
    map: Vec<Entry>,
    neighbours: Vec<u16>,
}

#[derive(Clone, Copy)]
enum Entry {
    OnGrid(u16),
    Off { start: u32, len: u32 },
}

/// The code of 8 levels (each in `0..=2`).
#[inline]
pub(super) fn code_of(levels: &[i8]) -> usize {
    levels
        .iter()
        .enumerate()
        .fold(0, |u, (i, &l)| u | ((l as usize) << (2 * i)))
}

/// The shared, lazily built grid of `lattice`.
pub(super) fn grid(lattice: Lattice) -> &'static Grid {
    static GRIDS: [OnceLock<Grid>; 4] = [
        OnceLock::new(),
        OnceLock::new(),
        OnceLock::new(),
        OnceLock::new(),
    ];
    let (slot, kgrid, nwant) = lattice.table();
    GRIDS[slot].get_or_init(|| Grid::build(kgrid, nwant))
}

impl Lattice {
    /// Its slot among the lattices, its grid and how many distances of neighbours it lists.
    pub(super) fn table(self) -> (usize, &'static [u16], usize) {
        match self {
            Lattice::Iq2Xxs => (0, &KGRID_2BIT_256, 2),
            Lattice::Iq2Xs => (1, &KGRID_2BIT_512, 2),
            Lattice::Iq2S => (2, &KGRID_2BIT_1024, 1),
            Lattice::Iq1 => (3, &KGRID_1BIT_2048, 3),
        }
    }
}

impl Grid {
    fn build(kgrid: &[u16], nwant: usize) -> Grid {
        let levels: Vec<[u8; 8]> = kgrid
            .iter()
            .map(|&c| std::array::from_fn(|i| ((c >> (2 * i)) & 3) as u8))
            .collect();
        let mut on_grid = vec![None; MAP_CODES];
        for (k, &c) in kgrid.iter().enumerate() {
            on_grid[c as usize] = Some(k as u16);
        }
        let off: Vec<usize> = (0..MAP_CODES).filter(|&c| on_grid[c].is_none()).collect();
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
        let per = off.len().div_ceil(threads).max(1);
        let lists: Vec<Vec<Vec<u16>>> = std::thread::scope(|s| {
            let workers: Vec<_> = off
                .chunks(per)
                .map(|codes| {
                    let levels = &levels;
                    s.spawn(move || {
                        let mut d2 = vec![0u16; levels.len()];
                        codes
                            .iter()
                            .map(|&c| nearest(levels, c, nwant, &mut d2))
                            .collect()
                    })
                })
                .collect();
            workers
                .into_iter()
                .map(|w| w.join().expect("a neighbour worker does not panic"))
                .collect()
        });
        let mut map: Vec<Entry> = on_grid
            .iter()
            .map(|e| Entry::OnGrid(e.unwrap_or(0)))
            .collect();
        let mut neighbours = Vec::new();
        for (&code, list) in off.iter().zip(lists.into_iter().flatten()) {
            let start = neighbours.len() as u32;
            map[code] = Entry::Off {
                start,
                len: list.len() as u32,
            };
            neighbours.extend(list);
        }
        Grid {
            points: levels
                .iter()
                .map(|l| l.map(|v| (2 * v + 1) as i8))
                .collect(),
            map,
            neighbours,
        }
    }

    /// Per code: the grid index, or the grid's neighbour list (as kernels/iq_grid.cuh's blob
    /// lays the map out).
    pub(super) fn lists(&self) -> impl Iterator<Item = Result<u16, &[u16]>> {
        self.map.iter().map(|e| match *e {
            Entry::OnGrid(k) => Ok(k),
            Entry::Off { start, len } => {
                Err(&self.neighbours[start as usize..(start + len) as usize])
            }
        })
    }

    /// The coordinates (`2 l + 1`) of grid point `index`.
    #[inline]
    pub(super) fn point(&self, index: usize) -> &[i8; 8] {
        &self.points[index]
    }

    /// The grid index of 8 levels, `None` when they are off the grid.
    #[inline]
    pub(super) fn index_of(&self, levels: &[i8]) -> Option<usize> {
        match self.map[code_of(levels)] {
            Entry::OnGrid(k) => Some(k as usize),
            Entry::Off { .. } => None,
        }
    }

    /// Of the neighbours of off-grid `levels`, the one `distance` puts strictly lowest, the
    /// first on ties (ggml's `iq2_find_best_neighbour` / `iq1_find_best_neighbour2` loop); its
    /// levels replace `levels`. ggml asserts one wins: only NaN or infinite distances leave
    /// none, and then the first neighbour is taken.
    pub(super) fn best_neighbour(
        &self,
        levels: &mut [i8],
        mut distance: impl FnMut(&[i8; 8]) -> f32,
    ) -> usize {
        let candidates = match self.map[code_of(levels)] {
            Entry::Off { start, len } => &self.neighbours[start as usize..(start + len) as usize],
            Entry::OnGrid(k) => return k as usize,
        };
        let mut best_d2 = f32::MAX;
        let mut best = candidates[0] as usize;
        for &j in candidates {
            let d2 = distance(&self.points[j as usize]);
            if d2 < best_d2 {
                best_d2 = d2;
                best = j as usize;
            }
        }
        for (l, &p) in levels.iter_mut().zip(&self.points[best]) {
            *l = (p - 1) / 2;
        }
        best
    }
}

/// The grid points at the `nwant` smallest squared distances from `code`'s point, by
/// distance then index. Distances are in units of 4 (coordinates differ by even numbers).
fn nearest(levels: &[[u8; 8]], code: usize, nwant: usize, d2: &mut [u16]) -> Vec<u16> {
    let pos: [i32; 8] = std::array::from_fn(|i| ((code >> (2 * i)) & 3) as i32);
    for (d, p) in d2.iter_mut().zip(levels) {
        *d = (0..8).map(|i| (p[i] as i32 - pos[i]).pow(2) as u16).sum();
    }
    // The `nwant` smallest distinct distances, ascending.
    let mut smallest: Vec<u16> = Vec::with_capacity(nwant + 1);
    for &d in d2.iter() {
        if let Err(at) = smallest.binary_search(&d) {
            if at < nwant {
                smallest.insert(at, d);
                smallest.truncate(nwant);
            }
        }
    }
    let mut out = Vec::new();
    for &want in &smallest {
        out.extend((0..d2.len()).filter(|&j| d2[j] == want).map(|j| j as u16));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// ggml's construction, literally: sort every `(d², j)` and walk the list.
    fn ggml_neighbours(kgrid: &[u16], code: usize, nwant: usize) -> Vec<u16> {
        let pos: Vec<i32> = (0..8)
            .map(|i| 2 * ((code >> (2 * i)) & 3) as i32 + 1)
            .collect();
        let mut dist2: Vec<(i32, usize)> = kgrid
            .iter()
            .enumerate()
            .map(|(j, &c)| {
                let d: i32 = (0..8)
                    .map(|i| (2 * ((c as i32 >> (2 * i)) & 3) + 1 - pos[i]).pow(2))
                    .sum();
                (d, j)
            })
            .collect();
        dist2.sort();
        let mut out = Vec::new();
        super::super::iq3::push_nearest(&dist2, nwant, &mut out);
        out
    }

    #[test]
    fn neighbour_lists_are_ggmls_sorted_walk() {
        for (lattice, kgrid, nwant) in [
            (Lattice::Iq2Xxs, &KGRID_2BIT_256[..], 2),
            (Lattice::Iq2S, &KGRID_2BIT_1024[..], 1),
            (Lattice::Iq1, &KGRID_1BIT_2048[..], 3),
        ] {
            let g = grid(lattice);
            let mut checked = 0;
            for code in (0..MAP_CODES).step_by(97) {
                match g.map[code] {
                    Entry::OnGrid(k) => assert_eq!(kgrid[k as usize] as usize, code),
                    Entry::Off { start, len } => {
                        let got = &g.neighbours[start as usize..(start + len) as usize];
                        assert_eq!(got, ggml_neighbours(kgrid, code, nwant), "{code}");
                        checked += 1;
                    }
                }
            }
            assert!(checked > 300, "{lattice:?}: {checked}");
        }
    }

    #[test]
    fn grid_points_map_to_their_index() {
        let g = grid(Lattice::Iq2Xs);
        for (k, &c) in KGRID_2BIT_512.iter().enumerate() {
            let levels: Vec<i8> = (0..8).map(|i| ((c >> (2 * i)) & 3) as i8).collect();
            assert_eq!(g.index_of(&levels), Some(k));
            assert_eq!(g.point(k)[0], 2 * levels[0] + 1);
        }
    }
}
