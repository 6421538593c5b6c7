//! `tftf selftest`: every GPU kernel against the CPU op, on random inputs and every edge code.
//!
//! Each case is a real op (the same structs the pipeline runs) with inputs chosen to reach
//! rounding ties, subnormals, NaN payloads, saturation and refused values. The GPU result must
//! equal the CPU bytes exactly, the LoRA/DoRA merge included (its product is summed in one fixed
//! order on both devices); on a mismatch the table shows how many units in the last place apart.
//! Without a GPU (`--device cpu`) each case instead compares the CPU op run whole with the same
//! op run in two chunks, which is what keeps output independent of chunk size.

use std::ops::Range;
use std::sync::Arc;
use std::time::Instant;

use crate::format::dtype::DType;
use crate::gpu::cuda::Ran;
use crate::gpu::Device;
use crate::ops::cast::Cast;
use crate::ops::fp4::engram::EngramRequant;
use crate::ops::fp4::nvfp4::{NvBlockScales, NvReencode};
use crate::ops::fp8::{DequantFp8, ScaleLayout, ScaleMode};
use crate::ops::kernel::Kernel;
use crate::ops::lora::merge::{ExpertSlice, GroupedLoraMerge, LoraFactors, LoraMerge};
use crate::ops::Op;

use super::inputs::scale_values;
pub use super::inputs::{f32_bytes_as, Case, Lcg};

/// f32 bit patterns that stress conversions: zeros, subnormal edges, infinities, NaNs with
/// payloads and both signs, BF16/F16 rounding ties and overflow edges, every exponent.
pub fn f32_edges() -> Vec<u32> {
    let mut v = vec![
        0x0000_0000,
        0x8000_0000,
        0x0000_0001,
        0x8000_0001,
        0x007F_FFFF,
        0x0080_0000,
        0x7F7F_FFFF,
        0xFF7F_FFFF,
        0x7F80_0000,
        0xFF80_0000,
        0x7FC0_0000,
        0xFFC0_0000,
        0x7F80_0001,
        0xFF80_0001,
        0x7FBF_FFFF,
        0x7FFF_FFFF,
        0x3F80_8000,
        0x3F81_8000,
        0x3F80_7FFF,
        0x3F80_8001,
        0x477F_E000,
        0x477F_F000,
        0x477F_EFFF,
        0x4780_0000,
        0x3300_0000,
        0x3300_0001,
        0x32FF_FFFF,
        0x3380_0000,
        0x387F_C000,
        0x3880_0000,
        0x7F7F_8000,
        0x7F7F_7FFF,
    ];
    for e in 0..256u32 {
        for m in [
            0u32, 1, 0x1000, 0x1FFF, 0x2000, 0x6000, 0x8000, 0x7FFF, 0x18000, 0x400000,
        ] {
            v.push(e << 23 | m);
            v.push(0x8000_0000 | e << 23 | m);
        }
    }
    v
}

/// f64 patterns around the f32 and 16-bit rounding boundaries, NaN payloads, every 7th exponent.
pub fn f64_edges() -> Vec<u64> {
    let mut v = vec![
        0,
        0x8000_0000_0000_0000,
        1,
        0x7FF0_0000_0000_0000,
        0xFFF0_0000_0000_0000,
        0x7FF8_0000_0000_0000,
        0xFFF8_0000_0000_0001,
        0x7FF0_0000_0000_0001,
        0x7FF4_5678_9ABC_DEF0,
        0x47EF_FFFF_E000_0000,
        0x47EF_FFFF_F000_0000,
        0x47EF_FFFF_EFFF_FFFF,
        0x47F0_0000_0000_0000,
        0x3690_0000_0000_0000,
        0x36A0_0000_0000_0000,
        0x3FF0_1000_0000_0000,
        0x3FF0_1000_0000_0001,
        0x3FF0_0FFF_FFFF_FFFF,
        0x3FF0_0000_1000_0000,
        0x3FF0_0000_1000_0001,
    ];
    for e in (0..2048u64).step_by(7) {
        for m in [
            0u64,
            1,
            0x1000_0000,
            0x1000_0001,
            0x0FFF_FFFF,
            0x8_0000_0000_0000,
        ] {
            v.push(e << 52 | m);
            v.push(1 << 63 | e << 52 | m);
        }
    }
    v
}

/// Inputs for a cast from `src`: every 8- and 16-bit code, the float edges, integer extremes
/// around 2^24 rounding, and random bytes.
pub fn cast_inputs(src: DType, rng: &mut Lcg) -> Vec<u8> {
    let mut v: Vec<u8> = match src {
        DType::F32 => f32_edges().iter().flat_map(|x| x.to_le_bytes()).collect(),
        DType::F64 => f64_edges().iter().flat_map(|x| x.to_le_bytes()).collect(),
        DType::F16 | DType::BF16 | DType::I16 | DType::U16 => {
            (0..=u16::MAX).flat_map(|x| x.to_le_bytes()).collect()
        }
        DType::BOOL => return vec![0, 1],
        DType::U8 | DType::I8 => (0..=255).collect(),
        DType::I32 | DType::U32 => [
            0u32,
            1,
            0x7FFF_FFFF,
            0x8000_0000,
            0xFFFF_FFFF,
            0x0100_0001,
            0x0100_0003,
            0x0300_0002,
            0xFFFF_FF7F,
            0x00FF_FFFF,
            0x0200_0003,
        ]
        .iter()
        .flat_map(|x| x.to_le_bytes())
        .collect(),
        _ => [
            0u64,
            1,
            u64::MAX,
            1 << 63,
            (1 << 63) - 1,
            0x0100_0000_0000_0001,
            0x0000_0000_0100_0001,
            0xFFFF_FFFF_FEFF_FFFF,
            0x8000_0080_0000_0000,
            0x8000_0080_0000_0001,
            0x00FF_FFFF_8000_0000,
        ]
        .iter()
        .flat_map(|x| x.to_le_bytes())
        .collect(),
    };
    v.extend(rng.bytes(64 << 10));
    let size = (src.bits() / 8) as usize;
    v.truncate(v.len() / size * size);
    v
}

/// A dequantisation test shape: experts × rows × cols with `br` × `bc` blocks (ragged edges
/// allowed); `shared`: one scale for every expert.
#[derive(Clone, Copy)]
pub struct DequantShape {
    pub experts: u64,
    pub rows: u64,
    pub cols: u64,
    pub br: u64,
    pub bc: u64,
    pub shared: bool,
}

/// The selftest's shapes: 3 experts of 20 × 300 in 8 × 128 blocks (ragged both ways), and two
/// experts under one shared scale.
pub const DEQUANT_SHAPES: [DequantShape; 2] = [
    DequantShape {
        experts: 3,
        rows: 20,
        cols: 300,
        br: 8,
        bc: 128,
        shared: false,
    },
    DequantShape {
        experts: 2,
        rows: 6,
        cols: 40,
        br: 6,
        bc: 40,
        shared: true,
    },
];

/// Every weight dtype × scale dtype (or none) × output dtype × (mode, --allow-nonfinite) on each
/// shape; all 256 codes appear (the non-finite ones only where allowed).
pub fn dequant_cases(
    rng: &mut Lcg,
    shapes: &[DequantShape],
    modes: &[(ScaleMode, bool)],
) -> Vec<Case> {
    let mut out = Vec::new();
    for sh in shapes {
        for weight in [DType::F8_E4M3, DType::F8_E5M2] {
            for scale in [
                None,
                Some(DType::F32),
                Some(DType::BF16),
                Some(DType::F16),
                Some(DType::F8_E8M0),
            ] {
                for dst in [DType::BF16, DType::F16, DType::F32] {
                    for &mode in modes {
                        out.push(dequant_case(rng, sh, weight, scale, dst, mode));
                    }
                }
            }
        }
    }
    out
}

/// One FP8 dequantisation case: `weight` codes on shape `sh` under `scale` (or one implicit
/// scale), into `dst`, with `(mode, --allow-nonfinite)`.
fn dequant_case(
    rng: &mut Lcg,
    sh: &DequantShape,
    weight: DType,
    scale: Option<DType>,
    dst: DType,
    (mode, allow): (ScaleMode, bool),
) -> Case {
    let (gr, gc) = (sh.rows.div_ceil(sh.br), sh.cols.div_ceil(sh.bc));
    // Without a scale tensor the op sees one implicit scale for everything.
    let whole = scale.is_none();
    let one = whole || sh.shared;
    let layout = ScaleLayout {
        experts: sh.experts,
        rows: sh.rows,
        cols: sh.cols,
        expert_stride: if one { 0 } else { gr * gc },
        grid_cols: if whole { 1 } else { gc },
        block_rows: if whole { sh.rows } else { sh.br },
        block_cols: if whole { sh.cols } else { sh.bc },
    };
    let mut inputs = vec![fp8_codes(
        rng,
        (sh.experts * sh.rows * sh.cols) as usize,
        weight,
        allow,
    )];
    if let Some(d) = scale {
        let n = if one {
            1
        } else {
            (sh.experts * gr * gc) as usize
        };
        inputs.push(scale_values(d, n, rng, allow));
    }
    Case {
        kernel: "dequant-fp8",
        what: format!(
            "{weight} × {} → {dst}{}{}, {}×{}×{}",
            scale.map_or("none".into(), |d| d.to_string()),
            if mode == ScaleMode::Divide { " ÷" } else { "" },
            if allow { " nonfinite" } else { "" },
            sh.experts,
            sh.rows,
            sh.cols
        ),
        op: Arc::new(DequantFp8 {
            weight_dtype: weight,
            scale_dtype: scale,
            layout,
            mode,
            dst,
            allow_nonfinite: allow,
        }),
        inputs,
        out_dtype: dst,
    }
}

/// `n` random FP8 codes of `weight`, the first 256 every code in order; without `allow` the
/// non-finite codes are made finite.
fn fp8_codes(rng: &mut Lcg, n: usize, weight: DType, allow: bool) -> Vec<u8> {
    let mut codes = rng.bytes(n);
    for (i, c) in codes.iter_mut().take(256).enumerate() {
        *c = i as u8;
    }
    if !allow {
        let special = |c: u8| match weight {
            DType::F8_E5M2 => c & 0x7C == 0x7C,
            _ => c & 0x7F == 0x7F,
        };
        codes
            .iter_mut()
            .filter(|c| special(**c))
            .for_each(|c| *c &= 0x3F);
    }
    codes
}

fn lora_cases(rng: &mut Lcg, out: &mut Vec<Case>) {
    let (rows, cols, rank) = (96u64, 160u64, 16u64);
    for base in [DType::BF16, DType::F16, DType::F32] {
        for (dst, transposed, dora) in [
            (base, false, false),
            (base, true, false),
            (base, false, true),
            (
                if base == DType::F32 {
                    DType::BF16
                } else {
                    DType::F32
                },
                false,
                false,
            ),
        ] {
            let f = LoraFactors {
                rank,
                a_dtype: DType::F32,
                b_dtype: base,
                m_dtype: dora.then_some(DType::F32),
                scale: 2.0,
                transposed,
                delta_dtype: None,
            };
            let floats = |n: u64, dtype: DType, rng: &mut Lcg, spread: f32| {
                let v: Vec<u8> = (0..n)
                    .flat_map(|_| {
                        ((rng.next_u32() as f32 / u32::MAX as f32 - 0.5) * spread).to_le_bytes()
                    })
                    .collect();
                f32_bytes_as(dtype, &v)
            };
            let a_len = rank * if transposed { rows } else { cols };
            let b_len = rank * if transposed { cols } else { rows };
            let mut inputs = vec![
                floats(rows * cols, base, rng, 0.2),
                floats(a_len, DType::F32, rng, 0.1),
                floats(b_len, base, rng, 0.1),
            ];
            if dora {
                inputs.push(floats(rows, DType::F32, rng, 4.0));
            }
            out.push(Case {
                kernel: "merge-lora",
                what: format!(
                    "{base} → {dst}, r={rank}{}{}",
                    if transposed { ", transposed" } else { "" },
                    if dora { ", DoRA" } else { "" }
                ),
                op: Arc::new(LoraMerge {
                    rows,
                    cols,
                    expert: ExpertSlice::WHOLE,
                    base_op: None,
                    base_inputs: 1,
                    base_dtype: base,
                    f,
                    dst,
                }),
                inputs,
                out_dtype: dst,
            });
        }
    }
}

/// F32 grouped factors of rank `rank` (per expert), scale 0.5.
fn expert_factors(rank: u64) -> LoraFactors {
    LoraFactors {
        rank,
        a_dtype: DType::F32,
        b_dtype: DType::F32,
        m_dtype: None,
        scale: 0.5,
        transposed: false,
        delta_dtype: None,
    }
}

/// Grouped expert merges (PEFT `target_parameters`): 3 experts, both base orientations.
fn grouped_lora_cases(rng: &mut Lcg, out: &mut Vec<Case>) {
    let (experts, x, y, rank) = (3u64, 12u64, 40u64, 4u64);
    for (in_out, base) in [(true, DType::BF16), (false, DType::F32)] {
        let (inn, outd) = if in_out { (x, y) } else { (y, x) };
        let f = expert_factors(rank);
        let inputs = vec![
            f32_bytes_as(base, &rng.f32s((experts * x * y) as usize)),
            rng.f32s((experts * rank * inn) as usize),
            rng.f32s((outd * experts * rank) as usize),
        ];
        out.push(Case {
            kernel: "merge-lora-experts",
            what: format!(
                "{base}, 3 experts, {}",
                if in_out {
                    "[E, in, out]"
                } else {
                    "[E, out, in]"
                }
            ),
            op: Arc::new(GroupedLoraMerge {
                experts,
                x,
                y,
                in_out,
                base_op: None,
                base_inputs: 1,
                base_dtype: base,
                f,
                dst: base,
            }),
            inputs,
            out_dtype: base,
        });
    }
}

/// One expert's block of grouped factors merged into a base stored per expert (a fused
/// `gate_up_proj` adapter into `experts.1.up_proj`: rows from 4 of the fused output): B's
/// coefficients strided by the expert count, read from the expert's first.
fn expert_slice_cases(rng: &mut Lcg, out: &mut Vec<Case>) {
    let (experts, rows, cols, rank, fused_rows) = (3u64, 12u64, 40u64, 4u64, 16u64);
    let f = expert_factors(rank);
    let inputs = vec![
        f32_bytes_as(DType::BF16, &rng.f32s((rows * cols) as usize)),
        rng.f32s((experts * rank * cols) as usize),
        rng.f32s((fused_rows * experts * rank) as usize),
    ];
    out.push(Case {
        kernel: "merge-lora",
        what: "BF16, expert 1 of 3, rows 4.. of the fused delta".into(),
        op: Arc::new(LoraMerge {
            rows,
            cols,
            expert: ExpertSlice {
                experts,
                index: 1,
                first_row: fused_rows - rows,
            },
            base_op: None,
            base_inputs: 1,
            base_dtype: DType::BF16,
            f,
            dst: DType::BF16,
        }),
        inputs,
        out_dtype: DType::BF16,
    });
}

/// Every case the selftest runs.
pub fn cases() -> Vec<Case> {
    let mut rng = Lcg(0x7f7f);
    let mut out = Vec::new();
    cast_cases(&mut rng, &mut out);
    out.extend(dequant_cases(
        &mut rng,
        &DEQUANT_SHAPES,
        &[
            (ScaleMode::Multiply, false),
            (ScaleMode::Multiply, true),
            (ScaleMode::Divide, true),
        ],
    ));
    mxfp4_to_nvfp4_cases(&mut rng, &mut out);
    engram_cases(&mut rng, &mut out);
    super::decoders::int_cases(&mut rng, &mut out);
    super::decoders::fp4_cases(&mut rng, &mut out);
    lora_cases(&mut rng, &mut out);
    grouped_lora_cases(&mut rng, &mut out);
    expert_slice_cases(&mut rng, &mut out);
    super::encoders::quantize_cases(&mut rng, &mut out);
    super::decoders::gptq_cases(&mut rng, &mut out);
    super::decoders::int4_modelopt_cases(&mut rng, &mut out);
    super::encoders::modelopt_cases(&mut rng, &mut out);
    super::encoders::gguf_cases(&mut rng, &mut out);
    super::encoders::gguf_block_cases(&mut rng, &mut out);
    super::merges::merge_cases(&mut rng, &mut out);
    out
}

/// Every castable dtype into each 16- and 32-bit float.
fn cast_cases(rng: &mut Lcg, out: &mut Vec<Case>) {
    let sources = DType::all().filter(|d| d.is_castable_float() || d.is_castable_int());
    for src in sources {
        let input = cast_inputs(src, rng);
        for dst in [DType::BF16, DType::F16, DType::F32] {
            if src == dst {
                continue;
            }
            let elements = input.len() as u64 / (src.bits() / 8);
            out.push(Case {
                kernel: "cast",
                what: format!("{src} → {dst}"),
                op: Arc::new(Cast { src, dst, elements }),
                inputs: vec![input.clone()],
                out_dtype: dst,
            });
        }
    }
}

/// MXFP4 → NVFP4: block scales and re-encoded codes under every E8M0 scale, at tensor scale
/// exponents from the smallest to the largest.
fn mxfp4_to_nvfp4_cases(rng: &mut Lcg, out: &mut Vec<Case>) {
    let all_scales: Vec<u8> = (0..=254).collect();
    for g in [-140, -127, -30, -9, 0, 8, 40, 127] {
        let mut packed = rng.bytes(16 * 255);
        packed[16..32].fill(0x88);
        let (rows, groups) = (5, 51);
        let case = |kernel, op: Arc<dyn Op>, inputs| Case {
            kernel,
            what: format!("all 255 scales, g={g}"),
            op,
            inputs,
            out_dtype: DType::U8,
        };
        out.push(case(
            "mxfp4→nvfp4 scales",
            Arc::new(NvBlockScales { rows, groups, g }),
            vec![all_scales.clone()],
        ));
        out.push(case(
            "mxfp4→nvfp4 re-encode",
            Arc::new(NvReencode { rows, groups, g }),
            vec![packed, all_scales.clone()],
        ));
    }
}

/// Engram tables requantised from E4M3 to E2M1, with zero blocks and a zero scale.
fn engram_cases(rng: &mut Lcg, out: &mut Vec<Case>) {
    for (rows, cols) in [(64u64, 256u64), (7, 7168)] {
        let mut codes = rng.bytes((rows * cols) as usize);
        codes
            .iter_mut()
            .filter(|c| **c & 0x7F == 0x7F)
            .for_each(|c| *c = 0x7E);
        codes[256..288].fill(0);
        let mut scales: Vec<u8> = (0..rows * cols / 32)
            .map(|_| (rng.next_u32() % 200) as u8)
            .collect();
        scales[20] = 0;
        codes[20 * 32..21 * 32].fill(0x01);
        out.push(Case {
            kernel: "requant-e2m1",
            what: format!("{rows} × {cols} E4M3, quality sums"),
            op: Arc::new(EngramRequant::new(rows, cols)),
            inputs: vec![codes, scales],
            out_dtype: DType::U8,
        });
    }
}

/// Input slices of `op` for `units`, cut from whole inputs (as the reader would read them).
pub fn slices<'a>(op: &dyn Op, units: Range<u64>, inputs: &'a [Vec<u8>]) -> Vec<&'a [u8]> {
    op.input_ranges(units)
        .iter()
        .zip(inputs)
        .map(|(r, i)| &i[r.start as usize..r.end as usize])
        .collect()
}

/// A way to compute a chunk of an op: the CPU op itself, or a GPU lane.
type Compute<'a> =
    dyn FnMut(&dyn Op, Range<u64>, &[&[u8]], &mut [&mut [u8]]) -> Result<(), String> + 'a;

/// Runs `units` of `op` with `f` into fresh output buffers.
fn compute_with(
    op: &dyn Op,
    units: Range<u64>,
    inputs: &[Vec<u8>],
    f: &mut Compute,
) -> Result<Vec<Vec<u8>>, String> {
    let mut outs: Vec<Vec<u8>> = (0..=op.extra_outputs())
        .map(|k| {
            let s = op.out_span(k, units.clone());
            vec![0u8; (s.end - s.start) as usize]
        })
        .collect();
    let ins = slices(op, units.clone(), inputs);
    let mut views: Vec<&mut [u8]> = outs.iter_mut().map(|o| o.as_mut_slice()).collect();
    f(op, units, &ins, &mut views)?;
    Ok(outs)
}

/// Largest difference in units in the last place between two outputs of `dtype`.
fn ulp_distance(dtype: DType, a: &[u8], b: &[u8]) -> u64 {
    let ordered = |bits: u64, width: u32| -> i64 {
        let sign = 1u64 << (width - 1);
        if bits & sign != 0 {
            -((bits & (sign - 1)) as i64)
        } else {
            bits as i64
        }
    };
    let w = (dtype.bits() / 8) as usize;
    a.chunks_exact(w)
        .zip(b.chunks_exact(w))
        .map(|(x, y)| {
            let (x, y) = if w == 2 {
                (
                    u16::from_le_bytes([x[0], x[1]]) as u64,
                    u16::from_le_bytes([y[0], y[1]]) as u64,
                )
            } else if w == 4 {
                (
                    u32::from_le_bytes(x.try_into().unwrap()) as u64,
                    u32::from_le_bytes(y.try_into().unwrap()) as u64,
                )
            } else {
                (x[0] as u64, y[0] as u64)
            };
            ordered(x, 8 * w as u32).abs_diff(ordered(y, 8 * w as u32))
        })
        .max()
        .unwrap_or(0)
}

pub struct Row {
    pub kernel: &'static str,
    pub what: String,
    pub bytes: u64,
    pub max_ulps: u64,
    pub seconds: f64,
    pub ok: bool,
    pub detail: String,
}

/// Runs every case on `device` (or, on the CPU, whole vs chunked) and returns the table rows.
pub fn run(device: &Device) -> Vec<Row> {
    cases()
        .into_iter()
        .map(|case| run_case(device, case))
        .collect()
}

/// The outputs of one run of a case, with the op's statistics where it gathers them.
type Outputs = Result<(Vec<Vec<u8>>, Option<serde_json::Value>), String>;

/// Computes `case` whole on the CPU and again on the device (or in two chunks), and compares.
fn run_case(device: &Device, case: Case) -> Row {
    let op = case.op.as_ref();
    let want = compute_with(op, 0..op.units(), &case.inputs, &mut cpu_compute);
    let t = Instant::now();
    let got = match &device.gpu {
        Some(gpu) => compute_on_gpu(gpu, &case),
        None => compute_in_two_chunks(&case),
    };
    let seconds = t.elapsed().as_secs_f64();
    let (ok, max_ulps, detail) = compare(&case, &want, &got);
    Row {
        kernel: case.kernel,
        bytes: case.inputs.iter().map(|i| i.len() as u64).sum(),
        what: case.what,
        max_ulps,
        seconds,
        ok,
        detail,
    }
}

/// A chunk computed by the CPU op itself.
fn cpu_compute(
    op: &dyn Op,
    units: Range<u64>,
    inputs: &[&[u8]],
    outputs: &mut [&mut [u8]],
) -> Result<(), String> {
    op.compute_all(units, inputs, outputs)
}

/// The whole case on a GPU lane.
fn compute_on_gpu(gpu: &crate::gpu::Gpu, case: &Case) -> Outputs {
    // A fresh op for the GPU run, so per-op statistics are gathered separately.
    let gop = case_twin(case);
    let r = compute_with(
        gop.as_ref(),
        0..case.op.units(),
        &case.inputs,
        &mut |op, u, i, o| match gpu.run(&kernel_of(op, &u), u, i, o) {
            Ok(Ran::Done(stats)) => {
                if let Some(stats) = stats {
                    op.absorb(stats);
                }
                Ok(())
            }
            Ok(Ran::Refused) => Err("refused".into()),
            Err(e) => Err(e),
        },
    );
    r.map(|o| (o, gop.report()))
}

/// The case on the CPU in two chunks cut at a granularity boundary, joined.
fn compute_in_two_chunks(case: &Case) -> Outputs {
    let n = case.op.units();
    let g = case.op.granularity().max(1);
    let cut = (n / 2 / g * g).clamp(g.min(n), n);
    let gop = case_twin(case);
    let a = compute_with(gop.as_ref(), 0..cut, &case.inputs, &mut cpu_compute);
    let b = compute_with(gop.as_ref(), cut..n, &case.inputs, &mut cpu_compute);
    a.and_then(|a| {
        b.map(|b| {
            let joined = a
                .into_iter()
                .zip(b)
                .map(|(mut x, y)| {
                    x.extend(y);
                    x
                })
                .collect();
            (joined, None)
        })
    })
}

/// Whether the two runs agree (bytes and statistics, or both refused), the largest ulp
/// distance, and what the table says about a difference.
fn compare(case: &Case, want: &Result<Vec<Vec<u8>>, String>, got: &Outputs) -> (bool, u64, String) {
    match (want, got) {
        (Ok(w), Ok((g, report))) => {
            let d: u64 = w
                .iter()
                .zip(g)
                .map(|(w, g)| ulp_distance(case.out_dtype, w, g))
                .max()
                .unwrap_or(0);
            // Quality sums (Engram) must agree exactly too.
            let same_report = report.is_none() || *report == case.op.report();
            let ok = d == 0 && same_report;
            let detail = if !same_report {
                "statistics differ".to_string()
            } else if ok {
                String::new()
            } else {
                format!("{d} ulp apart")
            };
            (ok, d, detail)
        }
        (Err(_), Err(_)) => (true, 0, "refused by both".into()),
        (Ok(_), Err(e)) => (false, 0, format!("device: {e}")),
        (Err(e), Ok(_)) => (false, 0, format!("CPU refused ({e}), device did not")),
    }
}

/// The op's kernel description for chunk `units`.
fn kernel_of(op: &dyn Op, units: &Range<u64>) -> Kernel {
    op.kernel(units).expect("selftest ops have kernels")
}

/// A second op like the case's, with its own statistics. Only the Engram op keeps state.
fn case_twin(case: &Case) -> Arc<dyn Op> {
    match case.op.kernel(&(0..0)) {
        Some(Kernel::Engram { cols }) => Arc::new(EngramRequant::new(case.op.units(), cols)),
        _ => case.op.clone(),
    }
}
