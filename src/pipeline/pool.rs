//! The buffer pool is the memory budget: every byte of tensor data in flight lives in a buffer
//! from here, and the pool never holds more than its capacity (allocated and free together),
//! except that one item larger than the whole pool may pass alone so that no input is too big
//! to convert.

use std::sync::{Condvar, Mutex};
use std::time::Duration;

use super::Cancel;
use crate::error::{Error, Result};

pub struct BufferPool {
    capacity: u64,
    state: Mutex<State>,
    freed: Condvar,
}

struct State {
    in_use: u64,
    free: Vec<Vec<u8>>,
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
        }
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
    pub fn acquire(&self, lens: &[usize], cancel: &Cancel) -> Result<Vec<Vec<u8>>> {
        let total: u64 = lens.iter().map(|&l| l as u64).sum();
        let mut st = self.state.lock().unwrap();
        while st.in_use != 0 && st.in_use + total > self.capacity {
            if cancel.is_raised() {
                return Err(Error::Cancelled);
            }
            st = self
                .freed
                .wait_timeout(st, Duration::from_millis(50))
                .unwrap()
                .0;
        }
        st.in_use += total;
        st.peak = st.peak.max(st.in_use);
        let mut out = Vec::with_capacity(lens.len());
        for &len in lens {
            let buf = match st.free.iter().position(|b| b.capacity() >= len) {
                Some(i) => st.free.swap_remove(i),
                None => {
                    // Drop cached buffers until a fresh allocation keeps the total in budget.
                    let mut cached: u64 = st.free.iter().map(|b| b.capacity() as u64).sum();
                    while cached + st.in_use > self.capacity && !st.free.is_empty() {
                        let b = st.free.pop().expect("non-empty");
                        cached -= b.capacity() as u64;
                    }
                    Vec::with_capacity(len)
                }
            };
            let mut buf = buf;
            // A reused buffer keeps its old length, so only growth is zero-filled; every byte
            // stays initialised without an unsafe `set_len`.
            buf.resize(len, 0);
            out.push(buf);
        }
        Ok(out)
    }

    pub fn release(&self, buf: Vec<u8>) {
        let mut st = self.state.lock().unwrap();
        st.in_use -= buf.len() as u64;
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

    #[test]
    fn cancel_wakes_a_waiting_acquire() {
        let pool = BufferPool::new(10);
        let cancel = Cancel::default();
        let _held = pool.acquire(&[10], &cancel).unwrap();
        cancel.raise();
        assert!(matches!(pool.acquire(&[5], &cancel), Err(Error::Cancelled)));
    }
}
