//! The CUDA backend: device selection (`--device auto|cpu|cuda|cuda:N`) and the lanes that
//! execute kernel descriptions ([`crate::ops::kernel::Kernel`]) on the GPU. It knows kernels,
//! not ops: what to compute comes in as a description, figures gathered go back as
//! [`crate::ops::kernel::KernelStats`].
//!
//! The driver is loaded at run time (cudarc's dynamic loading), so one binary builds without a
//! toolkit and starts without a driver; the library is probed before any CUDA call, because
//! cudarc panics when asked to load a library that is not there.

pub mod cuda;
pub mod host;

use std::sync::Arc;

use crate::error::{Error, Result};

pub use cuda::Gpu;

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
