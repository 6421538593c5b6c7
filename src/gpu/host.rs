//! Host memory pinning for device DMA, as an interface: the pipeline's buffer pool registers
//! each buffer it allocates through [`HostRegistrar`], and the CUDA backend implements it. It
//! is declared in the GPU module, beside its implementation, because the pipeline sits above
//! the GPU backend and names it, not the other way round.

/// Pins and unpins host memory for device DMA; [`super::Gpu`] implements it with
/// `cuMemHostRegister`.
pub trait HostRegistrar: Send + Sync {
    /// Registers `len` bytes at `ptr` (page-aligned, a whole number of pages); `Err` says why not.
    fn register(&self, ptr: *mut u8, len: usize) -> std::result::Result<(), String>;
    fn unregister(&self, ptr: *mut u8);
}
