//! The geometric and remaining merge methods (slerp, nuslerp, multislerp, karcher,
//! model_stock, nearswap, arcee_fusion, ram, ramplus_tl) against mergekit 0.1.5 itself
//! (issue #27 item 2).
//!
//! `tests/fixtures/merge/methods/generate_geometric.py` ran mergekit's registered methods on small seeded
//! tensors, in bf16 and f32 (`C.mk`), and on the same inputs widened to float64 (`C.ref`, the
//! method's formula in float64). Every output element must be within 1 ulp of mergekit's or no
//! farther from the float64 result than mergekit's, and at least 99 % must equal mergekit's or
//! the correctly rounded float64 result (either neighbour where that lies within 1e-12 of a
//! midpoint). NaN must appear exactly where the float64 run has it.

mod common;

use common::merge_fixtures::{json_shape, params, widen};

use common::merge_fixtures::whole_tensor_fn as method;
use half::bf16;
use safetensors::SafeTensors;
use serde_json::Value;
use tftf::ops::merge::methods::{misc, Inputs, ModelTensor, Params};

/// The methods this file checks, in a fixed order.
const METHODS: [&str; 9] = [
    "slerp",
    "nuslerp",
    "multislerp",
    "karcher",
    "model_stock",
    "nearswap",
    "arcee_fusion",
    "ram",
    "ramplus_tl",
];

struct Case {
    key: String,
    method: String,
    base: Option<usize>,
    global: Params,
    per_input: Vec<Params>,
    bf16: bool,
    shape: Vec<usize>,
    inputs: Vec<Vec<f32>>,
    mergekit: Vec<f64>,
    reference: Vec<f64>,
}

fn load(family: &str) -> Vec<Case> {
    let bytes = std::fs::read(common::fixture(&format!(
        "merge/methods/{family}.safetensors"
    )))
    .unwrap();
    let (_, header) = SafeTensors::read_metadata(&bytes).unwrap();
    let file = SafeTensors::deserialize(&bytes).unwrap();
    let mut cases: Vec<Case> = header
        .metadata()
        .as_ref()
        .unwrap()
        .iter()
        .map(|(key, json)| {
            let meta: Value = serde_json::from_str(json).unwrap();
            let count = (0..)
                .take_while(|k| file.tensor(&format!("{key}.in.{k}")).is_ok())
                .count();
            let inputs = (0..count)
                .map(|k| widen(&file.tensor(&format!("{key}.in.{k}")).unwrap()))
                .map(|v| v.into_iter().map(|x| x as f32).collect())
                .collect();
            let base = meta["base"].as_u64().map(|b| b as usize);
            let mut per_input = vec![Params::default(); count];
            for (name, values) in meta["per_input"].as_object().unwrap() {
                let slots = (0..count).filter(|&k| Some(k) != base);
                for (k, v) in slots.zip(values.as_array().unwrap()) {
                    per_input[k] = per_input[k].clone().with(name, v.as_f64().unwrap());
                }
            }
            Case {
                key: key.clone(),
                method: meta["method"].as_str().unwrap().to_string(),
                base,
                global: params(&meta["params"]),
                per_input,
                bf16: meta["dtype"] == "bf16",
                shape: json_shape(&meta["shape"]),
                inputs,
                mergekit: widen(&file.tensor(&format!("{key}.mk")).unwrap()),
                reference: widen(&file.tensor(&format!("{key}.ref")).unwrap()),
            }
        })
        .collect();
    cases.sort_by(|a, b| a.key.cmp(&b.key));
    cases
}

/// Our method on the case's inputs: the base apart, the other models in mergekit's order.
fn merge(case: &Case) -> Result<Vec<f32>, String> {
    let models: Vec<ModelTensor> = (0..case.inputs.len())
        .filter(|&k| Some(k) != case.base)
        .map(|k| ModelTensor {
            values: &case.inputs[k],
            params: &case.per_input[k],
        })
        .collect();
    let base = case.base.map_or(&[][..], |b| case.inputs[b].as_slice());
    let t = Inputs::new(base, &models, &case.global, &case.shape);
    let mut out = vec![0.0f32; case.reference.len()];
    method(&case.method)(&t, &mut out).map(|_| out)
}

/// A value's position on the number line of the output dtype (adjacent values differ by 1).
fn ordinal(x: f64, bf16: bool) -> i64 {
    let (bits, sign) = if bf16 {
        (bf16::from_f32(x as f32).to_bits() as i64, 1 << 15)
    } else {
        ((x as f32).to_bits() as i64, 1 << 31)
    };
    if bits & sign != 0 {
        -(bits & (sign - 1))
    } else {
        bits
    }
}

fn from_ordinal(i: i64, bf16: bool) -> f64 {
    let (magnitude, sign) = (i.unsigned_abs(), i < 0);
    if bf16 {
        bf16::from_bits(magnitude as u16 | if sign { 0x8000 } else { 0 }).to_f64()
    } else {
        f32::from_bits(magnitude as u32 | if sign { 0x8000_0000 } else { 0 }) as f64
    }
}

/// `x` correctly rounded to the output dtype (nearest, ties to even), from float64 directly.
fn round_once(x: f64, bf16: bool) -> f64 {
    let guess = ordinal(x as f32 as f64, bf16);
    let mut best = from_ordinal(guess, bf16);
    for i in [guess - 1, guess + 1] {
        let c = from_ordinal(i, bf16);
        let (dc, db) = ((c - x).abs(), (best - x).abs());
        if dc < db || (dc == db && i.rem_euclid(2) == 0) {
            best = c;
        }
    }
    best
}

/// Checks one case against the bar; returns the max ulps from mergekit and from the rounded
/// float64 result, and the share of elements equal to either.
fn check(case: &Case) -> (i64, i64, f64) {
    let ours = merge(case).unwrap_or_else(|e| panic!("{}: {e}", case.key));
    let (mut worst_mk, mut worst_exact, mut equal) = (0, 0, 0);
    for (k, &o) in ours.iter().enumerate() {
        let (mk, exact) = (case.mergekit[k], case.reference[k]);
        if exact.is_nan() || o.is_nan() {
            assert!(
                exact.is_nan() && o.is_nan(),
                "{} [{k}]: ours {o}, float64 {exact}",
                case.key
            );
            equal += 1;
            continue;
        }
        let o = if case.bf16 {
            bf16::from_f32(o).to_f64()
        } else {
            o as f64
        };
        // The float64 run is itself good to ~1e-15 relative; within 1e-12 of a midpoint
        // between two representable values (`1.5 x` of an f32 `x`, say) either one is the
        // correctly rounded result.
        let (low, high) = (
            round_once(exact * (1.0 - 1e-12), case.bf16),
            round_once(exact * (1.0 + 1e-12), case.bf16),
        );
        let rounded = if o == high { high } else { low };
        let from_mk = (ordinal(o, case.bf16) - ordinal(mk, case.bf16)).abs();
        let from_exact = (ordinal(o, case.bf16) - ordinal(rounded, case.bf16)).abs();
        (worst_mk, worst_exact) = (worst_mk.max(from_mk), worst_exact.max(from_exact));
        assert!(
            from_mk <= 1 || (o - exact).abs() <= (mk - exact).abs(),
            "{} [{k}]: ours {o}, mergekit {mk}, float64 {exact}",
            case.key
        );
        equal += usize::from(o == mk || o == rounded);
    }
    let share = equal as f64 / ours.len().max(1) as f64;
    assert!(
        share >= 0.99,
        "{}: only {:.2} % equal",
        case.key,
        share * 100.0
    );
    (worst_mk, worst_exact, share)
}

fn check_family(family: &str, methods: &[&str]) {
    let cases = load(family);
    for method in methods {
        assert!(
            cases.iter().any(|c| c.method == *method),
            "no {method} case in {family}"
        );
    }
    for case in &cases {
        let dtype = if case.bf16 { "bf16" } else { "f32" };
        let (mk, exact, share) = check(case);
        println!(
            "{} ({}, {dtype}, {:?}): max {mk} ulp from mergekit, {exact} from float64, {:.2} % equal",
            case.key,
            case.method,
            case.shape,
            share * 100.0
        );
    }
}

#[test]
fn slerp_nuslerp_multislerp_match_mergekit() {
    check_family("slerp", &["slerp", "nuslerp", "multislerp"]);
}

#[test]
fn karcher_matches_mergekit() {
    check_family("karcher", &["karcher"]);
}

#[test]
fn model_stock_matches_mergekit() {
    check_family("model_stock", &["model_stock"]);
}

#[test]
fn nearswap_arcee_fusion_ram_ramplus_tl_match_mergekit() {
    check_family("misc", &["nearswap", "arcee_fusion", "ram", "ramplus_tl"]);
}

#[test]
fn every_method_accepts_an_empty_tensor() {
    let (w, none) = (Params::default().with("weight", 1.0), Params::default());
    let global = none.clone().with("t", 0.5);
    let empty: &[f32] = &[];
    let one = [ModelTensor {
        values: empty,
        params: &w,
    }];
    let two = [one[0], one[0]];
    let shape = [0, 4];
    let unflattened = none.clone().with("nuslerp_flatten", 0.0);
    for (name, models, global) in [
        ("slerp", &one[..], &global),
        ("nuslerp", &two, &none),
        ("nuslerp", &two, &unflattened),
        ("multislerp", &two, &none),
        ("karcher", &two, &none),
        ("model_stock", &two, &none),
        ("nearswap", &one, &global),
        ("arcee_fusion", &one, &none),
        ("ram", &two, &none),
        ("ramplus_tl", &two, &none),
    ] {
        let t = Inputs::new(empty, models, global, &shape);
        method(name)(&t, &mut []).unwrap_or_else(|e| panic!("{name}: {e}"));
    }
}

#[test]
fn inputs_of_the_wrong_length_are_refused_not_a_panic() {
    let none = Params::default();
    let (short, long) = ([1.0f32], [1.0f32, 2.0]);
    let models = [ModelTensor {
        values: &short,
        params: &none,
    }];
    let mut out = [0.0f32; 2];
    let t = none.clone().with("t", 1.0);
    let err = misc::nearswap(&Inputs::new(&long, &models, &t, &[2]), &mut out).unwrap_err();
    assert_eq!(err, "model 0 has 1 values, the output 2");
    let same = [ModelTensor {
        values: &long,
        params: &none,
    }];
    let err = misc::arcee_fusion(&Inputs::new(&long, &same, &none, &[3]), &mut out).unwrap_err();
    assert_eq!(err, "shape [3] does not hold 2 values");
}

/// A value a checkpoint or a config might hold, the hostile ones included.
fn odd_f32() -> impl proptest::strategy::Strategy<Value = f32> {
    use proptest::prelude::*;
    prop_oneof![
        4 => -2.0f32..2.0,
        1 => Just(0.0f32),
        1 => Just(f32::NAN),
        1 => Just(f32::INFINITY),
        1 => Just(-f32::MAX),
        1 => Just(1e-40f32),
    ]
}

fn odd_param() -> impl proptest::strategy::Strategy<Value = f64> {
    use proptest::prelude::*;
    prop_oneof![4 => -1.0f64..2.0, 1 => Just(0.0), 1 => Just(f64::NAN), 1 => Just(1e300), 1 => Just(3.0)]
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig { cases: 1000, ..Default::default() })]

    /// Every method ends with Ok or a message on any values, shapes and parameters, and gives
    /// the same bits twice.
    #[test]
    fn methods_never_panic_and_are_deterministic(
        rows in 1usize..4,
        cols in 0usize..6,
        count in 1usize..4,
        values in proptest::collection::vec(odd_f32(), 4 * 3 * 5),
        p in proptest::collection::vec(odd_param(), 8),
    ) {
        let n = rows * cols;
        let inputs: Vec<&[f32]> = (0..=count).map(|m| &values[m * n..(m + 1) * n]).collect();
        let per_model: Vec<Params> = (0..count).map(|m| Params::default().with("weight", p[m])).collect();
        let models: Vec<ModelTensor> =
            (0..count).map(|m| ModelTensor { values: inputs[m + 1], params: &per_model[m] }).collect();
        let global = Params::default()
            .with("t", p[3]).with("epsilon", p[4].abs() * 1e-4).with("eps", p[4].abs() * 1e-6)
            .with("r", p[5]).with("alpha", p[6]).with("tol", p[7].abs() * 1e-3)
            .with("max_iter", (p[7].abs() * 10.0).round().min(50.0))
            .with("filter_wise", (p[5] > 0.5) as u8 as f64)
            .with("nuslerp_flatten", (p[6] > 0.5) as u8 as f64)
            .with("nuslerp_row_wise", (p[7] > 0.5) as u8 as f64)
            .with("normalize_weights", (p[3] > 0.5) as u8 as f64);
        let (base, shape) = (inputs[0], [rows, cols]);
        let all: Vec<ModelTensor> = std::iter::once(ModelTensor { values: base, params: &global })
            .chain(models.iter().copied())
            .collect();
        let run = |name: &str| {
            let mut out = vec![0.0f32; n];
            // karcher takes the base as one more model.
            let t = match name {
                "karcher" => Inputs::new(&[], &all, &global, &shape),
                _ => Inputs { seed: 9, ..Inputs::new(base, &models, &global, &shape) },
            };
            method(name)(&t, &mut out).map(|_| out.iter().map(|x| x.to_bits()).collect::<Vec<_>>())
        };
        for name in METHODS {
            let first = run(name);
            proptest::prop_assert_eq!(&first, &run(name), "method {}", name);
        }
    }
}
