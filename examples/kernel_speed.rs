//! In-memory throughput of the CPU kernels (no I/O), for `bench/RESULTS.md`.
//! `cargo run --release --example kernel_speed`

use std::ops::Range;
use std::time::Instant;

use tftf::format::dtype::DType;
use tftf::ops::cast::cast_slice;
use tftf::ops::fp4::engram::EngramRequant;
use tftf::ops::fp8::{resolve_layout, DequantFp8, ScaleMode};
use tftf::ops::lora::merge::{LoraFactors, LoraMerge};
use tftf::ops::Op;

fn best_of<F: FnMut()>(mut f: F) -> f64 {
    (0..3)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed().as_secs_f64()
        })
        .fold(f64::MAX, f64::min)
}

/// Runs `op` over all its units, split between `threads` threads by row blocks.
fn run_threads(op: &DequantFp8, inputs: &[&[u8]], out: &mut [u8], threads: u64) {
    let units = op.units();
    let per = units.div_ceil(threads).div_ceil(128) * 128;
    let ob = op.out_unit_bytes() as usize;
    std::thread::scope(|s| {
        let mut rest = out;
        let mut u = 0;
        while u < units {
            let end = (u + per).min(units);
            let (mine, tail) = rest.split_at_mut((end - u) as usize * ob);
            rest = tail;
            let r: Range<u64> = u..end;
            let ranges = op.input_ranges(r.clone());
            let ins: Vec<&[u8]> = inputs
                .iter()
                .zip(&ranges)
                .map(|(i, r)| &i[r.start as usize..r.end as usize])
                .collect();
            s.spawn(move || op.compute(r, &ins, mine).unwrap());
            u = end;
        }
    });
}

fn main() {
    let n = 64 << 20; // elements
    let input: Vec<u8> = (0..n as u32)
        .flat_map(|i| ((i % 1000) as f32 * 0.001).to_le_bytes())
        .collect();
    let mut out = vec![0u8; n * 4];
    for (src, dst, label) in [
        (DType::F32, DType::BF16, "cast f32->bf16"),
        (DType::F32, DType::F16, "cast f32->f16"),
    ] {
        let t = best_of(|| cast_slice(src, dst, &input, &mut out[..n * 2]));
        println!("{label:<34} 1 thread : {:6.2} Gelem/s", n as f64 / t / 1e9);
    }
    let (rows, cols) = (8192u64, 8192u64);
    let codes: Vec<u8> = (0..rows * cols)
        .map(|i| (i * 7 % 251) as u8 & 0xFE)
        .collect();
    for (sd, sbytes) in [(DType::F32, 4usize), (DType::F8_E8M0, 1)] {
        let scales: Vec<u8> = (0..64 * 64 * sbytes)
            .map(|i| {
                if sbytes == 1 {
                    120
                } else {
                    [0, 0, 0x80, 0x3B][i % 4]
                }
            })
            .collect();
        let (layout, _) = resolve_layout(&[rows, cols], &[64, 64], None).unwrap();
        let op = DequantFp8 {
            weight_dtype: DType::F8_E4M3,
            scale_dtype: Some(sd),
            layout,
            mode: ScaleMode::Multiply,
            dst: DType::BF16,
            allow_nonfinite: false,
        };
        let mut out = vec![0u8; (rows * cols * 2) as usize];
        for threads in [1, 2] {
            let t = best_of(|| run_threads(&op, &[&codes, &scales], &mut out, threads));
            println!(
                "dequant-fp8 e4m3->bf16, {:<7} {} thread{}: {:6.2} Gelem/s",
                format!("{sd}"),
                threads,
                if threads == 1 { " " } else { "s" },
                (rows * cols) as f64 / t / 1e9
            );
        }
    }
    // Engram requant, 2 threads over halves of a [8192, 4096] table.
    let (rows, cols) = (8192u64, 4096u64);
    let table: Vec<u8> = (0..rows * cols)
        .map(|i| (i * 13 % 251) as u8 & 0xFE)
        .collect();
    let scales: Vec<u8> = (0..rows * cols / 32)
        .map(|i| 110 + (i % 20) as u8)
        .collect();
    let op = EngramRequant::new(rows, cols);
    let mut codes = vec![0u8; (rows * cols / 2) as usize];
    let mut new_scales = vec![0u8; (rows * cols / 32) as usize];
    let t = best_of(|| {
        std::thread::scope(|s| {
            let half = rows / 2;
            let (c0, c1) = codes.split_at_mut((half * cols / 2) as usize);
            let (s0, s1) = new_scales.split_at_mut((half * cols / 32) as usize);
            let (op, table, scales) = (&op, &table, &scales);
            s.spawn(move || {
                op.compute_all(
                    0..half,
                    &[
                        &table[..(half * cols) as usize],
                        &scales[..(half * cols / 32) as usize],
                    ],
                    &mut [c0, s0],
                )
                .unwrap()
            });
            s.spawn(move || {
                op.compute_all(
                    half..rows,
                    &[
                        &table[(half * cols) as usize..],
                        &scales[(half * cols / 32) as usize..],
                    ],
                    &mut [c1, s1],
                )
                .unwrap()
            });
        })
    });
    println!(
        "engram requant e4m3->e2m1       2 threads: {:6.2} GB/s of E4M3 input",
        (rows * cols) as f64 / t / 1e9
    );
    // LoRA merge of a [4096, 4096] BF16 weight with r = 16 F32 factors (the product and the
    // epilogue), 2 threads over halves.
    let (n, r) = (4096u64, 16u64);
    let w: Vec<u8> = (0..n * n)
        .flat_map(|i| tftf::ops::cast::f32_to_bf16((i % 97) as f32 * 0.01).to_le_bytes())
        .collect();
    let a: Vec<u8> = (0..r * n)
        .flat_map(|i| ((i % 13) as f32 * 0.001).to_le_bytes())
        .collect();
    let b: Vec<u8> = (0..n * r)
        .flat_map(|i| ((i % 7) as f32 * 0.001).to_le_bytes())
        .collect();
    let op = LoraMerge {
        rows: n,
        cols: n,
        base_op: None,
        base_inputs: 1,
        base_dtype: DType::BF16,
        f: LoraFactors {
            rank: r,
            a_dtype: DType::F32,
            b_dtype: DType::F32,
            m_dtype: None,
            scale: 2.0,
            transposed: false,
        },
        dst: DType::BF16,
    };
    let mut out = vec![0u8; (n * n * 2) as usize];
    let t = best_of(|| {
        std::thread::scope(|s| {
            let half = n / 2;
            let (o0, o1) = out.split_at_mut((half * n * 2) as usize);
            let (op, w, a, b) = (&op, &w, &a, &b);
            s.spawn(move || {
                op.compute(
                    0..half,
                    &[
                        &w[..(half * n * 2) as usize],
                        a,
                        &b[..(half * r * 4) as usize],
                    ],
                    o0,
                )
                .unwrap()
            });
            s.spawn(move || {
                op.compute(
                    half..n,
                    &[
                        &w[(half * n * 2) as usize..],
                        a,
                        &b[(half * r * 4) as usize..],
                    ],
                    o1,
                )
                .unwrap()
            });
        })
    });
    println!(
        "lora merge bf16 4096x4096 r=16     2 threads: {:6.2} GFLOP/s, {:6.2} GB/s of base",
        (2 * r * n * n) as f64 / t / 1e9,
        (n * n * 2) as f64 / t / 1e9
    );
}
