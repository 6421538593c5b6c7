//! Writes a large synthetic sharded checkpoint for the benchmarks in `bench/`, streaming it to
//! disk (never held in memory).
//!
//! `cargo run --release --example gen_checkpoint -- OUT_DIR LAYOUT GIB`
//! Layouts: `core` — BF16 and F32 tensors, one F32 tensor of at least 2 GiB;
//!          `core-bf16` — the same shapes, every tensor BF16;
//!          `fp8` — DeepSeek-V3-style E4M3 [4096, 4096] weights with F32 128x128 block scales;
//!          `fp8-e8m0` — the same with F8_E8M0 scales;
//!          `fp8-as-bf16` — the same weights' shapes as BF16, no scales (the baseline);
//!          `v4` — DeepSeek-V4-style: MXFP4 routed experts (I8 + E8M0 scales), one E4M3 Engram
//!          table of 2 GiB with E8M0 scales, FP8 attention, BF16 embeddings;
//!          `lora` / `lora-rN` — a `core-bf16` base in `base/` and an F32 adapter of rank 16
//!          (or N) on every `*_proj` matrix in `adapter/`.

use std::io::Write;
use std::path::Path;

use tftf::commands::selftest::table::Lcg;
use tftf::format::dtype::DType;
use tftf::format::header::{serialize_header, TensorInfo};
use tftf::ops::cast::f32_to_bf16;

/// The library's generator, drawn as bytes (its top 8 bits) and small floats (its top 24).
struct Gen(Lcg);
impl Gen {
    fn new(seed: u64) -> Gen {
        Gen(Lcg(seed))
    }
    fn byte(&mut self) -> u8 {
        (self.0.next_u32() >> 24) as u8
    }
    fn value(&mut self) -> f32 {
        let u = self.0.next_u32() >> 8; // 24 random bits
        (u as f32 / (1u32 << 24) as f32 - 0.5) * 0.1
    }
}

fn write_shard(path: &Path, tensors: &[(String, DType, Vec<u64>)], gen: &mut Gen) {
    let mut infos = Vec::new();
    let mut begin = 0;
    for (name, dtype, shape) in tensors {
        let n: u64 = shape.iter().product::<u64>() * dtype.size().unwrap() as u64;
        infos.push(TensorInfo {
            name: name.clone(),
            dtype: *dtype,
            shape: shape.clone(),
            begin,
            end: begin + n,
        });
        begin += n;
    }
    let mut meta = serde_json::Map::new();
    meta.insert("format".into(), "pt".into());
    let mut f = std::io::BufWriter::with_capacity(8 << 20, std::fs::File::create(path).unwrap());
    f.write_all(&serialize_header(&meta, &infos, 8)).unwrap();
    let mut buf = Vec::with_capacity(8 << 20);
    for t in &infos {
        let mut left = t.end - t.begin;
        while left > 0 {
            buf.clear();
            let n = left.min(8 << 20);
            match t.dtype {
                DType::F32 => {
                    (0..n / 4).for_each(|_| buf.extend_from_slice(&gen.value().to_le_bytes()))
                }
                DType::BF16 => (0..n / 2)
                    .for_each(|_| buf.extend_from_slice(&f32_to_bf16(gen.value()).to_le_bytes())),
                // Finite E4M3 codes; E8M0 scales around 2^-8.
                DType::F8_E4M3 => (0..n).for_each(|_| buf.push(gen.byte() & 0xFE)),
                DType::F8_E8M0 => (0..n).for_each(|_| buf.push(115 + gen.byte() % 8)),
                DType::I8 | DType::U8 => (0..n).for_each(|_| buf.push(gen.byte())),
                _ => unreachable!(),
            }
            f.write_all(&buf).unwrap();
            left -= n;
        }
    }
    f.flush().unwrap();
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let [_, out, layout, gib] = &args[..] else {
        eprintln!("usage: gen_checkpoint OUT_DIR core|core-bf16 GIB");
        std::process::exit(2);
    };
    let gib: u64 = gib.parse().unwrap();
    let out = Path::new(out);
    std::fs::create_dir_all(out).unwrap();
    if layout.starts_with("fp8") {
        return fp8_layout(out, layout, gib);
    }
    if layout == "v4" {
        return v4_layout(out, gib);
    }
    if let Some(rank) = layout.strip_prefix("lora") {
        let rank = rank.strip_prefix("-r").map_or(16, |r| r.parse().unwrap());
        let names = core_layout(&out.join("base"), "core-bf16", gib);
        return lora_adapter(&out.join("adapter"), &names, rank);
    }
    core_layout(out, layout, gib);
}

/// An F32 adapter of rank `r` on every `*_proj` matrix: A [r, 4096], B [4096, r].
fn lora_adapter(out: &Path, names: &[String], r: u64) {
    std::fs::create_dir_all(out).unwrap();
    let mut tensors = Vec::new();
    for n in names.iter().filter(|n| n.ends_with("_proj.weight")) {
        let m = n.trim_end_matches(".weight");
        tensors.push((
            format!("base_model.model.{m}.lora_A.weight"),
            DType::F32,
            vec![r, 4096],
        ));
        tensors.push((
            format!("base_model.model.{m}.lora_B.weight"),
            DType::F32,
            vec![4096, r],
        ));
    }
    write_shard(
        &out.join("adapter_model.safetensors"),
        &tensors,
        &mut Gen::new(99),
    );
    std::fs::write(
        out.join("adapter_config.json"),
        format!(
            r#"{{"r": {r}, "lora_alpha": {}, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj"]}}"#,
            2 * r
        ),
    )
    .unwrap();
    println!(
        "{}: adapter for {} modules",
        out.display(),
        tensors.len() / 2
    );
}

/// Returns the tensor names written.
fn core_layout(out: &Path, layout: &str, gib: u64) -> Vec<String> {
    std::fs::create_dir_all(out).unwrap();
    let float = |d: DType| {
        if layout == "core-bf16" {
            DType::BF16
        } else {
            d
        }
    };
    // One big F32 tensor of 2 GiB + 128 MiB (an embedding-like [32768+2048, 16384]), then
    // layers of BF16 matrices and F32 norms until the size is reached.
    let mut shards: Vec<Vec<(String, DType, Vec<u64>)>> = vec![vec![(
        "model.embed_tokens.weight".into(),
        float(DType::F32),
        vec![34816, 16384],
    )]];
    let mut total = 34816u64 * 16384 * float(DType::F32).size().unwrap() as u64;
    let mut layer = 0;
    while total < gib << 30 {
        let p = format!("model.layers.{layer}");
        let mut s = Vec::new();
        for name in ["q_proj", "k_proj", "v_proj", "o_proj"] {
            s.push((
                format!("{p}.self_attn.{name}.weight"),
                float(DType::BF16),
                vec![4096, 4096],
            ));
        }
        for name in ["gate_proj", "up_proj"] {
            s.push((
                format!("{p}.mlp.{name}.weight"),
                float(DType::F32),
                vec![4096, 4096],
            ));
        }
        s.push((
            format!("{p}.input_layernorm.weight"),
            float(DType::F32),
            vec![4096],
        ));
        total += s
            .iter()
            .map(|(_, d, sh)| sh.iter().product::<u64>() * d.size().unwrap() as u64)
            .sum::<u64>();
        shards.push(s);
        layer += 1;
    }
    let names = shards.iter().flatten().map(|t| t.0.clone()).collect();
    finish(out, shards, total, r#"{"torch_dtype": "float32"}"#);
    names
}

/// 64 layers' worth of [4096, 4096] weights per GiB of FP8, 16 per shard.
fn fp8_layout(out: &Path, layout: &str, gib: u64) {
    let mut shards = Vec::new();
    let mut total = 0;
    for k in 0..gib * 64 {
        if k % 16 == 0 {
            shards.push(Vec::new());
        }
        let name = format!("model.layers.{}.mlp.experts.{}.weight", k / 16, k % 16);
        let s = shards.last_mut().unwrap();
        match layout {
            "fp8-as-bf16" => {
                s.push((name, DType::BF16, vec![4096, 4096]));
                total += 4096 * 4096 * 2;
            }
            _ => {
                let sd = if layout == "fp8-e8m0" {
                    DType::F8_E8M0
                } else {
                    DType::F32
                };
                s.push((format!("{name}_scale_inv"), sd, vec![32, 32]));
                s.push((name, DType::F8_E4M3, vec![4096, 4096]));
                total += 4096 * 4096 + 1024 * sd.size().unwrap() as u64;
            }
        }
    }
    let config = if layout == "fp8-as-bf16" {
        r#"{"torch_dtype": "bfloat16"}"#
    } else {
        r#"{"torch_dtype": "bfloat16", "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}}"#
    };
    finish(out, shards, total, config);
}

/// Experts [2048, 7168] (w1, w3) and [7168, 2048] (w2) with 32-element E8M0 scales, 8 per
/// layer; layer 0 also holds the Engram table; shards of about 1 GiB.
fn v4_layout(out: &Path, gib: u64) {
    let mut shards: Vec<Vec<(String, DType, Vec<u64>)>> = Vec::new();
    let mut total = 0u64;
    let size =
        |t: &(String, DType, Vec<u64>)| t.2.iter().product::<u64>() * t.1.size().unwrap() as u64;
    let push = |shards: &mut Vec<Vec<(String, DType, Vec<u64>)>>,
                t: (String, DType, Vec<u64>),
                total: &mut u64| {
        *total += size(&t);
        let cur: u64 = shards.last().map_or(u64::MAX, |s| s.iter().map(size).sum());
        if cur.saturating_add(size(&t)) > 1 << 30 {
            shards.push(Vec::new());
        }
        shards.last_mut().unwrap().push(t);
    };
    push(
        &mut shards,
        ("embed.weight".into(), DType::BF16, vec![65536, 4096]),
        &mut total,
    );
    push(
        &mut shards,
        (
            "layers.0.engram.embed.weight".into(),
            DType::F8_E4M3,
            vec![524288, 4096],
        ),
        &mut total,
    );
    push(
        &mut shards,
        (
            "layers.0.engram.embed.scale".into(),
            DType::F8_E8M0,
            vec![524288, 128],
        ),
        &mut total,
    );
    let mut layer = 0;
    while total < gib << 30 {
        let p = format!("layers.{layer}");
        push(
            &mut shards,
            (
                format!("{p}.attn.wq.weight"),
                DType::F8_E4M3,
                vec![4096, 4096],
            ),
            &mut total,
        );
        push(
            &mut shards,
            (format!("{p}.attn.wq.scale"), DType::F8_E8M0, vec![32, 32]),
            &mut total,
        );
        for e in 0..8 {
            for (w, shape) in [
                ("w1", [2048u64, 7168u64]),
                ("w2", [7168, 2048]),
                ("w3", [2048, 7168]),
            ] {
                let name = format!("{p}.ffn.experts.{e}.{w}");
                push(
                    &mut shards,
                    (
                        format!("{name}.weight"),
                        DType::I8,
                        vec![shape[0], shape[1] / 2],
                    ),
                    &mut total,
                );
                push(
                    &mut shards,
                    (
                        format!("{name}.scale"),
                        DType::F8_E8M0,
                        vec![shape[0], shape[1] / 32],
                    ),
                    &mut total,
                );
            }
        }
        layer += 1;
    }
    finish(
        out,
        shards,
        total,
        r#"{"model_type": "deepseek_v4", "expert_dtype": "fp4"}"#,
    );
}

fn finish(out: &Path, shards: Vec<Vec<(String, DType, Vec<u64>)>>, total: u64, config: &str) {
    let n = shards.len();
    let mut map = serde_json::Map::new();
    // GEN_SEED makes a second model of the same layout with other values (for merges).
    let seed = std::env::var("GEN_SEED").map_or(12345, |s| s.parse().expect("GEN_SEED: a number"));
    let mut gen = Gen::new(seed);
    for (i, s) in shards.iter().enumerate() {
        let name = format!("model-{:05}-of-{:05}.safetensors", i + 1, n);
        write_shard(&out.join(&name), s, &mut gen);
        for (t, _, _) in s {
            map.insert(t.clone(), name.clone().into());
        }
    }
    let index = serde_json::json!({"metadata": {"total_size": total}, "weight_map": map});
    std::fs::write(out.join("model.safetensors.index.json"), index.to_string()).unwrap();
    std::fs::write(out.join("config.json"), config).unwrap();
    println!("{}: {} shards, {} bytes", out.display(), n, total);
}
