"""The `tftf` console command and `python -m tftf`: the Rust command line, its exit codes."""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

TFTF = shutil.which("tftf", path=str(Path(sys.executable).parent))


@pytest.mark.parametrize("argv", [[TFTF], [sys.executable, "-m", "tftf"]])
def test_console_command_and_module_run_the_cli(argv, model):
    assert argv[0], "the tftf console script is not installed beside this interpreter"
    info = subprocess.run(argv + ["info", str(model)], capture_output=True, text=True)
    assert info.returncode == 0, info.stderr
    assert "model.layers.0.q_proj.weight" in info.stdout
    usage = subprocess.run(argv + ["info", "--no-such-flag"], capture_output=True, text=True)
    assert usage.returncode == 2
    assert "--no-such-flag" in usage.stderr
    missing = subprocess.run(argv + ["info", str(model.parent / "missing.safetensors")], capture_output=True, text=True)
    assert missing.returncode == 1
    assert "missing.safetensors" in missing.stderr


def test_sigterm_ends_a_run_with_143_and_no_temporaries(tmp_path):
    demo = tmp_path / "demo"
    # A run long enough to signal: the demo makes and converts its example checkpoints.
    proc = subprocess.Popen([TFTF, "demo", "--keep", str(demo)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 30
    while not demo.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    if proc.returncode == 0:
        pytest.skip("the demo finished before the signal")
    assert proc.returncode == 143, err
    assert not [p for p in tmp_path.rglob("*") if ".tmp" in p.name or "partial" in p.name]


def test_cli_function_returns_the_exit_code(model):
    from tftf.cli import main

    assert main(["info", str(model)]) == 0
    assert main(["info", str(model.parent / "nope")]) == 1
