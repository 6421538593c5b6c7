//! Reading the merge fixtures (tests/fixtures/merge/): tensors widened to f64, mergekit's
//! parameter objects, and the accuracy bar against mergekit's merges.

use std::collections::BTreeMap;
use std::path::Path;

use half::bf16;
use safetensors::tensor::TensorView;
use safetensors::Dtype;
use serde_json::Value;
use tftf::ops::merge::methods::Params;
use tftf::ops::merge::spec::{Arithmetic, MethodSpec, WholeTensorFn};

use super::{load_all, load_tensors};

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

/// The whole-tensor function the registry runs for method `name`.
pub fn whole_tensor_fn(name: &str) -> WholeTensorFn {
    match MethodSpec::get(name).map(|m| m.arithmetic) {
        Some(Arithmetic::WholeTensor(f)) => f,
        _ => panic!("no whole-tensor method {name}"),
    }
}

/// A fixture's `shape` (a JSON array of integers).
pub fn json_shape(value: &Value) -> Vec<usize> {
    let dims = value.as_array().unwrap().iter();
    dims.map(|d| d.as_u64().unwrap() as usize).collect()
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

/// Element `i` of a BF16 or F32 tensor's bytes as (f64 value, ordered integer for ulp
/// distances).
pub fn element(dtype: &str, bytes: &[u8], i: usize) -> (f64, i64) {
    let ordered = |bits: i64, sign: bool, mag: i64| if sign { -mag } else { bits.min(mag) };
    match dtype {
        "BF16" => {
            let b = u16::from_le_bytes([bytes[2 * i], bytes[2 * i + 1]]);
            let v = f32::from_bits((b as u32) << 16) as f64;
            let mag = (b & 0x7fff) as i64;
            (v, ordered(mag, b & 0x8000 != 0, mag))
        }
        "F32" => {
            let b = u32::from_le_bytes(bytes[4 * i..4 * i + 4].try_into().unwrap());
            let mag = (b & 0x7fff_ffff) as i64;
            (
                f32::from_bits(b) as f64,
                ordered(mag, b & 0x8000_0000 != 0, mag),
            )
        }
        d => panic!("unexpected dtype {d}"),
    }
}

/// `x` rounded once to `dtype` (nearest even), as the ordered integer of [`element`].
pub fn rounded(dtype: &str, x: f64) -> i64 {
    match dtype {
        "BF16" => {
            let b = half::bf16::from_f64(x).to_le_bytes();
            element("BF16", &b, 0).1
        }
        _ => element("F32", &(x as f32).to_le_bytes(), 0).1,
    }
}

/// Tensors by name: dtype, shape, bytes (as [`load_all`] reads them).
pub type Tensors = BTreeMap<String, (String, Vec<usize>, Vec<u8>)>;

/// The accuracy bar for merge `name`: every element within 1 ulp of mergekit's (the
/// output folder `theirs`), or no farther from the float64 result (`exact`) than mergekit's;
/// at least 99 % equal to mergekit's or to the correctly rounded float64 result. Returns the
/// share equal to mergekit's.
pub fn assert_as_right_as(name: &str, theirs: &Path, exact: &Path, ours: &Tensors) -> f64 {
    assert_as_right_as_but_ties(name, theirs, exact, ours, &|_, n| vec![false; n])
}

/// As [`assert_as_right_as`], except at the elements `tied(tensor, len)` marks: those whose
/// survival depends on the order of equal keys at a ranking's threshold (torch's unstable sort
/// there, any documented order here), which count only towards the 99 %.
pub fn assert_as_right_as_but_ties(
    name: &str,
    theirs: &Path,
    exact: &Path,
    ours: &Tensors,
    tied: &dyn Fn(&str, usize) -> Vec<bool>,
) -> f64 {
    let theirs = load_all(theirs);
    let exact = load_tensors(exact, false);
    assert_eq!(
        ours.keys().collect::<Vec<_>>(),
        theirs.keys().collect::<Vec<_>>(),
        "tensor names"
    );
    let (mut total, mut good, mut same) = (0usize, 0usize, 0usize);
    for (k, (dtype, shape, bytes)) in ours {
        let (d2, s2, b2) = &theirs[k];
        assert_eq!((dtype, shape), (d2, s2), "{k}: dtype and shape");
        let (exact_dtype, _, e) = &exact[k];
        let n = shape.iter().product::<usize>();
        let tied = tied(k, n);
        for i in 0..n {
            let (v, o) = element(dtype, bytes, i);
            let (mv, mo) = element(dtype, b2, i);
            // The newer methods' oracle is stored rounded to f32 (their outputs are bf16).
            let x = match exact_dtype.as_str() {
                "F64" => f64::from_le_bytes(e[8 * i..8 * i + 8].try_into().unwrap()),
                _ => element("F32", e, i).0,
            };
            let correct = rounded(dtype, x);
            assert!(
                tied[i] || o == correct || (o - mo).abs() <= 1 || (v - x).abs() <= (mv - x).abs(),
                "{k}[{i}]: ours {v}, mergekit {mv}, exact {x}"
            );
            total += 1;
            good += usize::from(o == mo || o == correct);
            same += usize::from(o == mo);
        }
    }
    assert!(
        good * 100 >= total * 99,
        "{name}: only {good} of {total} elements equal mergekit's or the exact result"
    );
    same as f64 / total as f64
}
