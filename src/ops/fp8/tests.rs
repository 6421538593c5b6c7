use super::*;
use crate::ops::fp8::codec::{e4m3_to_f32, e5m2_to_f32};

use crate::lcg::Lcg;

#[test]
fn layouts() {
    let (l, inferred) = resolve_layout(&[300, 260], &[3, 3], None).unwrap();
    assert!(inferred);
    assert_eq!((l.block_rows, l.block_cols, l.grid_cols), (128, 128, 3));
    let (l, inferred) = resolve_layout(&[300, 260], &[3, 3], Some((128, 128))).unwrap();
    assert!(!inferred);
    assert_eq!(l.describe(), "128x128 blocks");
    assert_eq!(
        resolve_layout(&[300, 260], &[], None).unwrap().0.describe(),
        "per-tensor scale"
    );
    assert_eq!(
        resolve_layout(&[300, 260], &[1], None)
            .unwrap()
            .0
            .describe(),
        "per-tensor scale"
    );
    assert_eq!(
        resolve_layout(&[300, 260], &[300], None)
            .unwrap()
            .0
            .describe(),
        "per-row scales"
    );
    assert_eq!(
        resolve_layout(&[300, 260], &[300, 1], Some((128, 128)))
            .unwrap()
            .0
            .describe(),
        "per-row scales"
    );
    let (l, _) = resolve_layout(&[256, 1024], &[256, 8], None).unwrap();
    assert_eq!(l.describe(), "1x128 blocks");
    let (l, _) = resolve_layout(&[4, 64, 96], &[4, 2, 3], None).unwrap();
    assert_eq!(
        (l.experts, l.expert_stride, l.block_rows, l.block_cols),
        (4, 6, 32, 32)
    );
    assert_eq!(
        resolve_layout(&[4, 64, 96], &[4], None)
            .unwrap()
            .0
            .describe(),
        "one scale per expert"
    );
    assert_eq!(
        resolve_layout(&[4, 64, 96], &[4, 64], None)
            .unwrap()
            .0
            .describe(),
        "per-row scales"
    );
    let err = resolve_layout(&[300, 260], &[7, 3], None).unwrap_err();
    assert!(err.contains("pass --block-size"), "{err}");
    let err = resolve_layout(&[300, 260], &[2, 2], Some((128, 128))).unwrap_err();
    assert!(err.contains("expected [3, 3]"), "{err}");
    assert!(resolve_layout(&[2, 3, 4, 5], &[2], None).is_err());
}

#[test]
fn arithmetic_decode_matches_the_tables_on_every_finite_code() {
    for c in 0..=255u8 {
        if !e4m3_is_nan(c) {
            assert_eq!(
                decode_fp8::<false>(c).to_bits(),
                e4m3_to_f32(c).to_bits(),
                "e4m3 {c:#04x}"
            );
        }
        if !e5m2_is_nonfinite(c) {
            assert_eq!(
                decode_fp8::<true>(c).to_bits(),
                e5m2_to_f32(c).to_bits(),
                "e5m2 {c:#04x}"
            );
        }
    }
}

#[test]
fn block_size_parsing() {
    assert_eq!(parse_block_size("128").unwrap(), (128, 128));
    assert_eq!(parse_block_size("1x128").unwrap(), (1, 128));
    assert!(parse_block_size("0x4").is_err());
    assert!(parse_block_size("big").is_err());
}

fn encode_scales(dtype: DType, vals: &[f32]) -> Vec<u8> {
    vals.iter()
        .flat_map(|&v| match dtype {
            DType::F32 => v.to_le_bytes().to_vec(),
            DType::BF16 => half::bf16::from_f32(v).to_bits().to_le_bytes().to_vec(),
            DType::F16 => half::f16::from_f32(v).to_bits().to_le_bytes().to_vec(),
            _ => vec![(v.log2() as i32 + 127) as u8],
        })
        .collect()
}

/// Independent scalar reference: direct 2-D indexing, `half` for the final rounding.
#[allow(clippy::too_many_arguments)]
fn reference(
    wdtype: DType,
    codes: &[u8],
    shape: (u64, u64, u64),
    scales: &[f32],
    grid: (u64, u64),
    block: (u64, u64),
    divide: bool,
    dst: DType,
) -> Vec<u8> {
    let (e, rows, cols) = shape;
    let mut out = Vec::new();
    for x in 0..e {
        for i in 0..rows {
            for j in 0..cols {
                let c = codes[((x * rows + i) * cols + j) as usize];
                let w = if wdtype == DType::F8_E4M3 {
                    e4m3_to_f32(c)
                } else {
                    e5m2_to_f32(c)
                };
                let per_expert = if scales.len() as u64 == grid.0 * grid.1 {
                    0
                } else {
                    grid.0 * grid.1
                };
                let s = scales[(x * per_expert + (i / block.0) * grid.1 + j / block.1) as usize];
                let y = if divide { w / s } else { w * s };
                match dst {
                    DType::BF16 => out.extend(half::bf16::from_f32(y).to_bits().to_le_bytes()),
                    DType::F16 => out.extend(half::f16::from_f32(y).to_bits().to_le_bytes()),
                    _ => out.extend(y.to_le_bytes()),
                }
            }
        }
    }
    out
}

fn run_op(
    op: &DequantFp8,
    codes: &[u8],
    scale_bytes: &[u8],
    cuts: &[u64],
) -> Result<Vec<u8>, String> {
    let mut out = vec![0u8; (op.units() * op.out_unit_bytes()) as usize];
    let mut bounds = vec![0];
    bounds.extend(cuts.iter().copied().filter(|&c| c > 0 && c < op.units()));
    bounds.push(op.units());
    bounds.sort();
    bounds.dedup();
    for w in bounds.windows(2) {
        let units = w[0]..w[1];
        let ranges = op.input_ranges(units.clone());
        let inputs: Vec<&[u8]> = if ranges.len() == 2 {
            vec![
                &codes[ranges[0].start as usize..ranges[0].end as usize],
                &scale_bytes[ranges[1].start as usize..ranges[1].end as usize],
            ]
        } else {
            vec![&codes[ranges[0].start as usize..ranges[0].end as usize]]
        };
        let ob = op.out_unit_bytes();
        op.compute(
            units.clone(),
            &inputs,
            &mut out[(units.start * ob) as usize..(units.end * ob) as usize],
        )?;
    }
    Ok(out)
}

#[test]
fn bit_exact_against_scalar_reference_for_every_layout_dtype_and_cut() {
    let mut rng = Lcg(99);
    let cases: &[(&[u64], &[u64])] = &[
        (&[300, 260], &[3, 3]),
        (&[129, 257], &[2, 3]),
        (&[64, 64], &[]),
        (&[50, 33], &[50, 1]),
        (&[3, 40, 70], &[3, 2, 3]),
        (&[3, 40, 70], &[3]),
        (&[16, 256], &[16, 2]),
    ];
    for &(wshape, sshape) in cases {
        let (layout, _) = resolve_layout(wshape, sshape, None).unwrap();
        let n: u64 = wshape.iter().product();
        for wdtype in [DType::F8_E4M3, DType::F8_E5M2] {
            // Every finite code appears: cycle through them, then random ones.
            let finite: Vec<u8> = (0..=255u8)
                .filter(|&c| {
                    if wdtype == DType::F8_E4M3 {
                        !e4m3_is_nan(c)
                    } else {
                        !e5m2_is_nonfinite(c)
                    }
                })
                .collect();
            let codes: Vec<u8> = (0..n as usize)
                .map(|i| {
                    if i < finite.len() {
                        finite[i]
                    } else {
                        finite[rng.next_u32() as usize % finite.len()]
                    }
                })
                .collect();
            let nscales = sshape.iter().product::<u64>() as usize;
            for sdtype in [DType::F32, DType::BF16, DType::F16, DType::F8_E8M0] {
                let vals: Vec<f32> = (0..nscales)
                    .map(|_| {
                        let e = (rng.next_u32() % 24) as i32 - 14;
                        if sdtype == DType::F8_E8M0 {
                            2f32.powi(e)
                        } else {
                            (1.0 + (rng.next_u32() % 1000) as f32 / 1000.0) * 2f32.powi(e)
                        }
                    })
                    .collect();
                let sbytes = encode_scales(sdtype, &vals);
                let decoded: Vec<f32> = DequantFp8 {
                    weight_dtype: wdtype,
                    scale_dtype: Some(sdtype),
                    layout: layout.clone(),
                    mode: ScaleMode::Multiply,
                    dst: DType::F32,
                    allow_nonfinite: false,
                }
                .decode_scales(&sbytes);
                for dst in [DType::BF16, DType::F16, DType::F32] {
                    for mode in [ScaleMode::Multiply, ScaleMode::Divide] {
                        // Some products overflow F16; the reference keeps them as infinity.
                        let op = DequantFp8 {
                            weight_dtype: wdtype,
                            scale_dtype: Some(sdtype),
                            layout: layout.clone(),
                            mode,
                            dst,
                            allow_nonfinite: true,
                        };
                        let (e, rows, cols) = (layout.experts, layout.rows, layout.cols);
                        let grid = (rows.div_ceil(layout.block_rows), layout.grid_cols);
                        let want = reference(
                            wdtype,
                            &codes,
                            (e, rows, cols),
                            &decoded,
                            grid,
                            (layout.block_rows, layout.block_cols),
                            mode == ScaleMode::Divide,
                            dst,
                        );
                        let whole = run_op(&op, &codes, &sbytes, &[]).unwrap();
                        assert_eq!(
                            whole, want,
                            "{wshape:?} {sshape:?} {wdtype} {sdtype} {dst} {mode:?}"
                        );
                        let cuts: Vec<u64> = (0..4)
                            .map(|_| rng.next_u32() as u64 % op.units().max(1))
                            .collect();
                        assert_eq!(
                            run_op(&op, &codes, &sbytes, &cuts).unwrap(),
                            want,
                            "cut at {cuts:?}"
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn nonfinite_codes_and_scales_are_errors_unless_allowed() {
    let (layout, _) = resolve_layout(&[2, 4], &[], None).unwrap();
    let mut op = DequantFp8 {
        weight_dtype: DType::F8_E4M3,
        scale_dtype: Some(DType::F8_E8M0),
        layout,
        mode: ScaleMode::Multiply,
        dst: DType::BF16,
        allow_nonfinite: false,
    };
    let codes = [0x38, 0x38, 0x38, 0x38, 0x38, 0x38, 0xFF, 0x38];
    let err = run_op(&op, &codes, &[127], &[]).unwrap_err();
    assert!(err.contains("0xff at [1, 2]"), "{err}");
    let err = run_op(&op, &[0x38; 8], &[0xFF], &[]).unwrap_err();
    assert!(err.contains("scale element 0 is not finite"), "{err}");
    op.allow_nonfinite = true;
    let out = run_op(&op, &codes, &[127], &[]).unwrap();
    assert_eq!(&out[12..14], &0x7FC0u16.to_le_bytes());
    assert_eq!(&out[0..2], &0x3F80u16.to_le_bytes()); // 0x38 = 1.0
}
