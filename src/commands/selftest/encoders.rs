//! Selftest cases of the quantisers' kernels (`tftf quantize`): every scheme on every
//! weight dtype, as compressed-tensors and as ModelOpt compute it, on rows built to reach the
//! encoders' edges.

use std::sync::Arc;

use super::inputs::{f32_bytes_as, Case, Lcg};
use crate::format::dtype::DType;
use crate::ops::fp8::codec::e4m3_to_f32;
use crate::ops::gguf::op::Slot;
use crate::ops::gguf::produce;
use crate::ops::gguf::tensor::{OutputTensor, Recipe, RowMap};
use crate::ops::gguf::{GgmlType, GgufTensorOp};
use crate::ops::quantize::encode::{amax, modelopt_nvfp4_scale_2, nvfp4_global_scale, WeightType};
use crate::ops::quantize::modelopt::ModeloptRows;
use crate::ops::quantize::ops::{BlockMath, QuantizeRows};
use crate::ops::quantize::Scheme;
use crate::ops::Op;

/// Values that sit on a rounding boundary when the scale is 1: E4M3 midpoints (ties of the FP8
/// encoders), E2M1 midpoints, and half integers (ties of the int encoders). All are exact in
/// BF16 and F16.
fn ties() -> Vec<f32> {
    let mut v: Vec<f32> = (0u8..0x7E)
        .map(|c| (e4m3_to_f32(c) + e4m3_to_f32(c + 1)) / 2.0)
        .collect();
    v.extend([0.25f32, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]);
    v.extend((0..128).map(|k| k as f32 + 0.5));
    v
}

/// Group maxima that make the scale 1 (or a power of two) under each scheme: 448 (FP8), 6
/// (NVFP4 with tensor scale 1), 127.5 and 7.5 (W8, W4), 4 and 256 (MXFP4, MXFP8).
const TIE_AMAX: [f32; 6] = [448.0, 6.0, 127.5, 7.5, 4.0, 256.0];

/// A `rows` × `cols` weight stored as `wt`, a row kind per row (by row number mod 8): all zeros
/// with negative zeros; random values of one magnitude; rounding ties with every 16th element at
/// a group maximum that makes the scale 1; magnitudes whose scales are subnormal (F16: tiny
/// subnormal weights); large magnitudes; a magnitude per 16 elements; F16-subnormal weights;
/// zero groups and small negatives that round to -0 beside a maximum.
pub fn quantize_weight(wt: WeightType, rows: u64, cols: u64, rng: &mut Lcg) -> Vec<u8> {
    let ties = ties();
    let f16 = wt == WeightType::F16;
    let unit = |rng: &mut Lcg| rng.next_u32() as f32 / u32::MAX as f32 * 2.0 - 1.0;
    let mut v = Vec::with_capacity((rows * cols) as usize);
    for r in 0..rows {
        let e_row = if f16 {
            (rng.next_u32() % 24) as i32 - 12
        } else {
            (rng.next_u32() % 40) as i32 - 24
        };
        let a = TIE_AMAX[(r / 8) as usize % TIE_AMAX.len()];
        let mut e_group = 0;
        for c in 0..cols {
            if c % 16 == 0 {
                e_group = (rng.next_u32() % 36) as i32 - if f16 { 20 } else { 28 };
            }
            let x = match r % 8 {
                0 => {
                    if c % 3 == 1 {
                        -0.0
                    } else {
                        0.0
                    }
                }
                1 => unit(rng) * 2f32.powi(e_row),
                2 => {
                    let sign = if rng.next_u32() & 1 == 1 { -1.0 } else { 1.0 };
                    if c % 16 == 0 {
                        sign * a
                    } else {
                        // a tie no larger than the group maximum
                        let t = ties[rng.next_u32() as usize % ties.len()];
                        sign * if t <= a { t } else { t % a }
                    }
                }
                3 if f16 => unit(rng) * 2f32.powi(-14 - (rng.next_u32() % 10) as i32),
                3 => unit(rng) * 2f32.powi(-118 - (rng.next_u32() % 16) as i32),
                4 if f16 => unit(rng) * 2f32.powi(10 + (rng.next_u32() % 5) as i32),
                4 => unit(rng) * 2f32.powi(100 + (rng.next_u32() % 26) as i32),
                5 => unit(rng) * 2f32.powi(e_group),
                6 => unit(rng) * 2f32.powi(-24 + (rng.next_u32() % 11) as i32),
                _ => match c % 32 {
                    0 => 6.0,
                    1..=15 => -(unit(rng).abs() * 0.25),
                    _ if c / 32 % 2 == 1 => 0.0,
                    _ => unit(rng) * 3.0,
                },
            };
            v.push(x);
        }
    }
    let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
    f32_bytes_as(wt.dtype(), &bytes)
}

/// The row-local schemes with a column count each (FP8_DYNAMIC's ragged: it has no groups).
pub const QUANTIZE_SHAPES: [(Scheme, u64); 6] = [
    (Scheme::Fp8Dynamic, 300),
    (Scheme::W8A16, 256),
    (Scheme::W4A16, 384),
    (Scheme::Nvfp4A16, 80),
    (Scheme::Mxfp4A16, 96),
    (Scheme::Mxfp8A16, 160),
];

/// The quantiser op of `scheme` over `weight` (NVFP4's tensor scale from its amax, as a
/// weight outside a fused group gets).
pub fn quantize_op(
    scheme: Scheme,
    wt: WeightType,
    rows: u64,
    cols: u64,
    weight: &[u8],
) -> QuantizeRows {
    let global = if scheme == Scheme::Nvfp4A16 {
        let mut x = Vec::new();
        wt.decode(weight, &mut x);
        nvfp4_global_scale(wt, amax(&x))
    } else {
        1.0
    };
    QuantizeRows {
        scheme,
        rows,
        cols,
        wt,
        global,
        block: BlockMath::CompressedTensors,
    }
}

/// A `quantize` case of a `rows`×`cols` weight ([`quantize_weight`]) of each weight dtype
/// (BF16, F16, F32), named `label` and the dtype, quantised by `op(dtype, weight)`.
fn weight_dtype_cases<O: Op + 'static>(
    rng: &mut Lcg,
    out: &mut Vec<Case>,
    label: &str,
    rows: u64,
    cols: u64,
    op: impl Fn(WeightType, &[u8]) -> O,
) {
    for wt in [WeightType::BF16, WeightType::F16, WeightType::F32] {
        let weight = quantize_weight(wt, rows, cols, rng);
        out.push(Case {
            kernel: "quantize",
            what: format!("{label} {}, {rows}×{cols}", wt.dtype()),
            op: Arc::new(op(wt, &weight)),
            inputs: vec![weight],
            out_dtype: DType::U8,
        });
    }
}

/// Every row-local scheme × weight dtype, 48 rows (each row kind six times), and FP8 blocks in
/// both block arithmetics (ragged rows and columns).
pub fn quantize_cases(rng: &mut Lcg, out: &mut Vec<Case>) {
    let rows = 48u64;
    for (scheme, cols) in QUANTIZE_SHAPES {
        weight_dtype_cases(rng, out, scheme.name(), rows, cols, |wt, weight| {
            quantize_op(scheme, wt, rows, cols, weight)
        });
    }
    // 300 rows: two whole block rows and a short one; 300 columns: a ragged last block.
    let (rows, cols) = (300u64, 300u64);
    for math in [BlockMath::CompressedTensors, BlockMath::Transformers] {
        for wt in [WeightType::BF16, WeightType::F16, WeightType::F32] {
            out.push(Case {
                kernel: "quantize",
                what: format!(
                    "FP8_BLOCK{} {}, {rows}×{cols}",
                    if math == BlockMath::Transformers {
                        " fp8-native"
                    } else {
                        ""
                    },
                    wt.dtype()
                ),
                op: Arc::new(QuantizeRows {
                    scheme: Scheme::Fp8Block,
                    rows,
                    cols,
                    wt,
                    global: 1.0,
                    block: math,
                }),
                inputs: vec![quantize_weight(wt, rows, cols, rng)],
                out_dtype: DType::U8,
            });
        }
    }
}

/// ModelOpt's quantiser op of `scheme` over `weight` (NVFP4's `weight_scale_2` from its amax,
/// as a weight outside a fused group gets).
pub fn modelopt_op(
    scheme: Scheme,
    wt: WeightType,
    rows: u64,
    cols: u64,
    weight: &[u8],
) -> ModeloptRows {
    let mut x = Vec::new();
    wt.decode(weight, &mut x);
    ModeloptRows {
        scheme,
        rows,
        cols,
        wt,
        scale_2: modelopt_nvfp4_scale_2(amax(&x)),
    }
}

/// ModelOpt's schemes (`--format modelopt`) × weight dtype, 48 rows, FP8 blocks on 300×300.
pub fn modelopt_cases(rng: &mut Lcg, out: &mut Vec<Case>) {
    let shapes = QUANTIZE_SHAPES
        .into_iter()
        .filter(|(s, _)| *s != Scheme::W8A16)
        .map(|(s, c)| (s, 48u64, c))
        .chain([(Scheme::Fp8Block, 300, 300)]);
    for (scheme, rows, cols) in shapes {
        let label = format!("ModelOpt {}", scheme.name());
        weight_dtype_cases(rng, out, &label, rows, cols, |wt, weight| {
            modelopt_op(scheme, wt, rows, cols, weight)
        });
    }
}

/// A GGUF weight for the block encoders, `rows` × `cols` f32 values, a kind of row per row (by
/// row number mod 8): one magnitude; all zeros and negative zeros; one large outlier; values so
/// small their scales are f16-subnormal; large values; sums of three uniforms; half integers
/// (rounding ties at scale 1); runs of one constant (sub-blocks whose max equals their min).
/// Finite, as a GPU makes NaNs of its own payload where x86 keeps the input's.
pub fn gguf_block_weight(rows: u64, cols: u64, rng: &mut Lcg) -> Vec<u8> {
    let mut unit = || rng.next_u32() as f32 / u32::MAX as f32 * 2.0 - 1.0;
    let mut v = Vec::with_capacity((rows * cols) as usize);
    for r in 0..rows {
        let scale = 2f32.powi((r as i32 * 5) % 14 - 10);
        let constant = unit();
        for c in 0..cols {
            let x = match r % 8 {
                0 => unit() * scale,
                1 => [0.0, -0.0][(c % 2) as usize],
                2 if c == 37 => 50.0 * scale,
                2 => unit() * scale,
                3 => unit() * 2f32.powi(-30),
                4 => unit() * 4096.0,
                5 => (unit() + unit() + unit()) * scale,
                6 => (unit() * 8.0).floor() + 0.5,
                _ => constant * scale * (1 + c / 32) as f32,
            };
            v.push(x);
        }
    }
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// Importance weights, `rows` rows of `cols`: random magnitudes, exact zeros, and a first
/// sub-block of zeros in every other row (a fit that has no weight at all).
fn gguf_importance(rows: u64, cols: u64, rng: &mut Lcg) -> Arc<[f32]> {
    (0..rows * cols)
        .map(|i| {
            let (r, c) = (i / cols, i % cols);
            match (r % 2 == 1 && c < 32, c % 7) {
                (true, _) | (_, 3) => 0.0,
                _ => (rng.next_u32() % 4000) as f32 / 1000.0 * 2f32.powi((c % 5) as i32 - 2),
            }
        })
        .collect()
}

/// One GGUF tensor case: `recipe` (named `recipe_name`) over sources `s0`, `s1`, … (one per
/// input) to `ty`.
fn gguf_case(
    recipe_name: &str,
    what: String,
    (recipe, shape): (&Recipe, &[u64]),
    (ty, dtype): (GgmlType, DType),
    quant_weights: Option<Arc<[f32]>>,
    inputs: Vec<Vec<u8>>,
) -> Case {
    let slots = (0..inputs.len())
        .map(|k| Slot::plain(&format!("s{k}")))
        .collect();
    let tensor = OutputTensor {
        name: format!("gguf {recipe_name}"),
        shape: shape.to_vec(),
        ty,
        recipe: recipe.clone(),
        src_dtype: Some(dtype),
        quant_weights,
    };
    Case {
        kernel: "gguf",
        what,
        op: Arc::new(GgufTensorOp::new(tensor, slots)),
        inputs,
        out_dtype: DType::U8,
    }
}

/// Source tensors a recipe of the cases reads.
fn gguf_sources(recipe: &Recipe) -> u64 {
    match recipe {
        Recipe::Stack { srcs } => srcs.len() as u64,
        _ => 1,
    }
}

/// The recipes the GGUF kernels take, on `rows` × `cols` sources: elements in order,
/// Q/K-permuted rows (`n_head` heads), one half of interleaved rows, three stacked experts.
fn gguf_recipes(rows: u64, cols: u64, n_head: u64) -> Vec<(&'static str, Recipe, Vec<u64>)> {
    let rows_of = |map| Recipe::Rows {
        src: "s0".into(),
        map,
        row_elems: cols,
    };
    vec![
        (
            "direct",
            Recipe::Direct { src: "s0".into() },
            vec![rows, cols],
        ),
        (
            "Q/K permute",
            rows_of(RowMap::QkPermute { rows, n_head }),
            vec![rows, cols],
        ),
        (
            "interleaved up",
            rows_of(RowMap::Interleaved {
                rows_out_per_expert: rows / 2,
                half: 1,
            }),
            vec![rows / 2, cols],
        ),
        (
            "3 experts",
            Recipe::Stack {
                srcs: (0..3).map(|k| format!("s{k}")).collect(),
            },
            vec![3, rows, cols],
        ),
    ]
}

/// GGUF tensors of every block type the kernel encodes (kernels/kquant.cuh), from every float
/// source, with and without importance weights (per expert for stacked experts), for each
/// recipe the kernel takes.
pub fn gguf_block_cases(rng: &mut Lcg, out: &mut Vec<Case>) {
    let (rows, cols) = (8u64, 512u64);
    let types = [
        GgmlType::Q4_0,
        GgmlType::Q4_1,
        GgmlType::Q5_0,
        GgmlType::Q5_1,
        GgmlType::Q2_K,
        GgmlType::Q3_K,
        GgmlType::Q4_K,
        GgmlType::Q5_K,
        GgmlType::Q6_K,
        GgmlType::IQ4_NL,
        GgmlType::IQ4_XS,
        GgmlType::TQ1_0,
        GgmlType::TQ2_0,
        GgmlType::IQ2_XXS,
        GgmlType::IQ2_XS,
        GgmlType::IQ2_S,
        GgmlType::IQ3_XXS,
        GgmlType::IQ3_S,
        GgmlType::IQ1_S,
        GgmlType::IQ1_M,
    ];
    for dtype in [DType::BF16, DType::F16, DType::F32] {
        for (name, recipe, shape) in &gguf_recipes(rows, cols, 2) {
            let sources = gguf_sources(recipe);
            for ty in types {
                for weighted in [false, true] {
                    if !weighted && crate::ops::gguf::encode::needs_quant_weights(ty) {
                        continue;
                    }
                    let weights = weighted.then(|| gguf_importance(sources, cols, rng));
                    let inputs = (0..sources)
                        .map(|_| f32_bytes_as(dtype, &gguf_block_weight(rows, cols, rng)))
                        .collect();
                    let imatrix = if weighted { ", imatrix" } else { "" };
                    let what = format!("{name}, {dtype} → {}{imatrix}", ty.name());
                    let geometry = (recipe, &shape[..]);
                    out.push(gguf_case(
                        name,
                        what,
                        geometry,
                        (ty, dtype),
                        weights,
                        inputs,
                    ));
                }
            }
        }
    }
}

/// GGUF tensors (ops::gguf) from random bits of every float source (NaNs, infinities and
/// subnormals among them) to each type the kernel writes, for each recipe it takes.
pub fn gguf_cases(rng: &mut Lcg, out: &mut Vec<Case>) {
    let (rows, cols) = (16u64, 64u64);
    for dtype in [DType::BF16, DType::F16, DType::F32] {
        let elem = dtype.size().expect("a float dtype");
        for (name, recipe, shape) in &gguf_recipes(rows, cols, 4) {
            for ty in [GgmlType::Q8_0, GgmlType::F16, GgmlType::Bf16, GgmlType::F32] {
                let copy = matches!(recipe, Recipe::Direct { .. } | Recipe::Stack { .. });
                if copy && produce::same_type(dtype, ty) {
                    continue; // a plain copy, which has no kernel
                }
                let inputs = (0..gguf_sources(recipe))
                    .map(|_| rng.bytes((rows * cols) as usize * elem))
                    .collect();
                let what = format!("{name}, {dtype} → {}", ty.name());
                let geometry = (recipe, &shape[..]);
                out.push(gguf_case(name, what, geometry, (ty, dtype), None, inputs));
            }
        }
    }
}
