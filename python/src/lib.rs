//! `tftf._core`: the Rust core as the Python package sees it.
//!
//! Five doors into the main crate, and nothing else: the command line ([`cli_main`], for the
//! `tftf` console command), a whole conversion ([`run_pipeline`], the library API's
//! `Pipeline::run` with the GIL released), a checkpoint reader ([`Checkpoint`], for upstream's
//! readers' `iter_records`), a stream of computed tensors ([`stream_records`], the library
//! API's `Pipeline::records`, for the built-in pipes at the head of a chain that goes on through
//! Python pipes), and single-tensor ops ([`cast`], [`dequant_fp8`]) for a pipe's `process` on
//! in-memory records. The Python modules in `python/tftf/` build upstream's API
//! on these.

mod ops;

use std::ffi::OsString;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use pyo3::create_exception;
use pyo3::exceptions::{PyFileExistsError, PyFileNotFoundError, PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyByteArray;
use tftf::api::{DeviceRequest, GgufFileType, Pipe, Pipeline, Reader, Writer};
use tftf::commands::run_sections;
use tftf::{Cancel, Error};

create_exception!(
    _core,
    TftfError,
    PyRuntimeError,
    "A conversion failed: unreadable input, a pipe that cannot apply, no space, … The message names the file and tensor."
);

/// How often a waiting run looks for Ctrl-C (Python's signal handlers run on the main thread
/// only when it holds the GIL).
const SIGNAL_POLL: Duration = Duration::from_millis(100);

/// Turns a core error into the Python exception a Python user expects for it.
pub(crate) fn to_py(e: Error) -> PyErr {
    let msg = e.to_string();
    match &e {
        Error::Usage(_) => PyValueError::new_err(msg),
        Error::Io { source, .. } if source.kind() == std::io::ErrorKind::NotFound => {
            PyFileNotFoundError::new_err(msg)
        }
        Error::OutputNotEmpty { .. } => PyFileExistsError::new_err(msg),
        _ => TftfError::new_err(msg),
    }
}

/// Runs the `tftf` command line on `argv` (`argv[0]` is the program name) and returns its exit
/// code. For a process's entry point: it takes SIGINT and SIGTERM over as the binary does.
#[pyfunction]
fn cli_main(py: Python<'_>, argv: Vec<OsString>) -> i32 {
    py.allow_threads(|| tftf::entry::run(argv))
}

/// Runs the `tftf` command line on `argv` in-process, keeping Python's signal handling: Ctrl-C
/// stops the run (its temporaries removed) and raises `KeyboardInterrupt`. Returns the exit code.
#[pyfunction]
fn cli_run(py: Python<'_>, argv: Vec<OsString>) -> PyResult<i32> {
    let cancel = Cancel::default();
    let raised = Mutex::new(None);
    let code = run_watching_signals(py, &cancel, &raised, || {
        tftf::entry::run_with(argv, &cancel)
    });
    match raised.into_inner().unwrap_or_else(|p| p.into_inner()) {
        Some(err) => Err(err),
        None => Ok(code),
    }
}

/// Where a pipeline writes: the writer kind (`sharded`, `file`, `null`, `gguf`) and its options.
#[derive(FromPyObject)]
struct WriterSpec {
    #[pyo3(item)]
    kind: String,
    #[pyo3(item)]
    path: Option<PathBuf>,
    #[pyo3(item)]
    max_shard_size: Option<u64>,
    #[pyo3(item)]
    outtype: Option<String>,
    #[pyo3(item)]
    force: bool,
    #[pyo3(item)]
    arch: Option<String>,
    #[pyo3(item)]
    vocab_pre: Option<String>,
}

impl WriterSpec {
    fn writer(&self) -> PyResult<Writer> {
        let path = || {
            self.path.clone().ok_or_else(|| {
                PyValueError::new_err(format!("a {} writer needs a path", self.kind))
            })
        };
        let mut writer = match self.kind.as_str() {
            "sharded" => Writer::sharded(path()?),
            "file" => Writer::file(path()?),
            "null" => Writer::null(),
            "gguf" => Writer::gguf(path()?),
            other => {
                return Err(PyValueError::new_err(format!(
                    "unknown writer kind `{other}`"
                )))
            }
        };
        if let Some(bytes) = self.max_shard_size {
            writer = writer.max_shard_size(bytes);
        }
        match self.outtype.as_deref() {
            None | Some("auto") => {}
            Some(t) => {
                let file_type = GgufFileType::parse(t).ok_or_else(|| {
                    PyValueError::new_err(format!(
                        "unknown GGUF outtype `{t}` (auto, f32, f16, bf16, q8_0, or a llama-quantize type: q4_k_m, q6_k, iq4_xs …)"
                    ))
                })?;
                writer = writer.outtype(file_type);
            }
        }
        if let Some(arch) = &self.arch {
            writer = writer.arch(arch);
        }
        if let Some(pre) = &self.vocab_pre {
            writer = writer.vocab_pre(pre);
        }
        Ok(writer.force(self.force))
    }
}

/// Runs one conversion: `input` through the `tftf run` sections in `sections` (the tokens after
/// `tftf run`, e.g. `["--dequant-fp8", "--dtype=bf16"]`) into `writer`. Returns the report as
/// JSON text. The GIL is released while it runs; Ctrl-C stops it (its output left as it was)
/// and raises `KeyboardInterrupt`; an exception in `progress` stops it and is raised.
#[pyfunction]
#[pyo3(signature = (input, sections, writer, threads=None, memory_budget=None, device="auto", progress=None))]
#[allow(clippy::too_many_arguments)]
fn run_pipeline(
    py: Python<'_>,
    input: PathBuf,
    sections: Vec<OsString>,
    writer: WriterSpec,
    threads: Option<usize>,
    memory_budget: Option<u64>,
    device: &str,
    progress: Option<PyObject>,
) -> PyResult<String> {
    let mut argv = vec![OsString::from("tftf"), OsString::from("run")];
    argv.extend(sections);
    let (_, sections) = run_sections::split(argv);
    let cancel = Cancel::default();
    let mut pipeline = Pipeline::new(
        Reader::from_path(input),
        Pipe::from(sections),
        writer.writer()?,
    )
    .device(DeviceRequest::parse(device).map_err(to_py)?)
    .cancel(cancel.clone());
    if let Some(n) = threads {
        pipeline = pipeline.threads(n);
    }
    if let Some(bytes) = memory_budget {
        pipeline = pipeline.memory_budget(bytes);
    }
    let raised: Arc<Mutex<Option<PyErr>>> = Arc::default();
    if let Some(callback) = progress {
        let (raised, cancel) = (raised.clone(), cancel.clone());
        pipeline = pipeline.on_progress(move |e| {
            Python::with_gil(|py| {
                if let Err(err) =
                    callback.call1(py, (e.bytes_done, e.bytes_total, e.file.to_string()))
                {
                    lock(&raised).get_or_insert(err);
                    cancel.raise();
                }
            })
        });
    }
    let result = run_watching_signals(py, &cancel, &raised, || pipeline.run());
    if let Some(err) = lock(&raised).take() {
        return Err(err);
    }
    let report = result.map_err(to_py)?;
    Ok(report.json().to_string())
}

/// Runs `work` on a thread of its own without the GIL, while this thread takes the GIL every
/// [`SIGNAL_POLL`] to let Python see Ctrl-C; a signal's exception is kept in `raised` and
/// stops the work through `cancel`. Returns what `work` returned.
fn run_watching_signals<T: Send>(
    py: Python<'_>,
    cancel: &Cancel,
    raised: &Mutex<Option<PyErr>>,
    work: impl FnOnce() -> T + Send,
) -> T {
    let (done_tx, done_rx) = std::sync::mpsc::channel();
    // A receiver is not `Sync`; the lock lets the GIL-free closure borrow it.
    let done_rx = Mutex::new(done_rx);
    std::thread::scope(|scope| {
        scope.spawn(move || {
            let _ = done_tx.send(work());
        });
        loop {
            match py.allow_threads(|| lock(&done_rx).recv_timeout(SIGNAL_POLL)) {
                Ok(result) => return result,
                Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
                    if let Err(err) = py.check_signals() {
                        lock(raised).get_or_insert(err);
                        cancel.raise();
                    }
                }
                // The worker panicked; pyo3 turns the panic into a Python exception.
                Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
                    panic!("the run's thread panicked")
                }
            }
        }
    })
}

/// Locks `m`, also after a panic elsewhere poisoned it (the value is still whole).
fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// A checkpoint opened by the Rust reader (safetensors file or shards, PyTorch `.bin`, DCP):
/// names, dtypes and shapes from the headers, and each tensor's bytes on request.
#[pyclass(module = "tftf._core", frozen)]
struct Checkpoint {
    inner: tftf::Checkpoint,
}

#[pymethods]
impl Checkpoint {
    #[new]
    fn open(py: Python<'_>, path: PathBuf) -> PyResult<Checkpoint> {
        let inner = py
            .allow_threads(|| tftf::Checkpoint::open(&path))
            .map_err(to_py)?;
        Ok(Checkpoint { inner })
    }

    /// `(name, dtype, shape)` of every tensor, in file order; dtypes in safetensors spelling.
    fn tensors(&self) -> Vec<(String, &'static str, Vec<u64>)> {
        let infos = self.inner.tensors.iter().map(|t| &t.info);
        infos
            .map(|i| (i.name.clone(), i.dtype.name(), i.shape.clone()))
            .collect()
    }

    /// The `__metadata__` of the (first) safetensors header, as JSON text, if any.
    fn metadata_json(&self) -> Option<String> {
        self.inner
            .metadata()
            .map(|m| serde_json::Value::Object(m.clone()).to_string())
    }

    /// The files the tensors come from.
    fn files(&self) -> Vec<PathBuf> {
        self.inner.shards.iter().map(|s| s.path.clone()).collect()
    }

    /// Tensor `name`'s bytes, read into a new `bytearray` with the GIL released.
    fn read<'py>(&self, py: Python<'py>, name: &str) -> PyResult<Bound<'py, PyByteArray>> {
        let t = self
            .inner
            .get(name)
            .ok_or_else(|| pyo3::exceptions::PyKeyError::new_err(name.to_string()))?;
        let mut failed = None;
        let out = PyByteArray::new_with(py, t.info.nbytes() as usize, |buf| {
            // No other Python code can see the new bytearray yet: the read runs without the GIL.
            failed = py
                .allow_threads(|| self.inner.read_tensor_at(t, 0, buf))
                .err();
            Ok(())
        })?;
        match failed {
            Some(e) => Err(to_py(e)),
            None => Ok(out),
        }
    }
}

/// `(name, dtype, shape, fd, nbytes, lent)` of one streamed tensor.
type StreamItem = (String, &'static str, Vec<u64>, i32, u64, Lent);

/// A streamed tensor's in-memory file, lent to Python while its mapping lives: `give_back`
/// (called when the mapping is gone) returns it to the stream, whose next tensors then reuse
/// its pages instead of the kernel zeroing fresh ones. Never given back, it is just closed.
#[pyclass(module = "tftf._core")]
struct Lent {
    file: Option<std::fs::File>,
    recycler: tftf::api::Recycler,
}

#[pymethods]
impl Lent {
    /// Returns the file to the stream. Only once nothing maps it any more: a later tensor's
    /// bytes overwrite it.
    fn give_back(&mut self) {
        if let Some(file) = self.file.take() {
            self.recycler.give_back(file);
        }
    }
}

/// Write-behind for a file Python writes sequentially (the writers after a Python pipe): the
/// bytes written so far are pushed to disk as they come and dropped from the page cache once
/// on disk, at most a window behind, as the engine's own writers do. Without it a big output
/// fills the cache with dirty pages, and every tensor written costs fresh cache pages (on the
/// development VM that was 3× the whole run's time: bench/RESULTS.md, issue 26).
#[pyclass(module = "tftf._core")]
struct WriteBehind {
    file: std::fs::File,
    /// The file's name, for errors.
    path: PathBuf,
    /// Where the bytes already handed to write-back end.
    end: u64,
    writeback: tftf::pipeline::Writeback,
}

#[pymethods]
impl WriteBehind {
    /// Follows the file open as `fd` (its own duplicate of it: closing `fd` first is safe)
    /// from byte `start`; `path` names it in errors.
    #[new]
    fn new(fd: i32, path: PathBuf, start: u64) -> PyResult<WriteBehind> {
        use std::os::fd::BorrowedFd;
        if fd < 0 {
            return Err(PyValueError::new_err(format!(
                "{}: not an open file (descriptor {fd})",
                path.display()
            )));
        }
        // SAFETY: `fd` is not -1 and is open for the duration of this call (the caller's file
        // object holds it); it is only duplicated here (a closed one fails the dup).
        let owned = unsafe { BorrowedFd::borrow_raw(fd) }
            .try_clone_to_owned()
            .map_err(|e| to_py(Error::io(&path, e)))?;
        Ok(WriteBehind {
            file: owned.into(),
            path,
            end: start,
            writeback: tftf::pipeline::Writeback::new(tftf::pipeline::WRITEBACK_WINDOW_MAX_BYTES),
        })
    }

    /// The file's bytes up to `end` have been written (and flushed to the kernel): starts their
    /// write-back, and waits for the oldest ranges beyond the window to reach the disk.
    fn advance(&mut self, py: Python<'_>, end: u64) -> PyResult<()> {
        if end <= self.end {
            return Ok(());
        }
        let (off, len) = (self.end, end - self.end);
        self.end = end;
        self.with_writeback(py, |wb, files, names| wb.push(files, names, 0, off, len))
    }

    /// Waits until every byte handed over is on disk (errors of the write-back surface here).
    fn finish(&mut self, py: Python<'_>) -> PyResult<()> {
        self.with_writeback(py, |wb, files, names| wb.finish(files, names))
    }
}

impl WriteBehind {
    /// Runs `f` on the engine's write-back with this one file (and its name), the GIL released.
    fn with_writeback(
        &mut self,
        py: Python<'_>,
        f: impl FnOnce(&mut tftf::pipeline::Writeback, &[std::fs::File], &[PathBuf]) -> tftf::Result<()>
            + Send,
    ) -> PyResult<()> {
        let WriteBehind {
            file,
            path,
            writeback,
            ..
        } = self;
        let (files, names) = (std::slice::from_ref(&*file), std::slice::from_ref(&*path));
        py.allow_threads(|| f(writeback, files, names))
            .map_err(to_py)
    }
}

/// The tensors of a reader and built-in pipes as the Rust engine computes them (the library
/// API's `Pipeline::records`), one at a time, for a pipeline that goes on through Python pipes.
/// Each item is `(name, dtype, shape, fd, nbytes, lent)`: the tensor's bytes lie in the
/// anonymous in-memory file `fd`, which the caller now owns (maps, then closes); `lent` holds
/// the stream's own handle of that file, to give back once the caller's mapping is gone.
#[pyclass(module = "tftf._core")]
struct RecordStream {
    records: Option<tftf::api::Records>,
}

#[pymethods]
impl RecordStream {
    /// `(name, dtype, shape)` of every tensor the stream yields, in order.
    fn tensors(&self) -> Vec<(String, &'static str, Vec<u64>)> {
        self.records.as_ref().map_or_else(Vec::new, |r| {
            r.tensors()
                .iter()
                .map(|(n, d, s)| (n.clone(), d.name(), s.clone()))
                .collect()
        })
    }

    fn __iter__(slf: PyRef<'_, Self>) -> PyRef<'_, Self> {
        slf
    }

    fn __next__(&mut self, py: Python<'_>) -> PyResult<Option<StreamItem>> {
        py.check_signals()?;
        let Some(records) = self.records.as_mut() else {
            return Ok(None);
        };
        match py.allow_threads(|| records.next()) {
            None => {
                self.records = None;
                Ok(None)
            }
            Some(Err(e)) => {
                self.records = None;
                Err(to_py(e))
            }
            Some(Ok(t)) => {
                use std::os::fd::IntoRawFd;
                let dtype = t.dtype.name();
                let fd = t.file.try_clone().map_err(|e| {
                    to_py(Error::Other(format!(
                        "cannot hand tensor `{}` over: {e}",
                        t.name
                    )))
                })?;
                let lent = Lent {
                    file: Some(t.file),
                    recycler: t.recycler,
                };
                Ok(Some((
                    t.name,
                    dtype,
                    t.shape,
                    fd.into_raw_fd(),
                    t.nbytes,
                    lent,
                )))
            }
        }
    }

    /// Stops the stream (also what dropping it does).
    fn close(&mut self, py: Python<'_>) {
        if let Some(records) = self.records.take() {
            py.allow_threads(|| drop(records));
        }
    }
}

/// Plans `input` through the `tftf run` sections in `sections` and returns the
/// [`RecordStream`] of its tensors; planning errors (an adapter that does not fit, an unknown
/// dtype, …) are raised here, before any data moves.
#[pyfunction]
#[pyo3(signature = (input, sections, threads=None, memory_budget=None, device="auto"))]
fn stream_records(
    py: Python<'_>,
    input: PathBuf,
    sections: Vec<OsString>,
    threads: Option<usize>,
    memory_budget: Option<u64>,
    device: &str,
) -> PyResult<RecordStream> {
    let mut argv = vec![OsString::from("tftf"), OsString::from("run")];
    argv.extend(sections);
    let (_, sections) = run_sections::split(argv);
    let mut pipeline = Pipeline::new(
        Reader::from_path(input),
        Pipe::from(sections),
        Writer::null(),
    )
    .device(DeviceRequest::parse(device).map_err(to_py)?);
    if let Some(n) = threads {
        pipeline = pipeline.threads(n);
    }
    if let Some(bytes) = memory_budget {
        pipeline = pipeline.memory_budget(bytes);
    }
    let records = py.allow_threads(|| pipeline.records()).map_err(to_py)?;
    Ok(RecordStream {
        records: Some(records),
    })
}

/// The model a mergekit `config` takes `config.json` and the side files from (its base model,
/// else its first): the input path of a run whose first section is `--merge config`.
#[pyfunction]
fn merge_donor(config: PathBuf) -> PyResult<PathBuf> {
    let config = tftf::ops::merge::MergeConfig::read(&config).map_err(to_py)?;
    Ok(config.donor().to_path_buf())
}

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("TftfError", m.py().get_type::<TftfError>())?;
    m.add_function(wrap_pyfunction!(cli_main, m)?)?;
    m.add_function(wrap_pyfunction!(cli_run, m)?)?;
    m.add_function(wrap_pyfunction!(run_pipeline, m)?)?;
    m.add_function(wrap_pyfunction!(ops::cast, m)?)?;
    m.add_function(wrap_pyfunction!(ops::dequant_fp8, m)?)?;
    m.add_class::<Checkpoint>()?;
    m.add_class::<RecordStream>()?;
    m.add_function(wrap_pyfunction!(stream_records, m)?)?;
    m.add_class::<Lent>()?;
    m.add_class::<WriteBehind>()?;
    m.add_function(wrap_pyfunction!(merge_donor, m)?)?;
    Ok(())
}
