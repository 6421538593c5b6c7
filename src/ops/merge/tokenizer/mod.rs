//! The merged vocabulary (`tokenizer_source`, or the newer `tokenizer:` section), as mergekit
//! 0.1.5 builds it (`mergekit/tokenizer/{build,embed,config}.py`): the output tokenizer (a
//! model's, the base's, or the union of every model's tokens), each model's permutation onto
//! it, and the rows of embedding-like tensors (`embed_tokens`, `lm_head`, …) remapped per model
//! before the merge method runs.
//!
//! Two of mergekit's orders are random from run to run — it takes the models in the order of a
//! Python `set` and each model's new tokens in the order of a Rust `HashMap` — so tftf fixes
//! them: the base (else the first model) first, then the models as the config lists them, and
//! each model's tokens by id. A model whose tokenizer cannot be read is an error here (mergekit
//! assumes it has the base's vocabulary).

mod remap;
mod vocab;

pub use remap::{RemapOp, RowPlan};
pub use vocab::{set_vocab_size, MergedVocab, VOCAB_TENSORS};

use std::path::PathBuf;

use serde_yaml::{Mapping, Value};

use super::config::{check_keys, mapping, model_path, TokenizerSource};

/// Where a token's embedding comes from when a model lacks it, or always when `force`d
/// (mergekit's `TokenEmbeddingConfig.source`).
#[derive(Clone, Debug, PartialEq)]
pub enum EmbedSource {
    /// A zero row (`kind: zero`).
    Zero,
    /// The same token's row in that model.
    Model(PathBuf),
    /// Another token's row in that model, by id or by text (`kind: model_token`).
    ModelToken { model: PathBuf, token: TokenRef },
}

/// A token of a model's own vocabulary.
#[derive(Clone, Debug, PartialEq)]
pub enum TokenRef {
    Id(u64),
    Text(String),
}

/// One entry of `tokenizer.tokens`.
#[derive(Clone, Debug, PartialEq)]
pub struct TokenSetting {
    /// `None`: mergekit's automatic rule (the only model that has it, the base, the average).
    pub source: Option<EmbedSource>,
    /// Use the source even for models that have the token.
    pub force: bool,
}

/// The `tokenizer:` section, or `tokenizer_source` alone.
#[derive(Clone, Debug, PartialEq)]
pub struct TokenizerConfig {
    pub source: TokenizerSource,
    /// Tokens to add (when missing) and where their rows come from, in the config's order.
    pub tokens: Vec<(String, TokenSetting)>,
    /// Rows padded up to a multiple of this, the padding rows each model's mean row.
    pub pad_to_multiple_of: Option<u64>,
}

/// Reads `tokenizer_source` or `tokenizer` from the top level of a config.
pub fn parse(map: &Mapping) -> Result<Option<TokenizerConfig>, String> {
    let plain = |source| TokenizerConfig {
        source,
        tokens: Vec::new(),
        pad_to_multiple_of: None,
    };
    match (map.get("tokenizer_source"), map.get("tokenizer")) {
        (Some(_), Some(_)) => Err("give `tokenizer_source` or `tokenizer`, not both".into()),
        (Some(Value::Null), None) | (None, None) | (None, Some(Value::Null)) => Ok(None),
        (Some(v), None) => Ok(Some(plain(source(v, "tokenizer_source")?))),
        (None, Some(t)) => {
            let m = mapping(t, "`tokenizer`")?;
            check_keys(
                m,
                &["source", "tokens", "pad_to_multiple_of"],
                " in `tokenizer`",
            )?;
            let mut cfg = plain(match m.get("source") {
                Some(v) => source(v, "tokenizer.source")?,
                None => TokenizerSource::Union,
            });
            cfg.pad_to_multiple_of = match m.get("pad_to_multiple_of") {
                None | Some(Value::Null) => None,
                Some(v) => match v.as_u64() {
                    Some(n) if n > 0 => Some(n),
                    _ => {
                        return Err(
                            "`tokenizer.pad_to_multiple_of` must be a positive whole number".into(),
                        )
                    }
                },
            };
            if let Some(tokens) = m.get("tokens").filter(|v| !v.is_null()) {
                for (k, v) in mapping(tokens, "`tokenizer.tokens`")? {
                    let name = k
                        .as_str()
                        .ok_or("`tokenizer.tokens`: each token must be text")?;
                    cfg.tokens.push((name.to_string(), setting(name, v)?));
                }
            }
            Ok(Some(cfg))
        }
    }
}

fn source(v: &Value, at: &str) -> Result<TokenizerSource, String> {
    match v {
        Value::String(s) if s == "base" => Ok(TokenizerSource::Base),
        Value::String(s) if s == "union" => Ok(TokenizerSource::Union),
        v => model_path(v, at).map(TokenizerSource::Model),
    }
}

fn setting(token: &str, v: &Value) -> Result<TokenSetting, String> {
    let at = format!("`tokenizer.tokens.{token}`");
    if v.is_null() {
        return Ok(TokenSetting {
            source: None,
            force: false,
        });
    }
    let m = mapping(v, &at)?;
    check_keys(m, &["source", "force"], &format!(" in {at}"))?;
    let force = match m.get("force") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(_) => return Err(format!("{at}: `force` must be true or false")),
    };
    let source = match m.get("source") {
        None | Some(Value::Null) => None,
        Some(s @ Value::String(_)) => Some(EmbedSource::Model(model_path(
            s,
            &format!("tokenizer.tokens.{token}.source"),
        )?)),
        Some(s) => Some(embed_source(s, &at)?),
    };
    if force && source.is_none() {
        return Err(format!(
            "{at}: `force: true` needs a `source` (a model, `kind: zero` or `kind: model_token`)"
        ));
    }
    Ok(TokenSetting { source, force })
}

fn embed_source(v: &Value, at: &str) -> Result<EmbedSource, String> {
    let m = mapping(v, &format!("{at}.source"))?;
    match m.get("kind").and_then(Value::as_str) {
        Some("zero") => {
            check_keys(m, &["kind"], &format!(" in {at}.source"))?;
            Ok(EmbedSource::Zero)
        }
        Some("model_token") => {
            check_keys(
                m,
                &["kind", "model", "token", "token_id"],
                &format!(" in {at}.source"),
            )?;
            let model = model_path(
                m.get("model")
                    .ok_or_else(|| format!("{at}.source: `model` is missing"))?,
                &format!("{at}.source.model"),
            )?;
            let token = match (m.get("token"), m.get("token_id")) {
                (Some(Value::String(t)), None) => TokenRef::Text(t.clone()),
                (None, Some(id)) => TokenRef::Id(
                    id.as_u64()
                        .ok_or_else(|| format!("{at}.source: `token_id` must be a whole number"))?,
                ),
                _ => {
                    return Err(format!(
                        "{at}.source: give one of `token` (text) or `token_id`"
                    ))
                }
            };
            Ok(EmbedSource::ModelToken { model, token })
        }
        _ => Err(format!(
            "{at}.source: expected a model path, `kind: zero` or `kind: model_token`"
        )),
    }
}

impl TokenizerConfig {
    /// Every model a token's source names (checked against the merged models at planning).
    pub fn source_models(&self) -> impl Iterator<Item = (&str, &PathBuf)> {
        self.tokens.iter().filter_map(|(t, s)| match &s.source {
            Some(EmbedSource::Model(m)) | Some(EmbedSource::ModelToken { model: m, .. }) => {
                Some((t.as_str(), m))
            }
            _ => None,
        })
    }
}
