//! Code compiled for wider vectors where the CPU has them, with the same results: Rust never
//! contracts a multiply and an add into a fused one, and no FMA feature is enabled, so only
//! the vector width changes.

/// Runs `f` compiled for AVX2 where the CPU has it (`f` and what it inlines: callers mark the
/// closure and the functions it calls `#[inline(always)]` for that), otherwise as built.
#[inline(always)]
pub(crate) fn with_avx2<R>(f: impl FnOnce() -> R) -> R {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        #[target_feature(enable = "avx2")]
        fn avx2<R>(f: impl FnOnce() -> R) -> R {
            f()
        }
        // SAFETY: the CPU has AVX2, checked just above.
        return unsafe { avx2(f) };
    }
    f()
}
