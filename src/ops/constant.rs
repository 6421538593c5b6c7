//! An op for a small tensor whose bytes are known at plan time (a quantised weight's
//! `weight_shape`, an MXFP4→NVFP4 `weight_scale_2` of `2^g`): written like any computed tensor,
//! so the plan needs no special recipe for it.

use std::ops::Range;

use crate::ops::Op;

/// A small tensor whose bytes are fixed at plan time.
#[derive(Debug)]
pub struct Constant {
    pub what: &'static str,
    pub bytes: Vec<u8>,
}

impl Op for Constant {
    fn name(&self) -> &'static str {
        self.what
    }
    fn units(&self) -> u64 {
        1
    }
    fn out_unit_bytes(&self) -> u64 {
        self.bytes.len() as u64
    }
    fn in_unit_bytes(&self) -> u64 {
        0
    }
    fn input_ranges(&self, _units: Range<u64>) -> Vec<Range<u64>> {
        Vec::new()
    }
    fn compute(&self, _units: Range<u64>, _inputs: &[&[u8]], out: &mut [u8]) -> Result<(), String> {
        out.copy_from_slice(&self.bytes);
        Ok(())
    }
}
