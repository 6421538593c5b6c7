//! In-memory throughput of the CPU kernels (no I/O), for `bench/RESULTS.md`.
//! `cargo run --release --example kernel_speed` (`-- memcpy`: only the memcpy reference, for
//! bench/io.sh)

use std::ops::Range;
use std::time::Instant;

use tftf::commands::selftest::table::slices;
use tftf::format::dtype::DType;
use tftf::ops::cast::cast_slice;
use tftf::ops::fp4::engram::{requant_row_scalar, EngramRequant, BLOCK};
use tftf::ops::fp8::{resolve_layout, DequantFp8, ScaleMode};
use tftf::ops::lora::merge::{ExpertSlice, LoraFactors, LoraMerge};
use tftf::ops::quantize::encode::WeightType;
use tftf::ops::quantize::modelopt::ModeloptRows;
use tftf::ops::quantize::ops::{BlockMath, QuantizeRows};
use tftf::ops::quantize::Scheme;
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
fn run_threads(op: &DequantFp8, inputs: &[Vec<u8>], out: &mut [u8], threads: u64) {
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
            let ins = slices(op, u..end, inputs);
            s.spawn(move || op.compute(u..end, &ins, mine).unwrap());
            u = end;
        }
    });
}

/// CPU seconds used so far by this process, all threads together.
fn cpu_seconds() -> f64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: a valid clock id and a timespec to fill.
    unsafe { libc::clock_gettime(libc::CLOCK_PROCESS_CPUTIME_ID, &mut ts) };
    ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9
}

/// Wall and CPU seconds of one call.
#[derive(Clone, Copy, Default)]
struct Took {
    wall: f64,
    cpu: f64,
}

/// Median wall and median CPU seconds of `RUNS` calls of each of `fs`, the calls interleaved
/// (old, new, old, new, …) so that a busy shared machine weighs on both alike. CPU time is
/// what the cores spent, whatever else ran on the machine meanwhile.
const RUNS: usize = 5;
fn medians<const N: usize>(fs: &mut [&mut dyn FnMut(); N]) -> [Took; N] {
    let mut t = [[Took::default(); N]; RUNS];
    for run in t.iter_mut() {
        for (took, f) in run.iter_mut().zip(fs.iter_mut()) {
            let (start, cpu) = (Instant::now(), cpu_seconds());
            f();
            *took = Took {
                wall: start.elapsed().as_secs_f64(),
                cpu: cpu_seconds() - cpu,
            };
        }
    }
    std::array::from_fn(|k| {
        let median = |f: fn(&Took) -> f64| {
            let mut x: Vec<f64> = t.iter().map(|run| f(&run[k])).collect();
            x.sort_by(f64::total_cmp);
            x[RUNS / 2]
        };
        Took {
            wall: median(|t| t.wall),
            cpu: median(|t| t.cpu),
        }
    })
}

/// Runs `f` over rows `0..rows` split into `threads` contiguous runs, each thread given its
/// rows of every input and output (`*_row` bytes per row each).
fn par_rows<F>(
    rows: u64,
    threads: u64,
    ins: &[&[u8]],
    in_row: &[u64],
    outs: &mut [&mut [u8]],
    out_row: &[u64],
    f: &F,
) where
    F: Fn(Range<u64>, &[&[u8]], &mut [&mut [u8]]) + Sync,
{
    let per = rows.div_ceil(threads);
    std::thread::scope(|s| {
        let mut rest: Vec<&mut [u8]> = outs.iter_mut().map(|o| &mut **o).collect();
        let mut u = 0;
        while u < rows {
            let end = (u + per).min(rows);
            let mut mine = Vec::new();
            for (k, o) in std::mem::take(&mut rest).into_iter().enumerate() {
                let (a, b) = o.split_at_mut(((end - u) * out_row[k]) as usize);
                mine.push(a);
                rest.push(b);
            }
            let ins: Vec<&[u8]> = ins
                .iter()
                .zip(in_row)
                .map(|(i, &n)| &i[(u * n) as usize..(end * n) as usize])
                .collect();
            let r = u..end;
            s.spawn(move || f(r, &ins, &mut mine));
            u = end;
        }
    });
}

/// A two-output op over all its units, split between `threads` threads at multiples of its
/// granularity, each output placed by `out_span`.
fn par_op(op: &dyn Op, threads: u64, input: &[u8], codes: &mut [u8], scales: &mut [u8]) {
    let g = op.granularity();
    let per = op.units().div_ceil(threads).div_ceil(g) * g;
    std::thread::scope(|s| {
        let (mut codes, mut scales) = (codes, scales);
        let mut u = 0;
        while u < op.units() {
            let end = (u + per).min(op.units());
            let (c, s0) = (op.out_span(0, u..end), op.out_span(1, u..end));
            let (mine_c, rest_c) = codes.split_at_mut((c.end - c.start) as usize);
            let (mine_s, rest_s) = scales.split_at_mut((s0.end - s0.start) as usize);
            (codes, scales) = (rest_c, rest_s);
            let r = &op.input_ranges(u..end)[0];
            let ins = &input[r.start as usize..r.end as usize];
            let units = u..end;
            s.spawn(move || {
                op.compute_all(units, &[ins], &mut [mine_c, mine_s])
                    .unwrap();
            });
            u = end;
        }
    });
}

/// `dst.copy_from_slice(src)` split between `threads` threads.
fn memcpy(src: &[u8], dst: &mut [u8], threads: usize) {
    let per = src.len().div_ceil(threads);
    std::thread::scope(|s| {
        for (d, c) in dst.chunks_mut(per).zip(src.chunks(per)) {
            s.spawn(move || d.copy_from_slice(c));
        }
    });
}

fn gbs(bytes: u64, secs: f64) -> f64 {
    bytes as f64 / secs / 1e9
}

/// One line for a kernel that reads `inb` and writes `outb` bytes: GB/s of input (wall), its
/// read + write traffic as a share of memcpy's with as many threads (memcpy reads and writes
/// its size), and GB/s of input per core (bytes over CPU seconds).
fn report(label: &str, threads: usize, inb: u64, outb: u64, t: Took, memcpy: &[Took]) {
    let mem = memcpy[threads - 1];
    let traffic = (inb + outb) as f64 / t.wall;
    println!(
        "{label:<40} {threads} thread{}: {:6.2} GB/s in, {:5.1} % of memcpy; per core {:6.2} GB/s in",
        if threads == 1 { " " } else { "s" },
        gbs(inb, t.wall),
        100.0 * traffic / (2.0 * MEMCPY_BYTES as f64 / mem.wall),
        gbs(inb, t.cpu),
    );
}

const MEMCPY_BYTES: usize = 256 << 20;

fn main() {
    println!(
        "{RUNS} interleaved runs each, medians; memcpy GB/s counts bytes copied (read once and \
         written once)"
    );
    let size = MEMCPY_BYTES;
    let src: Vec<u8> = (0..size).map(|i| (i * 7) as u8).collect();
    let mut dst = vec![1u8; size];
    let mut memcpy_t = Vec::new();
    for threads in [1, 2] {
        let [t] = medians(&mut [&mut || memcpy(&src, &mut dst, threads)]);
        memcpy_t.push(t);
        println!(
            "{:<40} {threads} thread{}: {:6.2} GB/s copied; per core {:6.2} GB/s",
            "memcpy 256 MiB",
            if threads == 1 { " " } else { "s" },
            gbs(size as u64, t.wall),
            gbs(size as u64, t.cpu)
        );
    }
    drop((src, dst));
    if std::env::args().nth(1).as_deref() == Some("memcpy") {
        return;
    }
    let n = 64 << 20; // elements
    let input: Vec<u8> = (0..n as u32)
        .flat_map(|i| ((i % 1000) as f32 * 0.001).to_le_bytes())
        .collect();
    let mut out = vec![0u8; n * 4];
    for (src, dst, label) in [
        (DType::F32, DType::BF16, "cast f32->bf16"),
        (DType::F32, DType::F16, "cast f32->f16"),
    ] {
        let [t] = medians(&mut [&mut || cast_slice(src, dst, &input, &mut out[..n * 2])]);
        report(label, 1, 4 * n as u64, 2 * n as u64, t, &memcpy_t);
    }
    drop((input, out));
    let (rows, cols) = (8192u64, 8192u64);
    let codes: Vec<u8> = (0..rows * cols)
        .map(|i| (i * 7 % 251) as u8 & 0xFE)
        .collect();
    // Codes and scales, as `run_threads` takes them.
    let mut inputs = [codes, Vec::new()];
    for (sd, sbytes) in [(DType::F32, 4usize), (DType::F8_E8M0, 1)] {
        inputs[1] = (0..64 * 64 * sbytes)
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
            let [t] = medians(&mut [&mut || run_threads(&op, &inputs, &mut out, threads as u64)]);
            report(
                &format!("dequant-fp8 e4m3->bf16, {sd} scales"),
                threads,
                rows * cols + inputs[1].len() as u64,
                rows * cols * 2,
                t,
                &memcpy_t,
            );
        }
    }
    drop(inputs);
    // Engram requant of a [8192, 4096] table: the scalar reference twin (the kernel before the
    // lane-parallel path) against `EngramRequant::compute_all` as the converter runs it.
    let (rows, cols) = (8192u64, 4096u64);
    let table: Vec<u8> = (0..rows * cols)
        .map(|i| (i * 13 % 251) as u8 & 0xFE)
        .collect();
    let scales: Vec<u8> = (0..rows * cols / 32)
        .map(|i| 110 + (i % 20) as u8)
        .collect();
    let op = EngramRequant::new(rows, cols);
    let (nb, half) = (cols / BLOCK as u64, cols / 2);
    let mut codes_old = vec![0u8; (rows * half) as usize];
    let mut scales_old = vec![0u8; (rows * nb) as usize];
    let mut codes_new = vec![0u8; (rows * half) as usize];
    let mut scales_new = vec![0u8; (rows * nb) as usize];
    let old = |units: Range<u64>, ins: &[&[u8]], outs: &mut [&mut [u8]]| {
        let [o, s] = outs else { unreachable!() };
        for (k, r) in units.enumerate() {
            let (c, b) = (cols as usize, nb as usize);
            requant_row_scalar(
                r,
                &ins[0][k * c..(k + 1) * c],
                &ins[1][k * b..(k + 1) * b],
                &mut o[k * c / 2..(k + 1) * c / 2],
                &mut s[k * b..(k + 1) * b],
            )
            .unwrap();
        }
    };
    let new = |units: Range<u64>, ins: &[&[u8]], outs: &mut [&mut [u8]]| {
        op.compute_all(units, ins, outs).unwrap()
    };
    for threads in [1, 2] {
        let ins: [&[u8]; 2] = [&table, &scales];
        let [t_old, t_new] = medians(&mut [
            &mut || {
                let outs: &mut [&mut [u8]] = &mut [&mut codes_old, &mut scales_old];
                par_rows(rows, threads, &ins, &[cols, nb], outs, &[half, nb], &old)
            },
            &mut || {
                let outs: &mut [&mut [u8]] = &mut [&mut codes_new, &mut scales_new];
                par_rows(rows, threads, &ins, &[cols, nb], outs, &[half, nb], &new)
            },
        ]);
        let (inb, outb) = (rows * (cols + nb), rows * (half + nb));
        let label = "engram requant e4m3->e2m1";
        report(
            &format!("{label}, old (scalar)"),
            threads as usize,
            inb,
            outb,
            t_old,
            &memcpy_t,
        );
        report(
            &format!("{label}, new (lanes)"),
            threads as usize,
            inb,
            outb,
            t_new,
            &memcpy_t,
        );
        println!(
            "{label:<40} {threads} thread{}: new/old {:.2}x wall, {:.2}x per core",
            if threads == 1 { " " } else { "s" },
            t_old.wall / t_new.wall,
            t_old.cpu / t_new.cpu
        );
    }
    assert!(
        codes_old == codes_new && scales_old == scales_new,
        "old and new bytes differ"
    );
    // The quantisers of `tftf quantize` on a [4096, 4096] BF16 weight: codes and scales, as the
    // pipeline runs them.
    let (rows, cols) = (4096u64, 4096u64);
    let w: Vec<u8> = (0..rows * cols)
        .flat_map(|i| {
            tftf::ops::cast::f32_to_bf16(((i * 37 % 1999) as f32 - 999.0) * 1e-3).to_le_bytes()
        })
        .collect();
    let wt = WeightType::of(DType::BF16).expect("bf16 weights");
    for scheme in [
        Scheme::Fp8Dynamic,
        Scheme::Fp8Block,
        Scheme::W4A16,
        Scheme::Nvfp4A16,
        Scheme::Mxfp4A16,
        Scheme::Mxfp8A16,
    ] {
        let ct = QuantizeRows {
            scheme,
            rows,
            cols,
            wt,
            global: 1.0,
            block: BlockMath::CompressedTensors,
        };
        let modelopt = ModeloptRows {
            scheme,
            rows,
            cols,
            wt,
            scale_2: 1.0 / 2688.0,
        };
        let ops: [(&dyn Op, &str); 2] = [(&ct, ""), (&modelopt, " (modelopt)")];
        for (op, format) in ops {
            let (cb, sb) = (op.out_span(0, 0..rows).end, op.out_span(1, 0..rows).end);
            let mut codes = vec![0u8; cb as usize];
            let mut scales = vec![0u8; sb as usize];
            for threads in [1u64, 2] {
                let [t] = medians(&mut [&mut || par_op(op, threads, &w, &mut codes, &mut scales)]);
                report(
                    &format!("quantize bf16 -> {}{format}", scheme.name()),
                    threads as usize,
                    rows * cols * 2,
                    cb + sb,
                    t,
                    &memcpy_t,
                );
            }
        }
    }
    drop(w);
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
        expert: ExpertSlice::WHOLE,
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
            delta_dtype: None,
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
