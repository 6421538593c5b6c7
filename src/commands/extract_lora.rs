//! `tftf extract-lora --base BASE --model FINETUNED -r RANK -o ADAPTER`: a PEFT adapter from
//! the difference of two models ([`crate::ops::lora::extract`] has the math). One tensor pair
//! is in memory at a time; the adapter file's layout is fixed from the headers before the
//! first SVD, so each result is written at its offset as soon as it exists, and the files
//! appear under their names only when the whole run succeeded.

use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use regex::Regex;
use serde_json::{json, Map, Value};

use crate::cli::ExtractLoraArgs;
use crate::error::{Error, Result};
use crate::format::checkpoint::Checkpoint;
use crate::format::header::{serialize_header, TensorInfo};
use crate::ops::lora::extract::{
    decompose, encode, read_f64, ExtractOptions, ExtractPlan, Item, ModuleFilter, Recipe,
};
use crate::output::{InputFiles, OutputTarget};
use crate::pipeline::Cancel;
use crate::sink::OutputKind;

pub const ADAPTER_WEIGHTS: &str = "adapter_model.safetensors";
pub const ADAPTER_CONFIG: &str = "adapter_config.json";
/// Bytes copied at a time for tensors saved whole.
const COPY_CHUNK_BYTES: usize = 64 << 20;

fn regexes(list: &[String], flag: &str) -> Result<Vec<Regex>> {
    list.iter()
        .map(|r| Regex::new(r).map_err(|e| Error::Usage(format!("{flag} `{r}`: {e}"))))
        .collect()
}

fn options(a: &ExtractLoraArgs) -> Result<ExtractOptions> {
    let dtype = a
        .dtype
        .as_deref()
        .map(super::steps::cast_target)
        .transpose()?;
    Ok(ExtractOptions {
        rank: usize::try_from(a.rank).map_err(|_| Error::Usage("-r/--rank is too large".into()))?,
        distribute_scale: !a.no_distribute_scale,
        embed_lora: a.embed_lora,
        save_modules: a.save_modules.clone(),
        modules: ModuleFilter {
            include: regexes(&a.include_regexes, "--include-regex")?,
            exclude: regexes(&a.exclude_regexes, "--exclude-regex")?,
        },
        skip_undecomposable: a.skip_undecomposable,
        dtype,
    })
}

pub fn run(a: &ExtractLoraArgs, cancel: &Cancel) -> Result<()> {
    let opts = options(a)?;
    let base = Checkpoint::open(&a.base)?;
    let model = Checkpoint::open(&a.model)?;
    let plan = ExtractPlan::build(&base, &model, &opts)?;
    if !a.quiet {
        for n in &plan.notes {
            errln!("note: {n}");
        }
    }
    let (infos, header) = layout(&plan);
    if a.dry_run {
        for i in &infos {
            outln!("{} {} {:?}", i.name, i.dtype, i.shape);
        }
        outln!("{}", config_text(&plan, &a.base));
        return Ok(());
    }
    let base_files: Vec<PathBuf> = base
        .shards
        .iter()
        .map(|s| s.path.clone())
        .chain(base.index_path.clone())
        .collect();
    let inputs = InputFiles::of(&model, &base_files);
    OutputTarget::resolve_as(&a.output, OutputKind::Dir, &base, &inputs)?;
    let target = OutputTarget::resolve_as(&a.output, OutputKind::Dir, &model, &inputs)?;
    let names = [ADAPTER_WEIGHTS.to_string(), ADAPTER_CONFIG.to_string()];
    target.claim_files(&names, a.force)?;
    let (mut set, notes) = target.begin()?;
    if !a.quiet {
        notes.iter().for_each(|n| errln!("note: {n}"));
    }
    let (file, tmp) = set.add(ADAPTER_WEIGHTS)?;
    let data_start = header.len() as u64;
    file.write_all_at(&header, 0)
        .map_err(|e| Error::io(&tmp, e))?;
    let ctx = Ctx {
        base: &base,
        model: &model,
        file: &file,
        tmp: &tmp,
        opts: &opts,
        verbose: a.verbose && !a.quiet,
    };
    let work: Vec<(&Item, u64)> = plan
        .items
        .iter()
        .zip(first_infos(&plan, &infos))
        .map(|(item, info)| (item, data_start + info.begin))
        .collect();
    write_items(&ctx, &work, a.threads, cancel)?;
    set.add_bytes(ADAPTER_CONFIG, config_text(&plan, &a.base).as_bytes())?;
    set.commit(&[])?;
    if !a.quiet {
        outln!(
            "{}: {} module(s) decomposed at rank {}, {} tensor(s) saved whole",
            a.output.display(),
            plan.items
                .iter()
                .filter(|i| matches!(i.recipe, Recipe::Decompose { .. }))
                .count(),
            plan.rank,
            plan.items
                .iter()
                .filter(|i| matches!(i.recipe, Recipe::Save { .. }))
                .count()
        );
    }
    Ok(())
}

/// Computes and writes every item, `threads` at a time. Each item's bytes are computed alone
/// (faer runs sequentially inside one), so the file is the same for any count; the error
/// kept is that of the first failing item in plan order, and it stops the others.
fn write_items(ctx: &Ctx, work: &[(&Item, u64)], threads: usize, cancel: &Cancel) -> Result<()> {
    use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
    let next = AtomicUsize::new(0);
    let failed: std::sync::Mutex<Option<(usize, Error)>> = std::sync::Mutex::new(None);
    let fail = |i: usize, e: Error| {
        let mut f = failed.lock().unwrap_or_else(|p| p.into_inner());
        if f.as_ref().is_none_or(|(j, _)| i < *j) {
            *f = Some((i, e));
        }
    };
    std::thread::scope(|scope| {
        for _ in 0..threads.clamp(1, work.len().max(1)) {
            scope.spawn(|| loop {
                let i = next.fetch_add(1, Relaxed);
                let Some((item, at)) = work.get(i) else {
                    return;
                };
                let stop = failed.lock().map_or(true, |f| f.is_some());
                if stop || cancel.is_raised() {
                    return fail(i, Error::Cancelled);
                }
                if let Err(e) = ctx.write_item(item, *at) {
                    return fail(i, e);
                }
            });
        }
    });
    match failed.into_inner().unwrap_or_else(|p| p.into_inner()) {
        Some((_, e)) => Err(e),
        None => Ok(()),
    }
}

/// The adapter file's tensors, in plan order, with their offsets, and its header bytes.
fn layout(plan: &ExtractPlan) -> (Vec<TensorInfo>, Vec<u8>) {
    let mut infos = Vec::new();
    let mut at = 0u64;
    for out in plan.items.iter().flat_map(|i| &i.outputs) {
        let len = out.shape.iter().product::<u64>() * out.dtype.bits() / 8;
        infos.push(TensorInfo {
            name: out.name.clone(),
            dtype: out.dtype,
            shape: out.shape.clone(),
            begin: at,
            end: at + len,
        });
        at += len;
    }
    let mut meta = Map::new();
    meta.insert("format".into(), Value::from("pt"));
    let header = serialize_header(&meta, &infos, 8);
    (infos, header)
}

/// The first output tensor of each item (its outputs are contiguous from there).
fn first_infos<'a>(plan: &ExtractPlan, infos: &'a [TensorInfo]) -> Vec<&'a TensorInfo> {
    let mut at = 0;
    plan.items
        .iter()
        .map(|i| {
            let first = &infos[at];
            at += i.outputs.len();
            first
        })
        .collect()
}

/// `adapter_config.json` as mergekit writes it (its keys, in its order; `r` and `lora_alpha`
/// equal, so the scale is 1), with PEFT's `lora_bias` when bias changes were extracted.
fn config_text(plan: &ExtractPlan, base: &Path) -> String {
    let mut c = json!({
        "base_model_name_or_path": base.to_string_lossy(),
        "peft_type": "LORA",
        "use_rslora": false,
        "target_modules": plan.target_modules,
        "modules_to_save": plan.modules_to_save,
        "task_type": "CAUSAL_LM",
        "r": plan.rank,
        "lora_alpha": plan.rank,
        "rank_pattern": {},
        "alpha_pattern": {},
        "lora_dropout": 0.0,
        "fan_in_fan_out": false,
        "inference_mode": true,
    });
    if plan.has_lora_bias() {
        c["lora_bias"] = Value::Bool(true);
    }
    let mut out = Vec::new();
    let fmt = serde_json::ser::PrettyFormatter::with_indent(b"    ");
    let mut ser = serde_json::Serializer::with_formatter(&mut out, fmt);
    serde::Serialize::serialize(&c, &mut ser).expect("JSON values serialise");
    String::from_utf8(out).expect("serde_json writes UTF-8")
}

/// What writing one item needs.
struct Ctx<'a> {
    base: &'a Checkpoint,
    model: &'a Checkpoint,
    file: &'a std::fs::File,
    tmp: &'a Path,
    opts: &'a ExtractOptions,
    verbose: bool,
}

impl Ctx<'_> {
    fn put(&self, bytes: &[u8], at: u64) -> Result<()> {
        self.file
            .write_all_at(bytes, at)
            .map_err(|e| Error::io(self.tmp, e))
    }

    /// The fine-tuned tensor minus the base one, in f64.
    fn difference(&self, name: &str) -> Result<(Vec<f64>, &[u64])> {
        let t = self.model.get(name).expect("planned from the model");
        let b = self.base.get(name).expect("checked at plan time");
        let mut d = read_f64(self.model, t)?;
        let base = read_f64(self.base, b)?;
        d.iter_mut().zip(&base).for_each(|(x, y)| *x -= y);
        if d.iter().any(|x| !x.is_finite()) {
            return Err(Error::InvalidTensor {
                path: self.model.input.clone(),
                tensor: name.into(),
                msg: "the difference from the base holds NaN or infinity: it has no SVD".into(),
            });
        }
        Ok((d, &t.info.shape))
    }

    /// Computes item `item` and writes its tensors from absolute offset `at` on.
    fn write_item(&self, item: &Item, at: u64) -> Result<()> {
        match &item.recipe {
            Recipe::Save { tensor } => {
                let t = self.model.get(tensor).expect("planned from the model");
                let len = t.info.nbytes();
                let mut buf = vec![0u8; COPY_CHUNK_BYTES.min(len as usize)];
                let mut done = 0u64;
                while done < len {
                    let n = (len - done).min(buf.len() as u64) as usize;
                    self.model.read_tensor_at(t, done, &mut buf[..n])?;
                    self.put(&buf[..n], at + done)?;
                    done += n as u64;
                }
            }
            Recipe::Difference { tensor } => {
                let (d, _) = self.difference(tensor)?;
                self.put(&encode(&d, item.outputs[0].dtype), at)?;
            }
            Recipe::Decompose { tensor, transpose } => {
                let (d, shape) = self.difference(tensor)?;
                let dims = (shape[0] as usize, shape[1] as usize);
                let (r, distribute) = (self.opts.rank, self.opts.distribute_scale);
                let f = decompose(d, dims, *transpose, r, distribute, tensor)?;
                let a = encode(&f.a, item.outputs[0].dtype);
                self.put(&a, at)?;
                self.put(&encode(&f.b, item.outputs[1].dtype), at + a.len() as u64)?;
                if self.verbose {
                    errln!(
                        "{tensor}: rank {r}, optimal (Eckart-Young) error {:.6e}",
                        f.optimal_error
                    );
                }
            }
        }
        Ok(())
    }
}
