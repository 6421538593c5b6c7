//! [`Pipe`]: what a pipeline does to the tensors, as a chain of `tftf run` sections.
//!
//! Each constructor is one section of `tftf run` (`--dequant-fp8`, `--merge-lora`, …) with its
//! command-line defaults, and `|` concatenates sections. The steps are then built by the same
//! code that builds `run`'s, so a chain behaves exactly as the command line with the same
//! sections: the same defaults, the same checks (a float64 cast after a dequant is refused),
//! the same choices (a merge after a dequant never requantises). Arguments are checked when
//! the pipeline runs, so constructors cannot fail and chains read as in upstream's Python.

use std::ffi::OsString;
use std::ops::BitOr;
use std::path::Path;

use crate::commands::RunSections;
use crate::error::Result;
use crate::format::dtype::DType;
use crate::plan::Step;

/// A chain of tensor transformations, upstream's `Pipe`; compose them with `|`.
///
/// An empty pipe ([`Pipe::new`]) copies every tensor unchanged.
///
/// ```
/// use tftf::{DType, Pipe};
///
/// let pipe = Pipe::fp8_dequant(DType::BF16)
///     | Pipe::lora_merge("my-lora/")
///     | Pipe::key_rename(r"^model\.", "")
///     | Pipe::dtype_cast(DType::F16);
/// assert_eq!(pipe.len(), 4);
/// ```
#[derive(Debug, Clone, Default)]
pub struct Pipe {
    sections: RunSections,
}

impl Pipe {
    /// The empty pipe: every tensor passes through unchanged.
    pub fn new() -> Pipe {
        Pipe::default()
    }

    /// Upstream's `FP8DequantPipe(dtype)`: dequantises FP8 weights with their block scales to
    /// `dtype` (BF16, F16 or F32) and drops the scales, as `tftf dequant --dtype` does.
    pub fn fp8_dequant(dtype: DType) -> Pipe {
        Pipe::section("--dequant-fp8", [dtype_arg(dtype)])
    }

    /// Upstream's `LoRAMergePipe(adapter)`: merges a PEFT adapter (its folder, or its
    /// `adapter_model.safetensors` with `adapter_config.json` beside it) into the weights, as
    /// `tftf merge-lora -a ADAPTER` does.
    pub fn lora_merge(adapter: impl AsRef<Path>) -> Pipe {
        let mut arg = OsString::from("--adapter=");
        arg.push(adapter.as_ref());
        Pipe::section("--merge-lora", [arg])
    }

    /// Upstream's `DTypeCastPipe(dtype)`: casts floating-point tensors to `dtype` (BF16, F16,
    /// F32 or F64); integer and bool tensors stay as they are.
    pub fn dtype_cast(dtype: DType) -> Pipe {
        Pipe::section("--dtype-cast", [dtype_arg(dtype)])
    }

    /// Upstream's `KeyFilterPipe(include, exclude)`: keeps the tensors whose names match any
    /// `include` glob (all of them when there is none), then drops those matching any
    /// `exclude` glob.
    pub fn key_filter<I, E>(include: I, exclude: E) -> Pipe
    where
        I: IntoIterator,
        I::Item: AsRef<str>,
        E: IntoIterator,
        E::Item: AsRef<str>,
    {
        let option = |name: &str, glob: &str| OsString::from(format!("--{name}={glob}"));
        let include = include.into_iter().map(|g| option("include", g.as_ref()));
        let exclude = exclude.into_iter().map(|g| option("exclude", g.as_ref()));
        Pipe::section("--key-filter", include.chain(exclude))
    }

    /// Upstream's `KeyRenamePipe`, one rule: replaces matches of `regex` in every tensor name
    /// with `replacement` (`$1` or `${name}` name capture groups). Chain several for several
    /// rules; they apply in order.
    pub fn key_rename(regex: &str, replacement: &str) -> Pipe {
        Pipe::section(
            "--key-rename",
            ["--rule", regex, replacement].map(OsString::from),
        )
    }

    /// Quantises the weights as `tftf quantize --scheme SCHEME --format FORMAT` does
    /// (llm-compressor presets: `FP8_BLOCK`, `W4A16`, …; formats `compressed-tensors`,
    /// `fp8-native`, `modelopt`), with its default ignore list. It must be the chain's last
    /// transformation.
    pub fn quantize(scheme: &str, format: &str) -> Pipe {
        Pipe::section(
            "--quantize",
            [format!("--scheme={scheme}"), format!("--format={format}")].map(OsString::from),
        )
    }

    /// How many transformations the chain holds.
    pub fn len(&self) -> usize {
        self.sections.len()
    }

    /// Whether the chain is empty (a plain copy).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn section(kind: &'static str, tokens: impl IntoIterator<Item = OsString>) -> Pipe {
        let mut sections = RunSections::default();
        sections.push(kind, tokens.into_iter().collect());
        Pipe { sections }
    }

    /// The plan steps of the chain, checked.
    pub(crate) fn steps(&self) -> Result<Vec<Step>> {
        self.sections.steps()
    }

    /// Refuses a chain whose quantised tensors a GGUF writer cannot take.
    pub(crate) fn refuse_quantised_for_gguf(&self) -> Result<()> {
        self.sections.refuse_quantised_for_gguf()
    }
}

impl BitOr for Pipe {
    type Output = Pipe;

    /// `a | b`: `a`'s transformations, then `b`'s.
    fn bitor(mut self, rhs: Pipe) -> Pipe {
        self.sections.append(rhs.sections);
        self
    }
}

impl From<RunSections> for Pipe {
    /// The sections of a `tftf run` command line, from [`crate::commands::run_sections::split`]:
    /// for front ends (the Python package) that offer every option a section takes.
    fn from(sections: RunSections) -> Pipe {
        Pipe { sections }
    }
}

/// `--dtype=NAME` in the spelling the command line takes (`bf16`); dtypes it does not take
/// are refused, naming them, when the steps are built.
fn dtype_arg(dtype: DType) -> OsString {
    OsString::from(format!("--dtype={}", dtype.name().to_ascii_lowercase()))
}
