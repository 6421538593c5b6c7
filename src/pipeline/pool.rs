//! The buffer pool is the memory budget: every byte of tensor data in flight lives in a buffer
//! from here, and the pool never holds more than its capacity (allocated and free together),
//! except that one item larger than the whole pool may pass alone so that no input is too big
//! to convert.
//!
//! Buffers are page-aligned so that, with a GPU, each can be registered with the driver
//! (`cuMemHostRegister`) once when allocated: host↔device copies then run by DMA straight from
//! and into them, with no staging copy.

use std::alloc::Layout;
use std::ptr::NonNull;
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use super::cancel::Cancel;
use crate::error::{Error, Result};
use crate::gpu::host::HostRegistrar;

/// Host page size assumed for alignment; registration needs page-aligned memory.
pub const PAGE: usize = 4096;

/// Buffers at least this big are mapped from the kernel, which hands out zeroed pages, instead
/// of allocated page-aligned and zeroed byte by byte (a tenth of a merge's time).
const MAPPED_BYTES: usize = 1 << 20;

/// A page-aligned, zero-initialised byte buffer from the pool; every byte of its capacity stays
/// initialised, so changing its length needs no zero-fill of reused memory.
pub struct PoolBuf {
    ptr: NonNull<u8>,
    cap: usize,
    len: usize,
    registered: Option<Arc<dyn HostRegistrar>>,
}

// SAFETY: the buffer owns its allocation exclusively, like a Vec<u8>.
unsafe impl Send for PoolBuf {}
// SAFETY: shared access is read-only through Deref.
unsafe impl Sync for PoolBuf {}

impl PoolBuf {
    /// A zeroed buffer of `len` bytes and capacity `cap >= len`.
    fn alloc(len: usize, cap: usize) -> PoolBuf {
        debug_assert!(cap >= len);
        let ptr = if cap == 0 {
            NonNull::<u8>::dangling()
        } else if cap >= MAPPED_BYTES {
            // SAFETY: a fresh private anonymous mapping; the kernel hands it out zeroed.
            let p = unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    cap,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                    -1,
                    0,
                )
            };
            let layout = Layout::from_size_align(cap, PAGE).expect("buffer size fits a Layout");
            match p {
                libc::MAP_FAILED => std::alloc::handle_alloc_error(layout),
                p => NonNull::new(p.cast::<u8>())
                    .unwrap_or_else(|| std::alloc::handle_alloc_error(layout)),
            }
        } else {
            let layout = Layout::from_size_align(cap, PAGE).expect("buffer size fits a Layout");
            // SAFETY: non-zero size.
            let p = unsafe { std::alloc::alloc_zeroed(layout) };
            NonNull::new(p).unwrap_or_else(|| std::alloc::handle_alloc_error(layout))
        };
        PoolBuf {
            ptr,
            cap,
            len,
            registered: None,
        }
    }

    /// A stand-alone buffer (not counted by any pool), for tests and one-off uses.
    pub fn zeroed(len: usize) -> PoolBuf {
        PoolBuf::alloc(len, len)
    }

    pub fn capacity(&self) -> usize {
        self.cap
    }

    /// Whether the buffer is registered with the device driver for direct DMA.
    pub fn is_registered(&self) -> bool {
        self.registered.is_some()
    }

    /// Sets the length; bytes past the old length keep whatever they held (zero or old data).
    fn set_len(&mut self, len: usize) {
        assert!(len <= self.cap);
        self.len = len;
    }
}

impl std::ops::Deref for PoolBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: ptr is valid for cap >= len initialised bytes (or dangling with len 0).
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl std::ops::DerefMut for PoolBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in Deref, and &mut self is exclusive.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for PoolBuf {
    fn drop(&mut self) {
        if let Some(r) = self.registered.take() {
            r.unregister(self.ptr.as_ptr());
        }
        if self.cap >= MAPPED_BYTES {
            // SAFETY: mapped in `alloc` with this length.
            unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.cap) };
        } else if self.cap > 0 {
            let layout = Layout::from_size_align(self.cap, PAGE).expect("allocated with it");
            // SAFETY: allocated in `alloc` with this layout.
            unsafe { std::alloc::dealloc(self.ptr.as_ptr(), layout) };
        }
    }
}

pub struct BufferPool {
    capacity: u64,
    state: Mutex<State>,
    freed: Condvar,
    registrar: Option<Arc<dyn HostRegistrar>>,
    /// Why registration failed, once it has; later buffers are not tried again.
    register_failed: Mutex<Option<String>>,
    registered_bytes: std::sync::atomic::AtomicU64,
}

struct State {
    /// Capacity of the buffers handed out.
    in_use: u64,
    free: Vec<PoolBuf>,
    peak: u64,
}

impl BufferPool {
    pub fn new(capacity: u64) -> BufferPool {
        BufferPool {
            capacity,
            state: Mutex::new(State {
                in_use: 0,
                free: Vec::new(),
                peak: 0,
            }),
            freed: Condvar::new(),
            registrar: None,
            register_failed: Mutex::new(None),
            registered_bytes: Default::default(),
        }
    }

    /// A pool whose new buffers are registered with `registrar` (rounded up to whole pages, the
    /// rounding counted in the budget like any capacity). A refused registration is remembered
    /// and the run goes on with unregistered buffers.
    pub fn with_registrar(capacity: u64, registrar: Arc<dyn HostRegistrar>) -> BufferPool {
        BufferPool {
            registrar: Some(registrar),
            ..BufferPool::new(capacity)
        }
    }

    /// Why buffers could not be registered, when they could not.
    pub fn register_failure(&self) -> Option<String> {
        self.register_failed.lock().unwrap().clone()
    }

    /// Bytes of buffers registered with the driver over the run.
    pub fn registered_bytes(&self) -> u64 {
        self.registered_bytes
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Capacity a fresh buffer of `len` bytes gets.
    fn fresh_capacity(&self, len: usize) -> usize {
        if self.registrar.is_some() {
            len.div_ceil(PAGE) * PAGE
        } else {
            len
        }
    }

    /// A fresh buffer, registered when the pool registers and registration still works.
    fn fresh(&self, len: usize) -> PoolBuf {
        let mut b = PoolBuf::alloc(len, self.fresh_capacity(len));
        if let (Some(r), true) = (&self.registrar, b.cap > 0) {
            let mut failed = self.register_failed.lock().unwrap();
            if failed.is_none() {
                match r.register(b.ptr.as_ptr(), b.cap) {
                    Ok(()) => {
                        b.registered = Some(r.clone());
                        self.registered_bytes
                            .fetch_add(b.cap as u64, std::sync::atomic::Ordering::Relaxed);
                    }
                    Err(why) => *failed = Some(why),
                }
            }
        }
        b
    }

    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    /// Highest number of bytes handed out at once.
    pub fn peak(&self) -> u64 {
        self.state.lock().unwrap().peak
    }

    /// Takes buffers of the given lengths all at once (so a reader never holds part of an item
    /// while waiting for the rest), blocking until the budget allows or `cancel` is raised.
    /// Memory is counted by capacity: a cached buffer is reused only when it is at most 25 %
    /// larger than asked, so small requests never pin big buffers.
    pub fn acquire(&self, lens: &[usize], cancel: &Cancel) -> Result<Vec<PoolBuf>> {
        let mut st = self.state.lock().unwrap();
        loop {
            // Pick a cached buffer (best fit) or a fresh allocation for each length.
            let mut taken: Vec<Option<usize>> = Vec::with_capacity(lens.len());
            let mut used = vec![false; st.free.len()];
            for &len in lens {
                let best = st
                    .free
                    .iter()
                    .enumerate()
                    .filter(|(i, b)| {
                        !used[*i] && b.capacity() >= len && b.capacity() <= len + len / 4
                    })
                    .min_by_key(|(_, b)| b.capacity())
                    .map(|(i, _)| i);
                if let Some(i) = best {
                    used[i] = true;
                }
                taken.push(best);
            }
            let need: u64 = lens
                .iter()
                .zip(&taken)
                .map(|(&len, t)| {
                    t.map_or(self.fresh_capacity(len), |i| st.free[i].capacity()) as u64
                })
                .sum();
            let reused: u64 = taken
                .iter()
                .flatten()
                .map(|&i| st.free[i].capacity() as u64)
                .sum();
            let cached: u64 = st.free.iter().map(|b| b.capacity() as u64).sum();
            // Evict cached buffers that are not being reused until the total fits.
            let mut other_cached = cached - reused;
            while st.in_use + need + other_cached > self.capacity && other_cached > 0 {
                let victim = (0..st.free.len())
                    .rev()
                    .find(|&i| !used[i])
                    .expect("an unused cached buffer");
                other_cached -= st.free[victim].capacity() as u64;
                st.free.remove(victim);
                used.remove(victim);
                for t in taken.iter_mut().flatten() {
                    if *t > victim {
                        *t -= 1;
                    }
                }
            }
            if st.in_use == 0 || st.in_use + need <= self.capacity {
                st.in_use += need;
                st.peak = st.peak.max(st.in_use);
                // Remove reused buffers from the free list, highest index first.
                let mut picks: Vec<(usize, usize)> = taken
                    .iter()
                    .enumerate()
                    .filter_map(|(k, t)| t.map(|i| (i, k)))
                    .collect();
                picks.sort_unstable_by_key(|p| std::cmp::Reverse(p.0));
                let mut out: Vec<Option<PoolBuf>> = (0..lens.len()).map(|_| None).collect();
                for (i, k) in picks {
                    out[k] = Some(st.free.swap_remove(i));
                }
                // Allocation (and registration, which pins pages) happens outside the lock.
                drop(st);
                return Ok(out
                    .into_iter()
                    .zip(lens)
                    .map(|(b, &len)| match b {
                        Some(mut buf) => {
                            buf.set_len(len);
                            buf
                        }
                        None => self.fresh(len),
                    })
                    .collect());
            }
            if cancel.is_raised() {
                return Err(Error::Cancelled);
            }
            st = self
                .freed
                .wait_timeout(st, Duration::from_millis(50))
                .unwrap()
                .0;
        }
    }

    pub fn release(&self, buf: PoolBuf) {
        let mut st = self.state.lock().unwrap();
        st.in_use -= buf.capacity() as u64;
        let cached: u64 = st.free.iter().map(|b| b.capacity() as u64).sum();
        if cached + st.in_use + buf.capacity() as u64 <= self.capacity {
            st.free.push(buf);
        }
        drop(st);
        self.freed.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn blocks_until_released_and_lets_oversized_items_pass_alone() {
        let pool = Arc::new(BufferPool::new(100));
        let cancel = Cancel::default();
        let a = pool.acquire(&[60], &cancel).unwrap();
        let p2 = pool.clone();
        let c2 = cancel.clone();
        let waiter = std::thread::spawn(move || p2.acquire(&[30, 30], &c2).map(|v| v.len()));
        std::thread::sleep(Duration::from_millis(100));
        assert!(!waiter.is_finished());
        for b in a {
            pool.release(b);
        }
        assert_eq!(waiter.join().unwrap().unwrap(), 2);
        assert_eq!(pool.peak(), 60);
        let big = BufferPool::new(10);
        assert_eq!(big.acquire(&[50], &cancel).unwrap()[0].len(), 50);
    }

    #[derive(Default)]
    struct Registry {
        live: Mutex<Vec<(usize, usize)>>,
        refuse: bool,
    }

    impl HostRegistrar for Registry {
        fn register(&self, ptr: *mut u8, len: usize) -> std::result::Result<(), String> {
            assert_eq!(ptr as usize % PAGE, 0, "page-aligned");
            assert_eq!(len % PAGE, 0, "whole pages");
            if self.refuse {
                return Err("refused".into());
            }
            self.live.lock().unwrap().push((ptr as usize, len));
            Ok(())
        }
        fn unregister(&self, ptr: *mut u8) {
            let mut live = self.live.lock().unwrap();
            let i = live
                .iter()
                .position(|r| r.0 == ptr as usize)
                .expect("registered");
            live.remove(i);
        }
    }

    #[test]
    fn registered_buffers_are_page_aligned_and_unregistered_when_dropped() {
        let reg = Arc::new(Registry::default());
        let pool = BufferPool::with_registrar(1 << 20, reg.clone());
        let cancel = Cancel::default();
        let bufs = pool.acquire(&[100, 5000], &cancel).unwrap();
        assert!(bufs
            .iter()
            .all(|b| b.is_registered() && b.iter().all(|&x| x == 0)));
        assert_eq!((bufs[0].len(), bufs[1].len()), (100, 5000));
        assert_eq!(reg.live.lock().unwrap().len(), 2);
        assert_eq!(pool.registered_bytes(), 3 * PAGE as u64);
        for b in bufs {
            pool.release(b);
        }
        drop(pool);
        assert!(reg.live.lock().unwrap().is_empty(), "all unregistered");

        let refusing = Arc::new(Registry {
            refuse: true,
            ..Default::default()
        });
        let pool = BufferPool::with_registrar(1 << 20, refusing);
        let b = pool.acquire(&[100], &cancel).unwrap();
        assert!(!b[0].is_registered());
        assert_eq!(pool.register_failure().as_deref(), Some("refused"));
    }

    #[test]
    fn cancel_wakes_a_waiting_acquire() {
        let pool = BufferPool::new(10);
        let cancel = Cancel::default();
        let _held = pool.acquire(&[10], &cancel).unwrap();
        cancel.raise();
        assert!(matches!(pool.acquire(&[5], &cancel), Err(Error::Cancelled)));
    }
}
