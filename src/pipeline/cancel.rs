//! The flag that stops a run: Ctrl-C raises it, and so does any pipeline stage that fails.
//! Every blocking wait, the buffer pool's included, checks it; it lives in its own file so the
//! pool can name it without naming the pipeline that uses the pool.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

#[derive(Clone, Default)]
pub struct Cancel(Arc<AtomicBool>);

impl Cancel {
    pub fn raise(&self) {
        self.0.store(true, Ordering::SeqCst);
    }
    pub fn is_raised(&self) -> bool {
        self.0.load(Ordering::Relaxed)
    }
}
