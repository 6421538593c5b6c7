//! The steps the writing commands (and `run`'s pipe sections) build from their options:
//! filters, renames, casts, dequantisation, LoRA merges with their requantisation, FP4 repacks.

use std::sync::Arc;

use crate::cli::{AdapterOpts, Fp4RepackArgs, Fp8Args, PassthroughArgs};
use crate::error::{Error, Result};
use crate::format::dtype::DType;
use crate::ops::dequant::DequantStep;
use crate::ops::fp4::repack::{
    RepackFp4Step, RepackOptions, ShardSelection, DEFAULT_ENGRAM_PATTERN, DEFAULT_EXPERT_PATTERN,
};
use crate::ops::fp8::{parse_block_size, DequantFp8Step, DequantOptions, ScaleMode};
use crate::ops::lora::{AdapterSource, LoraMergeStep, LoraOptions};
use crate::plan::Step;
use crate::transform::{Glob, Rename};

pub(crate) fn cast_target(s: &str) -> Result<DType> {
    DType::parse_cast_target(s).ok_or_else(|| {
        Error::Usage(format!(
            "unknown dtype `{s}`: use bf16, f16, f32 or f64 (or bfloat16, float16, float32, float64)"
        ))
    })
}

pub(crate) fn renames(flat: &[String]) -> Result<Vec<Rename>> {
    flat.chunks(2).map(|p| Rename::new(&p[0], &p[1])).collect()
}

pub(crate) fn globs(list: &[String]) -> Result<Vec<Glob>> {
    list.iter().map(|g| Glob::new(g)).collect()
}

/// passthrough: include, then exclude (so exclude wins), then renames in order, then the cast.
pub fn passthrough_steps(a: &PassthroughArgs) -> Result<Vec<Step>> {
    let mut steps = Vec::new();
    if !a.include.is_empty() {
        steps.push(Step::Include(globs(&a.include)?));
    }
    if !a.exclude.is_empty() {
        steps.push(Step::Exclude(globs(&a.exclude)?));
    }
    steps.extend(renames(&a.rename)?.into_iter().map(Step::Rename));
    if let Some(d) = &a.dtype {
        steps.push(Step::Cast {
            dtype: cast_target(d)?,
            cast_ints: a.cast_ints,
        });
    }
    Ok(steps)
}

pub(crate) fn dequant_step(dtype: &str, a: &Fp8Args) -> Result<Step> {
    let dtype = cast_target(dtype)?;
    if dtype == DType::F64 {
        return Err(Error::Usage(
            "dequant writes bf16, f16 or f32, not float64".into(),
        ));
    }
    Ok(Step::Op(Arc::new(DequantStep {
        fp8: DequantFp8Step {
            opts: DequantOptions {
                dtype,
                block: a.block_size.as_deref().map(parse_block_size).transpose()?,
                weight_scale_mode: if a.scale_mode == "divide" {
                    ScaleMode::Divide
                } else {
                    ScaleMode::Multiply
                },
                allow_unscaled: a.allow_unscaled_fp8,
                allow_nonfinite: a.allow_nonfinite,
            },
        },
        keep_kv_scales: a.keep_kv_scales,
    })))
}

pub(crate) fn repack_step(a: &Fp4RepackArgs) -> Result<Step> {
    let regex = |flag: &str,
                 given: &Option<String>,
                 default: &str,
                 groups: &[&str]|
     -> Result<regex::Regex> {
        let text = given.as_deref().unwrap_or(default);
        let re =
            regex::Regex::new(text).map_err(|e| Error::Usage(format!("{flag} `{text}`: {e}")))?;
        if let Some(g) = groups
            .iter()
            .find(|g| !re.capture_names().flatten().any(|n| n == **g))
        {
            return Err(Error::Usage(format!(
                "{flag} `{text}` needs a named group `(?P<{g}>...)`"
            )));
        }
        Ok(re)
    };
    Ok(Step::Op(Arc::new(RepackFp4Step::new(RepackOptions {
        experts: a.experts == "nvfp4",
        engram: a.engram == "fp4",
        require_lossless: a.require_lossless,
        expert_pattern: regex(
            "--expert-pattern",
            &a.expert_pattern,
            DEFAULT_EXPERT_PATTERN,
            &["prefix", "proj"],
        )?,
        engram_pattern: regex(
            "--engram-pattern",
            &a.engram_pattern,
            DEFAULT_ENGRAM_PATTERN,
            &["prefix"],
        )?,
        shards: match (a.only_shards, a.shard_list.is_empty()) {
            (Some(n), _) => Some(ShardSelection::First(n)),
            (None, false) => Some(ShardSelection::Names(a.shard_list.clone())),
            (None, true) => None,
        },
        config_update: !a.no_config_update,
    }))))
}

/// `allow_nonfinite`: merge adapter tensors holding NaN or infinity (`--allow-nonfinite`).
pub(crate) fn lora_step(
    adapter: &std::path::Path,
    a: &AdapterOpts,
    allow_nonfinite: bool,
) -> Result<Step> {
    lora_step_from(
        AdapterSource::Path(adapter.to_path_buf()),
        a,
        allow_nonfinite,
    )
}

pub(crate) fn lora_step_from(
    source: AdapterSource,
    a: &AdapterOpts,
    allow_nonfinite: bool,
) -> Result<Step> {
    let rank_alpha = match (a.rank, a.lora_alpha) {
        (Some(r), Some(alpha)) if r > 0 => Some((r, alpha)),
        (None, None) => None,
        _ => {
            return Err(Error::Usage(
                "--rank R and --lora-alpha A go together (R > 0): they stand in for a missing adapter_config.json".into(),
            ))
        }
    };
    Ok(Step::Op(Arc::new(LoraMergeStep::new(LoraOptions {
        adapter: source,
        config: a.adapter_config.clone(),
        adapter_name: a.adapter_name.clone(),
        scale: a.scale,
        allow_unmatched: a.allow_unmatched,
        rank_alpha,
        allow_nonfinite,
    }))))
}

/// The merge `step`, requantising a quantised base unless `--no-requant` or a cast of the merged
/// weights (`cast_after`) asks for float output.
pub(crate) fn requant_step(
    step: Step,
    r: &crate::cli::RequantArgs,
    cast_after: bool,
) -> Result<Step> {
    use crate::ops::quantize::requant::{RequantMergeStep, RequantMode};
    if r.requant && cast_after {
        return Err(Error::Usage(
            "--requant writes the base's quantised scheme; a --dtype cast of the merged weights contradicts it (drop one)".into(),
        ));
    }
    let mode = match (r.requant, r.no_requant || cast_after) {
        (true, _) => RequantMode::On,
        (false, true) => return Ok(step),
        (false, false) => RequantMode::Auto,
    };
    let Step::Op(merge) = step else {
        unreachable!("a merge is an op step")
    };
    Ok(Step::Op(Arc::new(RequantMergeStep { merge, mode })))
}

/// A merge command's steps after its renames: the merge (requantising a quantised base unless
/// told otherwise), then the `--dtype` cast.
pub(crate) fn merge_steps(merge: Step, m: &crate::cli::MergeOutputArgs) -> Result<Vec<Step>> {
    let mut steps = vec![requant_step(merge, &m.requant_args, m.dtype.is_some())?];
    if let Some(d) = &m.dtype {
        steps.push(Step::Cast {
            dtype: cast_target(d)?,
            cast_ints: false,
        });
    }
    Ok(steps)
}
