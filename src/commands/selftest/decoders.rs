//! Selftest cases of the weight decoders' kernels: packed FP4 (NVFP4, MXFP4, gpt-oss experts)
//! and packed integers (compressed-tensors, GPTQ, ModelOpt INT4).

use std::sync::Arc;

use super::inputs::{scale_values, Case, Lcg};
use crate::format::dtype::DType;
use crate::ops::fp4::dequant::{BlockScale, DequantFp4, GlobalScale};
use crate::ops::int::gptq::DequantGptq;
use crate::ops::int::modelopt::DequantModeloptInt4;
use crate::ops::int::DequantPackedInt;

/// Packed integers of every width 1–8, symmetric and with packed zero points (72 rows: the
/// zero-point words of a chunk straddle), scales of every float dtype with a NaN and an
/// infinity among them, into every output dtype.
pub fn int_cases(rng: &mut Lcg, out: &mut Vec<Case>) {
    use DType::{BF16, F16, F32};
    for bits in 1..=8u64 {
        for (zero_point, scale_dtype, dst) in [
            (false, BF16, BF16),
            (true, BF16, BF16),
            (true, F16, F16),
            (true, F32, F32),
            (false, F32, BF16),
        ] {
            let (rows, cols) = (72u64, 96u64);
            let group = if bits % 2 == 0 { 32 } else { cols };
            let (words, groups) = ((cols * bits).div_ceil(32), cols / group);
            let mut inputs = vec![
                rng.bytes((rows * words * 4) as usize),
                scale_values(scale_dtype, (rows * groups) as usize, rng, true),
            ];
            if zero_point {
                inputs.push(rng.bytes(((rows * bits).div_ceil(32) * groups * 4) as usize));
            }
            out.push(Case {
                kernel: "dequant-int",
                what: format!(
                    "{bits}-bit{} × {scale_dtype} per {group} → {dst}, {rows}×{cols}",
                    if zero_point { " with zero points" } else { "" }
                ),
                op: Arc::new(DequantPackedInt {
                    rows,
                    cols,
                    bits: bits as u32,
                    words,
                    group,
                    scale_dtype,
                    zero_point,
                    dst,
                }),
                inputs,
                out_dtype: dst,
            });
        }
    }
}

/// GPTQ at 2, 4 and 8 bits, v1 and v2 zeros, groups by size and by an act-order `g_idx` (a
/// shuffled one, and one with an index outside the scales, which both refuse), scales of every
/// float dtype with a NaN and an infinity among them, into every output dtype.
pub fn gptq_cases(rng: &mut Lcg, out: &mut Vec<Case>) {
    use DType::{BF16, F16, F32};
    let (rows, cols, group) = (64u64, 96u64, 32u64);
    let groups = cols / group;
    for bits in [2u32, 4, 8] {
        let p = 32 / bits as u64;
        for (g_idx, zero_offset, scale_dtype, dst) in [
            (None, true, F16, BF16),
            (Some(false), true, F16, F32),
            (Some(false), false, BF16, F16),
            (None, false, F32, F32),
            (Some(true), true, F16, BF16),
        ] {
            let mut inputs = vec![
                rng.bytes((cols / p * rows * 4) as usize),
                rng.bytes((groups * rows / p * 4) as usize),
                scale_values(scale_dtype, (groups * rows) as usize, rng, true),
            ];
            if let Some(bad) = g_idx {
                // act order: each input's group i / group, shuffled
                let mut g: Vec<u32> = (0..cols).map(|i| (i / group) as u32).collect();
                for i in (1..g.len()).rev() {
                    g.swap(i, rng.next_u32() as usize % (i + 1));
                }
                if bad {
                    g[41] = groups as u32;
                }
                inputs.push(g.iter().flat_map(|v| v.to_le_bytes()).collect());
            }
            out.push(Case {
                kernel: "dequant-gptq",
                what: format!(
                    "GPTQ {bits}-bit {} × {scale_dtype} {} → {dst}, {rows}×{cols}",
                    if zero_offset { "v1" } else { "v2" },
                    match g_idx {
                        None => format!("per {group}"),
                        Some(false) => "by g_idx".into(),
                        Some(true) => "by a g_idx outside the groups".into(),
                    }
                ),
                op: Arc::new(DequantGptq {
                    rows,
                    cols,
                    bits,
                    groups,
                    scale_dtype,
                    zero_offset,
                    group_size: g_idx.is_none().then_some(group),
                    dst,
                }),
                inputs,
                out_dtype: dst,
            });
        }
    }
}

/// ModelOpt INT4 (two rows a byte, two's complement) per 32 and per 128 into every output
/// dtype, with finite scales, and with a NaN and an infinite scale (both refuse).
pub fn int4_modelopt_cases(rng: &mut Lcg, out: &mut Vec<Case>) {
    for (group, dst, nonfinite) in [
        (128u64, DType::BF16, false),
        (32, DType::F16, false),
        (32, DType::F32, false),
        (128, DType::BF16, true),
    ] {
        let (rows, cols) = (10u64, 256u64);
        let inputs = vec![
            rng.bytes((rows / 2 * cols) as usize),
            scale_values(DType::F32, (rows * cols / group) as usize, rng, nonfinite),
        ];
        let nonfinite = if nonfinite { ", non-finite scales" } else { "" };
        let op = DequantModeloptInt4 {
            rows,
            cols,
            group,
            dst,
        };
        out.push(Case {
            kernel: "dequant-int4-modelopt",
            what: format!("ModelOpt INT4 per {group} → {dst}, {rows}×{cols}{nonfinite}"),
            op: Arc::new(op),
            inputs,
            out_dtype: dst,
        });
    }
}

/// One packed-FP4 scheme the selftest decodes.
struct Fp4Scheme {
    what: &'static str,
    scale: BlockScale,
    global: GlobalScale,
    /// gpt-oss experts, written transposed.
    transpose: bool,
    negative_zero: bool,
    dst: DType,
    /// `--allow-nonfinite`: non-finite scales are kept (and reached).
    allow: bool,
}

/// compressed-tensors NVFP4 (divides), ModelOpt NVFP4 (multiplies, code 8 is +0), MXFP4 over
/// every exponent (255 is infinite: only with `allow_nonfinite`, where 0 × inf is NaN), gpt-oss
/// experts written transposed.
fn fp4_schemes() -> [Fp4Scheme; 6] {
    use BlockScale::{E4M3, E8M0};
    use DType::{BF16, F16, F32};
    let scheme = |what, scale, global, transpose, negative_zero, dst, allow| Fp4Scheme {
        what,
        scale,
        global,
        transpose,
        negative_zero,
        dst,
        allow,
    };
    [
        scheme(
            "compressed-tensors NVFP4",
            E4M3,
            GlobalScale::Divide,
            false,
            true,
            BF16,
            false,
        ),
        scheme(
            "ModelOpt NVFP4",
            E4M3,
            GlobalScale::Multiply,
            false,
            false,
            F16,
            false,
        ),
        scheme(
            "NVFP4, NaN scales kept",
            E4M3,
            GlobalScale::Divide,
            false,
            true,
            F32,
            true,
        ),
        scheme("MXFP4", E8M0, GlobalScale::None, false, true, BF16, false),
        scheme(
            "MXFP4, every exponent",
            E8M0,
            GlobalScale::None,
            false,
            true,
            F32,
            true,
        ),
        scheme(
            "gpt-oss MXFP4 experts",
            E8M0,
            GlobalScale::None,
            true,
            true,
            BF16,
            false,
        ),
    ]
}

/// Packed FP4 under every scheme of [`fp4_schemes`]; odd rows and a ragged last block.
pub fn fp4_cases(rng: &mut Lcg, out: &mut Vec<Case>) {
    for s in fp4_schemes() {
        let (experts, rows, cols, group) = match (s.scale, s.transpose) {
            (_, true) => (2u64, 5u64, 96u64, 32u64),
            (BlockScale::E4M3, _) => (1, 37, 80, 16),
            (BlockScale::E8M0, _) => (1, 37, 112, 32),
        };
        let all_rows = experts * rows;
        let mut codes = rng.bytes((all_rows * cols / 2) as usize);
        codes[..8].fill(0x88);
        let scales = fp4_block_scales(
            rng,
            s.scale,
            (all_rows * cols.div_ceil(group)) as usize,
            s.allow,
        );
        let mut inputs = vec![codes, scales];
        // Typical tensor scales: amax-derived for compressed-tensors, its inverse for ModelOpt.
        match s.global {
            GlobalScale::Divide => inputs.push(1234.567f32.to_le_bytes().to_vec()),
            GlobalScale::Multiply => inputs.push(0.000_371_9f32.to_le_bytes().to_vec()),
            GlobalScale::None => {}
        }
        let dst = s.dst;
        out.push(Case {
            kernel: "dequant-fp4",
            what: format!("{} → {dst}, {experts}×{rows}×{cols}", s.what),
            op: Arc::new(DequantFp4 {
                experts,
                rows,
                cols,
                group,
                scale: s.scale,
                global: s.global,
                transpose: s.transpose,
                negative_zero: s.negative_zero,
                dst,
                allow_nonfinite: s.allow,
            }),
            inputs,
            out_dtype: dst,
        });
    }
}

/// `n` block scales of kind `scale`: with `allow`, every E8M0 exponent in turn or NaN E4M3
/// scales among random ones; without, finite random scales.
fn fp4_block_scales(rng: &mut Lcg, scale: BlockScale, n: usize, allow: bool) -> Vec<u8> {
    match scale {
        BlockScale::E8M0 if allow => (0..n).map(|i| (i % 256) as u8).collect(),
        BlockScale::E8M0 => (0..n).map(|_| (rng.next_u32() % 120) as u8 + 60).collect(),
        BlockScale::E4M3 => (0..n)
            .map(|i| match rng.next_u32() as u8 & 0x7F {
                0x7F if !allow => 0x7E,
                _ if allow && i % 17 == 3 => 0xFF,
                c => c,
            })
            .collect(),
    }
}
