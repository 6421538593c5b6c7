//! Running ops' chunks on an NVIDIA GPU through the driver API (cudarc, loaded at run time).
//!
//! A [`Gpu`] owns a small set of lanes; a lane is one CUDA stream with its own pinned staging
//! buffers and device buffers. A compute worker borrows a lane for one chunk: it copies the
//! chunk's inputs into pinned memory, queues host→device copies, the kernels and device→host
//! copies on the lane's stream, waits, and copies the results out. With two lanes, one lane's
//! copies overlap the other's kernels. Staging is allocated with `cuMemHostAlloc` flags 0
//! (never write-combined: the CPU reads the results back) and counted in the memory budget. On
//! an integrated GPU with unified memory (GB10) the kernels read and write the mapped staging
//! buffers directly and no copies are queued at all.
//!
//! On a discrete GPU the pipeline's pool buffers are registered with the driver
//! (`cuMemHostRegister`, see [`super::host::HostRegistrar`]); a chunk whose inputs
//! and outputs lie in registered memory is copied by DMA straight from and into them, skipping
//! the staging copies. `TFTF_NO_HOST_REGISTER=1` turns that off (for comparison), and a driver
//! that refuses registration leaves the staging path in use.

use std::ffi::c_void;
use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Instant;

use cudarc::driver::sys::{self, CUdevice_attribute, CUdeviceptr};
use cudarc::driver::{
    result, CudaContext, CudaFunction, CudaStream, DeviceRepr, LaunchConfig, PushKernelArg,
};

use crate::format::dtype::DType;
use crate::ops::fp4::kernel::Fp4Params;
use crate::ops::fp4::kernel::{RowSums, BLOCK_SUMS_BYTES};
use crate::ops::fp8::kernel::DequantParams;
use crate::ops::int::kernel::{GptqParams, Int4Params, IntParams};
use crate::ops::kernel::gguf::{GgufLaunch, GgufParams};
use crate::ops::kernel::{kernel_dtype, Kernel, KernelStats};
use crate::ops::lora::kernel::{BaseDequant, DeltaParams, LoraLaunch, LoraParams};
use crate::ops::quantize::kernel::QuantParams;
use crate::plan::kernel::merge::MergeParams;

/// PTX compiled by nvcc at build time (empty without a toolkit) and the committed PTX.
static PTX_NVCC: &str = include_str!(concat!(env!("OUT_DIR"), "/tftf-nvcc.ptx"));
static PTX_COMMITTED: &str = include_str!("../../kernels/tftf.ptx");

/// Streams (and staging sets) per GPU: two let copies and kernels of different chunks overlap.
pub const LANES: usize = 2;

// SAFETY: plain-old-data structs laid out as their C twins (repr(C), no pointers).
unsafe impl DeviceRepr for DequantParams {}
unsafe impl DeviceRepr for LoraParams {}
unsafe impl DeviceRepr for DeltaParams {}
unsafe impl DeviceRepr for IntParams {}
unsafe impl DeviceRepr for GptqParams {}
unsafe impl DeviceRepr for Int4Params {}
unsafe impl DeviceRepr for Fp4Params {}
unsafe impl DeviceRepr for QuantParams {}
unsafe impl DeviceRepr for GgufParams {}
unsafe impl DeviceRepr for MergeParams {}

struct Kernels {
    cast: CudaFunction,
    dequant: CudaFunction,
    dequant_int: CudaFunction,
    dequant_gptq: CudaFunction,
    dequant_int4: CudaFunction,
    dequant_fp4: CudaFunction,
    nv_scales: CudaFunction,
    nv_reencode: CudaFunction,
    engram_blocks: CudaFunction,
    engram_rows: CudaFunction,
    lora_delta: CudaFunction,
    dora: CudaFunction,
    lora: CudaFunction,
    quantize_groups: CudaFunction,
    quantize_fp8_amax: CudaFunction,
    quantize_fp8_scales: CudaFunction,
    quantize_fp8_codes: CudaFunction,
    gguf: CudaFunction,
    gguf_blocks: CudaFunction,
    merge: CudaFunction,
}

/// Counters for reports and benchmarks.
#[derive(Default)]
pub struct GpuCounters {
    pub chunks: AtomicU64,
    pub bytes_in: AtomicU64,
    pub bytes_out: AtomicU64,
    /// Time lanes were busy (staging, copies, kernels), summed over lanes.
    pub busy_ns: AtomicU64,
    /// Bytes copied by DMA straight from or into registered pool buffers (no staging copy).
    pub bytes_direct: AtomicU64,
}

/// Whether pool buffers are registered with the driver: yes unless `TFTF_NO_HOST_REGISTER` is
/// set to something other than `0` or empty.
pub fn host_register_enabled() -> bool {
    std::env::var_os("TFTF_NO_HOST_REGISTER").is_none_or(|v| v.is_empty() || v == "0")
}

/// Host ranges registered with the driver: (address, length).
#[derive(Default)]
struct Registry(Mutex<Vec<(usize, usize)>>);

impl Registry {
    /// Whether all of `data` lies inside one registered range.
    fn contains(&self, data: &[u8]) -> bool {
        let (p, n) = (data.as_ptr() as usize, data.len());
        n > 0
            && self
                .0
                .lock()
                .unwrap()
                .iter()
                .any(|&(start, len)| p >= start && p + n <= start + len)
    }
}

/// How a chunk's kernel ended.
#[derive(Debug)]
pub enum Ran {
    /// Outputs written; figures gathered beside them, if the kernel gathers any.
    Done(Option<KernelStats>),
    /// The kernel met a value the op refuses; the outputs are not valid.
    Refused,
}

pub struct Gpu {
    ctx: Arc<CudaContext>,
    kernels: Kernels,
    name: String,
    capability: (i32, i32),
    /// Unified memory: kernels use mapped host memory, no copies.
    pub integrated: bool,
    /// Which PTX the module was loaded from.
    pub ptx: &'static str,
    lanes: Mutex<Vec<Lane>>,
    lane_freed: Condvar,
    pub counters: GpuCounters,
    registry: Arc<Registry>,
}

/// Whether the driver library loads. cudarc resolves every CUDA 12.2 entry point when it loads
/// the library and panics if one is missing (an older driver), so that panic is caught, quietly.
fn probe_driver() -> Result<bool, ()> {
    let hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(|_| {}));
    // SAFETY: only tries to dlopen the driver library and resolve its symbols.
    let r = std::panic::catch_unwind(|| unsafe { sys::is_culib_present() });
    std::panic::set_hook(hook);
    r.map_err(|_| ())
}

fn driver_err(what: &str, e: impl std::fmt::Debug) -> String {
    format!("{what}: {e:?}")
}

impl Gpu {
    /// Opens device `ordinal`, or says why it cannot.
    pub fn open(ordinal: usize) -> Result<Gpu, String> {
        match probe_driver() {
            Ok(true) => {}
            Ok(false) => return Err("no CUDA driver (libcuda.so.1 not found)".into()),
            Err(()) => {
                return Err(
                    "the CUDA driver lacks functions of CUDA 12.2; update it to R535 or newer"
                        .into(),
                )
            }
        }
        result::init().map_err(|e| driver_err("CUDA driver present but cuInit failed", e))?;
        let count = CudaContext::device_count().map_err(|e| driver_err("cuDeviceGetCount", e))?;
        if ordinal >= count.max(0) as usize {
            return Err(format!("no CUDA device {ordinal} ({count} found)"));
        }
        let ctx = CudaContext::new(ordinal).map_err(|e| driver_err("creating a context", e))?;
        // Each lane uses its own buffers on its own stream: cudarc's cross-stream event
        // tracking would only add synchronisation.
        // SAFETY: no buffer is shared between streams.
        unsafe { ctx.disable_event_tracking() };
        let name = ctx.name().unwrap_or_else(|_| "unknown GPU".into());
        let capability = ctx.compute_capability().unwrap_or((0, 0));
        let attr = |a| ctx.attribute(a).unwrap_or(0);
        let integrated = attr(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_INTEGRATED) == 1
            && attr(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_CAN_MAP_HOST_MEMORY) == 1;
        let (module, ptx) = load_module(&ctx)?;
        let f = |n: &str| {
            module
                .load_function(n)
                .map_err(|e| driver_err(&format!("kernel {n}"), e))
        };
        let kernels = Kernels {
            cast: f("tftf_cast")?,
            dequant: f("tftf_dequant_fp8")?,
            dequant_int: f("tftf_dequant_int")?,
            dequant_gptq: f("tftf_dequant_gptq")?,
            dequant_int4: f("tftf_dequant_int4_modelopt")?,
            dequant_fp4: f("tftf_dequant_fp4")?,
            nv_scales: f("tftf_nv_block_scales")?,
            nv_reencode: f("tftf_nv_reencode")?,
            engram_blocks: f("tftf_engram_blocks")?,
            engram_rows: f("tftf_engram_rows")?,
            lora_delta: f("tftf_lora_delta")?,
            dora: f("tftf_dora_factors")?,
            lora: f("tftf_lora")?,
            quantize_groups: f("tftf_quantize_groups")?,
            quantize_fp8_amax: f("tftf_quantize_fp8_amax")?,
            quantize_fp8_scales: f("tftf_quantize_fp8_scales")?,
            quantize_fp8_codes: f("tftf_quantize_fp8_codes")?,
            gguf: f("tftf_gguf")?,
            gguf_blocks: f("tftf_gguf_blocks")?,
            merge: f("tftf_merge")?,
        };
        let registry = Arc::new(Registry::default());
        let mut lanes = Vec::with_capacity(LANES);
        for _ in 0..LANES {
            lanes.push(Lane::new(&ctx, integrated, registry.clone())?);
        }
        Ok(Gpu {
            ctx,
            kernels,
            name,
            capability,
            integrated,
            ptx,
            lanes: Mutex::new(lanes),
            lane_freed: Condvar::new(),
            counters: GpuCounters::default(),
            registry,
        })
    }

    pub fn describe(&self) -> String {
        format!(
            "cuda:{} ({}, sm_{}{}{})",
            self.ctx.ordinal(),
            self.name,
            self.capability.0,
            self.capability.1,
            if self.integrated {
                ", unified memory"
            } else {
                ""
            }
        )
    }

    /// Runs one chunk's kernel on the GPU. `Ok(Ran::Refused)`: the kernel met a value the op
    /// refuses, and the caller runs the CPU op to report it by name.
    pub fn run(
        &self,
        kernel: &Kernel,
        units: Range<u64>,
        inputs: &[&[u8]],
        outs: &mut [&mut [u8]],
    ) -> Result<Ran, String> {
        let mut lane = {
            let mut lanes = self.lanes.lock().unwrap();
            loop {
                if let Some(l) = lanes.pop() {
                    break l;
                }
                lanes = self.lane_freed.wait(lanes).unwrap();
            }
        };
        let t0 = Instant::now();
        lane.direct = 0;
        let r = self
            .ctx
            .bind_to_thread()
            .map_err(|e| driver_err("binding the context", e))
            .and_then(|_| lane.run(&self.kernels, kernel, units, inputs, outs));
        let c = &self.counters;
        c.busy_ns
            .fetch_add(t0.elapsed().as_nanos() as u64, Ordering::Relaxed);
        c.chunks.fetch_add(1, Ordering::Relaxed);
        c.bytes_in.fetch_add(
            inputs.iter().map(|i| i.len() as u64).sum(),
            Ordering::Relaxed,
        );
        c.bytes_out
            .fetch_add(outs.iter().map(|o| o.len() as u64).sum(), Ordering::Relaxed);
        c.bytes_direct.fetch_add(lane.direct, Ordering::Relaxed);
        self.lanes.lock().unwrap().push(lane);
        self.lane_freed.notify_one();
        r.map_err(|e| format!("GPU {}: {e}", self.describe()))
    }

    /// Measures host→device and device→host copy bandwidth from pinned memory (bytes/s), for
    /// `selftest` and the benchmark's reference figure.
    pub fn copy_bandwidth(&self, bytes: usize) -> Result<(f64, f64), String> {
        self.ctx
            .bind_to_thread()
            .map_err(|e| driver_err("binding the context", e))?;
        let stream = self
            .ctx
            .new_stream()
            .map_err(|e| driver_err("creating a stream", e))?;
        let host = Pinned::alloc(bytes, false)?;
        let dev = DevBuf::alloc(bytes)?;
        let time = |h2d: bool| -> Result<f64, String> {
            let t = Instant::now();
            for _ in 0..4 {
                // SAFETY: both buffers hold `bytes` bytes and live until the sync below.
                unsafe {
                    if h2d {
                        result::memcpy_htod_async(dev.ptr, host.slice(bytes), stream.cu_stream())
                    } else {
                        result::memcpy_dtoh_async(
                            host.slice_mut(bytes),
                            dev.ptr,
                            stream.cu_stream(),
                        )
                    }
                }
                .map_err(|e| driver_err("copy", e))?;
            }
            stream
                .synchronize()
                .map_err(|e| driver_err("synchronize", e))?;
            Ok(4.0 * bytes as f64 / t.elapsed().as_secs_f64())
        };
        time(true)?; // warm-up
        Ok((time(true)?, time(false)?))
    }
}

impl super::host::HostRegistrar for Gpu {
    fn register(&self, ptr: *mut u8, len: usize) -> Result<(), String> {
        self.ctx
            .bind_to_thread()
            .map_err(|e| driver_err("binding the context", e))?;
        // SAFETY: ptr..ptr+len is a live page-aligned allocation that stays registered until
        // `unregister`, which runs before it is freed.
        unsafe { sys::cuMemHostRegister_v2(ptr as *mut c_void, len, 0) }
            .result()
            .map_err(|e| driver_err(&format!("cuMemHostRegister of {len} bytes"), e))?;
        self.registry.0.lock().unwrap().push((ptr as usize, len));
        Ok(())
    }

    fn unregister(&self, ptr: *mut u8) {
        let mut live = self.registry.0.lock().unwrap();
        if let Some(i) = live.iter().position(|r| r.0 == ptr as usize) {
            live.swap_remove(i);
        }
        drop(live);
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: registered by `register`; no copy uses it (the pool only frees idle
            // buffers, and every chunk ends synchronised).
            let _ = unsafe { sys::cuMemHostUnregister(ptr as *mut c_void) };
        }
    }
}

impl Drop for Gpu {
    fn drop(&mut self) {
        // Staging and device buffers are freed with the context current on this thread.
        if self.ctx.bind_to_thread().is_ok() {
            self.lanes.get_mut().unwrap().clear();
        }
    }
}

fn load_module(
    ctx: &Arc<CudaContext>,
) -> Result<(Arc<cudarc::driver::CudaModule>, &'static str), String> {
    let mut last = String::new();
    for (ptx, what) in [(PTX_NVCC, "nvcc"), (PTX_COMMITTED, "committed")] {
        if ptx.is_empty() {
            continue;
        }
        match ctx.load_module(cudarc::nvrtc::Ptx::from_src(ptx)) {
            Ok(m) => return Ok((m, what)),
            // A driver older than the build's nvcc rejects its PTX ISA: try the committed one.
            Err(e) => last = driver_err(&format!("loading the {what} PTX"), e),
        }
    }
    Err(last)
}

/// Page-locked host memory, never write-combined; mapped into the device's address space on
/// unified-memory devices.
struct Pinned {
    ptr: *mut u8,
    len: usize,
    /// Device address of the same memory (mapped staging), when mapped.
    dev: Option<CUdeviceptr>,
}

// SAFETY: the buffer is owned by one lane, which one thread uses at a time.
unsafe impl Send for Pinned {}

impl Pinned {
    fn alloc(len: usize, mapped: bool) -> Result<Pinned, String> {
        let len = len.max(256);
        let flags = if mapped {
            sys::CU_MEMHOSTALLOC_DEVICEMAP
        } else {
            0
        };
        // SAFETY: a plain allocation; freed in Drop.
        let ptr = unsafe { result::malloc_host(len, flags) }
            .map_err(|e| driver_err(&format!("allocating {len} bytes of pinned memory"), e))?
            as *mut u8;
        let dev = if mapped {
            let mut d: CUdeviceptr = 0;
            // SAFETY: ptr was allocated with DEVICEMAP.
            unsafe { sys::cuMemHostGetDevicePointer_v2(&mut d, ptr as *mut c_void, 0) }
                .result()
                .map_err(|e| driver_err("mapping pinned memory", e))?;
            Some(d)
        } else {
            None
        };
        Ok(Pinned { ptr, len, dev })
    }

    /// # Safety
    /// `n <= self.len`, and no device work is writing the buffer.
    unsafe fn slice(&self, n: usize) -> &[u8] {
        std::slice::from_raw_parts(self.ptr, n)
    }

    /// # Safety
    /// `n <= self.len`, and no device work is using the buffer.
    #[allow(clippy::mut_from_ref)]
    unsafe fn slice_mut(&self, n: usize) -> &mut [u8] {
        std::slice::from_raw_parts_mut(self.ptr, n)
    }
}

impl Drop for Pinned {
    fn drop(&mut self) {
        // SAFETY: allocated by cuMemHostAlloc; every use was synchronised.
        let _ = unsafe { result::free_host(self.ptr as *mut c_void) };
    }
}

struct DevBuf {
    ptr: CUdeviceptr,
    len: usize,
}

impl DevBuf {
    fn alloc(len: usize) -> Result<DevBuf, String> {
        let len = len.max(256);
        // SAFETY: a plain allocation; freed in Drop.
        let ptr = unsafe { result::malloc_sync(len) }
            .map_err(|e| driver_err(&format!("allocating {len} bytes on the GPU"), e))?;
        Ok(DevBuf { ptr, len })
    }
}

impl Drop for DevBuf {
    fn drop(&mut self) {
        // SAFETY: allocated by cuMemAlloc; every use was synchronised.
        let _ = unsafe { result::free_sync(self.ptr) };
    }
}

/// Input slots 0..6 (a DoRA merge over an NVFP4 base has six: codes, block scales, tensor
/// scale, A, B, magnitude), output slots 6..8, device-only scratch after.
const IN: usize = 0;
const OUT: usize = 6;
const SCRATCH: usize = 8;
const SLOTS: usize = 16;
/// The scratch slot of the refusal flag kernels raise.
const FLAG: usize = SCRATCH;
/// A requantised chunk's merged rows, between the merge and the encoder.
const MERGED: usize = SCRATCH + 7;

struct Lane {
    stream: Arc<CudaStream>,
    mapped: bool,
    host: Vec<Option<Pinned>>,
    dev: Vec<Option<DevBuf>>,
    registry: Arc<Registry>,
    /// Bytes of the current chunk copied by DMA from or into registered memory.
    direct: u64,
}

fn launch_config(n: u64) -> LaunchConfig {
    let blocks = n.div_ceil(256).clamp(1, 1 << 20) as u32;
    LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    }
}

impl Lane {
    fn new(ctx: &Arc<CudaContext>, mapped: bool, registry: Arc<Registry>) -> Result<Lane, String> {
        let stream = ctx
            .new_stream()
            .map_err(|e| driver_err("creating a stream", e))?;
        Ok(Lane {
            stream,
            mapped,
            host: (0..SLOTS).map(|_| None).collect(),
            dev: (0..SLOTS).map(|_| None).collect(),
            registry,
            direct: 0,
        })
    }

    /// Whether `data` can be copied by DMA as it is (registered, and the device not mapped).
    fn direct_ok(&self, data: &[u8]) -> bool {
        !self.mapped && self.registry.contains(data)
    }

    fn pinned(&mut self, slot: usize, len: usize) -> Result<&Pinned, String> {
        if self.host[slot].as_ref().is_none_or(|p| p.len < len) {
            self.host[slot] = None;
            self.host[slot] = Some(Pinned::alloc(len + len / 8, self.mapped)?);
        }
        Ok(self.host[slot].as_ref().expect("just allocated"))
    }

    /// A device buffer of at least `len` bytes in `slot`.
    fn device(&mut self, slot: usize, len: usize) -> Result<CUdeviceptr, String> {
        if self.mapped && slot < SCRATCH {
            return Ok(self.pinned(slot, len)?.dev.expect("mapped"));
        }
        if self.dev[slot].as_ref().is_none_or(|d| d.len < len) {
            self.dev[slot] = None;
            self.dev[slot] = Some(DevBuf::alloc(len + len / 8)?);
        }
        Ok(self.dev[slot].as_ref().expect("just allocated").ptr)
    }

    /// Stages input `data` into slot `slot` and queues its copy; returns its device address.
    fn upload(&mut self, slot: usize, data: &[u8]) -> Result<CUdeviceptr, String> {
        if self.direct_ok(data) {
            let dptr = self.device(slot, data.len())?;
            // SAFETY: registered memory the caller keeps borrowed, untouched, until the
            // chunk's final sync.
            unsafe { result::memcpy_htod_async(dptr, data, self.stream.cu_stream()) }
                .map_err(|e| driver_err("host-to-device copy", e))?;
            self.direct += data.len() as u64;
            return Ok(dptr);
        }
        self.upload_joined(slot, &[data])
    }

    /// Uploads `inputs` to slots `IN`, `IN + 1`, ...: the device addresses of the first `N`, 0
    /// for an optional input the chunk does not have.
    fn upload_n<const N: usize>(&mut self, inputs: &[&[u8]]) -> Result<[CUdeviceptr; N], String> {
        let mut at = [0; N];
        for (k, data) in inputs.iter().take(N).enumerate() {
            at[k] = self.upload(IN + k, data)?;
        }
        Ok(at)
    }

    /// [`Self::upload`] of `data`, or a null device address when it is empty (an optional
    /// kernel argument: a unit map, importance weights, blend coefficients).
    fn upload_or_null(&mut self, slot: usize, data: &[u8]) -> Result<CUdeviceptr, String> {
        match data.is_empty() {
            true => Ok(0),
            false => self.upload(slot, data),
        }
    }

    /// Stages `parts`, one after the other, into slot `slot` and queues their copy as one
    /// buffer; returns its device address.
    fn upload_joined(&mut self, slot: usize, parts: &[&[u8]]) -> Result<CUdeviceptr, String> {
        Ok(self.upload_aligned(slot, parts, 1)?.0)
    }

    /// [`Self::upload_joined`] with each part starting at a multiple of `align` bytes; returns
    /// the device address and each part's offset.
    fn upload_aligned(
        &mut self,
        slot: usize,
        parts: &[&[u8]],
        align: usize,
    ) -> Result<(CUdeviceptr, Vec<u64>), String> {
        let offsets: Vec<usize> = parts
            .iter()
            .scan(0usize, |at, p| {
                let start = at.next_multiple_of(align);
                *at = start + p.len();
                Some(start)
            })
            .collect();
        let len = offsets
            .last()
            .map_or(0, |&o| o + parts[parts.len() - 1].len());
        let p = self.pinned(slot, len)?;
        // SAFETY: the previous chunk's copies finished (each chunk ends synchronised).
        let staged = unsafe { p.slice_mut(len) };
        for (part, &at) in parts.iter().zip(&offsets) {
            staged[at..at + part.len()].copy_from_slice(part);
        }
        let dptr = self.device(slot, len)?;
        if !self.mapped {
            let p = self.host[slot].as_ref().expect("staged");
            // SAFETY: the pinned source stays untouched until the chunk's final sync.
            unsafe { result::memcpy_htod_async(dptr, p.slice(len), self.stream.cu_stream()) }
                .map_err(|e| driver_err("host-to-device copy", e))?;
        }
        Ok((dptr, offsets.into_iter().map(|o| o as u64).collect()))
    }

    /// Queues the copy of `len` bytes of device slot `slot` back to its pinned staging.
    fn download(&mut self, slot: usize, len: usize) -> Result<(), String> {
        if self.mapped && slot < SCRATCH {
            return Ok(());
        }
        let src = self.device(slot, len)?;
        let stream = self.stream.cu_stream();
        let p = self.pinned(slot, len)?;
        // SAFETY: the destination is read only after the chunk's final sync.
        unsafe { result::memcpy_dtoh_async(p.slice_mut(len), src, stream) }
            .map_err(|e| driver_err("device-to-host copy", e))
    }

    /// The downloaded bytes of `slot` (after `finish`).
    fn result(&self, slot: usize, len: usize) -> &[u8] {
        // SAFETY: the stream has been synchronised.
        unsafe { self.host[slot].as_ref().expect("downloaded").slice(len) }
    }

    fn zero(&mut self, slot: usize, len: usize) -> Result<CUdeviceptr, String> {
        let d = self.device(slot, len)?;
        // SAFETY: a live device buffer of at least len bytes.
        unsafe { result::memset_d8_async(d, 0, len, self.stream.cu_stream()) }
            .map_err(|e| driver_err("memset", e))?;
        Ok(d)
    }

    fn finish(&self) -> Result<(), String> {
        self.stream
            .synchronize()
            .map_err(|e| driver_err("running the kernels", e))
    }

    /// `f32` copy of the `dtype` elements at device address `src` (in scratch slot `slot`).
    fn as_f32(
        &mut self,
        k: &Kernels,
        slot: usize,
        src: CUdeviceptr,
        dtype: DType,
        n: u64,
    ) -> Result<CUdeviceptr, String> {
        if dtype == DType::F32 {
            return Ok(src);
        }
        let dst = self.device(slot, 4 * n as usize)?;
        let (s, d) = (kernel_dtype(dtype), kernel_dtype(DType::F32));
        let mut b = self.stream.launch_builder(&k.cast);
        b.arg(&src).arg(&dst).arg(&n).arg(&s).arg(&d);
        // SAFETY: argument types match tftf_cast's signature; buffers hold n elements.
        unsafe { b.launch(launch_config(n)) }.map_err(|e| driver_err("tftf_cast", e))?;
        Ok(dst)
    }

    fn run(
        &mut self,
        k: &Kernels,
        kernel: &Kernel,
        units: Range<u64>,
        inputs: &[&[u8]],
        outs: &mut [&mut [u8]],
    ) -> Result<Ran, String> {
        let nunits = units.end - units.start;
        let mut flag = None;
        match kernel {
            Kernel::Cast { src, dst } => {
                let i = self.upload(IN, inputs[0])?;
                let o = self.device(OUT, outs[0].len())?;
                let (s, d) = (kernel_dtype(*src), kernel_dtype(*dst));
                let mut b = self.stream.launch_builder(&k.cast);
                b.arg(&i).arg(&o).arg(&nunits).arg(&s).arg(&d);
                // SAFETY: argument types match tftf_cast; buffers hold nunits elements.
                unsafe { b.launch(launch_config(nunits)) }
                    .map_err(|e| driver_err("tftf_cast", e))?;
            }
            Kernel::Gguf(l) => self.gguf(k, l, inputs, outs[0].len())?,
            Kernel::Merge(l) => {
                // Each model's chunk at an 8-byte boundary, for the kernel's typed loads.
                let (i, offsets) = self.upload_aligned(IN, inputs, 8)?;
                let mut p = l.params;
                p.offsets[..offsets.len()].copy_from_slice(&offsets);
                let coefs: Vec<u8> = l.coefs.iter().flat_map(|c| c.to_le_bytes()).collect();
                let c = self.upload_or_null(IN + 1, &coefs)?;
                let o = self.device(OUT, outs[0].len())?;
                let mut b = self.stream.launch_builder(&k.merge);
                b.arg(&i).arg(&c).arg(&o).arg(&nunits).arg(&p);
                // SAFETY: argument types match tftf_merge; input k holds nunits elements of
                // its dtype at offsets[k], `c` the blend's p.inner coefficient pairs, and `o`
                // nunits elements of p.dst.
                unsafe { b.launch(launch_config(nunits)) }
                    .map_err(|e| driver_err("tftf_merge", e))?;
            }
            Kernel::DequantFp8(p) => {
                let o = self.device(OUT, outs[0].len())?;
                flag = Some(self.dequant(k, p, inputs, o)?);
            }
            Kernel::DequantFp4(p) => {
                let o = self.device(OUT, outs[0].len())?;
                flag = Some(self.dequant_fp4(k, p, inputs, o)?);
            }
            Kernel::DequantInt(p) => {
                let [w, s, z] = self.upload_n(inputs)?;
                let o = self.device(OUT, outs[0].len())?;
                let n = nunits * p.cols;
                let mut b = self.stream.launch_builder(&k.dequant_int);
                b.arg(&w).arg(&s).arg(&z).arg(&o).arg(&n).arg(p);
                // SAFETY: argument types match tftf_dequant_int; the inputs are the op's
                // whole-row ranges for these units and `o` holds n elements of p.dst.
                unsafe { b.launch(launch_config(n)) }
                    .map_err(|e| driver_err("tftf_dequant_int", e))?;
            }
            Kernel::DequantGptq(p) => {
                let [w, z, s, g] = self.upload_n(inputs)?;
                let o = self.device(OUT, outs[0].len())?;
                let f = self.zero(FLAG, 4)?;
                flag = Some(f);
                let n = p.rows * p.cols;
                let mut b = self.stream.launch_builder(&k.dequant_gptq);
                b.arg(&w)
                    .arg(&z)
                    .arg(&s)
                    .arg(&g)
                    .arg(&o)
                    .arg(&n)
                    .arg(p)
                    .arg(&f);
                // SAFETY: argument types match tftf_dequant_gptq; the inputs are the whole
                // tensors and `o` holds n elements of p.dst.
                unsafe { b.launch(launch_config(n)) }
                    .map_err(|e| driver_err("tftf_dequant_gptq", e))?;
            }
            Kernel::DequantInt4Modelopt(p) => {
                let [c, s] = self.upload_n(inputs)?;
                let o = self.device(OUT, outs[0].len())?;
                let f = self.zero(FLAG, 4)?;
                flag = Some(f);
                let n = 2 * nunits * p.cols;
                let mut b = self.stream.launch_builder(&k.dequant_int4);
                b.arg(&c).arg(&s).arg(&o).arg(&n).arg(p).arg(&f);
                // SAFETY: argument types match tftf_dequant_int4_modelopt; `c` holds the
                // chunk's packed rows (two weight rows each) and `o` n elements of p.dst.
                unsafe { b.launch(launch_config(n)) }
                    .map_err(|e| driver_err("tftf_dequant_int4_modelopt", e))?;
            }
            Kernel::NvBlockScales { g } => {
                let i = self.upload(IN, inputs[0])?;
                let o = self.device(OUT, outs[0].len())?;
                let f = self.zero(FLAG, 4)?;
                flag = Some(f);
                let n = inputs[0].len() as u64;
                let mut b = self.stream.launch_builder(&k.nv_scales);
                b.arg(&i).arg(&o).arg(&n).arg(g).arg(&f);
                // SAFETY: argument types match tftf_nv_block_scales.
                unsafe { b.launch(launch_config(n)) }
                    .map_err(|e| driver_err("tftf_nv_block_scales", e))?;
            }
            Kernel::NvReencode { g } => {
                let [w, s] = self.upload_n(inputs)?;
                let o = self.device(OUT, outs[0].len())?;
                let blocks = inputs[1].len() as u64;
                let mut b = self.stream.launch_builder(&k.nv_reencode);
                b.arg(&w).arg(&s).arg(&o).arg(&blocks).arg(g);
                // SAFETY: argument types match tftf_nv_reencode; 16 bytes per block.
                unsafe { b.launch(launch_config(blocks)) }
                    .map_err(|e| driver_err("tftf_nv_reencode", e))?;
            }
            Kernel::Engram { cols } => {
                let [codes, scales] = self.upload_n(inputs)?;
                let blocks = inputs[1].len() as u64;
                let per_row = cols / 32;
                let o_codes = self.device(OUT, outs[0].len())?;
                let o_scales = self.device(OUT + 1, outs[1].len())?;
                let sums = self.device(SCRATCH + 1, blocks as usize * BLOCK_SUMS_BYTES)?;
                let rows_slot = SCRATCH + 2;
                let rows = self.device(rows_slot, nunits as usize * 32)?;
                let f = self.zero(FLAG, 4)?;
                let clamped = self.zero(SCRATCH + 3, 8)?;
                flag = Some(f);
                let mut b = self.stream.launch_builder(&k.engram_blocks);
                b.arg(&codes).arg(&scales).arg(&o_codes).arg(&o_scales);
                b.arg(&sums).arg(&blocks).arg(&f).arg(&clamped);
                // SAFETY: argument types match tftf_engram_blocks; 32 codes per block.
                unsafe { b.launch(launch_config(blocks)) }
                    .map_err(|e| driver_err("tftf_engram_blocks", e))?;
                let mut b = self.stream.launch_builder(&k.engram_rows);
                b.arg(&sums).arg(&rows).arg(&nunits).arg(&per_row);
                // SAFETY: argument types match tftf_engram_rows.
                unsafe { b.launch(launch_config(nunits)) }
                    .map_err(|e| driver_err("tftf_engram_rows", e))?;
                self.download(rows_slot, nunits as usize * 32)?;
                self.download(SCRATCH + 3, 8)?;
            }
            Kernel::Lora(m) => flag = self.lora(k, m, &units, inputs, OUT, outs[0].len())?,
            Kernel::Quantize(p) => {
                let w = self.upload(IN, inputs[0])?;
                let f = self.zero(FLAG, 4)?;
                self.quantize(k, p, w, outs, f)?;
                flag = Some(f);
            }
            Kernel::Requant {
                merge,
                quant,
                measure,
            } => {
                // The merged rows, in the weight dtype the encoder reads, stay on the device.
                let len = (quant.rows * quant.cols * quant.weight_bytes()) as usize;
                let f = match self.lora(k, merge, &units, inputs, MERGED, len)? {
                    Some(f) => f,
                    None => self.zero(FLAG, 4)?,
                };
                let w = self.device(MERGED, len)?;
                // One refusal flag: the FP8 base's dequantisation raised it, or the encoder will.
                self.quantize(k, quant, w, outs, f)?;
                flag = Some(f);
                if *measure {
                    self.download(MERGED, len)?;
                }
            }
        }
        // Registered outputs receive their bytes by DMA; the others through staging.
        let mut staged = vec![true; outs.len()];
        for (j, o) in outs.iter_mut().enumerate() {
            if self.direct_ok(o) {
                let src = self.device(OUT + j, o.len())?;
                // SAFETY: registered memory the caller keeps borrowed until the final sync.
                unsafe { result::memcpy_dtoh_async(&mut o[..], src, self.stream.cu_stream()) }
                    .map_err(|e| driver_err("device-to-host copy", e))?;
                self.direct += o.len() as u64;
                staged[j] = false;
            } else {
                self.download(OUT + j, o.len())?;
            }
        }
        if flag.is_some() {
            self.download(FLAG, 4)?;
        }
        self.finish()?;
        if flag.is_some() && self.result(FLAG, 4) != [0, 0, 0, 0] {
            return Ok(Ran::Refused);
        }
        for (j, o) in outs.iter_mut().enumerate().filter(|(j, _)| staged[*j]) {
            o.copy_from_slice(self.result(OUT + j, o.len()));
        }
        if let Kernel::Requant {
            quant,
            measure: true,
            ..
        } = kernel
        {
            let len = (quant.rows * quant.cols * quant.weight_bytes()) as usize;
            return Ok(Ran::Done(Some(KernelStats::Requant {
                rows: units,
                merged: self.result(MERGED, len).to_vec(),
                codes: outs[0].to_vec(),
                scales: outs[1].to_vec(),
            })));
        }
        if let Kernel::Engram { .. } = kernel {
            let bytes = self.result(SCRATCH + 2, nunits as usize * 32);
            let rows: Vec<RowSums> = bytes
                .chunks_exact(32)
                .map(|c| {
                    let f = |i: usize| f64::from_le_bytes(c[8 * i..8 * i + 8].try_into().unwrap());
                    RowSums {
                        dot: f(0),
                        xx: f(1),
                        yy: f(2),
                        sq_err: f(3),
                    }
                })
                .collect();
            let clamped = u64::from_le_bytes(self.result(SCRATCH + 3, 8).try_into().unwrap());
            return Ok(Ran::Done(Some(KernelStats::Engram { rows, clamped })));
        }
        Ok(Ran::Done(None))
    }

    /// Queues a GGUF chunk: the inputs joined in order, the unit map beside them, into the
    /// `out_len` bytes of output slot `OUT`.
    fn gguf(
        &mut self,
        k: &Kernels,
        l: &GgufLaunch,
        inputs: &[&[u8]],
        out_len: usize,
    ) -> Result<(), String> {
        let i = match inputs {
            [one] => self.upload(IN, one)?,
            parts => self.upload_joined(IN, parts)?,
        };
        let map: Vec<u8> = l.map.iter().flat_map(|u| u.to_le_bytes()).collect();
        let m = self.upload_or_null(IN + 1, &map)?;
        let o = self.device(OUT, out_len)?;
        let n = l.items;
        if !l.blocks {
            let mut b = self.stream.launch_builder(&k.gguf);
            b.arg(&i).arg(&m).arg(&o).arg(&n).arg(&l.params);
            // SAFETY: argument types match tftf_gguf; the joined input holds every element the
            // map names, `o` holds n items (Q8_0 blocks or elements) of the output type.
            unsafe { b.launch(launch_config(n)) }.map_err(|e| driver_err("tftf_gguf", e))?;
            return Ok(());
        }
        let weights: Vec<u8> = l.weights.iter().flat_map(|w| w.to_le_bytes()).collect();
        let w = self.upload_or_null(IN + 2, &weights)?;
        let t = self.upload_or_null(IN + 3, l.tables.as_deref().unwrap_or(&[]))?;
        let mut b = self.stream.launch_builder(&k.gguf_blocks);
        b.arg(&i)
            .arg(&m)
            .arg(&w)
            .arg(&t)
            .arg(&o)
            .arg(&n)
            .arg(&l.params);
        // SAFETY: argument types match tftf_gguf_blocks; the joined input holds every element
        // the map names, the weights a row for each expert the chunk's rows belong to, the
        // tables the lattice of an IQ type, and `o` holds n blocks of the output type.
        unsafe { b.launch(launch_config(n)) }.map_err(|e| driver_err("tftf_gguf_blocks", e))?;
        Ok(())
    }

    /// Queues FP8 dequantisation of a chunk (`inputs`: codes, then the scales if any) into
    /// device buffer `out`; returns the refusal flag's address.
    fn dequant(
        &mut self,
        k: &Kernels,
        p: &DequantParams,
        inputs: &[&[u8]],
        out: CUdeviceptr,
    ) -> Result<CUdeviceptr, String> {
        let [c, s] = self.upload_n(inputs)?;
        let flag = self.zero(FLAG, 4)?;
        let n = inputs[0].len() as u64;
        let mut b = self.stream.launch_builder(&k.dequant);
        b.arg(&c).arg(&s).arg(&out).arg(&n).arg(p).arg(&flag);
        // SAFETY: argument types match tftf_dequant_fp8; buffers are sized for n.
        unsafe { b.launch(launch_config(n)) }.map_err(|e| driver_err("tftf_dequant_fp8", e))?;
        Ok(flag)
    }

    /// Queues FP4 dequantisation of a chunk (`inputs`: codes, block scales, the tensor scale if
    /// any) into device buffer `out`; returns the refusal flag's address.
    fn dequant_fp4(
        &mut self,
        k: &Kernels,
        p: &Fp4Params,
        inputs: &[&[u8]],
        out: CUdeviceptr,
    ) -> Result<CUdeviceptr, String> {
        let [c, s, g] = self.upload_n(inputs)?;
        let f = self.zero(FLAG, 4)?;
        let n = 2 * inputs[0].len() as u64;
        let mut b = self.stream.launch_builder(&k.dequant_fp4);
        b.arg(&c).arg(&s).arg(&g).arg(&out).arg(&n).arg(p).arg(&f);
        // SAFETY: argument types match tftf_dequant_fp4; the inputs are the op's ranges for
        // these units (two codes a byte) and `out` holds n elements of p.dst.
        unsafe { b.launch(launch_config(n)) }.map_err(|e| driver_err("tftf_dequant_fp4", e))?;
        Ok(f)
    }

    /// Queues a quantiser over a chunk (its weight rows at device address `w`) into output
    /// slots 0 (codes) and 1 (scales), raising the refusal flag `f`.
    fn quantize(
        &mut self,
        k: &Kernels,
        p: &QuantParams,
        w: CUdeviceptr,
        outs: &[&mut [u8]],
        f: CUdeviceptr,
    ) -> Result<(), String> {
        let codes = self.device(OUT, outs[0].len())?;
        let scales = self.device(OUT + 1, outs[1].len())?;
        if p.is_fp8_rows() || p.is_fp8_block() {
            // Segments of ≤128 columns fold their amax into their row's or block's, each
            // target's scale and factor follow, then the codes.
            let segments = p.rows * p.cols.div_ceil(128);
            let targets = if p.is_fp8_block() {
                p.rows.div_ceil(128) * p.cols.div_ceil(128)
            } else {
                p.rows
            };
            let amax = self.zero(SCRATCH + 1, 4 * targets as usize)?;
            let mut b = self.stream.launch_builder(&k.quantize_fp8_amax);
            b.arg(&w).arg(&amax).arg(&segments).arg(p).arg(&f);
            // SAFETY: argument types match tftf_quantize_fp8_amax; `amax` holds one word per
            // target, the weight p.rows rows.
            unsafe { b.launch(launch_config(segments)) }
                .map_err(|e| driver_err("tftf_quantize_fp8_amax", e))?;
            let mut b = self.stream.launch_builder(&k.quantize_fp8_scales);
            b.arg(&amax).arg(&scales).arg(&targets).arg(p).arg(&f);
            // SAFETY: argument types match tftf_quantize_fp8_scales; one scale per target.
            unsafe { b.launch(launch_config(targets)) }
                .map_err(|e| driver_err("tftf_quantize_fp8_scales", e))?;
            let n = p.rows * p.cols;
            let mut b = self.stream.launch_builder(&k.quantize_fp8_codes);
            b.arg(&w).arg(&amax).arg(&codes).arg(&n).arg(p);
            // SAFETY: argument types match tftf_quantize_fp8_codes; one code per element.
            unsafe { b.launch(launch_config(n)) }
                .map_err(|e| driver_err("tftf_quantize_fp8_codes", e))?;
        } else {
            let n = p.group_threads();
            let mut b = self.stream.launch_builder(&k.quantize_groups);
            b.arg(&w).arg(&codes).arg(&scales).arg(&n).arg(p).arg(&f);
            // SAFETY: argument types match tftf_quantize_groups; n groups of whole rows.
            unsafe { b.launch(launch_config(n)) }
                .map_err(|e| driver_err("tftf_quantize_groups", e))?;
        }
        Ok(())
    }

    /// LoRA/DoRA: factors to f32, Δ = B@A in the fixed summation order the CPU uses, then the
    /// fused add / DoRA-normalise / round kernels. Returns the refusal flag of an FP8 base.
    fn lora(
        &mut self,
        k: &Kernels,
        f: &LoraLaunch,
        units: &Range<u64>,
        inputs: &[&[u8]],
        out_slot: usize,
        out_len: usize,
    ) -> Result<Option<CUdeviceptr>, String> {
        let tr = units.end - units.start;
        let cols = f.delta.cols;
        let nb = f.base_inputs;
        // A computed base (FP8) is dequantised to f32 on the device first; its kernel may
        // refuse a value, which the caller then hands to the CPU op.
        let (base, base_dtype, flag) = match &f.base_dequant {
            None => (self.upload(IN, inputs[0])?, f.base_dtype, None),
            Some(BaseDequant::Fp8(p)) => {
                let o = self.device(SCRATCH + 6, (tr * cols * 4) as usize)?;
                let fl = self.dequant(k, p, &inputs[..nb], o)?;
                (o, DType::F32, Some(fl))
            }
            Some(BaseDequant::Fp4(p)) => {
                let o = self.device(SCRATCH + 6, (tr * cols * 4) as usize)?;
                let fl = self.dequant_fp4(k, p, &inputs[..nb], o)?;
                (o, DType::F32, Some(fl))
            }
        };
        let a_raw = self.upload(IN + nb, inputs[nb])?;
        let b_raw = self.upload(IN + nb + 1, inputs[nb + 1])?;
        let a_len = inputs[nb].len() as u64 / (f.a_dtype.bits() / 8);
        let b_len = inputs[nb + 1].len() as u64 / (f.b_dtype.bits() / 8);
        let a = self.as_f32(k, SCRATCH + 1, a_raw, f.a_dtype, a_len)?;
        let b = self.as_f32(k, SCRATCH + 2, b_raw, f.b_dtype, b_len)?;
        let delta = self.device(SCRATCH + 3, (tr * cols * 4) as usize)?;
        let (coef, vecs) = if f.coef_is_a { (a, b) } else { (b, a) };
        let d = f.delta;
        let n = tr * cols;
        let mut l = self.stream.launch_builder(&k.lora_delta);
        l.arg(&coef).arg(&vecs).arg(&delta).arg(&n).arg(&d);
        // SAFETY: argument types match tftf_lora_delta; the strides stay inside A and B.
        unsafe { l.launch(launch_config(n)) }.map_err(|e| driver_err("tftf_lora_delta", e))?;
        let p = LoraParams {
            cols,
            scale: f.scale,
            base_dtype: kernel_dtype(base_dtype),
            dst: kernel_dtype(f.dst),
            dora: f.m_dtype.is_some() as i32,
            pad: 0,
        };
        let factors = self.device(SCRATCH + 4, (tr * 4) as usize)?;
        if let Some(md) = f.m_dtype {
            let mag_raw = self.upload(IN + nb + 2, inputs[nb + 2])?;
            let mag = self.as_f32(k, SCRATCH + 5, mag_raw, md, tr)?;
            let mut b = self.stream.launch_builder(&k.dora);
            b.arg(&base)
                .arg(&delta)
                .arg(&mag)
                .arg(&factors)
                .arg(&tr)
                .arg(&p);
            // SAFETY: argument types match tftf_dora_factors.
            unsafe { b.launch(launch_config(tr)) }
                .map_err(|e| driver_err("tftf_dora_factors", e))?;
        }
        let o = self.device(out_slot, out_len)?;
        let mut b = self.stream.launch_builder(&k.lora);
        b.arg(&base)
            .arg(&delta)
            .arg(&factors)
            .arg(&o)
            .arg(&n)
            .arg(&p);
        // SAFETY: argument types match tftf_lora.
        unsafe { b.launch(launch_config(n)) }.map_err(|e| driver_err("tftf_lora", e))?;
        Ok(flag)
    }
}
