//! The CUDA backend: device selection (`--device auto|cpu|cuda|cuda:N`), the kernels'
//! host-side descriptions, and the lanes that run ops' chunks on the GPU.
//!
//! The driver is loaded at run time (cudarc's dynamic loading), so one binary builds without a
//! toolkit and starts without a driver; the library is probed before any CUDA call, because
//! cudarc panics when asked to load a library that is not there.

pub mod cuda;
pub mod params;
pub mod selftest;

use std::sync::Arc;

use crate::error::{Error, Result};
use crate::format::dtype::DType;
use crate::ops::dequant_fp8::DequantFp8;
use crate::ops::fp4::EngramRequant;
use crate::ops::Op;
use params::DeltaParams;

pub use cuda::Gpu;

/// What an op asks of the GPU for one chunk; ops without one always run on the CPU.
pub enum GpuKernel<'a> {
    Cast { src: DType, dst: DType },
    DequantFp8(&'a DequantFp8),
    NvBlockScales { g: i32 },
    NvReencode { g: i32 },
    Engram(&'a EngramRequant),
    Lora(&'a dyn LoraKernel),
}

/// A LoRA-style merge as the GPU runs it: `base (+ computed by base_op) + scale · Δ`, Δ summed
/// in rank order from the operands `delta` describes, optionally DoRA-normalised.
pub struct LoraPlan<'a> {
    /// Inputs: `base_inputs` of the base, then A, B and (DoRA) the magnitude.
    pub base_inputs: usize,
    /// FP8 dequantisation producing the base as f32, when the base is computed.
    pub base_op: Option<&'a dyn Op>,
    pub base_dtype: DType,
    pub a_dtype: DType,
    pub b_dtype: DType,
    pub m_dtype: Option<DType>,
    pub scale: f32,
    pub dst: DType,
    pub delta: DeltaParams,
    /// Δ's coefficients come from A (else from B); the vectors from the other factor.
    pub coef_is_a: bool,
}

/// Merge ops that run on the GPU (LoRA/DoRA, grouped expert LoRA).
pub trait LoraKernel: Sync {
    /// The plan for the chunk `units`.
    fn plan(&self, units: &std::ops::Range<u64>) -> LoraPlan<'_>;
}

/// `--device` as given.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DeviceRequest {
    Auto,
    Cpu,
    Cuda(usize),
}

impl DeviceRequest {
    pub fn parse(s: &str) -> Result<DeviceRequest> {
        match s {
            "auto" => Ok(DeviceRequest::Auto),
            "cpu" => Ok(DeviceRequest::Cpu),
            "cuda" | "gpu" => Ok(DeviceRequest::Cuda(0)),
            _ => s
                .strip_prefix("cuda:")
                .and_then(|n| n.parse().ok())
                .map(DeviceRequest::Cuda)
                .ok_or_else(|| {
                    Error::Usage(format!("--device {s}: use auto, cpu, cuda or cuda:N"))
                }),
        }
    }
}

/// The device a run computes on, and why (for the report).
#[derive(Clone)]
pub struct Device {
    pub gpu: Option<Arc<Gpu>>,
    /// "cpu", or "cuda:0 (NVIDIA H200, sm_90)".
    pub name: String,
    /// Why `auto` chose the CPU, when it did.
    pub note: Option<String>,
}

impl Device {
    pub fn cpu(note: Option<String>) -> Device {
        Device {
            gpu: None,
            name: "cpu".into(),
            note,
        }
    }

    /// Opens the requested device. `auto` falls back to the CPU (saying why); an explicit
    /// `cuda` that cannot be had is an error.
    pub fn open(req: &DeviceRequest) -> Result<Device> {
        let ordinal = match req {
            DeviceRequest::Cpu => return Ok(Device::cpu(None)),
            DeviceRequest::Auto => 0,
            DeviceRequest::Cuda(n) => *n,
        };
        match Gpu::open(ordinal) {
            Ok(gpu) => Ok(Device {
                name: gpu.describe(),
                gpu: Some(Arc::new(gpu)),
                note: None,
            }),
            Err(why) if *req == DeviceRequest::Auto => Ok(Device::cpu(Some(why))),
            Err(why) => Err(Error::Device(format!(
                "--device cuda:{ordinal}: {why}; use --device cpu (or auto) to compute on the CPU"
            ))),
        }
    }
}
