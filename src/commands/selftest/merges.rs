//! Selftest cases of the elementwise merge kernel (`tftf merge`'s linear and task arithmetic):
//! inputs of every float dtype with random bits (NaNs, infinities, subnormals among them),
//! rounded first to each compute dtype, into each output dtype.

use std::sync::Arc;

use super::inputs::{Case, Lcg};
use crate::format::dtype::DType;
use crate::ops::merge::op::MergeOp;

/// A merge of the cases: its name, whether it is task arithmetic, the weights, the denominator
/// or scale, the inputs' dtypes.
type Mix = (&'static str, bool, Vec<f64>, f64, Vec<DType>);

pub fn merge_cases(rng: &mut Lcg, out: &mut Vec<Case>) {
    let elements = 1000u64;
    let mixes: [Mix; 3] = [
        (
            "linear",
            false,
            vec![0.5, 0.3, 0.2],
            1.0,
            vec![DType::BF16, DType::F16, DType::F32],
        ),
        (
            "linear, normalised",
            false,
            vec![1.0, 3.0, -0.7, 0.1],
            3.4,
            vec![DType::F64, DType::BF16, DType::BF16, DType::F32],
        ),
        (
            "task arithmetic",
            true,
            vec![0.7, -0.4],
            1.3,
            vec![DType::F32, DType::BF16, DType::F64],
        ),
    ];
    let computes = [None, Some(DType::BF16), Some(DType::F16), Some(DType::F32)];
    for (what, task, weights, coef, dtypes) in &mixes {
        for compute in computes {
            for dst in [DType::BF16, DType::F16, DType::F32, DType::F64] {
                let inputs = dtypes
                    .iter()
                    .map(|d| rng.bytes(elements as usize * d.size().expect("a float")))
                    .collect();
                let op = MergeOp::elementwise(
                    *task,
                    weights.clone(),
                    *coef,
                    dtypes.clone(),
                    compute,
                    elements,
                    dst,
                );
                let compute = compute.map_or("inputs'".into(), |c| c.to_string());
                out.push(Case {
                    kernel: "merge",
                    what: format!("{what}, computed as {compute} → {dst}"),
                    op: Arc::new(op),
                    inputs,
                    out_dtype: dst,
                });
            }
        }
    }
}
