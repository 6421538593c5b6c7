//! The lattice tables of the IQ1/IQ2/IQ3 encoders as the GPU reads them (kernels/iq_grid.cuh):
//! one blob per lattice, built once per process from the grids the CPU encoders use, uploaded
//! with each launch of a type that needs it.
//!
//! Layout (little-endian): `u32` dimensions, bits per level, grid points, codes, neighbour
//! entries; `u16` grid codes (padded to 4 bytes); `i32` per code: the grid index, or `-(1 +
//! at)` where the code's neighbour list starts in the entries (its length, then its indices);
//! the `u16` entries.

use std::sync::{Arc, OnceLock};

use super::iq2_grid::{grid, Lattice};
use super::iq3;
use crate::ops::gguf::GgmlType;

/// The blob of `ty`'s lattice; `None` for a type without one.
pub fn device_tables(ty: GgmlType) -> Option<Arc<[u8]>> {
    static BLOBS: [OnceLock<Arc<[u8]>>; 6] = [const { OnceLock::new() }; 6];
    let (slot, build): (usize, fn() -> Vec<u8>) = match ty {
        GgmlType::IQ2_XXS => (0, || lattice_blob(Lattice::Iq2Xxs)),
        GgmlType::IQ2_XS => (1, || lattice_blob(Lattice::Iq2Xs)),
        GgmlType::IQ2_S => (2, || lattice_blob(Lattice::Iq2S)),
        GgmlType::IQ1_S | GgmlType::IQ1_M => (3, || lattice_blob(Lattice::Iq1)),
        GgmlType::IQ3_XXS => (4, || iq3_blob(false)),
        GgmlType::IQ3_S => (5, || iq3_blob(true)),
        _ => return None,
    };
    Some(BLOBS[slot].get_or_init(|| build().into()).clone())
}

fn lattice_blob(lattice: Lattice) -> Vec<u8> {
    let (_, kgrid, _) = lattice.table();
    let lists: Vec<Result<u16, &[u16]>> = grid(lattice).lists().collect();
    blob(8, 2, kgrid, &lists)
}

fn iq3_blob(large: bool) -> Vec<u8> {
    let (lists, kgrid) = iq3::lists(large);
    blob(4, 3, kgrid, &lists)
}

/// The blob of a grid of `dims` levels of `bits` bits each.
fn blob(dims: u32, bits: u32, kgrid: &[u16], lists: &[Result<u16, &[u16]>]) -> Vec<u8> {
    let mut map = Vec::with_capacity(lists.len());
    let mut entries: Vec<u16> = Vec::new();
    for l in lists {
        map.push(match l {
            Ok(k) => *k as i32,
            Err(list) => {
                let at = entries.len() as i32;
                entries.push(list.len() as u16);
                entries.extend_from_slice(list);
                -(1 + at)
            }
        });
    }
    let header = [
        dims,
        bits,
        kgrid.len() as u32,
        map.len() as u32,
        entries.len() as u32,
    ];
    let mut out: Vec<u8> = header.iter().flat_map(|v| v.to_le_bytes()).collect();
    out.extend(kgrid.iter().flat_map(|v| v.to_le_bytes()));
    out.resize(out.len().div_ceil(4) * 4, 0);
    out.extend(map.iter().flat_map(|v| v.to_le_bytes()));
    out.extend(entries.iter().flat_map(|v| v.to_le_bytes()));
    out
}
