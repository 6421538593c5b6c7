"""Upstream Python tftf's three README examples run verbatim (on the demo's checkpoints), and
write what the command line writes."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from conftest import read_safetensors  # noqa: E402

FP8_DEQUANT_AND_LORA_MERGE = '''
from tftf import (
    Pipeline,
    ShardedSafetensorsReader,
    ShardedWriter,
    FP8DequantPipe,
    LoRAMergePipe,
)
import torch

pipe = FP8DequantPipe(torch.bfloat16) | LoRAMergePipe("./my-lora/adapter_model.safetensors")

Pipeline(
    reader=ShardedSafetensorsReader.from_path("./DeepSeek-V3/"),
    pipe=pipe,
    writer=ShardedWriter("./DeepSeek-V3-bf16-merged/"),
).run()
'''

DRY_RUN = '''
from tftf import Pipeline, SafetensorsReader, NullWriter, FP8DequantPipe
import torch

writer = NullWriter()
Pipeline(
    reader=SafetensorsReader("./model.safetensors"),
    pipe=FP8DequantPipe(torch.bfloat16),
    writer=writer,
).run()

print(writer.report.summary())
assert writer.report.ok
'''

LORA_MERGE_AND_CAST = '''
from tftf import Pipeline, SafetensorsReader, StreamingWriter, LoRAMergePipe, DTypeCastPipe
import torch

pipe = LoRAMergePipe("adapter_model.safetensors") | DTypeCastPipe(torch.float16)

Pipeline(
    reader=SafetensorsReader("model.safetensors"),
    pipe=pipe,
    writer=StreamingWriter("merged.safetensors"),
).run()
'''


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("demo") / "demo"
    subprocess.run([sys.executable, "-m", "tftf", "demo", "--keep", str(d)], check=True, capture_output=True)
    return d


def run_example(code: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": ""})


def tftf(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "tftf", *args, "--quiet"], check=True)


def test_fp8_dequant_and_lora_merge_example(demo, tmp_path):
    shutil.copytree(demo / "example", tmp_path / "DeepSeek-V3")
    shutil.copytree(demo / "adapter", tmp_path / "my-lora")
    done = run_example(FP8_DEQUANT_AND_LORA_MERGE, tmp_path)
    assert done.returncode == 0, done.stderr
    out = tmp_path / "DeepSeek-V3-bf16-merged"
    tftf("run", str(tmp_path / "DeepSeek-V3"), "-o", str(tmp_path / "cli"), "--max-shard-size", str(20 * 1024**3),
         "--dequant-fp8", "--dtype", "bf16", "--block-size", "128x128", "--merge-lora", "--adapter",
         str(tmp_path / "my-lora" / "adapter_model.safetensors"), "--scale", "1.0")
    got = {k: v for f in sorted(out.glob("*.safetensors")) for k, v in read_safetensors(f).items()}
    want = {k: v for f in sorted((tmp_path / "cli").glob("*.safetensors")) for k, v in read_safetensors(f).items()}
    assert got == want
    assert not any(k.endswith("_scale_inv") for k in got)
    assert got["model.layers.0.self_attn.q_proj.weight"][0] == "BF16"
    assert (out / "model.safetensors.index.json").exists()


def test_dry_run_example(demo, tmp_path):
    tftf("passthrough", str(demo / "example"), "-o", str(tmp_path / "model.safetensors"))
    done = run_example(DRY_RUN, tmp_path)
    assert done.returncode == 0, done.stderr
    assert "Result  : OK" in done.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]


def test_lora_merge_and_cast_example(demo, tmp_path):
    tftf("passthrough", str(demo / "dequantized"), "-o", str(tmp_path / "model.safetensors"))
    for f in (demo / "adapter").iterdir():
        shutil.copy(f, tmp_path / f.name)
    done = run_example(LORA_MERGE_AND_CAST, tmp_path)
    assert done.returncode == 0, done.stderr
    got = read_safetensors(tmp_path / "merged.safetensors")
    assert {dtype for dtype, _, _ in got.values()} == {"F16"}
    base = read_safetensors(tmp_path / "model.safetensors")
    assert got.keys() == base.keys()


class _Seen:
    """What a user pipe saw: keys in order and dtypes."""

    def __init__(self):
        self.keys, self.dtypes = [], set()


def _identity(seen):
    from tftf import Pipe

    class Identity(Pipe):
        def process(self, records):
            for r in records:
                seen.keys.append(r.key)
                seen.dtypes.add(r.tensor.dtype)
                yield r

    return Identity()


def test_a_python_pipe_after_builtin_pipes_keeps_them_in_rust(demo, tmp_path):
    """The first example with a user pipe appended: the built-in pipes run as one Rust job that
    hands its tensors to the user's pipe, so the bytes are the command line's (one rounding),
    not those of a BF16 round trip between the dequantisation and the merge."""
    from tftf import FP8DequantPipe, LoRAMergePipe, Pipeline, ShardedSafetensorsReader, ShardedWriter

    seen = _Seen()
    pipe = FP8DequantPipe(torch.bfloat16) | LoRAMergePipe(str(demo / "adapter" / "adapter_model.safetensors"))
    out = tmp_path / "mixed"
    pipeline = Pipeline(ShardedSafetensorsReader.from_path(str(demo / "example")), pipe | _identity(seen),
                        ShardedWriter(str(out)))
    assert not pipeline.runs_in_rust()
    pipeline.run(show_progress=False)
    tftf("run", str(demo / "example"), "-o", str(tmp_path / "cli"), "--dequant-fp8", "--dtype", "bf16",
         "--merge-lora", "--adapter", str(demo / "adapter" / "adapter_model.safetensors"))
    got = {k: v for f in sorted(out.glob("*.safetensors")) for k, v in read_safetensors(f).items()}
    want = {k: v for f in sorted((tmp_path / "cli").glob("*.safetensors")) for k, v in read_safetensors(f).items()}
    assert got == want
    assert seen.keys and sorted(seen.keys) == sorted(want)
    assert torch.bfloat16 in seen.dtypes


def test_an_exception_in_a_python_pipe_after_builtin_pipes_leaves_no_output(demo, tmp_path, boom):
    from tftf import FP8DequantPipe, Pipeline, SafetensorsReader, StreamingWriter

    out = tmp_path / "out.safetensors"
    fds = len(os.listdir("/proc/self/fd"))
    with pytest.raises(KeyError, match="boom at"):
        Pipeline(SafetensorsReader(str(demo / "example")), FP8DequantPipe(torch.bfloat16) | boom(2),
                 StreamingWriter(out)).run(show_progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    # The engine's stream is closed: no in-memory tensor file stays open.
    assert len(os.listdir("/proc/self/fd")) <= fds
