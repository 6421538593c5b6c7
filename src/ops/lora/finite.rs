//! Non-finite adapter values, found at plan time. One NaN or infinity in `lora_A`, `lora_B` or a
//! DoRA magnitude spreads through `B @ A` to a whole row or column of the merged weight (a NaN
//! magnitude, or a NaN in a row's norm, to the whole row), so a merge would write NaN weights
//! without a word. The factors are small (r rows or columns), so reading them once before any
//! output exists costs little next to the merge; `--allow-nonfinite` skips the scan.

use crate::error::{Error, Result};
use crate::format::checkpoint::Checkpoint;
use crate::ops::cast::to_f32;

/// Bytes read at a time: the scan's whole memory.
const SCAN_CHUNK_BYTES: usize = 1 << 20;

/// The error for the first NaN or infinity of the float adapter tensor `tensor` (an index into
/// `ckpt.tensors`), naming the file, the tensor and the element.
pub fn refuse_nonfinite(ckpt: &Checkpoint, tensor: usize) -> Result<()> {
    let t = &ckpt.tensors[tensor];
    let width = (t.info.dtype.bits() / 8).max(1) as usize;
    let total = t.info.nbytes();
    let chunk = SCAN_CHUNK_BYTES / width * width;
    let mut buf = vec![0u8; chunk.min(total as usize)];
    let mut at = 0u64;
    while at < total {
        let n = chunk.min((total - at) as usize);
        ckpt.read_tensor_at(t, at, &mut buf[..n])?;
        let values = to_f32(t.info.dtype, &buf[..n]);
        if let Some(k) = values.iter().position(|v| !v.is_finite()) {
            let element = at / width as u64 + k as u64;
            return Err(Error::TensorData {
                path: ckpt.shards[t.shard()].path.clone(),
                tensor: t.info.name.clone(),
                msg: format!(
                    "holds {} at {}: merging it would write non-finite weights; fix the adapter, or pass --allow-nonfinite to merge it anyway",
                    values[k],
                    position(&t.info.shape, element)
                ),
            });
        }
        at += n as u64;
    }
    Ok(())
}

/// `[i, j, …]` of the row-major element `index` of a tensor of `shape`.
fn position(shape: &[u64], mut index: u64) -> String {
    let mut at = vec![0u64; shape.len()];
    for (slot, &d) in at.iter_mut().zip(shape).rev() {
        if d > 0 {
            *slot = index % d;
            index /= d;
        }
    }
    let parts: Vec<String> = at.iter().map(u64::to_string).collect();
    format!("[{}]", parts.join(", "))
}

#[cfg(test)]
mod tests {
    #[test]
    fn positions_are_row_major() {
        assert_eq!(super::position(&[3, 4], 7), "[1, 3]");
        assert_eq!(super::position(&[2, 3, 4], 23), "[1, 2, 3]");
        assert_eq!(super::position(&[5], 4), "[4]");
    }
}
