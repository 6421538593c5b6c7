//! Command-line definitions (clap derive) and nothing else.

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand};

#[derive(Parser, Debug)]
#[command(
    name = "tftf",
    version,
    about = "Stream-convert huge LLM checkpoints (safetensors, PyTorch .bin, FSDP DCP in; safetensors, GGUF out) with bounded memory",
    long_about = None
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// List tensors, dtypes, shapes and sizes, with totals and a per-layer summary
    Info(Box<InfoArgs>),
    /// Copy a checkpoint, optionally filtering, renaming, casting and resharding it
    Passthrough(Box<PassthroughArgs>),
    /// Dequantise FP8 (block, per-row or per-tensor scales), MXFP8, NVFP4, MXFP4 and packed int
    /// weights to bf16, f16 or f32
    #[command(name = "dequant", visible_alias = "dequant-fp8")]
    DequantFp8(Box<DequantArgs>),
    /// Quantise Linear weights (weight-only FP8, int or FP4 schemes) into the compressed-tensors
    /// layout llm-compressor writes
    Quantize(Box<QuantizeArgs>),
    /// Transcode MXFP4 experts to NVFP4 (lossless where possible) and requantise E4M3 Engram
    /// tables to E2M1
    #[command(name = "repack-fp4")]
    RepackFp4(Box<RepackArgs>),
    /// Merge models as a mergekit YAML config describes (mergekit's methods and configs,
    /// unchanged), streaming tensor by tensor; or, with --weights and --lora, merge an adapter
    Merge(Box<MergeKitArgs>),
    /// Merge a PEFT LoRA/DoRA adapter into a base model, streaming
    #[command(name = "merge-lora")]
    MergeLora(Box<MergeArgs>),
    /// Merge a LoRA adapter from a PyTorch Distributed Checkpoint (FSDP training output) into
    /// a base model
    #[command(name = "merge-dcp-lora")]
    MergeDcpLora(Box<MergeDcpArgs>),
    /// Merge a LoRA adapter saved as FSDP rank shards (dim-0 slices) into a base model
    #[command(name = "merge-fsdp-lora")]
    MergeFsdpLora(Box<MergeFsdpArgs>),
    /// Write a GGUF file that llama.cpp loads (Llama, Mistral, Mixtral, Qwen2, Qwen3,
    /// Qwen3-MoE, gpt-oss, DeepSeek-V3), streaming, sharing unchanged tensors' extents
    Gguf(Box<GgufArgs>),
    /// Check a checkpoint's structure (and with --check-values, its numbers)
    Validate(Box<ValidateArgs>),
    /// Apply a chain of pipe sections, in the order given
    Run(Box<RunArgs>),
    /// Build a small example checkpoint, convert it, validate the result and print a summary
    Demo(DemoArgs),
    /// Check every GPU kernel against the CPU ops on random and edge inputs (exit 1 on any
    /// mismatch); without a GPU, check the CPU ops give the same bytes in one chunk or two
    Selftest(SelftestArgs),
    /// Finish a commit that a killed run left half done in an output directory and remove
    /// killed runs' temporary files (writing commands do this by themselves)
    Recover(RecoverArgs),
    /// Re-hash a checkpoint written with --checksums against its tftf-manifest.json and name
    /// the first tensor that differs (exit 1)
    Verify(VerifyArgs),
    /// Complete an output written by `--part K/N` jobs: check every part's records, then write
    /// the index, config, side files and checksums
    Finalize(FinalizeArgs),
    /// Convert a model into a directory: `--format gguf` runs `gguf`, `--format safetensors`
    /// runs `passthrough`
    Convert(Box<ConvertArgs>),
    /// Extract a PEFT LoRA adapter from the difference between a fine-tuned model and its
    /// base (truncated SVD per linear weight), as mergekit-extract-lora does
    #[command(name = "extract-lora")]
    ExtractLora(Box<ExtractLoraArgs>),
}

#[derive(Args, Debug)]
pub struct ConvertArgs {
    #[command(flatten)]
    pub input: InputArgs,
    /// Output format: gguf (as `tftf gguf`) or safetensors (as `tftf passthrough`)
    #[arg(long, value_name = "FORMAT", value_parser = ["gguf", "safetensors"])]
    pub format: String,
    /// Output directory (created); GGUF: the file is named after the input (`model.pt` gives
    /// `model.gguf`, a folder its name); safetensors: `model.safetensors` or shards + index
    #[arg(long, short = 'o', visible_alias = "output", value_name = "DIR")]
    pub outdir: PathBuf,
    /// GGUF tensor type, as `gguf --outtype`: auto, f32, f16, bf16 or q8_0
    #[arg(long, value_name = "TYPE", value_parser = ["auto", "f32", "f16", "bf16", "q8_0"])]
    pub outtype: Option<String>,
    /// GGUF: split into files of at most SIZE tensor bytes, as `gguf --split-max-size`
    #[arg(long, value_name = "SIZE")]
    pub split_max_size: Option<String>,
    /// GGUF: treat the model as this architecture, as `gguf --arch`
    #[arg(long, value_name = "NAME")]
    pub arch: Option<String>,
    /// GGUF: tokenizer.ggml.pre to write, as `gguf --vocab-pre`
    #[arg(long, value_name = "NAME")]
    pub vocab_pre: Option<String>,
    /// safetensors: cast float tensors to bf16, f16 or f32, as `passthrough --dtype`
    #[arg(long, value_name = "DTYPE")]
    pub dtype: Option<String>,
    /// safetensors: shards of at most SIZE, as `passthrough --max-shard-size`
    #[arg(long, value_name = "SIZE")]
    pub max_shard_size: Option<String>,
    #[command(flatten)]
    pub job: JobArgs,
}

#[derive(Args, Debug)]
pub struct ExtractLoraArgs {
    /// The base model (any input tftf reads)
    #[arg(long, visible_alias = "base-model", value_name = "BASE")]
    pub base: PathBuf,
    /// The fine-tuned model
    #[arg(long, value_name = "FINETUNED")]
    pub model: PathBuf,
    /// Output directory for adapter_model.safetensors and adapter_config.json
    #[arg(
        short = 'o',
        long = "output",
        visible_alias = "out-path",
        value_name = "ADAPTER"
    )]
    pub output: PathBuf,
    /// LoRA rank of every decomposed module; larger than a weight's smaller side is an error
    #[arg(
        short = 'r',
        long,
        visible_alias = "max-rank",
        value_name = "RANK",
        default_value_t = 128
    )]
    pub rank: u64,
    /// Put all singular values into lora_A instead of sqrt(S) into each factor
    #[arg(long)]
    pub no_distribute_scale: bool,
    /// Decompose embeddings (lora_embedding_A/B) and lm_head too, instead of saving them
    /// whole in modules_to_save
    #[arg(long)]
    pub embed_lora: bool,
    /// Save modules with this name (last name component or full name) at full rank (repeatable)
    #[arg(long = "save-module", value_name = "NAME")]
    pub save_modules: Vec<String>,
    /// Leave out modules whose name matches this regex (repeatable)
    #[arg(short = 'e', long = "exclude-regex", value_name = "REGEX")]
    pub exclude_regexes: Vec<String>,
    /// Only decompose modules whose name matches one of these regexes (repeatable)
    #[arg(short = 'i', long = "include-regex", value_name = "REGEX")]
    pub include_regexes: Vec<String>,
    /// Leave out weights that cannot be decomposed (norms, other non-2-D weights) instead of
    /// saving them at full rank
    #[arg(long)]
    pub skip_undecomposable: bool,
    /// dtype of lora_A/lora_B: bf16, f16 or f32 (default: the fine-tuned weight's)
    #[arg(long, value_name = "DTYPE")]
    pub dtype: Option<String>,
    /// Tensors decomposed at once, each on one core: N tensor pairs in memory instead of one,
    /// the same bytes
    #[arg(long, value_name = "N", default_value_t = 1)]
    pub threads: usize,
    /// Print the plan and write nothing
    #[arg(long)]
    pub dry_run: bool,
    /// Replace an existing adapter in the output directory
    #[arg(long)]
    pub force: bool,
    /// Print nothing but errors
    #[arg(short, long)]
    pub quiet: bool,
    /// Print one line per module
    #[arg(short, long)]
    pub verbose: bool,
}

#[derive(Args, Debug)]
pub struct FinalizeArgs {
    /// The output directory the parts wrote
    #[arg(value_name = "DIR")]
    pub dir: std::path::PathBuf,
    /// Remove model files of an earlier output that are not this run's
    #[arg(long)]
    pub force: bool,
    /// Print nothing but errors
    #[arg(short, long)]
    pub quiet: bool,
    /// Accepted on every command (as in Python tftf)
    #[arg(short, long)]
    pub verbose: bool,
}

#[derive(Args, Debug)]
pub struct VerifyArgs {
    /// The checkpoint directory
    #[arg(value_name = "DIR")]
    pub dir: std::path::PathBuf,
    /// Accepted on every command (as in Python tftf)
    #[arg(short, long)]
    pub verbose: bool,
}

#[derive(Args, Debug)]
pub struct RecoverArgs {
    /// The output directory
    #[arg(value_name = "DIR")]
    pub dir: std::path::PathBuf,
    /// Accepted on every command (as in Python tftf); recover prints every step anyway
    #[arg(short, long)]
    pub verbose: bool,
}

#[derive(Args, Debug)]
pub struct SelftestArgs {
    /// auto (a CUDA GPU when one is usable, else the CPU), cpu, cuda or cuda:N
    #[arg(long, value_name = "DEVICE", default_value = "auto")]
    pub device: String,
    /// Print only the summary line (and failures)
    #[arg(short, long)]
    pub quiet: bool,
    /// Accepted on every command (as in Python tftf); selftest prints every case anyway
    #[arg(short, long)]
    pub verbose: bool,
}

#[derive(Args, Debug)]
pub struct InputArgs {
    /// Input: a .safetensors file, a model directory, an index .json file, a PyTorch .bin/.pt/.pth
    /// file, a folder of .bin shards or a DCP folder
    #[arg(
        short = 'i',
        long = "input",
        short_alias = 'b',
        alias = "base",
        value_name = "MODEL"
    )]
    pub input: Option<PathBuf>,
    /// Input, as a positional argument
    #[arg(value_name = "MODEL", conflicts_with = "input")]
    pub model: Option<PathBuf>,
}

/// Options of every command that runs a conversion: planning, threads, memory, messages.
#[derive(Args, Debug, Clone)]
pub struct RunOpts {
    /// Print the plan and create nothing
    #[arg(long)]
    pub dry_run: bool,
    /// Compute threads (default: all cores)
    #[arg(long, value_name = "N")]
    pub threads: Option<usize>,
    /// Reader threads and writer threads (each): auto (1 on a rotational disk, else one per
    /// four cores, 1 to 4) or N
    #[arg(long, value_name = "N", default_value = "auto")]
    pub io_threads: String,
    /// Bound on tensor data in flight (default: a quarter of available memory, at most 4GiB)
    #[arg(long, value_name = "SIZE")]
    pub memory_budget: Option<String>,
    /// Print nothing but errors
    #[arg(short, long)]
    pub quiet: bool,
    /// No progress bar or progress lines
    #[arg(long)]
    pub no_progress: bool,
    /// Progress on stderr: auto (a bar on a terminal, else lines), plain, json, none
    #[arg(long, value_name = "MODE")]
    pub progress: Option<String>,
    /// Seconds between progress lines when stderr is not a terminal (fractions allowed)
    #[arg(long, value_name = "SECS")]
    pub progress_interval: Option<String>,
    /// Also print informational notes (e.g. why untouched tensors were copied, not shared)
    #[arg(short, long)]
    pub verbose: bool,
    /// Write a JSON summary of the run to this file
    #[arg(long, value_name = "FILE")]
    pub report: Option<PathBuf>,
}

#[derive(Args, Debug, Clone)]
pub struct WriteArgs {
    /// Output directory, or a file name ending in .safetensors for a single file
    #[arg(short = 'o', long = "output", alias = "out", value_name = "OUT")]
    pub output: PathBuf,
    /// Repack into shards of at most SIZE (5GB, 5GiB, 500MB or bytes); a bigger tensor gets its
    /// own shard. Default: keep the input's shard boundaries, splitting shards above 5GiB
    #[arg(long, value_name = "SIZE")]
    pub max_shard_size: Option<String>,
    /// Accepted for compatibility; directory output is always sharded by --max-shard-size
    #[arg(long)]
    pub sharded: bool,
    /// Write the output even when filters keep no tensor or an op finds nothing to do
    #[arg(long)]
    pub allow_empty: bool,
    #[command(flatten)]
    pub job: JobArgs,
}

/// What every writing command takes besides its output: how it runs, how its output is
/// committed, and where its ops compute. One struct, so the flags cannot drift apart between
/// the commands.
#[derive(Args, Debug, Clone)]
pub struct JobArgs {
    #[command(flatten)]
    pub run: RunOpts,
    #[command(flatten)]
    pub policy: PolicyArgs,
    /// Replace the model files of a non-empty output directory (or existing output files)
    #[arg(long)]
    pub force: bool,
    /// Copy untouched tensors through user memory instead of copy_file_range/reflinks (GGUF:
    /// and keep the reference's tensor order, with no reflink padding key)
    #[arg(long)]
    pub no_reflink: bool,
    /// Where ops compute: auto (a CUDA GPU when a driver and device exist and an op has a
    /// kernel, else the CPU), cpu, cuda or cuda:N
    #[arg(long, value_name = "DEVICE", default_value = "auto")]
    pub device: String,
}

/// How a writing command's output is committed: checksums, parts, resume.
#[derive(Args, Debug, Clone)]
pub struct PolicyArgs {
    /// Write SHA256SUMS and tftf-manifest.json (per-file and per-tensor SHA-256) with the
    /// output, for `tftf verify`; on by default with --part and --resume (--checksums=off)
    #[arg(long, value_name = "on|off", num_args = 0..=1, require_equals = true, default_missing_value = "on")]
    pub checksums: Option<String>,
    /// Write only part K of N of the output's files, for one job of a job array; every part
    /// runs the same command, then `tftf finalize OUT` (or --finalize) completes the output
    #[arg(long, value_name = "K/N")]
    pub part: Option<String>,
    /// Continue an interrupted --part or --resume run: files it committed that still match
    /// their records are kept, the rest written (refused if the inputs or arguments changed)
    #[arg(long)]
    pub resume: bool,
    /// With --part: when this part finishes and every other part has, finalize the output
    #[arg(long)]
    pub finalize: bool,
}

#[derive(Args, Debug)]
pub struct InfoArgs {
    #[command(flatten)]
    pub input: InputArgs,
    /// Only tensors whose name contains this text
    #[arg(long, value_name = "SUBSTR")]
    pub filter: Option<String>,
    /// Print per-dtype counts and bytes instead of the tensor list
    #[arg(long)]
    pub dtype_summary: bool,
    /// Machine-readable output
    #[arg(long)]
    pub json: bool,
    /// Accepted on every command (as in Python tftf); info prints everything anyway
    #[arg(short, long)]
    pub verbose: bool,
}

#[derive(Args, Debug)]
pub struct PassthroughArgs {
    #[command(flatten)]
    pub input: InputArgs,
    #[command(flatten)]
    pub write: WriteArgs,
    /// Cast float tensors (F16/BF16/F32/F64) to bf16, f16 or f32
    #[arg(long, value_name = "DTYPE")]
    pub dtype: Option<String>,
    /// Keep only tensors matching any of these fnmatch globs
    #[arg(long, value_name = "GLOB")]
    pub include: Vec<String>,
    /// Drop tensors matching any of these globs (wins over --include)
    #[arg(long, value_name = "GLOB")]
    pub exclude: Vec<String>,
    /// Rename tensors: regex and replacement (\1 or $1 for groups); repeatable, applied in order
    #[arg(long, num_args = 2, value_names = ["REGEX", "REPL"], allow_hyphen_values = true)]
    pub rename: Vec<String>,
    /// Also cast integer and bool tensors with --dtype
    #[arg(long)]
    pub cast_ints: bool,
}

/// Options of the FP8 dequantisation, shared by `dequant-fp8` and `run --dequant-fp8`.
#[derive(Args, Debug, Clone)]
pub struct Fp8Args {
    /// Scale block size R or RxC when config.json does not give weight_block_size (default:
    /// inferred from the weight and scale shapes)
    #[arg(long, value_name = "R[xC]")]
    pub block_size: Option<String>,
    /// How `X.weight_scale` applies: multiply (compressed-tensors) or divide (old Python tftf);
    /// `weight_scale_inv` and `.scale` always multiply
    #[arg(long, value_name = "MODE", default_value = "multiply", value_parser = ["multiply", "divide"])]
    pub scale_mode: String,
    /// Decode FP8 weights that have no scale as plain casts instead of failing
    #[arg(long)]
    pub allow_unscaled_fp8: bool,
    /// Keep NaN/Inf FP8 codes (as NaN) instead of failing (with --merge-lora: merge adapter
    /// tensors holding NaN/Inf too)
    #[arg(long)]
    pub allow_nonfinite: bool,
    /// Keep the KV-cache scales (`k_scale`, `v_scale`) and quantization_config's
    /// `kv_cache_scheme` instead of dropping them with the weight quantisation
    #[arg(long)]
    pub keep_kv_scales: bool,
}

#[derive(Args, Debug)]
pub struct DequantArgs {
    #[command(flatten)]
    pub input: InputArgs,
    #[command(flatten)]
    pub write: WriteArgs,
    /// Output dtype of the dequantised weights (and torch_dtype in config.json)
    #[arg(long, value_name = "DTYPE", default_value = "bf16")]
    pub dtype: String,
    #[command(flatten)]
    pub fp8: Fp8Args,
    /// Merge this adapter after dequantising (never into FP8 codes)
    #[arg(long, value_name = "ADAPTER")]
    pub merge_lora: Option<PathBuf>,
    #[command(flatten)]
    pub lora: AdapterOpts,
}

#[derive(Args, Debug)]
pub struct QuantizeArgs {
    #[command(flatten)]
    pub input: InputArgs,
    #[command(flatten)]
    pub write: WriteArgs,
    #[command(flatten)]
    pub quantize: QuantizeOptions,
}

/// The quantisation options, shared by `quantize` and `run --quantize`.
#[derive(Args, Debug)]
pub struct QuantizeOptions {
    /// llm-compressor preset: FP8_DYNAMIC, FP8_BLOCK, W8A16, W4A16, NVFP4A16, MXFP4A16 or
    /// MXFP8A16
    #[arg(long, value_name = "SCHEME")]
    pub scheme: String,
    /// Output layout: compressed-tensors (llm-compressor), fp8-native (transformers
    /// FineGrainedFP8 / DeepSeek-V3 `weight_scale_inv`, FP8_BLOCK only), or modelopt (NVIDIA
    /// ModelOpt's export with hf_quant_config.json: FP8_BLOCK, FP8_DYNAMIC, NVFP4A16, MXFP4A16,
    /// MXFP8A16, W4A16)
    #[arg(long, value_name = "FORMAT", default_value = "compressed-tensors", value_parser = ["compressed-tensors", "fp8-native", "modelopt"])]
    pub format: String,
    /// Leave these modules unquantised: globs on module or tensor names, or `re:REGEX` on
    /// module names as llm-compressor writes them (repeat or comma-separate)
    #[arg(long, value_name = "GLOB", value_delimiter = ',')]
    pub ignore: Vec<String>,
    /// Quantise lm_head and MoE routers too (embeddings are never quantised)
    #[arg(long)]
    pub no_default_ignore: bool,
}

/// Options of the FP4 repack, shared by `repack-fp4` and `run --repack-fp4`.
#[derive(Args, Debug, Clone)]
pub struct Fp4RepackArgs {
    /// MXFP4 routed experts: transcode to NVFP4, or keep them as they are
    #[arg(long, value_name = "MODE", default_value = "nvfp4", value_parser = ["nvfp4", "keep"])]
    pub experts: String,
    /// E4M3 Engram tables: requantise to FP4 (E2M1), or keep them
    #[arg(long, value_name = "MODE", default_value = "fp4", value_parser = ["fp4", "keep"])]
    pub engram: String,
    /// Only the first N input shards (in name order)
    #[arg(long, value_name = "N")]
    pub only_shards: Option<usize>,
    /// Only these input shards (file names, comma-separated)
    #[arg(
        long,
        value_name = "A,B,...",
        value_delimiter = ',',
        conflicts_with = "only_shards"
    )]
    pub shard_list: Vec<String>,
    /// Fail if any expert block cannot be transcoded exactly
    #[arg(long)]
    pub require_lossless: bool,
    /// Regex for expert weights, with named groups `prefix` and `proj`; the scale is
    /// `<prefix>.<proj>.scale`
    #[arg(long, value_name = "REGEX")]
    pub expert_pattern: Option<String>,
    /// Regex for Engram tables, with a named group `prefix`; the scale is `<prefix>.scale`
    #[arg(long, value_name = "REGEX")]
    pub engram_pattern: Option<String>,
    /// Leave config.json as it is
    #[arg(long)]
    pub no_config_update: bool,
}

#[derive(Args, Debug)]
pub struct RepackArgs {
    /// Input: a .safetensors file, a model directory, an index .json file, a PyTorch .bin/.pt/.pth
    /// file, a folder of .bin shards or a DCP folder
    #[arg(
        long = "src",
        short = 'i',
        aliases = ["input", "base"],
        short_alias = 'b',
        value_name = "MODEL"
    )]
    pub src: Option<PathBuf>,
    /// Input, as a positional argument
    #[arg(value_name = "MODEL", conflicts_with = "src")]
    pub model: Option<PathBuf>,
    #[command(flatten)]
    pub write: WriteArgs,
    #[command(flatten)]
    pub fp4: Fp4RepackArgs,
}

/// Adapter options, shared by `merge-lora`, `dequant-fp8 --merge-lora` and `run --merge-lora`.
#[derive(Args, Debug, Clone)]
pub struct AdapterOpts {
    /// Multiply every module's alpha/r by F (also --lora-scale, as dequant-fp8 spells it)
    #[arg(long, value_name = "F", aliases = ["alpha", "lora-scale"], default_value_t = 1.0, allow_negative_numbers = true)]
    pub scale: f64,
    /// adapter_config.json to use (default: the one beside the adapter weights; also
    /// --lora-config)
    #[arg(long, value_name = "FILE", alias = "lora-config")]
    pub adapter_config: Option<PathBuf>,
    /// Adapter name segment in the keys (also --lora-adapter-name)
    #[arg(
        long,
        value_name = "NAME",
        default_value = "default",
        alias = "lora-adapter-name"
    )]
    pub adapter_name: String,
    /// Merge what matches and report the rest instead of failing
    #[arg(long)]
    pub allow_unmatched: bool,
    /// LoRA rank r, used (with --lora-alpha) when there is no adapter_config.json
    #[arg(long, value_name = "R", requires = "lora_alpha")]
    pub rank: Option<u64>,
    /// LoRA alpha, used (with --rank) when there is no adapter_config.json
    #[arg(long, value_name = "A", requires = "rank")]
    pub lora_alpha: Option<f64>,
}

/// Requantisation after merging into a quantised base (`merge-lora`, `merge-dcp-lora`, `run
/// --merge-lora`).
#[derive(Args, Debug, Clone, Default)]
pub struct RequantArgs {
    /// Quantise the merged weights again in the base's scheme and layout (FP8 128x128 blocks,
    /// compressed-tensors NVFP4A16); the default for such a base when --dtype is not given
    #[arg(long, conflicts_with = "no_requant")]
    pub requant: bool,
    /// Do not requantise a quantised base (merging into it is then refused: dequantise it first)
    #[arg(long)]
    pub no_requant: bool,
}

/// What the three merge commands (`merge-lora`, `merge-dcp-lora`, `merge-fsdp-lora`) take after
/// their adapter source: the output, the adapter options, requantisation and the cast of the
/// merged weights. One struct, so the flags cannot drift apart between the commands.
#[derive(Args, Debug)]
pub struct MergeOutputArgs {
    #[command(flatten)]
    pub write: WriteArgs,
    #[command(flatten)]
    pub lora: AdapterOpts,
    #[command(flatten)]
    pub requant_args: RequantArgs,
    /// Cast float tensors (the merged ones included) to bf16, f16 or f32
    #[arg(long, value_name = "DTYPE", conflicts_with = "requant")]
    pub dtype: Option<String>,
    /// Merge adapter tensors that hold NaN or infinity instead of failing
    #[arg(long)]
    pub allow_nonfinite: bool,
}

#[derive(Args, Debug)]
pub struct MergeArgs {
    #[command(flatten)]
    pub input: InputArgs,
    /// Adapter: a .safetensors file, a directory with adapter_model.safetensors, or a training
    /// output directory (the highest checkpoint-N is used)
    #[arg(short = 'a', long = "adapter", value_name = "ADAPTER")]
    pub adapter: PathBuf,
    #[command(flatten)]
    pub merge: MergeOutputArgs,
    /// Rename tensors: regex and replacement, as in passthrough
    #[arg(long, num_args = 2, value_names = ["REGEX", "REPL"], allow_hyphen_values = true)]
    pub rename: Vec<String>,
}

#[derive(Args, Debug)]
pub struct MergeDcpArgs {
    #[command(flatten)]
    pub input: InputArgs,
    /// The DCP folder (`pytorch_model_fsdp_0/`), a training checkpoint holding one, or a
    /// training output directory (the highest checkpoint-N is used)
    #[arg(
        short = 'c',
        long = "checkpoint-dir",
        value_name = "DIR",
        short_alias = 'a',
        alias = "adapter"
    )]
    pub checkpoint_dir: PathBuf,
    #[command(flatten)]
    pub merge: MergeOutputArgs,
    /// Rename tensors before merging: regex and replacement, as in passthrough
    #[arg(long, num_args = 2, value_names = ["REGEX", "REPL"], allow_hyphen_values = true)]
    pub rename: Vec<String>,
}

#[derive(Args, Debug)]
pub struct MergeFsdpArgs {
    #[command(flatten)]
    pub input: InputArgs,
    /// A rank file (repeat in rank order)
    #[arg(
        short = 's',
        long = "shard",
        value_name = "RANK_FILE",
        required_unless_present = "shard_dir"
    )]
    pub shards: Vec<PathBuf>,
    /// Directory of rank files, taken in name order
    #[arg(long, value_name = "DIR", conflicts_with = "shards")]
    pub shard_dir: Option<PathBuf>,
    #[command(flatten)]
    pub merge: MergeOutputArgs,
}

#[derive(Args, Debug)]
pub struct ValidateArgs {
    #[command(flatten)]
    pub input: InputArgs,
    /// Also check a conversion plan: dtype:X, filter:GLOB, exclude:GLOB or rename:REGEX=REPL
    /// (repeatable, in order)
    #[arg(long, value_name = "STEP")]
    pub pipe: Vec<String>,
    /// Scan float tensors for NaN and Inf
    #[arg(long)]
    pub check_values: bool,
    /// Machine-readable output
    #[arg(long)]
    pub json: bool,
    /// Bound on data in flight while scanning values
    #[arg(long, value_name = "SIZE")]
    pub memory_budget: Option<String>,
    /// No progress while scanning values
    #[arg(long)]
    pub no_progress: bool,
    /// Progress on stderr: auto (a bar on a terminal, else lines), plain, json, none
    #[arg(long, value_name = "MODE")]
    pub progress: Option<String>,
    /// Seconds between progress lines when stderr is not a terminal (fractions allowed)
    #[arg(long, value_name = "SECS")]
    pub progress_interval: Option<String>,
    /// Accepted on every command (as in Python tftf); validate reports every finding anyway
    #[arg(short, long)]
    pub verbose: bool,
}

/// `run`'s global options. Its pipe sections (`--key-filter ...`, `--merge-lora ...`) are split
/// off the raw arguments before clap sees them (`commands::run_sections`) and parsed one by one
/// with the section structs below.
#[derive(Args, Debug)]
#[command(after_long_help = RUN_SECTIONS_HELP)]
pub struct RunArgs {
    #[command(flatten)]
    pub input: InputArgs,
    #[command(flatten)]
    pub write: WriteArgs,
}

pub const RUN_SECTIONS_HELP: &str = "\
Pipe sections, applied in the order written; options after a section flag belong to it:
  --key-filter  [--include] GLOB... [--exclude GLOB]...   keep matching names
  --key-exclude [--exclude] GLOB...                       drop matching names
  --key-rename  [--rule] REGEX REPL [REGEX REPL]...       rename, rules in order
  --dtype-cast  [--dtype] DTYPE [--cast-ints]             bf16, f16, f32, f64 (or float32, ...)
  --dequant-fp8 [[--dtype] DTYPE] [--block-size R[xC]] [--scale-mode M]
                [--allow-unscaled-fp8] [--allow-nonfinite]
  --merge-lora  [--adapter] PATH [--adapter-config FILE] [--adapter-name NAME] [--scale F]
                [--rank R --lora-alpha A] [--allow-unmatched] [--allow-nonfinite]
  --merge       [--config] CONFIG [--random-seed N] [--allow-crimes] [--no-copy-tokenizer]
                (the first section; the models come from the mergekit config, no -i)
  --repack-fp4  [--experts M] [--engram M] [--only-shards N] [--shard-list A,B]
                [--require-lossless] [--expert-pattern RE] [--engram-pattern RE]
                [--no-config-update]
  --quantize    --scheme SCHEME [--format F] [--ignore GLOB]... [--no-default-ignore]
                (the last section; as the `quantize` command)
  --gguf        [--outtype TYPE] [--imatrix FILE] [--tensor-type P=T]... [--arch NAME]
                [--vocab-pre NAME] [--split-max-size SIZE]   (the last section: -o OUT.gguf,
                a GGUF of what the sections before produce, as the `gguf` command writes it)
A section option written before the first section, or in a section of another kind, is a
default for every section of its kind (the older form `--merge-lora A --dequant-fp8 --scale 2`).

Example:
  tftf run -i in/ -o out/ --dequant-fp8 --dtype bf16 --merge-lora --adapter ./lora --scale 0.5 \\
      --key-rename --rule '^model\\.' '' --key-filter --include 'layers.*' --exclude '*.bias'";

/// `run --key-filter`: keep names matching any include glob, then drop those matching any
/// exclude glob.
#[derive(Args, Debug)]
pub struct KeyFilterSection {
    /// Keep tensors matching this glob (repeatable)
    #[arg(long, value_name = "GLOB", allow_hyphen_values = true)]
    pub include: Vec<String>,
    /// Drop tensors matching this glob (repeatable)
    #[arg(long, value_name = "GLOB", allow_hyphen_values = true)]
    pub exclude: Vec<String>,
    /// Globs to keep, as bare values
    #[arg(value_name = "GLOB")]
    pub value: Vec<String>,
}

/// `run --key-exclude`: drop names matching any glob.
#[derive(Args, Debug)]
pub struct KeyExcludeSection {
    /// Drop tensors matching this glob (repeatable)
    #[arg(long, value_name = "GLOB", allow_hyphen_values = true)]
    pub exclude: Vec<String>,
    /// Globs to drop, as bare values
    #[arg(value_name = "GLOB")]
    pub value: Vec<String>,
}

/// `run --key-rename`: regex rules applied in order.
#[derive(Args, Debug)]
pub struct KeyRenameSection {
    /// A rule: regex and replacement (repeatable)
    #[arg(long, num_args = 2, value_names = ["REGEX", "REPL"], allow_hyphen_values = true)]
    pub rule: Vec<String>,
    /// Rules as bare REGEX REPL pairs
    #[arg(value_name = "REGEX REPL", allow_hyphen_values = true)]
    pub value: Vec<String>,
}

/// `run --dtype-cast`.
#[derive(Args, Debug)]
pub struct DtypeCastSection {
    /// Target dtype
    #[arg(long, value_name = "DTYPE")]
    pub dtype: Option<String>,
    /// Target dtype, as a bare value
    #[arg(value_name = "DTYPE", conflicts_with = "dtype")]
    pub value: Option<String>,
    /// Also cast integer and bool tensors
    #[arg(long)]
    pub cast_ints: bool,
}

/// `run --dequant-fp8`.
#[derive(Args, Debug)]
pub struct DequantSection {
    /// Output dtype (default bf16)
    #[arg(long, value_name = "DTYPE")]
    pub dtype: Option<String>,
    /// Output dtype, as a bare value
    #[arg(value_name = "DTYPE", conflicts_with = "dtype")]
    pub value: Option<String>,
    #[command(flatten)]
    pub fp8: Fp8Args,
}

/// `run --merge-lora`.
#[derive(Args, Debug)]
pub struct MergeSection {
    /// The adapter (as for merge-lora -a)
    #[arg(long, value_name = "ADAPTER")]
    pub adapter: Option<PathBuf>,
    /// The adapter, as a bare value
    #[arg(value_name = "ADAPTER", conflicts_with = "adapter")]
    pub value: Option<PathBuf>,
    #[command(flatten)]
    pub lora: AdapterOpts,
    #[command(flatten)]
    pub requant_args: RequantArgs,
    /// Merge adapter tensors that hold NaN or infinity instead of failing
    #[arg(long)]
    pub allow_nonfinite: bool,
}

/// `run --merge`: a mergekit config merged as `tftf merge` merges it, as the first section;
/// the models come from the config (no `-i`).
#[derive(Args, Debug)]
pub struct MergeKitSection {
    /// The mergekit YAML configuration
    #[arg(long, value_name = "CONFIG")]
    pub config: Option<PathBuf>,
    /// The configuration, as a bare value
    #[arg(value_name = "CONFIG", conflicts_with = "config")]
    pub value: Option<PathBuf>,
    /// Seed of the stochastic methods (as for `tftf merge`)
    #[arg(long, value_name = "N", default_value_t = 0)]
    pub random_seed: u64,
    /// Merge models whose architectures differ
    #[arg(long)]
    pub allow_crimes: bool,
    /// Do not copy the donor's tokenizer files
    #[arg(long)]
    pub no_copy_tokenizer: bool,
}

/// `run --repack-fp4`.
#[derive(Args, Debug)]
pub struct RepackSection {
    #[command(flatten)]
    pub fp4: Fp4RepackArgs,
}

/// `run --quantize`.
#[derive(Args, Debug)]
pub struct QuantizeSection {
    #[command(flatten)]
    pub quantize: QuantizeOptions,
}

#[derive(Args, Debug)]
pub struct DemoArgs {
    /// Keep the example checkpoint and outputs in this directory instead of a temporary one
    #[arg(long, value_name = "DIR")]
    pub keep: Option<PathBuf>,
    /// Accepted on every command (as in Python tftf); demo prints every step anyway
    #[arg(short, long)]
    pub verbose: bool,
}

/// llama-quantize's options, for `--outtype` of a llama-quantize type.
#[derive(Args, Debug, Default)]
pub struct GgufQuantizeArgs {
    /// Keep output.weight as it is (F32), as llama-quantize --leave-output-tensor
    #[arg(long)]
    pub leave_output_tensor: bool,
    /// Type of output.weight (a ggml type name: q8_0, q6_k, f16 …)
    #[arg(long, value_name = "TYPE")]
    pub output_tensor_type: Option<String>,
    /// Type of token_embd.weight
    #[arg(long, value_name = "TYPE")]
    pub token_embedding_type: Option<String>,
    /// Type of the tensors whose name a regular expression matches (PATTERN=TYPE, e.g.
    /// attn_v=q8_0); repeatable, the first match wins
    #[arg(long, value_name = "PATTERN=TYPE")]
    pub tensor_type: Vec<String>,
    /// Every quantised tensor gets the type's default type, without the mix's choices
    #[arg(long)]
    pub pure: bool,
    /// Importance matrix from llama-imatrix (its GGUF format or the legacy .dat)
    #[arg(long, value_name = "FILE")]
    pub imatrix: Option<PathBuf>,
    /// Use the importance matrix only for tensors whose name contains NAME (repeatable)
    #[arg(long, value_name = "NAME", conflicts_with = "exclude_weights")]
    pub include_weights: Vec<String>,
    /// Do not use the importance matrix for tensors whose name contains NAME (repeatable)
    #[arg(long, value_name = "NAME")]
    pub exclude_weights: Vec<String>,
}

#[derive(Args, Debug)]
pub struct GgufArgs {
    #[command(flatten)]
    pub input: InputArgs,
    /// Output file (NAME.gguf); with --split-max-size, NAME-0000i-of-0000N.gguf beside it
    #[arg(short = 'o', long = "output", alias = "out", value_name = "OUT.gguf")]
    pub output: PathBuf,
    #[command(flatten)]
    pub gguf: GgufFormatArgs,
    #[command(flatten)]
    pub job: JobArgs,
}

/// What a GGUF output holds: `gguf`'s options, and `run --gguf`'s section.
#[derive(Args, Debug)]
pub struct GgufFormatArgs {
    /// Tensor type: auto (keep BF16/F16 as the checkpoint has them; F32 becomes F16), f32,
    /// f16, bf16 or q8_0 as convert_hf_to_gguf.py writes them (norms, biases and routers stay
    /// F32; MXFP4 experts stay MXFP4); or a llama-quantize type, with its per-tensor choices:
    /// q4_0, q4_1, q5_0, q5_1, q2_k, q2_k_s, q3_k_s, q3_k_m, q3_k_l, q4_k_s, q4_k_m, q5_k_s,
    /// q5_k_m, q6_k, iq4_nl, iq4_xs, tq1_0, tq2_0, iq2_xxs, iq2_xs, iq2_s, iq2_m, iq3_xxs,
    /// iq3_xs, iq3_s, iq3_m, iq1_s, iq1_m (q3_k, q4_k, q5_k: the _m ones)
    #[arg(long, value_name = "TYPE", default_value = "auto")]
    pub outtype: String,
    #[command(flatten)]
    pub quantize: GgufQuantizeArgs,
    /// Split into files of at most SIZE tensor bytes (decimal: 500M, 5G, or bytes), as
    /// llama.cpp's gguf-split names and keys them
    #[arg(long, value_name = "SIZE")]
    pub split_max_size: Option<String>,
    /// Treat the model as this architecture: a config.json class name (LlamaForCausalLM) or a
    /// GGUF architecture (llama, qwen2, qwen3, qwen3moe, gpt-oss, deepseek2)
    #[arg(long, value_name = "NAME")]
    pub arch: Option<String>,
    /// tokenizer.ggml.pre to write instead of identifying the pre-tokenizer by its hash
    /// (e.g. llama-bpe, qwen2, gpt-2)
    #[arg(long, value_name = "NAME")]
    pub vocab_pre: Option<String>,
}

impl GgufFormatArgs {
    /// Whether any option was given (a command whose output may be GGUF or not refuses them
    /// beside another output).
    pub fn given(&self) -> bool {
        let q = &self.quantize;
        self.outtype != "auto"
            || self.split_max_size.is_some()
            || self.arch.is_some()
            || self.vocab_pre.is_some()
            || q.leave_output_tensor
            || q.output_tensor_type.is_some()
            || q.token_embedding_type.is_some()
            || !q.tensor_type.is_empty()
            || q.pure
            || q.imatrix.is_some()
            || !q.include_weights.is_empty()
            || !q.exclude_weights.is_empty()
    }
}

/// `tftf merge CONFIG.yml OUT`, mergekit-yaml's options, and the short LoRA form
/// `tftf merge --weights BASE --lora ADAPTER --alpha A --output OUT`.
#[derive(Args, Debug)]
pub struct MergeKitArgs {
    /// The mergekit YAML configuration
    #[arg(value_name = "CONFIG", required_unless_present = "weights")]
    pub config: Option<PathBuf>,
    /// The output directory (or give it as -o OUT)
    #[arg(value_name = "OUT", conflicts_with = "output")]
    pub out: Option<PathBuf>,
    /// Output directory, or a file name ending in .safetensors for a single file
    #[arg(short = 'o', long = "output", value_name = "OUT")]
    pub output: Option<PathBuf>,
    /// Seed of the stochastic methods (DARE, DELLA, ...): the same bytes for any thread count
    #[arg(long, value_name = "N", default_value_t = 0)]
    pub random_seed: u64,
    /// Shards of at most SIZE: mergekit's 5B, 500M (powers of 1000), or tftf's 5GB, 5GiB, bytes
    /// (default 5B for config merges; the short form keeps the base's shards)
    #[arg(long, value_name = "SIZE")]
    pub out_shard_size: Option<String>,
    /// Copy the donor's tokenizer files (base model, else the first model): the default
    #[arg(long, overrides_with = "no_copy_tokenizer")]
    pub copy_tokenizer: bool,
    /// Do not copy tokenizer files
    #[arg(long)]
    pub no_copy_tokenizer: bool,
    /// Merge models whose architectures differ
    #[arg(long)]
    pub allow_crimes: bool,
    /// Short form: the base model to merge the --lora adapter into
    #[arg(
        long,
        value_name = "BASE",
        requires = "lora",
        conflicts_with = "config"
    )]
    pub weights: Option<PathBuf>,
    /// Short form: the adapter (as merge-lora -a)
    #[arg(long, value_name = "ADAPTER", requires = "weights")]
    pub lora: Option<PathBuf>,
    /// Short form: the adapter's scale (as merge-lora --scale)
    #[arg(
        long,
        value_name = "A",
        default_value_t = 1.0,
        allow_negative_numbers = true,
        requires = "weights"
    )]
    pub alpha: f64,
    #[command(flatten, next_help_heading = "GGUF output (OUT ending in .gguf)")]
    pub gguf: GgufFormatArgs,
    #[command(flatten)]
    pub job: JobArgs,
}
