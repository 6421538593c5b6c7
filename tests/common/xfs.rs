//! A loop-mounted reflink XFS image for the tests of extent sharing (needs root and
//! xfsprogs); [`xfs_or_skip`] says why a test is skipped where it cannot be made.

use std::path::PathBuf;
use std::process::Command;

/// A 1 GiB XFS image made with `mkfs.xfs -m reflink=1`, loop-mounted at `mnt` and unmounted
/// (lazily) when dropped.
pub struct Xfs {
    pub mnt: PathBuf,
    _dir: tempfile::TempDir,
}

/// Runs `cmd args`: Ok on success, else the command and its stderr.
fn run(cmd: &str, args: &[&str]) -> Result<(), String> {
    let o = Command::new(cmd)
        .args(args)
        .output()
        .map_err(|e| format!("{cmd}: {e}"))?;
    if o.status.success() {
        Ok(())
    } else {
        Err(format!(
            "{cmd} {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&o.stderr).trim()
        ))
    }
}

impl Xfs {
    /// Makes and mounts the image (and, with `filefrag`, checks that `filefrag` runs), or
    /// says why not.
    pub fn mount(filefrag: bool) -> Result<Xfs, String> {
        let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
        let img = dir.path().join("xfs.img");
        let mnt = dir.path().join("mnt");
        std::fs::create_dir(&mnt).map_err(|e| e.to_string())?;
        std::fs::File::create(&img)
            .and_then(|f| f.set_len(1 << 30))
            .map_err(|e| e.to_string())?;
        let (img_s, mnt_s) = (img.to_str().unwrap(), mnt.to_str().unwrap());
        run("mkfs.xfs", &["-q", "-m", "reflink=1", img_s])?;
        run("mount", &["-o", "loop", img_s, mnt_s])?;
        let xfs = Xfs { mnt, _dir: dir };
        if filefrag {
            run("filefrag", &["-V"]).map_err(|e| format!("filefrag missing: {e}"))?;
        }
        Ok(xfs)
    }
}

impl Drop for Xfs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.mnt).status();
    }
}

/// [`Xfs::mount`] without the `filefrag` check: see [`xfs_or_skip_with`].
pub fn xfs_or_skip(test: &str) -> Option<Xfs> {
    xfs_or_skip_with(test, false)
}

/// [`Xfs::mount`] with the `filefrag` check: see [`xfs_or_skip_with`].
pub fn xfs_with_filefrag_or_skip(test: &str) -> Option<Xfs> {
    xfs_or_skip_with(test, true)
}

/// [`Xfs::mount`], or `None` after printing (to stdout and stderr) that `test` is skipped
/// and why.
pub fn xfs_or_skip_with(test: &str, filefrag: bool) -> Option<Xfs> {
    match Xfs::mount(filefrag) {
        Ok(x) => Some(x),
        Err(why) => {
            eprintln!("SKIPPED {test}: cannot mount a reflink XFS image: {why}");
            println!("SKIPPED {test}: cannot mount a reflink XFS image: {why}");
            None
        }
    }
}
