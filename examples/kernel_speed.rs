//! In-memory throughput of the CPU kernels, for `bench/RESULTS.md`.
//! `cargo run --release --example kernel_speed`

use std::time::Instant;

use tftf::format::dtype::DType;
use tftf::ops::cast::cast_slice;

fn main() {
    let n = 64 << 20; // elements
    let input: Vec<u8> = (0..n as u32).flat_map(|i| ((i % 1000) as f32 * 0.001).to_le_bytes()).collect();
    let mut out = vec![0u8; n * 2];
    for (src, dst, label) in [(DType::F32, DType::BF16, "f32->bf16"), (DType::F32, DType::F16, "f32->f16")] {
        let mut best = f64::MAX;
        for _ in 0..3 {
            let t = Instant::now();
            cast_slice(src, dst, &input, &mut out);
            best = best.min(t.elapsed().as_secs_f64());
        }
        println!("{label}: {:.2} Gelem/s, {:.2} GB/s of input (1 thread)", n as f64 / best / 1e9, input.len() as f64 / best / 1e9);
    }
}
