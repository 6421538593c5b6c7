//! `tftf demo`: a tiny two-shard checkpoint (BF16, F32 and block-scaled FP8 tensors, an index, a
//! config and a tokenizer file), converted with every operation available, then validated
//! byte for byte against what the conversions promise.

use std::path::{Path, PathBuf};

use serde_json::json;

use crate::error::{Error, Result};
use crate::format::checkpoint::Checkpoint;
use crate::format::dtype::DType;
use crate::format::write_small;
use crate::job::{Job, WriteOptions};
use crate::lcg::Lcg;
use crate::ops::cast::f32_to_bf16;
use crate::ops::fp8::codec::{e4m3_to_f32, e8m0_to_f32};
use crate::ops::fp8::{DequantFp8Step, DequantOptions, ScaleMode};
use crate::pipeline::Cancel;
use crate::plan::Step;
use crate::transform::{Glob, Rename};

const HIDDEN: u64 = 64;
const LAYERS: usize = 2;

struct Rng(Lcg);
impl Rng {
    /// 31 random bits.
    fn next(&mut self) -> u32 {
        self.0.next_u32() >> 1
    }
    fn normal_ish(&mut self) -> f32 {
        (0..4)
            .map(|_| self.next() as f32 / (1u64 << 31) as f32 - 0.5)
            .sum::<f32>()
            * 0.05
    }
}

type Tensor = (String, DType, Vec<u64>, Vec<u8>);

fn bf16_tensor(name: &str, shape: Vec<u64>, rng: &mut Rng) -> Tensor {
    let n: u64 = shape.iter().product();
    let data = (0..n)
        .flat_map(|_| f32_to_bf16(rng.normal_ish()).to_le_bytes())
        .collect();
    (name.into(), DType::BF16, shape, data)
}

fn f32_tensor(name: &str, shape: Vec<u64>, rng: &mut Rng) -> Tensor {
    let n: u64 = shape.iter().product();
    let data = (0..n)
        .flat_map(|_| (1.0 + rng.normal_ish()).to_le_bytes())
        .collect();
    (name.into(), DType::F32, shape, data)
}

fn fp8_tensor(name: &str, shape: Vec<u64>, rng: &mut Rng) -> Tensor {
    let n: u64 = shape.iter().product();
    // Finite E4M3 codes only: 0x7F/0xFF are NaN.
    let data = (0..n)
        .map(|_| (rng.next() % 0x7F) as u8 | (rng.next() as u8 & 0x80))
        .collect();
    (name.into(), DType::F8_E4M3, shape, data)
}

/// Writes the example checkpoint into `dir`.
pub fn make_example(dir: &Path) -> Result<()> {
    std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
    let mut rng = Rng(Lcg(42));
    let h = HIDDEN;
    let mut shard1 = vec![bf16_tensor(
        "model.embed_tokens.weight",
        vec![256, h],
        &mut rng,
    )];
    let mut shard2 = Vec::new();
    for l in 0..LAYERS {
        let target = if l == 0 { &mut shard1 } else { &mut shard2 };
        target.extend(layer_tensors(l, &mut rng));
    }
    shard2.push(f32_tensor("model.norm.weight", vec![h], &mut rng));
    shard2.push(bf16_tensor("lm_head.weight", vec![256, h], &mut rng));
    let names = [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    ];
    let mut weight_map = serde_json::Map::new();
    let mut total = 0u64;
    for (name, tensors) in names.iter().zip([&shard1, &shard2]) {
        write_small(&dir.join(name), tensors)?;
        for t in tensors.iter() {
            weight_map.insert(t.0.clone(), json!(name));
            total += t.3.len() as u64;
        }
    }
    let index = json!({"metadata": {"total_size": total}, "weight_map": weight_map});
    write_json(dir, "model.safetensors.index.json", &index)?;
    write_json(dir, "config.json", &example_config())?;
    write_json(
        dir,
        "tokenizer_config.json",
        &json!({"model_max_length": 4096}),
    )
}

/// One decoder layer: FP8 attention projections with their scales, BF16 MLP, F32 norms.
fn layer_tensors(l: usize, rng: &mut Rng) -> Vec<Tensor> {
    let h = HIDDEN;
    let p = format!("model.layers.{l}");
    let mut tensors = Vec::new();
    for proj in ["q_proj", "k_proj", "v_proj", "o_proj"] {
        tensors.push(fp8_tensor(
            &format!("{p}.self_attn.{proj}.weight"),
            vec![h, h],
            rng,
        ));
        let scale: Vec<u8> = (0..1).flat_map(|_| 0.01f32.to_le_bytes()).collect();
        tensors.push((
            format!("{p}.self_attn.{proj}.weight_scale_inv"),
            DType::F32,
            vec![1, 1],
            scale,
        ));
    }
    for (proj, shape) in [
        ("gate_proj", [2 * h, h]),
        ("up_proj", [2 * h, h]),
        ("down_proj", [h, 2 * h]),
    ] {
        tensors.push(bf16_tensor(
            &format!("{p}.mlp.{proj}.weight"),
            shape.to_vec(),
            rng,
        ));
    }
    tensors.push(f32_tensor(
        &format!("{p}.input_layernorm.weight"),
        vec![h],
        rng,
    ));
    tensors.push(f32_tensor(
        &format!("{p}.post_attention_layernorm.weight"),
        vec![h],
        rng,
    ));
    tensors
}

/// The example's `config.json`: a Llama with block-scaled FP8 attention weights.
fn example_config() -> serde_json::Value {
    json!({
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": HIDDEN,
        "num_hidden_layers": LAYERS,
        "torch_dtype": "bfloat16",
        "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]},
    })
}

/// Writes `v` pretty-printed to `dir/name`.
fn write_json(dir: &Path, name: &str, v: &serde_json::Value) -> Result<()> {
    let p = dir.join(name);
    std::fs::write(&p, serde_json::to_string_pretty(v).expect("JSON")).map_err(|e| Error::io(&p, e))
}

fn repack_step() -> Result<Step> {
    use crate::ops::fp4::repack::{
        RepackFp4Step, RepackOptions, DEFAULT_ENGRAM_PATTERN, DEFAULT_EXPERT_PATTERN,
    };
    let re = |p: &str| regex::Regex::new(p).map_err(|e| Error::Other(e.to_string()));
    Ok(Step::Op(std::sync::Arc::new(RepackFp4Step::new(
        RepackOptions {
            experts: true,
            engram: true,
            require_lossless: true,
            expert_pattern: re(DEFAULT_EXPERT_PATTERN)?,
            engram_pattern: re(DEFAULT_ENGRAM_PATTERN)?,
            shards: None,
            config_update: true,
        },
    ))))
}

/// Two MXFP4 experts (w1, w2, w3 of [32, 64]) and a [64, 64] E4M3 Engram table.
fn make_v4_example(dir: &Path) -> Result<()> {
    std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
    let mut rng = Rng(Lcg(7));
    let mut tensors = Vec::new();
    for e in 0..2 {
        for w in ["w1", "w2", "w3"] {
            let p = format!("layers.0.ffn.experts.{e}.{w}");
            let codes: Vec<u8> = (0..32 * 32).map(|_| rng.next() as u8).collect();
            let scales: Vec<u8> = (0..32 * 2).map(|_| 118 + (rng.next() % 12) as u8).collect();
            tensors.push((format!("{p}.weight"), DType::I8, vec![32, 32], codes));
            tensors.push((format!("{p}.scale"), DType::F8_E8M0, vec![32, 2], scales));
        }
    }
    let table: Vec<u8> = (0..64 * 64)
        .map(|_| (rng.next() % 0x7F) as u8 | (rng.next() as u8 & 0x80))
        .collect();
    let tscale: Vec<u8> = (0..64 * 2).map(|_| 120 + (rng.next() % 8) as u8).collect();
    tensors.push((
        "layers.0.engram.embed.weight".into(),
        DType::F8_E4M3,
        vec![64, 64],
        table,
    ));
    tensors.push((
        "layers.0.engram.embed.scale".into(),
        DType::F8_E8M0,
        vec![64, 2],
        tscale,
    ));
    tensors.push(bf16_tensor("embed.weight", vec![64, 16], &mut rng));
    write_small(&dir.join("model.safetensors"), &tensors)?;
    let cfg = dir.join("config.json");
    std::fs::write(
        &cfg,
        "{\"model_type\": \"deepseek_v4\", \"expert_dtype\": \"fp4\"}\n",
    )
    .map_err(|e| Error::io(&cfg, e))
}

fn quiet_opts(output: &Path, max_shard_bytes: Option<u64>) -> WriteOptions {
    WriteOptions {
        output: output.into(),
        format: crate::job::Format::Safetensors { max_shard_bytes },
        silent: false,
        on_progress: None,
        dry_run: false,
        threads: 2,
        io_threads: None,
        memory_budget: 16 << 20,
        quiet: true,
        progress: crate::progress::Mode::Off,
        progress_interval: std::time::Duration::from_secs(30),
        verbose: false,
        allow_empty: false,
        report: None,
        force: false,
        kernel_copy: true,
        device: crate::gpu::DeviceRequest::Auto,
        checksums: None,
        part: None,
        resume: false,
        finalize: false,
        arguments: String::new(),
    }
}

fn tensor_bytes(ckpt: &Checkpoint, name: &str) -> Result<Vec<u8>> {
    let t = ckpt.get(name).ok_or_else(|| {
        Error::Other(format!(
            "demo: `{name}` missing from {}",
            ckpt.input.display()
        ))
    })?;
    let mut buf = vec![0u8; t.info.nbytes() as usize];
    ckpt.read_tensor_at_cached(t, 0, &mut buf, true)?;
    Ok(buf)
}

fn check(cond: bool, what: &str) -> Result<()> {
    if cond {
        println!("  ok  {what}");
        Ok(())
    } else {
        Err(Error::Other(format!("demo check failed: {what}")))
    }
}

pub fn run(keep: Option<&Path>, cancel: &Cancel) -> Result<()> {
    let tmp;
    let root = match keep {
        Some(dir) => dir.to_path_buf(),
        None => {
            tmp = TempDir::new()?;
            tmp.0.clone()
        }
    };
    let src = root.join("example");
    make_example(&src)?;
    let input = Checkpoint::open(&src)?;
    println!(
        "example checkpoint: {} tensors in {} shards, {} bytes ({})",
        input.tensors.len(),
        input.shards.len(),
        input.total_bytes(),
        src.display()
    );
    let demo = Demo {
        root: &root,
        src: &src,
        input: &input,
        cancel,
    };
    let outputs = [
        demo.passthrough_bf16()?,
        demo.exclude_and_rename()?,
        demo.dequant_fp8()?,
        demo.repack_fp4()?,
        demo.merge_lora()?,
    ];
    validate_outputs(&outputs)?;
    println!(
        "\ndemo finished: every check passed{}",
        match keep {
            Some(d) => format!("; files kept in {}", d.display()),
            None => String::new(),
        }
    );
    Ok(())
}

/// The example checkpoint and where the demo's conversions of it go; each step converts,
/// checks what the conversion promises, and returns its output directory.
struct Demo<'a> {
    root: &'a Path,
    src: &'a Path,
    input: &'a Checkpoint,
    cancel: &'a Cancel,
}

/// An FP8 attention weight of the example's second layer.
const Q_PROJ: &str = "model.layers.1.self_attn.q_proj.weight";

impl Demo<'_> {
    fn passthrough_bf16(&self) -> Result<PathBuf> {
        let (input, src) = (self.input, self.src);
        let bf16_dir = self.root.join("bf16-resharded");
        println!("\n1. passthrough --dtype bf16 --max-shard-size 40KB");
        Job {
            command: "passthrough",
            source: src,
            steps: &[Step::Cast {
                dtype: DType::BF16,
                cast_ints: false,
            }],
            options: &quiet_opts(&bf16_dir, Some(40_000)),
        }
        .execute(self.cancel)?;
        let out = Checkpoint::open(&bf16_dir)?;
        check(
            out.tensors.len() == input.tensors.len(),
            "every tensor present",
        )?;
        check(
            out.shards.len() > 2,
            &format!("resharded into {} shards with an index", out.shards.len()),
        )?;
        let norm_in = tensor_bytes(input, "model.norm.weight")?;
        let norm_out = tensor_bytes(&out, "model.norm.weight")?;
        let expected: Vec<u8> = norm_in
            .chunks_exact(4)
            .flat_map(|c| f32_to_bf16(f32::from_le_bytes(c.try_into().unwrap())).to_le_bytes())
            .collect();
        check(
            norm_out == expected,
            "F32 norms cast to BF16, rounded to nearest even",
        )?;
        check(
            tensor_bytes(&out, Q_PROJ)? == tensor_bytes(input, Q_PROJ)?,
            "FP8 weights copied byte for byte",
        )?;
        let cfg: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(bf16_dir.join("config.json"))
                .map_err(|e| Error::io(&bf16_dir, e))?,
        )
        .map_err(|e| Error::Other(e.to_string()))?;
        check(
            cfg["torch_dtype"] == "bfloat16",
            "config.json torch_dtype says bfloat16",
        )?;
        check(
            bf16_dir.join("tokenizer_config.json").is_file(),
            "tokenizer files copied",
        )?;
        Ok(bf16_dir)
    }

    fn exclude_and_rename(&self) -> Result<PathBuf> {
        let renamed = self.root.join("renamed.safetensors");
        println!("\n2. run --key-exclude '*.weight_scale_inv' --key-rename '^model\\.' '' -o renamed.safetensors");
        Job {
            command: "run",
            source: self.src,
            steps: &[
                Step::Exclude(vec![Glob::new("*.weight_scale_inv")?]),
                Step::Rename(Rename::new(r"^model\.", "")?),
            ],
            options: &quiet_opts(&renamed, None),
        }
        .execute(self.cancel)?;
        let out2 = Checkpoint::open(&renamed)?;
        check(
            out2.get("layers.0.mlp.up_proj.weight").is_some(),
            "`model.` prefix stripped",
        )?;
        check(
            out2.tensors
                .iter()
                .all(|t| !t.info.name.ends_with("weight_scale_inv")),
            "scales excluded",
        )?;
        check(
            tensor_bytes(&out2, "embed_tokens.weight")?
                == tensor_bytes(self.input, "model.embed_tokens.weight")?,
            "renamed tensors keep their bytes",
        )?;
        Ok(renamed)
    }

    fn dequant_fp8(&self) -> Result<PathBuf> {
        let input = self.input;
        let deq_dir = self.root.join("dequantized");
        println!("\n3. dequant-fp8 (FP8 E4M3 weights with F32 scales -> BF16)");
        Job {
            command: "dequant-fp8",
            source: self.src,
            steps: &[Step::Op(std::sync::Arc::new(DequantFp8Step {
                opts: DequantOptions {
                    dtype: DType::BF16,
                    block: None,
                    weight_scale_mode: ScaleMode::Multiply,
                    allow_unscaled: false,
                    allow_nonfinite: false,
                },
            }))],
            options: &quiet_opts(&deq_dir, None),
        }
        .execute(self.cancel)?;
        let out3 = Checkpoint::open(&deq_dir)?;
        let codes = tensor_bytes(input, Q_PROJ)?;
        let scale = first_f32(&tensor_bytes(input, &format!("{Q_PROJ}_scale_inv"))?);
        let want: Vec<u8> = codes
            .iter()
            .flat_map(|&c| f32_to_bf16(e4m3_to_f32(c) * scale).to_le_bytes())
            .collect();
        check(
            tensor_bytes(&out3, Q_PROJ)? == want,
            "every FP8 weight equals bf16(f32(w) * scale), bit for bit",
        )?;
        check(
            out3.tensors
                .iter()
                .all(|t| !t.info.name.ends_with("_scale_inv")),
            "scale tensors dropped",
        )?;
        let cfg3 = std::fs::read_to_string(deq_dir.join("config.json"))
            .map_err(|e| Error::io(&deq_dir, e))?;
        check(
            !cfg3.contains("quantization_config"),
            "config.json no longer claims FP8 quantisation",
        )?;
        Ok(deq_dir)
    }

    fn repack_fp4(&self) -> Result<PathBuf> {
        let v4 = self.root.join("v4-example");
        make_v4_example(&v4)?;
        let fp4_dir = self.root.join("fp4-repacked");
        println!("\n4. repack-fp4 of a tiny DeepSeek-V4-style checkpoint (MXFP4 experts -> NVFP4, E4M3 Engram -> E2M1)");
        Job {
            command: "repack-fp4",
            source: &v4,
            steps: &[repack_step()?],
            options: &quiet_opts(&fp4_dir, None),
        }
        .execute(self.cancel)?;
        let v4_in = Checkpoint::open(&v4)?;
        let out4 = Checkpoint::open(&fp4_dir)?;
        check(
            experts_repacked_exactly(&v4_in, &out4)?,
            "every expert keeps its nibbles and decodes to the same values under NVFP4 scales",
        )?;
        let table = out4
            .get("layers.0.engram.embed.weight")
            .map(|t| (t.info.dtype, t.info.shape.clone()));
        check(
            table == Some((DType::U8, vec![64, 32])),
            "the Engram table is packed E2M1, half the bytes",
        )?;
        let cfg4 = std::fs::read_to_string(fp4_dir.join("config.json"))
            .map_err(|e| Error::io(&fp4_dir, e))?;
        check(
            cfg4.contains("\"expert_dtype\": \"nvfp4\"")
                && cfg4.contains("\"engram_dtype\": \"fp4\""),
            "config.json records the new formats",
        )?;
        Ok(fp4_dir)
    }

    fn merge_lora(&self) -> Result<PathBuf> {
        println!("\n5. merge-lora: an r=4 adapter on both layers' up_proj");
        let adapter = self.root.join("adapter");
        let factors = make_example_adapter(&adapter)?;
        let merged_dir = self.root.join("merged");
        let lora = Step::Op(std::sync::Arc::new(crate::ops::lora::LoraMergeStep::new(
            crate::ops::lora::LoraOptions {
                adapter: crate::ops::lora::AdapterSource::Path(adapter.clone()),
                config: None,
                adapter_name: "default".into(),
                scale: 1.0,
                allow_unmatched: false,
                rank_alpha: None,
                allow_nonfinite: false,
            },
        )));
        Job {
            command: "merge-lora",
            source: self.src,
            steps: &[lora],
            options: &quiet_opts(&merged_dir, None),
        }
        .execute(self.cancel)?;
        let out5 = Checkpoint::open(&merged_dir)?;
        let up = "model.layers.1.mlp.up_proj.weight";
        let (w0, w1) = (tensor_bytes(self.input, up)?, tensor_bytes(&out5, up)?);
        let worst = worst_merge_ulp(&w0, &w1, &factors[2].3, &factors[3].3);
        check(
            worst <= 1.0,
            &format!("merged weights equal bf16(W + 2·B@A) within {worst:.2} ulp"),
        )?;
        check(
            tensor_bytes(&out5, "lm_head.weight")? == tensor_bytes(self.input, "lm_head.weight")?,
            "untargeted tensors unchanged",
        )?;
        Ok(merged_dir)
    }
}

/// The first four bytes of `bytes` as a little-endian F32 (a per-tensor scale).
fn first_f32(bytes: &[u8]) -> f32 {
    f32::from_le_bytes(bytes[..4].try_into().unwrap())
}

/// Whether every repacked expert kept its nibbles and each NVFP4 block scale times the tensor
/// scale equals the MXFP4 scale it replaced.
fn experts_repacked_exactly(v4_in: &Checkpoint, out4: &Checkpoint) -> Result<bool> {
    let mut exact = true;
    for e in 0..2 {
        for w in ["w1", "w2", "w3"] {
            let p = format!("layers.0.ffn.experts.{e}.{w}");
            let codes = tensor_bytes(v4_in, &format!("{p}.weight"))?;
            exact &= tensor_bytes(out4, &format!("{p}.weight"))? == codes;
            let k = tensor_bytes(v4_in, &format!("{p}.scale"))?;
            let bs = tensor_bytes(out4, &format!("{p}.weight_scale"))?;
            let t2 = first_f32(&tensor_bytes(out4, &format!("{p}.weight_scale_2"))?);
            for (i, &c) in k.iter().enumerate() {
                for h in 0..2 {
                    let got = e4m3_to_f32(bs[2 * i + h]) as f64 * t2 as f64;
                    exact &= got == e8m0_to_f32(c) as f64;
                }
            }
        }
    }
    Ok(exact)
}

/// Writes a PEFT adapter for [`make_example`]'s model into `adapter`: rank 4 on both layers'
/// `up_proj`. Returns its factors (A then B for each layer).
pub fn make_example_adapter(adapter: &Path) -> Result<Vec<Tensor>> {
    std::fs::create_dir_all(adapter).map_err(|e| Error::io(adapter, e))?;
    let mut rng = Rng(Lcg(11));
    let mut factors = Vec::new();
    for l in 0..LAYERS {
        let m = format!("base_model.model.model.layers.{l}.mlp.up_proj");
        let a: Vec<f32> = (0..4 * HIDDEN).map(|_| rng.normal_ish()).collect();
        let b: Vec<f32> = (0..2 * HIDDEN * 4).map(|_| rng.normal_ish()).collect();
        factors.push((
            format!("{m}.lora_A.weight"),
            DType::F32,
            vec![4, HIDDEN],
            a.iter().flat_map(|x| x.to_le_bytes()).collect(),
        ));
        factors.push((
            format!("{m}.lora_B.weight"),
            DType::F32,
            vec![2 * HIDDEN, 4],
            b.iter().flat_map(|x| x.to_le_bytes()).collect(),
        ));
    }
    write_small(&adapter.join("adapter_model.safetensors"), &factors)?;
    let cfg_path = adapter.join("adapter_config.json");
    std::fs::write(
        &cfg_path,
        r#"{"r": 4, "lora_alpha": 8, "target_modules": ["up_proj"]}"#,
    )
    .map_err(|e| Error::io(&cfg_path, e))?;
    Ok(factors)
}

/// The largest distance, in BF16 ulps, between the merged BF16 weight `w1` and
/// `w0 + 2·B@A` computed in f64 (`a`, `b`: the F32 factors' bytes).
fn worst_merge_ulp(w0: &[u8], w1: &[u8], a: &[u8], b: &[u8]) -> f64 {
    let f = |b: &[u8], k: usize| {
        crate::ops::cast::bf16_to_f32(u16::from_le_bytes([b[2 * k], b[2 * k + 1]])) as f64
    };
    let g = |v: &[u8], k: usize| f32::from_le_bytes(v[4 * k..4 * k + 4].try_into().unwrap()) as f64;
    let mut worst = 0f64;
    for i in 0..(2 * HIDDEN) as usize {
        for j in 0..HIDDEN as usize {
            let delta: f64 = (0..4)
                .map(|k| g(b, i * 4 + k) * g(a, k * HIDDEN as usize + j))
                .sum();
            let want = f(w0, i * HIDDEN as usize + j) + 2.0 * delta;
            let ulp = want.abs().max(1e-30) * 2f64.powi(-7);
            worst = worst.max((f(w1, i * HIDDEN as usize + j) - want).abs() / ulp);
        }
    }
    worst
}

/// Step 6: every output opens (its structure is valid) and holds only finite values.
fn validate_outputs(dirs: &[PathBuf]) -> Result<()> {
    println!("\n6. validate --check-values on every output");
    for dir in dirs {
        let c = Checkpoint::open(dir)?;
        let mut bad = 0;
        for t in &c.tensors {
            let mut acc = crate::commands::validate::NonFinite::default();
            crate::commands::validate::scan_nonfinite(
                t.info.dtype,
                &tensor_bytes(&c, &t.info.name)?,
                0,
                &mut acc,
            );
            bad += acc.count;
        }
        check(
            bad == 0,
            &format!("{}: structure valid, all values finite", dir.display()),
        )?;
    }
    Ok(())
}

struct TempDir(PathBuf);

impl TempDir {
    fn new() -> Result<TempDir> {
        let base = std::env::temp_dir();
        for i in 0..100u32 {
            let p = base.join(format!("tftf-demo-{}-{i}", std::process::id()));
            if std::fs::create_dir(&p).is_ok() {
                return Ok(TempDir(p));
            }
        }
        Err(Error::Other(format!(
            "cannot create a temporary directory in {}",
            base.display()
        )))
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}
