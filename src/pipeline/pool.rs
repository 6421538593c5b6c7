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
    /// Capacity of the buffers handed out.
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
    /// Memory is counted by capacity: a cached buffer is reused only when it is at most 25 %
    /// larger than asked, so small requests never pin big buffers.
    pub fn acquire(&self, lens: &[usize], cancel: &Cancel) -> Result<Vec<Vec<u8>>> {
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
                .map(|(&len, t)| t.map_or(len, |i| st.free[i].capacity()) as u64)
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
                let mut out: Vec<Option<Vec<u8>>> = vec![None; lens.len()];
                for (i, k) in picks {
                    out[k] = Some(st.free.swap_remove(i));
                }
                return Ok(out
                    .into_iter()
                    .zip(lens)
                    .map(|(b, &len)| {
                        let mut buf = b.unwrap_or_else(|| Vec::with_capacity(len));
                        // A reused buffer keeps its old length, so only growth is zero-filled;
                        // every byte stays initialised without an unsafe `set_len`.
                        buf.resize(len, 0);
                        buf
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

    pub fn release(&self, buf: Vec<u8>) {
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

    #[test]
    fn cancel_wakes_a_waiting_acquire() {
        let pool = BufferPool::new(10);
        let cancel = Cancel::default();
        let _held = pool.acquire(&[10], &cancel).unwrap();
        cancel.raise();
        assert!(matches!(pool.acquire(&[5], &cancel), Err(Error::Cancelled)));
    }
}
