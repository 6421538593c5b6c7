//! The stream: reader thread(s), compute workers and writer thread(s) joined by bounded
//! channels, with every data buffer drawn from one [`BufferPool`] sized by the memory budget.
//!
//! One planner thread walks the plan in order and takes pool buffers for each chunk. With one
//! I/O thread it also reads them; with more (`--io-threads`, see [`io_threads_auto`]) it hands
//! each chunk to a set of reader threads that `pread` concurrently, so several chunks of one
//! big tensor or of several tensors are read at once. As many writer threads `pwrite` and
//! `copy_file_range` finished pieces. Every piece has a fixed destination offset, so arrival
//! order never changes the output bytes, and every buffer still comes from the one pool.
//!
//! The reader `pread`s input ranges into pooled buffers rather than touching an mmap: the pool
//! then bounds resident memory exactly (mapped pages would count until `madvise`), and it drops
//! the pages it read from the page cache so neither grows with the checkpoint. Untouched tensors
//! never enter user memory: the writer moves them with `copy_file_range`. Written ranges are
//! pushed to disk and dropped from the cache behind a sliding window.
//!
//! Any stage that fails raises the shared [`Cancel`] flag and records the first error; every
//! blocking call waits in short slices and checks the flag, so no thread stays stuck on a full
//! channel or an empty pool.

mod cancel;
pub mod pool;
pub use cancel::Cancel;
pub use pool::PoolBuf;

use std::collections::VecDeque;
use std::fs::File;
use std::ops::Range;
use std::os::unix::fs::FileExt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crossbeam_channel::{bounded, Receiver, RecvTimeoutError, SendTimeoutError, Sender};

use crate::error::{Error, Result};
use crate::format::checkpoint::Checkpoint;
use crate::gpu::cuda::Ran;
use crate::plan::{Plan, Recipe};
use crate::sink::Layout;
use crate::sys;
pub use pool::BufferPool;

/// Copies are handed to the writer in pieces of this size, so progress and write-back advance
/// smoothly on huge tensors.
const COPY_PIECE_BYTES: u64 = 64 << 20;
/// Largest compute chunk; bigger chunks only add latency.
const MAX_CHUNK_BYTES: u64 = 64 << 20;
const MIN_CHUNK_BYTES: u64 = 1 << 20;
/// Written bytes allowed in flight to the disk before the writer waits for the oldest. Larger
/// windows let dirty pages pile up and the disk alternate between bursts of reads and writes
/// (measured: merge-lora 1.45× passthrough with a 1 GiB window, 1.25× with 64 MiB).
pub const WRITEBACK_WINDOW_MAX_BYTES: u64 = 64 << 20;
const POLL: Duration = Duration::from_millis(50);

pub struct PipelineConfig {
    pub threads: usize,
    pub memory_budget: u64,
    pub cancel: Cancel,
    pub progress: Option<crate::progress::Progress>,
    /// `false` forces user-space copies (for tests and filesystems that misbehave).
    pub kernel_copy: bool,
    /// Whether untouched ranges will probably be cloned; if not, the reader prefetches them.
    pub expect_reflink: bool,
    /// Ops with a CUDA kernel run there; the rest (and refused values) on the CPU.
    pub gpu: Option<Arc<crate::gpu::Gpu>>,
    /// Reader threads and writer threads (each); `None`: [`io_threads_auto`].
    pub io_threads: Option<usize>,
}

/// Most reader (and writer) threads the automatic choice picks.
pub const MAX_AUTO_IO_THREADS: usize = 4;

/// The automatic `--io-threads`: 1 when any of `paths` lies on a rotational disk (concurrent
/// reads there only add seeks), else one per four cores, from 1 to [`MAX_AUTO_IO_THREADS`].
/// On memory-speed storage (tmpfs, NVMe RAID) a single thread's `pread`/`pwrite` copy becomes
/// the limit, but each extra I/O thread is a busy core taken from the compute workers: on the
/// 2-core development VM two I/O threads measured no faster than one (bench/RESULTS.md), so
/// small machines keep one and a 16-core GPU host gets four.
pub fn io_threads_auto(paths: &[&std::path::Path]) -> usize {
    if paths.iter().any(|p| sys::is_rotational(p) == Some(true)) {
        return 1;
    }
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    (cores / 4).clamp(1, MAX_AUTO_IO_THREADS)
}

#[derive(Debug, Default, Clone, serde::Serialize)]
pub struct RunStats {
    /// Tensor bytes produced by ops and written with `pwrite`.
    pub bytes_computed: u64,
    /// Untouched bytes shared with the input (`FICLONERANGE`): no data written at all.
    pub bytes_reflinked: u64,
    /// Untouched bytes moved inside the kernel (`copy_file_range`).
    pub bytes_copied_in_kernel: u64,
    /// Untouched bytes copied through user memory (fallback).
    pub bytes_copied_user: u64,
    /// Why extents could not be shared, when a clone was refused.
    pub reflink_unavailable: Option<String>,
    pub chunks: u64,
    pub chunk_bytes: u64,
    pub pool_bytes: u64,
    pub pool_peak_bytes: u64,
    /// Pinned staging set aside for the GPU lanes (inside the memory budget).
    pub gpu_staging_bytes: u64,
    /// Reader threads and writer threads (each) the run used.
    pub io_threads: usize,
    /// Pool buffers registered with the GPU driver for direct DMA.
    pub host_registered_bytes: u64,
    /// Why pool buffers could not be registered (copies then go through the staging buffers).
    pub host_register_failed: Option<String>,
}

/// Budget split: the pool gets all but a reserve for the writer's fallback buffer, channel
/// slots and the process itself.
pub fn pool_bytes_for_budget(budget: u64) -> u64 {
    budget - (budget / 8).min(32 << 20)
}

pub fn chunk_bytes_for_pool(pool: u64) -> u64 {
    (pool / 8).clamp(MIN_CHUNK_BYTES.min(pool / 2).max(1), MAX_CHUNK_BYTES)
}

/// Where an op output goes: (shard, absolute offset), or nowhere when filtered away.
type Destination = Option<(usize, u64)>;

enum Work {
    Compute {
        tensor: usize,
        units: Range<u64>,
        inputs: Vec<PoolBuf>,
        /// Inputs still to be read by a reader thread: (source tensor, byte offset in it) of
        /// each input buffer; empty once read.
        unread: Vec<(usize, u64)>,
        /// Destination (shard, offset) and buffer of each op output.
        outs: Vec<(Destination, PoolBuf)>,
    },
    Copy(CopySpan),
    /// Untouched bytes read through user memory (a tensor that is not one range).
    Gathered {
        shard: usize,
        offset: u64,
        buf: PoolBuf,
    },
}

enum Done {
    Data {
        shard: usize,
        offset: u64,
        buf: PoolBuf,
        /// Copied untouched data rather than an op's output (for the byte counters).
        copied: bool,
    },
    Copy(CopySpan),
}

struct Shared<'a> {
    ckpt: &'a Checkpoint,
    plan: &'a Plan,
    layout: &'a Layout,
    outputs: &'a [File],
    output_names: &'a [std::path::PathBuf],
    pool: &'a BufferPool,
    gpu: Option<Arc<crate::gpu::Gpu>>,
    expect_reflink: bool,
    /// (shard, absolute offset) of every planned tensor.
    locations: Vec<(usize, u64)>,
    cancel: Cancel,
    first_error: Mutex<Option<Error>>,
    stats: Counters,
    /// Test hook `TFTF_TEST_READ_ERROR_AT=N`: the N-th input read of the stream fails with EIO.
    fail_read_at: Option<u64>,
    reads: AtomicU64,
}

#[derive(Default)]
struct Counters {
    reflinked: AtomicU64,
    reflink_refused: Mutex<Option<String>>,
    computed: AtomicU64,
    copied_kernel: AtomicU64,
    copied_user: AtomicU64,
    chunks: AtomicU64,
}

impl Shared<'_> {
    /// Reads bytes `at..` of input tensor `src` into `buf` (the stream's one way to read
    /// tensor data, so the test hook sees every read).
    fn read_input(&self, src: usize, at: u64, buf: &mut [u8]) -> Result<()> {
        self.read_input_cached(src, at, buf, false)
    }

    /// [`Shared::read_input`], leaving the pages cached when `keep_cached`: a survey's passes
    /// read a tensor again right after, and only its last read drops it.
    fn read_input_cached(
        &self,
        src: usize,
        at: u64,
        buf: &mut [u8],
        keep_cached: bool,
    ) -> Result<()> {
        let r = &self.ckpt.tensors[src];
        let n = self.reads.fetch_add(1, Ordering::Relaxed) + 1;
        if self.fail_read_at == Some(n) {
            return Err(Error::io(
                &self.ckpt.shards[r.shard()].path,
                std::io::Error::from_raw_os_error(libc::EIO),
            ));
        }
        self.ckpt.read_tensor_at_cached(r, at, buf, keep_cached)
    }

    fn fail(&self, e: Error) {
        let mut slot = self.first_error.lock().unwrap();
        if slot.is_none() && !matches!(e, Error::Cancelled) {
            *slot = Some(e);
        }
        self.cancel.raise();
    }
}

fn send<T>(tx: &Sender<T>, mut item: T, cancel: &Cancel) -> Result<()> {
    loop {
        match tx.send_timeout(item, POLL) {
            Ok(()) => return Ok(()),
            Err(SendTimeoutError::Timeout(back)) => {
                if cancel.is_raised() {
                    return Err(Error::Cancelled);
                }
                item = back;
            }
            Err(SendTimeoutError::Disconnected(_)) => return Err(Error::Cancelled),
        }
    }
}

fn recv<T>(rx: &Receiver<T>, cancel: &Cancel) -> Result<Option<T>> {
    loop {
        match rx.recv_timeout(POLL) {
            Ok(v) => return Ok(Some(v)),
            Err(RecvTimeoutError::Disconnected) => return Ok(None),
            Err(RecvTimeoutError::Timeout) => {
                if cancel.is_raised() {
                    return Err(Error::Cancelled);
                }
            }
        }
    }
}

/// Starts `count` threads of one stage between `rx` and `tx`. The handles passed in drop
/// here, once every thread holds its clones, so a channel closes when the last thread on its
/// sending side ends.
fn start_stage<'scope, I, O>(
    scope: &'scope std::thread::Scope<'scope, '_>,
    sh: &'scope Shared<'_>,
    name: &str,
    count: usize,
    rx: Receiver<I>,
    tx: Sender<O>,
    stage: fn(&Shared, Receiver<I>, Sender<O>) -> Result<()>,
) where
    I: Send + 'scope,
    O: Send + 'scope,
{
    for _ in 0..count {
        let (rx, tx) = (rx.clone(), tx.clone());
        start(scope, sh, name, move || stage(sh, rx, tx));
    }
}

/// Starts one stage in `scope`. A thread that cannot start (no memory for its stack, a process
/// limit) fails the run like any stage error: the closure is dropped with its channel ends, so
/// the stages already running see a disconnect or the cancel flag and stop.
fn start<'scope, F>(
    scope: &'scope std::thread::Scope<'scope, '_>,
    sh: &'scope Shared<'_>,
    name: &str,
    body: F,
) where
    F: FnOnce() -> Result<()> + Send + 'scope,
{
    let spawned = std::thread::Builder::new()
        .name(format!("tftf-{name}"))
        .spawn_scoped(scope, move || {
            if let Err(e) = body() {
                sh.fail(e);
            }
        });
    if let Err(e) = spawned {
        sh.fail(Error::Other(format!(
            "cannot start the {name} thread: {e}; lower --threads or free memory"
        )));
    }
}

/// What a run's memory budget buys, fixed before any data moves: the buffer pool, the compute
/// chunk size and the compute threads. A run makes them for its plan; a caller that runs several
/// plans' parts one after another (a stream handing tensors over one at a time) keeps one, so
/// its buffers are mapped once instead of once per part.
pub struct Resources {
    pool: BufferPool,
    pool_bytes: u64,
    chunk_bytes: u64,
    threads: usize,
    gpu_staging_bytes: u64,
}

impl Resources {
    /// The budget split for `plan` run with `cfg` (whose threads, budget and GPU count).
    pub fn new(plan: &Plan, cfg: &PipelineConfig) -> Resources {
        let mut pool_bytes = pool_bytes_for_budget(cfg.memory_budget);
        let mut chunk_bytes = chunk_bytes_for_pool(pool_bytes);
        // With a GPU, at least one worker per lane keeps both streams busy.
        let threads = match cfg.gpu {
            Some(_) => cfg.threads.max(crate::gpu::cuda::LANES),
            None => cfg.threads.max(1),
        };
        // Ops that work outside the pool's buffers use up to a chunk each per compute thread:
        // that comes out of the pool.
        let scratch = plan.tensors.iter().any(
            |t| matches!(&t.recipe, Recipe::Compute { op, .. } if op.scratch_unit_bytes() > 0),
        );
        if scratch {
            let reserve = (threads as u64 * chunk_bytes).min(pool_bytes / 2);
            pool_bytes -= reserve;
            chunk_bytes = chunk_bytes.min(reserve / threads as u64).max(1);
        }
        let mut gpu_staging_bytes = 0;
        if cfg.gpu.is_some() {
            // Each GPU lane stages a chunk's inputs and outputs in pinned memory; that comes out
            // of the same budget, and chunks shrink so the pool still holds several in flight.
            chunk_bytes = chunk_bytes_for_pool(pool_bytes / 2);
            gpu_staging_bytes = crate::gpu::cuda::LANES as u64 * 2 * chunk_bytes;
            pool_bytes -= gpu_staging_bytes;
        }
        let pool = match &cfg.gpu {
            // Unified-memory devices read the mapped staging directly; nothing to register.
            Some(gpu) if !gpu.integrated && crate::gpu::cuda::host_register_enabled() => {
                BufferPool::with_registrar(pool_bytes, gpu.clone())
            }
            _ => BufferPool::new(pool_bytes),
        };
        Resources {
            pool,
            pool_bytes,
            chunk_bytes,
            threads,
            gpu_staging_bytes,
        }
    }

    /// Chunks of at most `bytes` (and at least the smallest chunk): a run over one tensor at a
    /// time needs chunks smaller than the tensor for every compute thread to have work.
    pub fn with_chunks_at_most(mut self, bytes: u64) -> Resources {
        self.chunk_bytes = self.chunk_bytes.min(bytes.max(MIN_CHUNK_BYTES));
        self
    }
}

/// Streams every planned tensor into `outputs` (one open file per plan shard, already sized and
/// holding its header), with buffers from `resources` (made by [`Resources::new`] for this
/// plan and `cfg`). After a failed run its pool may still count buffers that were dropped in
/// flight: the resources are then not to be used again.
pub fn execute(
    resources: &Resources,
    ckpt: &Checkpoint,
    plan: &Plan,
    layout: &Layout,
    outputs: &[File],
    output_names: &[std::path::PathBuf],
    cfg: &PipelineConfig,
) -> Result<RunStats> {
    let Resources {
        pool,
        pool_bytes,
        chunk_bytes,
        threads,
        gpu_staging_bytes,
    } = resources;
    let (pool_bytes, chunk_bytes, threads, gpu_staging_bytes) =
        (*pool_bytes, *chunk_bytes, *threads, *gpu_staging_bytes);
    let io_threads = cfg.io_threads.unwrap_or_else(|| {
        let mut paths: Vec<&std::path::Path> =
            ckpt.shards.iter().map(|s| s.path.as_path()).collect();
        paths.extend(output_names.iter().map(|p| p.as_path()));
        io_threads_auto(&paths)
    });
    let io_threads = io_threads.max(1);
    let shared = Shared {
        ckpt,
        plan,
        layout,
        outputs,
        output_names,
        pool,
        gpu: cfg.gpu.clone(),
        expect_reflink: cfg.expect_reflink,
        locations: {
            let mut loc = vec![(0, 0); plan.tensors.len()];
            for (si, s) in layout.shards.iter().enumerate() {
                for (&t, &off) in s.tensors.iter().zip(&s.offsets) {
                    loc[t] = (si, off);
                }
            }
            loc
        },
        cancel: cfg.cancel.clone(),
        first_error: Mutex::new(None),
        stats: Counters::default(),
        fail_read_at: std::env::var("TFTF_TEST_READ_ERROR_AT")
            .ok()
            .and_then(|v| v.parse().ok()),
        reads: AtomicU64::new(0),
    };
    for s in &ckpt.shards {
        sys::advise_sequential(&s.file);
    }
    let (work_tx, work_rx) = bounded::<Work>(threads * 2);
    let (done_tx, done_rx) = bounded::<Done>((threads * 2).max(io_threads * 2));
    // The window is shared out among the writers so the bytes in flight to disk stay the same.
    let writeback_window =
        (cfg.memory_budget / 4).clamp(8 << 20, WRITEBACK_WINDOW_MAX_BYTES) / io_threads as u64;
    std::thread::scope(|scope| {
        let sh = &shared;
        if io_threads == 1 {
            start(scope, sh, "reader", move || {
                read_stage(sh, chunk_bytes, false, work_tx)
            });
        } else {
            let (read_tx, read_rx) = bounded::<Work>(io_threads * 2);
            start(scope, sh, "planner", move || {
                read_stage(sh, chunk_bytes, true, read_tx)
            });
            start_stage(scope, sh, "reader", io_threads, read_rx, work_tx, reader);
        }
        start_stage(
            scope,
            sh,
            "compute",
            threads,
            work_rx,
            done_tx,
            compute_stage,
        );
        for _ in 0..io_threads {
            let rx = done_rx.clone();
            let progress = cfg.progress.clone();
            let kernel_copy = cfg.kernel_copy;
            let scratch = (8 << 20) / io_threads;
            start(scope, sh, "writer", move || {
                write_stage(sh, rx, writeback_window, progress, kernel_copy, scratch)
            });
        }
        drop(done_rx);
    });
    if let Some(e) = shared.first_error.lock().unwrap().take() {
        return Err(e);
    }
    if shared.cancel.is_raised() {
        return Err(Error::Cancelled);
    }
    let c = &shared.stats;
    let reflink_unavailable = c.reflink_refused.lock().unwrap().clone();
    Ok(RunStats {
        bytes_computed: c.computed.load(Ordering::Relaxed),
        bytes_reflinked: c.reflinked.load(Ordering::Relaxed),
        reflink_unavailable,
        bytes_copied_in_kernel: c.copied_kernel.load(Ordering::Relaxed),
        bytes_copied_user: c.copied_user.load(Ordering::Relaxed),
        chunks: c.chunks.load(Ordering::Relaxed),
        chunk_bytes,
        pool_bytes,
        pool_peak_bytes: shared.pool.peak(),
        gpu_staging_bytes,
        io_threads,
        host_registered_bytes: shared.pool.registered_bytes(),
        host_register_failed: shared.pool.register_failure(),
    })
}

/// Asks the kernel to read the inputs of upcoming computed tensors while earlier ones are being
/// read and computed, so many small inputs (scale tensors scattered through a shard) do not
/// cost one disk round trip each. At most `window` bytes are requested ahead.
struct Prefetcher {
    /// (position in the shard's tensor list, input shard, file offset, bytes)
    items: Vec<(usize, usize, u64, u64)>,
    next: usize,
    window: u64,
}

impl Prefetcher {
    fn new(sh: &Shared, tensors: &[usize], window: u64) -> Prefetcher {
        let mut items = Vec::new();
        for (k, &ti) in tensors.iter().enumerate() {
            if let Recipe::Compute { inputs, .. } = &sh.plan.tensors[ti].recipe {
                for &i in inputs {
                    let r = &sh.ckpt.tensors[i];
                    if let Some((file, off)) = r.contiguous() {
                        items.push((k, file, off, r.info.nbytes().min(window)));
                    }
                }
            }
        }
        Prefetcher {
            items,
            next: 0,
            window,
        }
    }

    fn advance(&mut self, sh: &Shared, k: usize) {
        let first = self.items.partition_point(|it| it.0 < k);
        let mut ahead: u64 = self.items[first..self.next.max(first)]
            .iter()
            .map(|it| it.3)
            .sum();
        self.next = self.next.max(first);
        while self.next < self.items.len() && ahead < self.window {
            let (_, shard, off, len) = self.items[self.next];
            sys::prefetch(&sh.ckpt.shards[shard].file, off, len);
            ahead += len;
            self.next += 1;
        }
    }
}

/// A reader thread: reads the inputs of the chunks the planner left unread.
fn reader(sh: &Shared, rx: Receiver<Work>, tx: Sender<Work>) -> Result<()> {
    while let Some(mut work) = recv(&rx, &sh.cancel)? {
        if let Work::Compute { inputs, unread, .. } = &mut work {
            for (buf, (src, at)) in inputs.iter_mut().zip(unread.drain(..)) {
                sh.read_input(src, at, buf)?;
            }
        }
        send(&tx, work, &sh.cancel)?;
    }
    Ok(())
}

/// Walks the plan in order, taking pool buffers for each chunk. `defer_reads`: inputs stored
/// as byte ranges are left for the reader threads; others (strided views, chunk grids) are
/// gathered here, so their cache is dropped only after the last read.
fn read_stage(sh: &Shared, chunk_bytes: u64, defer_reads: bool, tx: Sender<Work>) -> Result<()> {
    let window = (sh.pool.capacity() / 4).clamp(8 << 20, 256 << 20);
    for (si, shard) in sh.layout.shards.iter().enumerate() {
        if let Some(src) = shard.clone_from {
            emit_copy(sh, si, (src, 0, 0, shard.len), &tx)?;
            continue;
        }
        let mut prefetch = Prefetcher::new(sh, &shard.tensors, window);
        // Consecutive copies that are contiguous in both files become one run.
        let mut run: Option<(usize, u64, u64, u64)> = None; // (src shard, src off, dst off, len)
        for (k, &ti) in shard.tensors.iter().enumerate() {
            prefetch.advance(sh, k);
            let t = &sh.plan.tensors[ti];
            let offset = shard.offsets[k];
            match &t.recipe {
                Recipe::Copy { src } => {
                    let r = &sh.ckpt.tensors[*src];
                    if let Some((file, src_off)) = r.contiguous() {
                        match &mut run {
                            Some((s, so, d, len))
                                if *s == file && *so + *len == src_off && *d + *len == offset =>
                            {
                                *len += t.nbytes;
                            }
                            _ => {
                                if let Some(prev) = run.take() {
                                    emit_copy(sh, si, prev, &tx)?;
                                }
                                run = Some((file, src_off, offset, t.nbytes));
                            }
                        }
                        continue;
                    }
                    if let Some(prev) = run.take() {
                        emit_copy(sh, si, prev, &tx)?;
                    }
                    match r.pieces() {
                        // Slices in several files, each one range (FSDP rank shards).
                        Some(pieces) => {
                            let mut at = offset;
                            for (file, off, len) in pieces {
                                emit_copy(sh, si, (file, off, at, len), &tx)?;
                                at += len;
                            }
                        }
                        // A strided view or a chunk grid: gathered in bounded chunks.
                        None => emit_gather(sh, si, *src, offset, chunk_bytes, &tx)?,
                    }
                }
                Recipe::Compute { op, inputs, extra } => {
                    if let Some(prev) = run.take() {
                        emit_copy(sh, si, prev, &tx)?;
                    }
                    let mut dests = vec![Some((si, offset))];
                    dests.extend(extra.iter().map(|e| e.map(|t| sh.locations[t])));
                    let chunking = Chunking {
                        bytes: chunk_bytes,
                        defer_reads,
                    };
                    emit_compute(sh, ti, &dests, op.as_ref(), inputs, chunking, &tx)?;
                }
                // Written by the items of the tensor whose op produces it.
                Recipe::Produced { .. } => {}
            }
        }
        if let Some(prev) = run.take() {
            emit_copy(sh, si, prev, &tx)?;
        }
    }
    Ok(())
}

fn emit_copy(
    sh: &Shared,
    shard: usize,
    run: (usize, u64, u64, u64),
    tx: &Sender<Work>,
) -> Result<()> {
    let (src_shard, src_off, dst_off, len) = run;
    let mut done = 0;
    while done < len {
        let piece = (len - done).min(COPY_PIECE_BYTES);
        // The writer copies in order; reading ahead here overlaps the next copy's reads with
        // the current one's writes (bounded by the channel). Clones read nothing.
        if !sh.expect_reflink {
            sys::prefetch(&sh.ckpt.shards[src_shard].file, src_off + done, piece);
        }
        send(
            tx,
            Work::Copy(CopySpan {
                src_shard,
                src_offset: src_off + done,
                shard,
                offset: dst_off + done,
                len: piece,
            }),
            &sh.cancel,
        )?;
        done += piece;
    }
    Ok(())
}

/// Reads a tensor that is not one byte range (a strided view, a chunk grid) through the
/// element gatherer, a pooled chunk at a time, for the writer to `pwrite` at `dst_off`.
fn emit_gather(
    sh: &Shared,
    shard: usize,
    src: usize,
    dst_off: u64,
    chunk_bytes: u64,
    tx: &Sender<Work>,
) -> Result<()> {
    let r = &sh.ckpt.tensors[src];
    let es = r.info.dtype.size().unwrap_or(1).max(1) as u64;
    let step = (chunk_bytes / es * es).max(es);
    let len = r.info.nbytes();
    let mut done = 0;
    while done < len {
        let n = (len - done).min(step);
        let mut buf = sh
            .pool
            .acquire(&[n as usize], &sh.cancel)?
            .pop()
            .expect("one buffer");
        sh.read_input(src, done, &mut buf)?;
        send(
            tx,
            Work::Gathered {
                shard,
                offset: dst_off + done,
                buf,
            },
            &sh.cancel,
        )?;
        done += n;
    }
    sh.ckpt.drop_gathered_cache(r);
    Ok(())
}

#[derive(Clone, Copy)]
struct Chunking {
    bytes: u64,
    /// Leave byte-range inputs for the reader threads.
    defer_reads: bool,
}

/// Splits a computed tensor into chunks of whole units and reads each chunk's inputs (or has
/// them read). `dests` holds where each of the op's outputs goes (`None`: computed but not
/// written).
fn emit_compute(
    sh: &Shared,
    tensor: usize,
    dests: &[Option<(usize, u64)>],
    op: &dyn crate::ops::Op,
    inputs: &[usize],
    chunking: Chunking,
    tx: &Sender<Work>,
) -> Result<()> {
    let chunk_bytes = chunking.bytes;
    let defer = chunking.defer_reads
        && inputs
            .iter()
            .all(|&i| sh.ckpt.tensors[i].pieces().is_some());
    let units = op.units();
    let out_units = op.all_unit_bytes();
    debug_assert_eq!(out_units.len(), dests.len());
    if out_units.iter().all(|&b| b == 0) {
        // Nothing to write, however many units: a tensor such as [2^40, 0] would otherwise be
        // walked chunk by chunk for hours.
        return Ok(());
    }
    let per_unit =
        out_units.iter().sum::<u64>().max(op.in_unit_bytes()).max(1) + op.scratch_unit_bytes();
    let g = op.granularity().max(1);
    let per_chunk = ((chunk_bytes / per_unit) / g * g).max(g);
    if per_chunk < units {
        survey(sh, tensor, op, inputs, per_chunk)?;
    }
    let mut u = 0;
    while u < units {
        let end = (u + per_chunk).min(units);
        let ranges = op.input_ranges(u..end);
        let mut lens: Vec<usize> = ranges.iter().map(|r| (r.end - r.start) as usize).collect();
        let spans: Vec<Range<u64>> = (0..out_units.len())
            .map(|k| op.out_span(k, u..end))
            .collect();
        lens.extend(spans.iter().map(|s| (s.end - s.start) as usize));
        let mut bufs = sh.pool.acquire(&lens, &sh.cancel)?;
        let out_bufs = bufs.split_off(ranges.len());
        let outs = out_bufs
            .into_iter()
            .zip(dests)
            .zip(&spans)
            .map(|((buf, dest), s)| (dest.map(|(shard, off)| (shard, off + s.start)), buf))
            .collect();
        let mut unread = Vec::new();
        for ((buf, range), &src) in bufs.iter_mut().zip(&ranges).zip(inputs) {
            if defer {
                unread.push((src, range.start));
            } else {
                sh.read_input(src, range.start, buf)?;
            }
        }
        send(
            tx,
            Work::Compute {
                tensor,
                units: u..end,
                inputs: bufs,
                unread,
                outs,
            },
            &sh.cancel,
        )?;
        u = end;
    }
    for &src in inputs {
        sh.ckpt.drop_gathered_cache(&sh.ckpt.tensors[src]);
    }
    Ok(())
}

/// Runs the op's survey passes over a tensor that spans several chunks: each pass reads the
/// inputs chunk by chunk, in order, into pooled buffers released before the next chunk.
fn survey(
    sh: &Shared,
    tensor: usize,
    op: &dyn crate::ops::Op,
    inputs: &[usize],
    per_chunk: u64,
) -> Result<()> {
    let units = op.units();
    for pass in 0..op.survey_passes() {
        let mut u = 0;
        while u < units {
            let end = (u + per_chunk).min(units);
            let ranges = op.input_ranges(u..end);
            let lens: Vec<usize> = ranges.iter().map(|r| (r.end - r.start) as usize).collect();
            let mut bufs = sh.pool.acquire(&lens, &sh.cancel)?;
            for ((buf, range), &src) in bufs.iter_mut().zip(&ranges).zip(inputs) {
                sh.read_input_cached(src, range.start, buf, true)?;
            }
            let views: Vec<&[u8]> = bufs.iter().map(|b| &b[..]).collect();
            let surveyed = op.survey(pass, u..end, &views);
            drop(views);
            for b in bufs {
                sh.pool.release(b);
            }
            surveyed.map_err(|msg| tensor_error(sh, tensor, msg))?;
            u = end;
        }
    }
    Ok(())
}

/// An op's complaint about tensor `tensor`'s data, naming its source file and tensor.
fn tensor_error(sh: &Shared, tensor: usize, msg: String) -> Error {
    let src = &sh.ckpt.tensors[sh.plan.tensors[tensor].source_index];
    Error::TensorData {
        path: sh.ckpt.shards[src.shard()].path.clone(),
        tensor: src.info.name.clone(),
        msg,
    }
}

fn compute_stage(sh: &Shared, rx: Receiver<Work>, tx: Sender<Done>) -> Result<()> {
    while let Some(work) = recv(&rx, &sh.cancel)? {
        let done = match work {
            Work::Compute {
                tensor,
                units,
                inputs,
                unread,
                mut outs,
            } => {
                debug_assert!(unread.is_empty(), "a reader thread read the inputs");
                let t = &sh.plan.tensors[tensor];
                let Recipe::Compute { op, .. } = &t.recipe else {
                    unreachable!("compute work for a copy recipe")
                };
                let views: Vec<&[u8]> = inputs.iter().map(|b| &b[..]).collect();
                let mut out_views: Vec<&mut [u8]> =
                    outs.iter_mut().map(|(_, b)| &mut b[..]).collect();
                // A GPU kernel that meets a value the op refuses leaves it to the CPU op,
                // which names it.
                let kernel = sh.gpu.as_ref().and_then(|g| Some((g, op.kernel(&units)?)));
                let on_gpu = match kernel {
                    Some((gpu, k)) => match gpu
                        .run(&k, units.clone(), &views, &mut out_views)
                        .map_err(Error::Device)?
                    {
                        Ran::Done(stats) => {
                            if let Some(stats) = stats {
                                op.absorb(stats);
                            }
                            true
                        }
                        Ran::Refused => false,
                    },
                    None => false,
                };
                if !on_gpu {
                    op.compute_all(units, &views, &mut out_views)
                } else {
                    Ok(())
                }
                .map_err(|msg| tensor_error(sh, tensor, msg))?;
                for b in inputs {
                    sh.pool.release(b);
                }
                sh.stats.chunks.fetch_add(1, Ordering::Relaxed);
                let mut main = None;
                for (dest, buf) in outs {
                    match (dest, main.is_none()) {
                        (Some((shard, offset)), true) => {
                            main = Some(Done::Data {
                                shard,
                                offset,
                                buf,
                                copied: false,
                            })
                        }
                        (Some((shard, offset)), false) => send(
                            &tx,
                            Done::Data {
                                shard,
                                offset,
                                buf,
                                copied: false,
                            },
                            &sh.cancel,
                        )?,
                        (None, _) => sh.pool.release(buf),
                    }
                }
                main.expect("the main output always has a destination")
            }
            Work::Copy(span) => Done::Copy(span),
            Work::Gathered { shard, offset, buf } => Done::Data {
                shard,
                offset,
                buf,
                copied: true,
            },
        };
        send(&tx, done, &sh.cancel)?;
    }
    Ok(())
}

/// Written ranges of output files pushed to disk as they come, then waited for and dropped
/// from the page cache at most `window` bytes behind, so an output never fills the cache with
/// dirty pages (the engine's writers, and the Python writers after a custom pipe).
pub struct Writeback {
    /// (file, offset, length) of each range not yet waited for, oldest first.
    pending: VecDeque<(usize, u64, u64)>,
    bytes: u64,
    window: u64,
}

impl Writeback {
    pub fn new(window: u64) -> Writeback {
        Writeback {
            pending: VecDeque::new(),
            bytes: 0,
            window,
        }
    }

    /// Bytes `off..off + len` of `files[i]` are written: starts their write-back and waits for
    /// the oldest ranges beyond the window (errors name `names[i]` of the file that failed).
    pub fn push(
        &mut self,
        files: &[File],
        names: &[std::path::PathBuf],
        i: usize,
        off: u64,
        len: u64,
    ) -> Result<()> {
        sys::start_writeback(&files[i], off, len);
        self.pending.push_back((i, off, len));
        self.bytes += len;
        while self.bytes > self.window {
            self.pop(files, names)?;
        }
        Ok(())
    }

    /// Waits until every range pushed is on disk.
    pub fn finish(&mut self, files: &[File], names: &[std::path::PathBuf]) -> Result<()> {
        while !self.pending.is_empty() {
            self.pop(files, names)?;
        }
        Ok(())
    }

    fn pop(&mut self, files: &[File], names: &[std::path::PathBuf]) -> Result<()> {
        if let Some((i, off, len)) = self.pending.pop_front() {
            self.bytes -= len;
            sys::finish_writeback(&files[i], off, len).map_err(|e| Error::io(&names[i], e))?;
        }
        Ok(())
    }
}

fn write_stage(
    sh: &Shared,
    rx: Receiver<Done>,
    window: u64,
    progress: Option<crate::progress::Progress>,
    kernel_copy: bool,
    scratch_bytes: usize,
) -> Result<()> {
    let mut wb = Writeback::new(window);
    let mut copy = CopyState {
        kernel_copy,
        reflink: kernel_copy,
        scratch: Vec::new(),
        scratch_bytes: scratch_bytes.max(64 << 10),
    };
    while let Some(done) = recv(&rx, &sh.cancel)? {
        let (shard, offset, len) = match done {
            Done::Data {
                shard,
                offset,
                buf,
                copied,
            } => {
                sh.outputs[shard]
                    .write_all_at(&buf, offset)
                    .map_err(|e| Error::io(&sh.output_names[shard], e))?;
                let len = buf.len() as u64;
                sh.pool.release(buf);
                let counter = if copied {
                    &sh.stats.copied_user
                } else {
                    &sh.stats.computed
                };
                counter.fetch_add(len, Ordering::Relaxed);
                (shard, offset, len)
            }
            Done::Copy(span) => {
                copy_range(sh, span, &mut copy)?;
                (span.shard, span.offset, span.len)
            }
        };
        wb.push(sh.outputs, sh.output_names, shard, offset, len)?;
        if let Some(p) = &progress {
            p.advance(shard, len);
        }
    }
    wb.finish(sh.outputs, sh.output_names)
}

/// How the writer moves untouched bytes; each method is dropped for the rest of the run at its
/// first "not supported here" error.
struct CopyState {
    kernel_copy: bool,
    reflink: bool,
    scratch: Vec<u8>,
    /// Size of the user-space copy buffer (the writers share one budget reserve).
    scratch_bytes: usize,
}

/// Untouched bytes to copy: `len` bytes at `src_offset` of input shard `src_shard` to
/// `offset` of output shard `shard`.
#[derive(Clone, Copy)]
struct CopySpan {
    src_shard: usize,
    src_offset: u64,
    shard: usize,
    offset: u64,
    len: u64,
}

impl CopySpan {
    /// The first `n` bytes of the span.
    fn head(self, n: u64) -> CopySpan {
        CopySpan { len: n, ..self }
    }

    /// The span without its first `n` bytes.
    fn after(self, n: u64) -> CopySpan {
        CopySpan {
            src_offset: self.src_offset + n,
            offset: self.offset + n,
            len: self.len - n,
            ..self
        }
    }
}

/// Copies an untouched range: the block-aligned middle is cloned when source and destination
/// offsets are congruent modulo the block size, everything else goes through
/// `copy_file_range`, or through a user-space buffer where that is unavailable.
fn copy_range(sh: &Shared, span: CopySpan, st: &mut CopyState) -> Result<()> {
    let CopySpan {
        src_shard,
        src_offset,
        shard,
        offset,
        len,
    } = span;
    let src = &sh.ckpt.shards[src_shard];
    let dst = &sh.outputs[shard];
    let block = sys::block_size(dst);
    let mut done = 0u64;
    if st.reflink && src_offset % block == offset % block {
        let head = (block - src_offset % block) % block;
        let middle = (len.saturating_sub(head)) / block * block;
        if middle > 0 {
            copy_plain(sh, span.head(head.min(len)), st)?;
            match sys::clone_range(&src.file, src_offset + head, dst, offset + head, middle) {
                Ok(()) => {
                    sh.stats.reflinked.fetch_add(middle, Ordering::Relaxed);
                    done = head + middle;
                }
                Err(e) if sys::is_unsupported(&e) => {
                    st.reflink = false;
                    *sh.stats.reflink_refused.lock().unwrap() = Some(format!(
                        "{} ({} on {})",
                        e,
                        sys::filesystem_name(&sh.output_names[shard]),
                        sh.output_names[shard]
                            .parent()
                            .map_or("?".into(), |p| p.display().to_string())
                    ));
                    done = head.min(len);
                }
                Err(e) => return Err(Error::io(&sh.output_names[shard], e)),
            }
        }
    }
    copy_plain(sh, span.after(done), st)?;
    sys::drop_cache(&src.file, src_offset, len);
    Ok(())
}

/// Copies `span` with `copy_file_range`, or through the user-space buffer where that is not
/// supported.
fn copy_plain(sh: &Shared, mut span: CopySpan, st: &mut CopyState) -> Result<()> {
    let src = &sh.ckpt.shards[span.src_shard];
    let dst = &sh.outputs[span.shard];
    let dst_name = &sh.output_names[span.shard];
    while span.len > 0 && st.kernel_copy {
        match sys::copy_file_range(&src.file, span.src_offset, dst, span.offset, span.len) {
            Ok(0) => {
                return Err(Error::io(
                    &src.path,
                    std::io::Error::new(
                        std::io::ErrorKind::UnexpectedEof,
                        "file shrank while being read",
                    ),
                ))
            }
            Ok(n) => {
                span = span.after(n);
                sh.stats.copied_kernel.fetch_add(n, Ordering::Relaxed);
            }
            Err(e) if sys::is_unsupported(&e) => st.kernel_copy = false,
            Err(e) => return Err(Error::io(dst_name, e)),
        }
    }
    if span.len > 0 {
        let piece = span.len.min(st.scratch_bytes as u64) as usize;
        st.scratch.resize(piece, 0);
        while span.len > 0 {
            let n = (span.len as usize).min(piece);
            src.file
                .read_exact_at(&mut st.scratch[..n], span.src_offset)
                .map_err(|e| Error::io(&src.path, e))?;
            dst.write_all_at(&st.scratch[..n], span.offset)
                .map_err(|e| Error::io(dst_name, e))?;
            span = span.after(n as u64);
            sh.stats.copied_user.fetch_add(n as u64, Ordering::Relaxed);
        }
    }
    Ok(())
}
