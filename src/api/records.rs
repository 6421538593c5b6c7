//! [`Pipeline::records`](super::Pipeline::records): a pipeline's tensors handed out in memory.

use crossbeam_channel::{bounded, Receiver};

use crate::error::{Error, Result};
use crate::format::dtype::DType;
use crate::job::PlannedStream;
pub use crate::job::{Recycler, StreamedTensor};
use crate::pipeline::Cancel;

/// The output tensors of a reader and a pipe, in order, each computed by the engine (all
/// cores, the memory budget, the GPU where an op has a kernel) while the previous one is
/// being consumed. An iterator of [`StreamedTensor`]s; it ends after the last tensor or the
/// first error.
pub struct Records {
    tensors: Vec<(String, DType, Vec<u64>)>,
    rx: Option<Receiver<Result<StreamedTensor>>>,
    worker: Option<std::thread::JoinHandle<()>>,
    cancel: Cancel,
}

impl Records {
    pub(super) fn start(planned: PlannedStream, threads: usize, cancel: Cancel) -> Records {
        let tensors = planned.tensors();
        // One tensor handed over and one waiting: the next is computed while the consumer
        // works on the current one.
        let (tx, rx) = bounded::<Result<StreamedTensor>>(1);
        let flag = cancel.clone();
        let worker = std::thread::Builder::new()
            .name("tftf-records".into())
            .spawn(move || {
                let result = planned.run(threads, &flag, |t| {
                    tx.send(Ok(t)).map_err(|_| Error::Cancelled)
                });
                if let Err(e) = result {
                    let _ = tx.send(Err(e));
                }
            });
        match worker {
            Ok(handle) => Records {
                tensors,
                rx: Some(rx),
                worker: Some(handle),
                cancel,
            },
            Err(e) => {
                let (tx, rx) = bounded(1);
                let _ = tx.send(Err(Error::Other(format!(
                    "cannot start the stream's thread: {e}"
                ))));
                Records {
                    tensors,
                    rx: Some(rx),
                    worker: None,
                    cancel,
                }
            }
        }
    }

    /// Name, dtype and shape of every tensor the iterator yields, in order (known from the
    /// headers before any data moves).
    pub fn tensors(&self) -> &[(String, DType, Vec<u64>)] {
        &self.tensors
    }
}

impl Iterator for Records {
    type Item = Result<StreamedTensor>;

    fn next(&mut self) -> Option<Self::Item> {
        let item = self.rx.as_ref()?.recv().ok();
        if matches!(item, None | Some(Err(_))) {
            self.rx = None;
        }
        item
    }
}

impl Drop for Records {
    fn drop(&mut self) {
        self.cancel.raise();
        // Closing the channel unblocks a worker waiting to hand over a tensor.
        self.rx = None;
        if let Some(worker) = self.worker.take() {
            let _ = worker.join();
        }
    }
}
