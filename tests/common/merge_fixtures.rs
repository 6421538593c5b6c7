//! Reading the merge methods' golden fixtures (tests/fixtures/merge/methods/): tensors widened
//! to f64 and mergekit's parameter objects.

use std::collections::BTreeMap;

use half::bf16;
use safetensors::tensor::TensorView;
use safetensors::Dtype;
use serde_json::Value;
use tftf::ops::merge::methods::Params;

/// The values of a bf16, f32 or f64 fixture tensor, exactly, as f64.
pub fn widen(view: &TensorView) -> Vec<f64> {
    let data = view.data();
    match view.dtype() {
        Dtype::BF16 => data
            .chunks_exact(2)
            .map(|b| bf16::from_le_bytes([b[0], b[1]]).to_f64())
            .collect(),
        Dtype::F32 => data
            .chunks_exact(4)
            .map(|b| f64::from(f32::from_le_bytes(b.try_into().unwrap())))
            .collect(),
        Dtype::F64 => data
            .chunks_exact(8)
            .map(|b| f64::from_le_bytes(b.try_into().unwrap()))
            .collect(),
        other => panic!("unexpected dtype {other:?}"),
    }
}

/// A JSON object of mergekit parameters (numbers, booleans as 0/1) as [`Params`].
pub fn params(value: &Value) -> Params {
    let mut map = BTreeMap::new();
    for (key, v) in value.as_object().unwrap() {
        let v = match v {
            Value::Bool(b) => f64::from(u8::from(*b)),
            v => v.as_f64().unwrap(),
        };
        map.insert(key.clone(), v);
    }
    Params(map)
}
