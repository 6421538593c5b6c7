//! `tftf selftest`: the kernel table (see `commands::selftest::table`).

mod decoders;
pub mod encoders;
mod inputs;
mod merges;
pub mod table;

use crate::cli::SelftestArgs;
use crate::error::Result;
use crate::gpu::{Device, DeviceRequest};
use crate::size::human;

pub fn run(a: &SelftestArgs) -> Result<i32> {
    let device = Device::open(&DeviceRequest::parse(&a.device)?)?;
    let mode = match (&device.gpu, &device.note) {
        (Some(_), _) => format!("{} against the CPU ops", device.name),
        (None, Some(why)) => format!("no GPU ({why}); CPU ops in one chunk against two chunks"),
        (None, None) => "CPU ops in one chunk against two chunks".into(),
    };
    if !a.quiet {
        outln!("selftest: {mode}");
    }
    if let Some(gpu) = &device.gpu {
        if let Ok((h2d, d2h)) = gpu.copy_bandwidth(256 << 20) {
            if !a.quiet {
                outln!(
                    "copy bandwidth (pinned, 256 MiB): host→device {}/s, device→host {}/s",
                    human(h2d as u64),
                    human(d2h as u64)
                );
            }
        }
    }
    let rows = table::run(&device);
    if !a.quiet {
        outln!(
            "{:<22} {:<38} {:>10} {:>5} {:>10}  result",
            "kernel",
            "case",
            "input",
            "ulps",
            "time"
        );
    }
    let failed = rows.iter().filter(|r| !r.ok).count();
    for r in &rows {
        if a.quiet && r.ok {
            continue;
        }
        outln!(
            "{:<22} {:<38} {:>10} {:>5} {:>8.2}ms  {}{}",
            r.kernel,
            r.what,
            human(r.bytes),
            r.max_ulps,
            r.seconds * 1e3,
            if r.ok { "ok" } else { "MISMATCH" },
            if r.detail.is_empty() {
                String::new()
            } else {
                format!(" ({})", r.detail)
            }
        );
    }
    outln!(
        "selftest: {} cases, {} failed ({})",
        rows.len(),
        failed,
        device.name
    );
    Ok(if failed == 0 { 0 } else { 1 })
}
