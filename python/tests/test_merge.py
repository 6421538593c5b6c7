"""MergeReader: a mergekit config merged by the Rust core, as a reader of a Pipeline."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tftf import MergeReader, Pipe, Pipeline, PassthroughPipe, QuantizePipe, ShardedWriter, TftfError
from conftest import read_safetensors

REPO = Path(__file__).resolve().parents[2]
MODELS = REPO / "tests" / "fixtures" / "merge" / "models"
TFTF = shutil.which("tftf", path=str(Path(sys.executable).parent))


def linear_config(tmp_path: Path, method: str = "linear") -> Path:
    """mergekit's linear merge of two of the repository's bf16 fixture models, one weight a
    gradient across the layers."""
    cfg = tmp_path / "merge.yml"
    cfg.write_text(f"""merge_method: {method}
models:
  - model: {MODELS / 'a_bf16'}
    parameters:
      weight: [0.2, 0.9]
  - model: {MODELS / 'b_bf16'}
    parameters:
      weight: 0.3
dtype: bfloat16
""")
    return cfg


def tensors_of(out: Path) -> dict:
    found = {}
    for f in sorted(out.glob("*.safetensors")):
        found.update(read_safetensors(f))
    return found


def cli(*args: str) -> None:
    r = subprocess.run([TFTF, *args], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_a_merge_pipeline_writes_what_tftf_merge_writes(tmp_path):
    cfg = linear_config(tmp_path)
    cli("merge", str(cfg), str(tmp_path / "cli"), "-q")
    p = Pipeline(MergeReader(cfg), PassthroughPipe(), ShardedWriter(tmp_path / "api"))
    assert p.runs_in_rust()
    p.run(show_progress=False)
    assert tensors_of(tmp_path / "api") == tensors_of(tmp_path / "cli")

    def side_files(d):
        return {f.name: f.read_bytes() for f in d.iterdir() if not f.name.startswith("model")}

    assert side_files(tmp_path / "api") == side_files(tmp_path / "cli")
    assert {"config.json", "mergekit_config.yml"} <= set(side_files(tmp_path / "api"))


def test_merged_tensors_reach_a_python_pipe_in_order_with_the_merge_bytes(tmp_path):
    cfg = linear_config(tmp_path)
    cli("merge", str(cfg), str(tmp_path / "cli"), "-q")
    seen = []

    class Recorder(Pipe):
        def process(self, records):
            for r in records:
                seen.append(r.key)
                yield r

    p = Pipeline(MergeReader(cfg), Recorder(), ShardedWriter(tmp_path / "mixed"))
    assert not p.runs_in_rust()
    p.run(show_progress=False)
    want = tensors_of(tmp_path / "cli")
    assert seen == list(want)
    assert tensors_of(tmp_path / "mixed") == want


def test_merge_then_quantize_is_one_pass_equal_to_run_merge_quantize(tmp_path):
    cfg = linear_config(tmp_path)
    cli("run", "-o", str(tmp_path / "cli"), "--merge", str(cfg), "--quantize", "--scheme", "FP8_DYNAMIC", "-q")
    p = Pipeline(MergeReader(cfg), QuantizePipe("FP8_DYNAMIC"), ShardedWriter(tmp_path / "api"))
    assert p.runs_in_rust()
    p.run(show_progress=False)
    assert tensors_of(tmp_path / "api") == tensors_of(tmp_path / "cli")
    assert any(d == "F8_E4M3" for d, _, _ in tensors_of(tmp_path / "api").values())


def test_a_bad_config_is_refused_when_the_reader_is_made_and_nothing_is_written(tmp_path):
    with pytest.raises(FileNotFoundError):
        MergeReader(tmp_path / "missing.yml")
    cfg = linear_config(tmp_path, method="linnear")
    with pytest.raises((ValueError, TftfError), match="linnear"):
        MergeReader(cfg)
    # A model without a tensor the others have: refused when the run plans, before any output.
    bad = tmp_path / "bad.yml"
    bad.write_text(f"""merge_method: linear
models:
  - model: {MODELS / 'a_bf16'}
    parameters: {{weight: 0.5}}
  - model: {tmp_path / 'nowhere'}
    parameters: {{weight: 0.5}}
""")
    with pytest.raises((ValueError, TftfError, FileNotFoundError), match="nowhere"):
        Pipeline(MergeReader(bad), PassthroughPipe(), ShardedWriter(tmp_path / "out")).run(show_progress=False)
    assert not (tmp_path / "out").exists()
