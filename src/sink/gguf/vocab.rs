//! Which of the converter's vocabulary writers an architecture's `set_vocab` takes, and the
//! KVs it writes before them (`add_space_prefix`).
//!
//! Llama-family models (Llama, Mistral, Mixtral, Granite) take `tokenizer.model` when they ship
//! one (Llama 2, Mistral 7B v0.1), else the BPE `tokenizer.json`; Gemma 2 always takes it, Gemma
//! 3 when it ships one (both with `add_space_prefix` false); Phi-3 always does, by its own rules,
//! unless `tokenizer_config.json` names `GPT2Tokenizer` (Phi-4: BPE); a Llama-2-style BPE
//! `tokenizer.json` with byte fallback and no `tokenizer.model` would take the converter's
//! `LlamaHfVocab`, which is not reproduced, so it is refused rather than written as GPT-2 BPE.

use std::path::Path;

use serde_json::Value as Json;

use super::arch::{Config, Family};
use super::kv::{Metadata, Value};
use super::sentencepiece::{spm_vocab_kvs, SpmRules};
use super::tokenizer::{self, read_json, tok_err};
use crate::error::{Error, Result};

/// Tokenizer KVs of the model in `dir` for `cfg`'s architecture, `add_space_prefix` first
/// where the converter writes it. `pre_override` is `--vocab-pre` (BPE vocabularies only).
pub fn vocab_kvs_for(cfg: &Config, dir: &Path, pre_override: Option<&str>) -> Result<Metadata> {
    let vocab_size = cfg.u64(&["vocab_size"])?;
    let mut m = Metadata::new();
    let spm = dir.join("tokenizer.model").exists();
    let vocab = match cfg.spec.family {
        Family::Llama | Family::Granite => {
            if let Some(b) = tokenizer::add_space_prefix(dir)? {
                m.set("tokenizer.ggml.add_space_prefix", Value::Bool(b));
            }
            if spm {
                spm_vocab_kvs(dir, vocab_size, SpmRules::Converter)?
            } else {
                refuse_llama_hf(dir)?;
                bpe(dir, vocab_size, pre_override)?
            }
        }
        // Gemma2Model.set_vocab / Gemma3Model.set_vocab (Gemma 3 without tokenizer.model: BPE).
        Family::Gemma2 | Family::Gemma3 if spm || cfg.spec.family == Family::Gemma2 => {
            m.set("tokenizer.ggml.add_space_prefix", Value::Bool(false));
            spm_vocab_kvs(dir, vocab_size, SpmRules::Converter)?
        }
        // BitnetModel.set_vocab: SentencePiece (the reference has no other; a BPE
        // `tokenizer.json` alone, as BitNet b1.58 2B4T ships, takes the GPT-2 writer below, as
        // later releases of the converter do).
        Family::Bitnet if spm => spm_vocab_kvs(dir, vocab_size, SpmRules::Converter)?,
        // Phi3MiniModel.set_vocab: GPT-2 BPE for Phi-4, else Phi-3's SentencePiece reader.
        Family::Phi3 if !super::arch_phi::gpt2_vocab(dir)? => {
            spm_vocab_kvs(dir, vocab_size, SpmRules::Phi3)?
        }
        _ => bpe(dir, vocab_size, pre_override)?,
    };
    for (k, v) in vocab.iter() {
        m.set(k, v.clone());
    }
    Ok(m)
}

/// The converter's `_set_vocab_gpt2`, from `tokenizer.json`.
fn bpe(dir: &Path, vocab_size: Option<u64>, pre_override: Option<&str>) -> Result<Metadata> {
    let tok_json = dir.join("tokenizer.json");
    // Only a missing file is missing: a FIFO or a device there is refused when read.
    if !tok_json.exists() {
        return Err(Error::GgufTokenizer {
            path: tok_json,
            msg: "missing: the GGUF needs the model's tokenizer.json (a BPE tokenizer)".into(),
        });
    }
    tokenizer::vocab_kvs(dir, vocab_size, pre_override)
}

/// `LlamaHfVocab`'s test: a BPE model with byte fallback and a `Sequence` decoder (Llama 2's
/// `tokenizer.json`), not Llama 3's (`ignore_merges`, no byte fallback).
fn refuse_llama_hf(dir: &Path) -> Result<()> {
    let path = dir.join("tokenizer.json");
    let Some(tj) = read_json(&path)? else {
        return Ok(());
    };
    let model = &tj["model"];
    let flag = |k: &str| model.get(k).and_then(Json::as_bool);
    let llama3 = flag("ignore_merges") == Some(true) && flag("byte_fallback") == Some(false);
    let llama_hf = model["type"] == "BPE"
        && flag("byte_fallback") == Some(true)
        && tj.pointer("/decoder/type") == Some(&Json::from("Sequence"));
    if llama_hf && !llama3 {
        return Err(tok_err(
            &path,
            "a SentencePiece-style BPE vocabulary (byte fallback) without its tokenizer.model; \
             put the model's tokenizer.model next to it",
        ));
    }
    Ok(())
}
