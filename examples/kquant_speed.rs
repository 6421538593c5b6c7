//! Single-thread throughput of the k-quant encoders (no I/O), for `bench/RESULTS.md`:
//! `cargo run --release --example kquant_speed [-- TYPE...]` (default Q4_K Q5_K Q6_K), each
//! with and without importance weights (only with them for IQ2_XXS, IQ2_XS, IQ1_S), on 16 MiB
//! of normally distributed f32 weights.

use std::time::Instant;

use tftf::ops::gguf::kquants::{row_bytes, KQuant};

/// Deterministic normal-ish values (sum of four uniforms), a few outliers like real weights.
fn weights(n: usize) -> Vec<f32> {
    let mut s = 0x9E37_79B9_7F4A_7C15u64;
    let mut next = || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        (s >> 40) as f32 / (1u64 << 24) as f32
    };
    (0..n)
        .map(|i| {
            let v = (next() + next() + next() + next() - 2.0) * 0.02;
            if i % 997 == 0 {
                v * 8.0
            } else {
                v
            }
        })
        .collect()
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let names: Vec<&str> = if args.is_empty() {
        vec!["Q4_K", "Q5_K", "Q6_K"]
    } else {
        args.iter().map(String::as_str).collect()
    };
    let cols = 4096;
    let rows = 1024;
    let x = weights(rows * cols);
    let qw: Vec<f32> = weights(cols).iter().map(|v| v * v * 100.0 + 0.01).collect();
    for name in names {
        let ty = *KQuant::ALL
            .iter()
            .find(|t| t.name().eq_ignore_ascii_case(name))
            .unwrap_or_else(|| panic!("unknown type {name}"));
        let rb = row_bytes(ty, cols).expect("whole blocks");
        let mut out = vec![0u8; rb * rows];
        for (label, w) in [("ref", None), ("imatrix", Some(&qw[..]))] {
            // IQ2_XXS, IQ2_XS and IQ1_S are only defined with importance weights.
            if w.is_none() && ["IQ2_XXS", "IQ2_XS", "IQ1_S"].contains(&ty.name()) {
                continue;
            }
            let mut best = f64::MAX;
            for _ in 0..3 {
                let t = Instant::now();
                for (src, dst) in x.chunks_exact(cols).zip(out.chunks_exact_mut(rb)) {
                    ty.quantize_row(src, dst, w);
                }
                best = best.min(t.elapsed().as_secs_f64());
            }
            let mb = (x.len() * 4) as f64 / 1e6;
            println!(
                "{:6} {:8} {:8.1} MB/s of f32 ({:.3} s for {:.0} MB), checksum {:08x}",
                ty.name(),
                label,
                mb / best,
                best,
                mb,
                out.iter().fold(0u32, |h, &b| h.rotate_left(5) ^ b as u32)
            );
        }
    }
}
