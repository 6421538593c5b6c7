//! llama-quantize's type mixes: which ggml type each tensor of a model gets under `Q4_K_M`,
//! `Q3_K_S`, `IQ4_XS` …, written from reading llama.cpp 0c1e570's `src/llama-quant.cpp`
//! (`tensor_allows_quantization`, `llama_tensor_get_type`, `llama_tensor_get_type_impl`,
//! `tensor_type_fallback`, `tensor_requires_imatrix`) and `tools/quantize/quantize.cpp`.
//!
//! The reference quantises the converter's F32 GGUF. Its decisions depend on the tensor's
//! name, its shape, the order tensors are visited in (the loader's: tensors outside blocks
//! first, then by block number, each group by name: [`quantize_order`]), counters over that
//! order (`i_attention_wv`, and `i_ffn_down` … when the model has no experts), and a few
//! hyperparameters ([`ModelFacts`]). [`choose_types`] replays all of it and returns one type
//! per tensor, or the reference's refusal ("needs an imatrix") as an error.

use regex::Regex;

use super::GgmlType;
use crate::error::{Error, Result};

use GgmlType as T;

/// A `llama_ftype` mix llama-quantize offers for LLM weights, by `--outtype` name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[allow(non_camel_case_types)]
pub enum Mix {
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q2_K,
    Q2_K_S,
    Q3_K_S,
    Q3_K_M,
    Q3_K_L,
    Q4_K_S,
    Q4_K_M,
    Q5_K_S,
    Q5_K_M,
    Q6_K,
    IQ4_NL,
    IQ4_XS,
    TQ1_0,
    TQ2_0,
    IQ2_XXS,
    IQ2_XS,
    IQ2_S,
    IQ2_M,
    IQ3_XXS,
    IQ3_XS,
    IQ3_S,
    IQ3_M,
    IQ1_S,
    IQ1_M,
}

/// `(mix, --outtype name, llama_ftype id, default tensor type)`. `--outtype q8_0` stays the
/// converter's Q8_0 (`FileType::MostlyQ8_0`); this row serves the rules and their tests.
const MIXES: [(Mix, &str, u32, GgmlType); 29] = [
    (Mix::Q4_0, "q4_0", 2, T::Q4_0),
    (Mix::Q4_1, "q4_1", 3, T::Q4_1),
    (Mix::Q5_0, "q5_0", 8, T::Q5_0),
    (Mix::Q5_1, "q5_1", 9, T::Q5_1),
    (Mix::Q8_0, "q8_0", 7, T::Q8_0),
    (Mix::Q2_K, "q2_k", 10, T::Q2_K),
    (Mix::Q2_K_S, "q2_k_s", 21, T::Q2_K),
    (Mix::Q3_K_S, "q3_k_s", 11, T::Q3_K),
    (Mix::Q3_K_M, "q3_k_m", 12, T::Q3_K),
    (Mix::Q3_K_L, "q3_k_l", 13, T::Q3_K),
    (Mix::Q4_K_S, "q4_k_s", 14, T::Q4_K),
    (Mix::Q4_K_M, "q4_k_m", 15, T::Q4_K),
    (Mix::Q5_K_S, "q5_k_s", 16, T::Q5_K),
    (Mix::Q5_K_M, "q5_k_m", 17, T::Q5_K),
    (Mix::Q6_K, "q6_k", 18, T::Q6_K),
    (Mix::IQ4_NL, "iq4_nl", 25, T::IQ4_NL),
    (Mix::IQ4_XS, "iq4_xs", 30, T::IQ4_XS),
    (Mix::TQ1_0, "tq1_0", 36, T::TQ1_0),
    (Mix::TQ2_0, "tq2_0", 37, T::TQ2_0),
    (Mix::IQ2_XXS, "iq2_xxs", 19, T::IQ2_XXS),
    (Mix::IQ2_XS, "iq2_xs", 20, T::IQ2_XS),
    (Mix::IQ2_S, "iq2_s", 28, T::IQ2_XS),
    (Mix::IQ2_M, "iq2_m", 29, T::IQ2_S),
    (Mix::IQ3_XXS, "iq3_xxs", 23, T::IQ3_XXS),
    (Mix::IQ3_XS, "iq3_xs", 22, T::IQ3_S),
    (Mix::IQ3_S, "iq3_s", 26, T::IQ3_S),
    (Mix::IQ3_M, "iq3_m", 27, T::IQ3_S),
    (Mix::IQ1_S, "iq1_s", 24, T::IQ1_S),
    (Mix::IQ1_M, "iq1_m", 31, T::IQ1_M),
];

impl Mix {
    fn row(self) -> &'static (Mix, &'static str, u32, GgmlType) {
        crate::ops::gguf::listed(&MIXES, |m| m.0 == self, "mix")
    }

    /// The `--outtype` spelling (any case; `q3_k`, `q4_k`, `q5_k` are llama-quantize's aliases
    /// of the `_m` mixes).
    pub fn parse(s: &str) -> Option<Mix> {
        let s = s.to_ascii_lowercase();
        let s = match s.as_str() {
            "q3_k" | "q4_k" | "q5_k" => format!("{s}_m"),
            _ => s,
        };
        MIXES.iter().find(|m| m.1 == s).map(|m| m.0)
    }

    pub fn name(self) -> &'static str {
        self.row().1
    }

    /// `general.file_type` (`llama_ftype`).
    pub fn ftype(self) -> u32 {
        self.row().2
    }

    /// `llama_ftype_get_default_type`.
    pub fn default_type(self) -> GgmlType {
        self.row().3
    }

    fn is_iq2_family(self) -> bool {
        use Mix::*;
        matches!(self, IQ2_XXS | IQ2_XS | IQ1_S | IQ2_S | IQ2_M | IQ1_M)
    }
}

/// Hyperparameters the rules read (from the model's KVs, as llama.cpp's loader does).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ModelFacts {
    /// `block_count`.
    pub n_layer: u64,
    /// `attention.head_count` / `head_count_kv` (layer 0): `n_gqa()`, 0 without kv heads.
    pub n_gqa: u64,
    /// `expert_count`, 0 when absent or 1.
    pub n_expert: u64,
    /// llama.cpp detects `LLM_TYPE_70B` (Llama or Qwen2 with 80 layers, Llama with GQA).
    pub is_70b: bool,
}

/// What the user asked for beyond the mix (llama-quantize's options of the same names).
#[derive(Debug, Clone, Default)]
pub struct MixOptions {
    /// `--leave-output-tensor`.
    pub leave_output: bool,
    /// `--output-tensor-type`.
    pub output_type: Option<GgmlType>,
    /// `--token-embedding-type`.
    pub token_embedding_type: Option<GgmlType>,
    /// `--tensor-type PATTERN=TYPE`, in order; the first pattern found in a name wins.
    pub tensor_types: Vec<(Regex, GgmlType)>,
    /// `--pure`.
    pub pure: bool,
    /// `--imatrix` given (some rules differ with one).
    pub has_imatrix: bool,
    /// `--imatrix FILE`'s weights (`has_imatrix` when it holds any entry).
    pub imatrix: Option<std::sync::Arc<super::imatrix::Imatrix>>,
}

/// `--tensor-type PATTERN=TYPE`: the pattern lower-cased, the type by ggml name.
pub fn parse_tensor_type(arg: &str) -> std::result::Result<(Regex, GgmlType), String> {
    let Some((pattern, ty)) = arg
        .split_once('=')
        .filter(|(p, t)| !p.is_empty() && !t.is_empty())
    else {
        return Err(format!(
            "--tensor-type `{arg}`: give PATTERN=TYPE (e.g. attn_v=q8_0)"
        ));
    };
    let ty =
        GgmlType::parse(ty).ok_or_else(|| format!("--tensor-type `{arg}`: unknown type `{ty}`"))?;
    let re = Regex::new(&pattern.to_ascii_lowercase()).map_err(|e| {
        format!("--tensor-type `{arg}`: the pattern is not a regular expression: {e}")
    })?;
    Ok((re, ty))
}

/// A tensor as the reference sees it in the F32 GGUF.
#[derive(Debug, Clone, Copy)]
pub struct MixTensor<'a> {
    pub name: &'a str,
    /// Outermost first (PyTorch order; ggml's `ne` reversed).
    pub shape: &'a [u64],
    /// Its type in the F32 file (F32, or MXFP4 for gpt-oss experts).
    pub ty: GgmlType,
}

/// The block number `sscanf(name, "blk.%d.")` reads, if any.
fn block_of(name: &str) -> Option<i64> {
    let rest = name.strip_prefix("blk.")?;
    let (n, _) = rest.split_once('.')?;
    let digits = n.strip_prefix(['+', '-']).unwrap_or(n);
    (!digits.is_empty() && digits.bytes().all(|b| b.is_ascii_digit()))
        .then(|| n.parse().ok())
        .flatten()
}

/// The loader's tensor order (`weight_name_comparer`): block number (-1 outside blocks),
/// then name, byte-wise. Returns indices into `names`.
pub fn quantize_order(names: &[&str]) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..names.len()).collect();
    idx.sort_by(|&a, &b| {
        let key = |i: usize| (block_of(names[i]).unwrap_or(-1), names[i].as_bytes());
        key(a).cmp(&key(b))
    });
    idx
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Category {
    TokenEmbd,
    AttnQ,
    AttnV,
    AttnK,
    AttnQkv,
    AttnKvB,
    AttnOutput,
    FfnUp,
    FfnGate,
    FfnDown,
    Output,
    Other,
}

/// `tensor_get_category`: exact names first, then the first substring found, in this order.
fn category(name: &str) -> Category {
    use Category::*;
    const BY_SUBSTRING: [(&str, Category); 9] = [
        ("attn_qkv.weight", AttnQkv),
        ("attn_kv_b.weight", AttnKvB),
        ("attn_v.weight", AttnV),
        ("attn_k.weight", AttnK),
        ("attn_q.weight", AttnQ),
        ("attn_output.weight", AttnOutput),
        ("ffn_up", FfnUp),
        ("ffn_gate", FfnGate),
        ("ffn_down", FfnDown),
    ];
    match name {
        "output.weight" => Output,
        "token_embd.weight" | "per_layer_token_embd.weight" => TokenEmbd,
        _ => BY_SUBSTRING
            .iter()
            .find(|(s, _)| name.contains(s))
            .map_or(Other, |(_, c)| *c),
    }
}

fn is_attn_v(c: Category) -> bool {
    matches!(c, Category::AttnV | Category::AttnQkv | Category::AttnKvB)
}

/// `ggml_n_dims`: dimensions up to the outermost one larger than 1.
fn n_dims(shape: &[u64]) -> usize {
    shape
        .iter()
        .position(|&d| d > 1)
        .map_or(1, |i| shape.len() - i)
        .max(1)
}

/// `tensor_allows_quantization` for the architectures tftf writes.
fn allows_quantization(t: &MixTensor, leave_output: bool) -> bool {
    const KEEP: [&str; 10] = [
        "_norm.weight",
        "ffn_gate_inp.weight",
        "ffn_gate_tid2eid.weight",
        "altup",
        "laurel",
        "per_layer_model_proj",
        "ssm_conv1d",
        "shortconv.conv.weight",
        "indexer.k_proj.weight",
        "indexer.q_proj.weight",
    ];
    n_dims(t.shape) >= 2
        && t.name.ends_with("weight")
        && !KEEP.iter().any(|k| t.name.contains(k))
        && !(leave_output && t.name == "output.weight")
        && t.name != "position_embd.weight"
        && t.name != "token_types.weight"
        && !t.name.contains("attn_rel_b.weight")
        && !t.name.contains("time_mix_")
}

/// `tensor_requires_imatrix`.
pub(crate) fn requires_imatrix(name: &str, ty: GgmlType, mix: Mix) -> bool {
    if matches!(category(name), Category::TokenEmbd | Category::Output) {
        return false;
    }
    match ty {
        T::IQ3_XXS | T::IQ2_XXS | T::IQ2_XS | T::IQ2_S | T::IQ1_M | T::IQ1_S => true,
        T::Q2_K => mix == Mix::Q2_K_S,
        _ => false,
    }
}

/// `tensor_type_fallback`: a type whose block does not divide the row falls back to one that
/// does (a 32-block type), else F16. `Err` for a type without a fallback.
fn fallback(name: &str, ncols: u64, ty: GgmlType) -> Result<GgmlType> {
    let (qk, _) = ty.block();
    if ncols.is_multiple_of(qk) {
        return Ok(ty);
    }
    let back = match ty {
        T::IQ1_S
        | T::IQ1_M
        | T::IQ2_XXS
        | T::IQ2_XS
        | T::IQ2_S
        | T::IQ3_XXS
        | T::IQ3_S
        | T::IQ4_XS => T::IQ4_NL,
        T::Q2_K | T::Q3_K | T::TQ1_0 | T::TQ2_0 => T::Q4_0,
        T::Q4_K => T::Q5_0,
        T::Q5_K => T::Q5_1,
        T::Q6_K => T::Q8_0,
        _ if qk <= 32 => ty,
        _ => {
            return Err(Error::GgufTensor {
                tensor: name.into(),
                msg: format!("no fallback type for {} (rows of {ncols})", ty.name()),
            })
        }
    };
    Ok(if ncols.is_multiple_of(back.block().0) {
        back
    } else {
        T::F16
    })
}

/// The counters `llama_tensor_get_type_impl` keeps over the tensor order.
#[derive(Debug, Default)]
struct Counters {
    n_attention_wv: u64,
    i_attention_wv: u64,
    i_ffn_down: u64,
    i_ffn_gate: u64,
    i_ffn_up: u64,
}

/// What every tensor's choice reads: the mix, the model, the options, and whether the
/// output shares the token embedding (no `output.weight`).
#[derive(Clone, Copy)]
struct Mixing<'a> {
    mix: Mix,
    facts: &'a ModelFacts,
    opts: &'a MixOptions,
    tied: bool,
}

/// C's `%` truncates: a negative difference never gives 2.
fn use_more_bits(i: u64, n: u64) -> bool {
    i < n / 8 || i >= 7 * n / 8 || (i as i64 - (n / 8) as i64) % 3 == 2
}

/// `layer_info`: with experts the block number is read from the name, else the counter.
fn layer(facts: &ModelFacts, counter: u64, name: &str) -> Result<u64> {
    if facts.n_expert <= 1 {
        return Ok(counter);
    }
    match block_of(name) {
        Some(b) if b >= 0 && (b as u64) < facts.n_layer => Ok(b as u64),
        _ => Err(Error::GgufTensor {
            tensor: name.into(),
            msg: format!("no block number below {} in the name", facts.n_layer),
        }),
    }
}

/// The type of every tensor under `mix`, in `tensors`' order (which must be
/// [`quantize_order`]'s: the counters depend on it).
pub fn choose_types(
    mix: Mix,
    facts: &ModelFacts,
    opts: &MixOptions,
    tensors: &[MixTensor],
) -> Result<Vec<GgmlType>> {
    let mut c = Counters {
        n_attention_wv: tensors
            .iter()
            .filter(|t| is_attn_v(category(t.name)))
            .count() as u64,
        ..Counters::default()
    };
    let tied = !tensors.iter().any(|t| category(t.name) == Category::Output);
    let m = Mixing {
        mix,
        facts,
        opts,
        tied,
    };
    let mut out = Vec::with_capacity(tensors.len());
    for t in tensors {
        out.push(if allows_quantization(t, opts.leave_output) {
            tensor_type(m, &mut c, t)?
        } else {
            t.ty
        });
    }
    Ok(out)
}

/// llama-quantize's refusal: without an importance matrix, the first quantised tensor whose
/// type needs one (IQ1/IQ2/IQ3_XXS, Q2_K in a Q2_K_S file) is an error naming it.
pub fn check_imatrix(
    mix: Mix,
    opts: &MixOptions,
    tensors: &[MixTensor],
    types: &[GgmlType],
) -> Result<()> {
    if opts.has_imatrix {
        return Ok(());
    }
    for (t, &ty) in tensors.iter().zip(types) {
        if allows_quantization(t, opts.leave_output) && requires_imatrix(t.name, ty, mix) {
            return Err(Error::Usage(format!(
                "--outtype {}: `{}` would be {}, which needs an importance matrix (--imatrix FILE); llama-quantize refuses it without one",
                mix.name(),
                t.name,
                ty.name()
            )));
        }
    }
    Ok(())
}

/// `llama_tensor_get_type` for a tensor that may be quantised.
fn tensor_type(m: Mixing, c: &mut Counters, t: &MixTensor) -> Result<GgmlType> {
    let Mixing { mix, opts, .. } = m;
    let cat = category(t.name);
    if let (Some(ty), Category::TokenEmbd) = (opts.token_embedding_type, cat) {
        let named = t.name == "per_layer_token_embd.weight"
            && opts.tensor_types.iter().any(|(re, _)| re.is_match(t.name));
        if !named {
            return Ok(ty);
        }
    }
    if let (Some(ty), Category::Output) = (opts.output_type, cat) {
        return Ok(ty);
    }
    let mut ty = mix.default_type();
    let manual = opts.tensor_types.iter().find(|(re, _)| re.is_match(t.name));
    if let Some((_, m)) = manual {
        ty = *m;
    }
    if manual.is_none() && !opts.pure {
        ty = mixed_type(m, c, t, cat, ty)?;
    }
    fallback(t.name, *t.shape.last().unwrap_or(&1), ty)
}

/// `llama_tensor_get_type_impl`: the mix's per-category choices.
fn mixed_type(
    m: Mixing,
    c: &mut Counters,
    t: &MixTensor,
    cat: Category,
    mut ty: GgmlType,
) -> Result<GgmlType> {
    let Mixing {
        mix,
        facts,
        opts,
        tied,
    } = m;
    use Category as C;
    use Mix as M;
    let (gqa4, n_expert) = (facts.n_gqa >= 4, facts.n_expert);
    let ncols = *t.shape.last().unwrap_or(&1);
    if cat == C::Output || (tied && cat == C::TokenEmbd) {
        return Ok(match opts.output_type {
            Some(o) => o,
            None if !ncols.is_multiple_of(ty.block().0) => T::Q8_0,
            None if mix.is_iq2_family() || mix == M::IQ3_XXS => T::Q5_K,
            None if ty != T::Q8_0 => T::Q6_K,
            None => ty,
        });
    }
    if cat == C::TokenEmbd {
        return Ok(match (opts.token_embedding_type, mix) {
            (Some(o), _) => o,
            (None, M::IQ2_XXS | M::IQ2_XS | M::IQ1_S | M::IQ1_M) => T::Q2_K,
            (None, M::IQ2_S | M::IQ2_M | M::IQ3_XXS) => T::IQ3_S,
            (None, M::TQ1_0 | M::TQ2_0) => T::Q4_K,
            _ => ty,
        });
    }
    if mix.is_iq2_family() {
        let s_or_m = matches!(mix, M::IQ2_S | M::IQ2_M);
        if is_attn_v(cat) {
            ty = if gqa4 || n_expert >= 4 {
                T::Q4_K
            } else if s_or_m {
                T::IQ3_S
            } else {
                T::Q2_K
            };
            c.i_attention_wv += 1;
        } else if n_expert == 8 && cat == C::AttnK {
            ty = T::Q4_K;
        } else if cat == C::FfnDown {
            if c.i_ffn_down < facts.n_layer / 8 {
                ty = if s_or_m { T::IQ3_S } else { T::Q2_K };
            }
            c.i_ffn_down += 1;
        } else if cat == C::AttnOutput {
            if n_expert == 8 {
                ty = T::Q5_K;
            } else if matches!(mix, M::IQ1_S | M::IQ1_M) {
                ty = T::IQ2_XXS;
            } else if s_or_m {
                ty = T::IQ3_S;
            }
        }
        return Ok(ty);
    }
    match cat {
        _ if is_attn_v(cat) => {
            let i = c.i_attention_wv;
            ty = match mix {
                M::Q2_K if gqa4 => T::Q4_K,
                M::Q2_K => T::Q3_K,
                M::Q2_K_S if gqa4 => T::Q4_K,
                M::IQ3_XXS if gqa4 => T::Q4_K,
                M::IQ3_XXS if !opts.has_imatrix => T::IQ3_S,
                M::IQ3_XXS => T::IQ3_XXS,
                M::IQ3_XS | M::IQ3_S if gqa4 => T::Q4_K,
                M::IQ3_M => T::Q4_K,
                M::Q3_K_M if i < 2 => T::Q5_K,
                M::Q3_K_M => T::Q4_K,
                M::Q3_K_L => T::Q5_K,
                M::IQ4_NL | M::IQ4_XS if gqa4 => T::Q5_K,
                M::Q4_K_M | M::Q5_K_M if use_more_bits(i, c.n_attention_wv) => T::Q6_K,
                M::Q4_K_S if i < 4 => T::Q5_K,
                _ => ty,
            };
            if facts.is_70b && matches!(ty, T::Q3_K | T::Q4_K) {
                ty = T::Q5_K;
            }
            if n_expert == 8 {
                ty = T::Q8_0;
            }
            c.i_attention_wv += 1;
        }
        C::AttnK => {
            ty = match mix {
                _ if n_expert == 8 => T::Q8_0,
                M::IQ3_XS => T::IQ3_XXS,
                M::IQ3_XXS => T::IQ2_S,
                _ => ty,
            }
        }
        C::AttnQ => {
            ty = match mix {
                M::IQ3_XS => T::IQ3_XXS,
                M::IQ3_XXS => T::IQ2_S,
                _ => ty,
            }
        }
        C::FfnDown => {
            let n = facts.n_layer;
            let i = layer(facts, c.i_ffn_down, t.name)?;
            ty = match mix {
                M::Q2_K => T::Q3_K,
                M::Q2_K_S if i < n / 8 => T::Q4_K,
                M::Q2_K_S => ty,
                M::IQ3_XXS if !opts.has_imatrix => {
                    if i < n / 8 {
                        T::Q4_K
                    } else {
                        T::Q3_K
                    }
                }
                // Falcon's branch aside (not an architecture tftf writes), Q4_K.
                M::Q3_K_M if i < n / 16 => T::Q5_K,
                M::Q3_K_M => T::Q4_K,
                M::IQ3_M if i < n / 8 || (n_expert == 8 && use_more_bits(i, n)) => T::Q4_K,
                M::Q3_K_L => T::Q5_K,
                M::Q4_K_M if use_more_bits(i, n) => T::Q6_K,
                M::Q4_K_M => ty,
                M::IQ4_NL | M::IQ4_XS if i < n / 8 && !opts.has_imatrix => T::Q5_K,
                M::Q5_K_M if use_more_bits(i, n) => T::Q6_K,
                M::Q4_K_S if i < n / 8 => T::Q5_K,
                M::Q4_0 if opts.has_imatrix && i < n / 8 => T::Q4_1,
                M::Q5_0 if opts.has_imatrix && i < n / 8 => T::Q5_1,
                _ => ty,
            };
            c.i_ffn_down += 1;
        }
        C::AttnOutput => {
            ty = if n_expert == 8 {
                match mix {
                    M::Q2_K
                    | M::IQ3_XS
                    | M::IQ3_XXS
                    | M::Q3_K_S
                    | M::Q3_K_M
                    | M::IQ4_NL
                    | M::Q4_K_S
                    | M::Q4_K_M
                    | M::IQ3_S
                    | M::IQ3_M
                    | M::IQ4_XS => T::Q5_K,
                    _ => ty,
                }
            } else {
                match mix {
                    M::Q2_K => T::Q3_K,
                    M::IQ3_XXS => T::IQ3_S,
                    M::Q3_K_M | M::IQ3_M => T::Q4_K,
                    M::Q3_K_L => T::Q5_K,
                    _ => ty,
                }
            }
        }
        C::FfnGate | C::FfnUp => {
            let counter = if cat == C::FfnGate {
                &mut c.i_ffn_gate
            } else {
                &mut c.i_ffn_up
            };
            let i = layer(facts, *counter, t.name)?;
            let n = facts.n_layer;
            if mix == M::IQ3_XS && i >= n / 8 && i < 7 * n / 8 {
                ty = T::IQ3_XXS;
            }
            *counter += 1;
        }
        _ => {}
    }
    Ok(ty)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dense(n_layer: u64) -> ModelFacts {
        ModelFacts {
            n_layer,
            n_gqa: 1,
            n_expert: 0,
            is_70b: false,
        }
    }

    fn types(
        mix: Mix,
        facts: &ModelFacts,
        opts: &MixOptions,
        ts: &[(&str, &[u64])],
    ) -> Vec<&'static str> {
        let tensors: Vec<MixTensor> = ts
            .iter()
            .map(|(name, shape)| MixTensor {
                name,
                shape,
                ty: T::F32,
            })
            .collect();
        choose_types(mix, facts, opts, &tensors)
            .unwrap()
            .into_iter()
            .map(GgmlType::name)
            .collect()
    }

    #[test]
    fn rows_that_are_not_whole_blocks_fall_back_as_llama_quantize() {
        for (ty, cols, want) in [
            (T::Q4_K, 96, T::Q5_0),
            (T::Q5_K, 64, T::Q5_1),
            (T::Q6_K, 64, T::Q8_0),
            (T::Q2_K, 32, T::Q4_0),
            (T::IQ4_XS, 32, T::IQ4_NL),
            (T::Q3_K, 48, T::F16),
            (T::Q4_0, 48, T::F16),
            (T::Q4_K, 512, T::Q4_K),
        ] {
            assert_eq!(fallback("t", cols, ty).unwrap(), want, "{ty:?} {cols}");
        }
    }

    #[test]
    fn the_loader_orders_global_tensors_first_then_blocks_by_number() {
        let names = [
            "blk.10.x",
            "blk.2.a",
            "token_embd.weight",
            "output.weight",
            "blk.2.B",
        ];
        let got: Vec<&str> = quantize_order(&names).iter().map(|&i| names[i]).collect();
        assert_eq!(
            got,
            [
                "output.weight",
                "token_embd.weight",
                "blk.2.B",
                "blk.2.a",
                "blk.10.x"
            ]
        );
    }

    #[test]
    fn more_bits_go_to_the_first_and_last_eighth_and_every_third_layer() {
        let more: Vec<u64> = (0..16).filter(|&i| use_more_bits(i, 16)).collect();
        assert_eq!(more, [0, 1, 4, 7, 10, 13, 14, 15]);
    }

    #[test]
    fn q4_k_m_promotes_attn_v_and_ffn_down_by_layer_and_keeps_norms_f32() {
        let mut ts: Vec<(String, Vec<u64>)> = Vec::new();
        for l in 0..8 {
            ts.push((format!("blk.{l}.attn_norm.weight"), vec![256]));
            ts.push((format!("blk.{l}.attn_v.weight"), vec![256, 256]));
            ts.push((format!("blk.{l}.ffn_down.weight"), vec![256, 512]));
        }
        let refs: Vec<(&str, &[u64])> =
            ts.iter().map(|(n, s)| (n.as_str(), s.as_slice())).collect();
        let got = types(Mix::Q4_K_M, &dense(8), &MixOptions::default(), &refs);
        for l in 0..8usize {
            let want = if [0, 3, 6, 7].contains(&l) {
                "Q6_K"
            } else {
                "Q4_K"
            };
            assert_eq!(got[3 * l], "F32");
            assert_eq!((got[3 * l + 1], got[3 * l + 2]), (want, want), "layer {l}");
        }
    }

    #[test]
    fn tied_embeddings_take_the_output_rule_and_options_override_it() {
        let ts: [(&str, &[u64]); 2] = [
            ("token_embd.weight", &[1000, 256]),
            ("blk.0.attn_q.weight", &[256, 256]),
        ];
        assert_eq!(
            types(Mix::Q4_0, &dense(1), &MixOptions::default(), &ts),
            ["Q6_K", "Q4_0"]
        );
        let opts = MixOptions {
            token_embedding_type: Some(T::Q8_0),
            tensor_types: vec![parse_tensor_type("ATTN_Q=q5_1").unwrap()],
            ..MixOptions::default()
        };
        assert_eq!(types(Mix::Q4_0, &dense(1), &opts, &ts), ["Q8_0", "Q5_1"]);
        let pure = MixOptions {
            pure: true,
            ..MixOptions::default()
        };
        // --pure skips every choice of the mix, the tied output rule included.
        assert_eq!(types(Mix::Q4_K_M, &dense(1), &pure, &ts), ["Q4_K", "Q4_K"]);
    }

    #[test]
    fn eight_experts_put_attn_v_and_attn_k_in_q8_0() {
        let facts = ModelFacts {
            n_expert: 8,
            ..dense(2)
        };
        let ts: [(&str, &[u64]); 3] = [
            ("blk.1.attn_k.weight", &[256, 256]),
            ("blk.1.attn_v.weight", &[256, 256]),
            ("blk.1.ffn_down_exps.weight", &[8, 256, 512]),
        ];
        assert_eq!(
            types(Mix::Q4_K_M, &facts, &MixOptions::default(), &ts),
            ["Q8_0", "Q8_0", "Q6_K"]
        );
    }

    #[test]
    fn single_row_tensors_and_output_left_alone_are_not_quantised() {
        assert_eq!(n_dims(&[1, 64]), 1);
        assert_eq!(n_dims(&[8, 1, 64]), 3);
        let opts = MixOptions {
            leave_output: true,
            ..MixOptions::default()
        };
        let ts: [(&str, &[u64]); 2] = [
            ("output.weight", &[1000, 256]),
            ("blk.0.ffn_gate_inp_shexp.weight", &[1, 256]),
        ];
        assert_eq!(types(Mix::Q6_K, &dense(1), &opts, &ts), ["F32", "F32"]);
    }

    #[test]
    fn iq2_mixes_are_refused_without_an_importance_matrix_naming_the_tensor() {
        let t = [MixTensor {
            name: "blk.0.attn_q.weight",
            shape: &[256, 256],
            ty: T::F32,
        }];
        let opts = MixOptions::default();
        let types = choose_types(Mix::IQ2_XXS, &dense(1), &opts, &t).unwrap();
        let err = check_imatrix(Mix::IQ2_XXS, &opts, &t, &types)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("`blk.0.attn_q.weight` would be IQ2_XXS") && err.contains("--imatrix"),
            "{err}"
        );
        let with = MixOptions {
            has_imatrix: true,
            ..opts
        };
        assert!(check_imatrix(Mix::IQ2_XXS, &with, &t, &types).is_ok());
    }

    #[test]
    fn mix_names_parse_in_any_case_with_llama_quantizes_aliases() {
        assert_eq!(Mix::parse("Q4_K"), Some(Mix::Q4_K_M));
        assert_eq!(Mix::parse("iq4_XS"), Some(Mix::IQ4_XS));
        assert_eq!(Mix::parse("q4_k_x"), None);
        assert_eq!(Mix::Q4_K_M.ftype(), 15);
    }
}
