"""QuantizePipe: ``tftf quantize`` as the last pipe of a Rust pipeline, the same bytes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from conftest import read_safetensors

from tftf import DTypeCastPipe, Pipeline, QuantizePipe, SafetensorsReader, ShardedWriter

QUANTIZE = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "quantize"


def _files(d: Path) -> dict:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


@pytest.mark.parametrize("scheme,fmt,model", [("W4A16", "compressed-tensors", "input_even"),
                                              ("FP8_BLOCK", "fp8-native", "input")])
def test_quantize_pipe_writes_the_bytes_of_tftf_quantize(tmp_path, scheme, fmt, model):
    src = QUANTIZE / model
    out = tmp_path / "api"
    pipeline = Pipeline(SafetensorsReader(src), QuantizePipe(scheme, format=fmt), ShardedWriter(out))
    assert pipeline.runs_in_rust()
    pipeline.run(show_progress=False)
    cli = tmp_path / "cli"
    subprocess.run([sys.executable, "-m", "tftf", "quantize", "-i", str(src), "-o", str(cli), "-q",
                    "--scheme", scheme, "--format", fmt], check=True)
    # The same config and tensors, byte for byte (ShardedWriter always writes an index, as
    # upstream's; the command line writes one model.safetensors).
    got, want = _files(out), _files(cli)
    assert b"quantization_config" in got["config.json"]
    assert got.pop("config.json") == want.pop("config.json")
    assert sorted(got) == ["model-00001-of-00001.safetensors", "model.safetensors.index.json"]
    assert read_safetensors(out / "model-00001-of-00001.safetensors") == read_safetensors(cli / "model.safetensors")
    assert sorted(want) == ["model.safetensors"]


def test_quantize_pipe_comes_last_and_runs_in_rust_only(tmp_path):
    src = QUANTIZE / "input_even"
    out = tmp_path / "out"
    with pytest.raises(ValueError, match="--quantize must be the last section"):
        Pipeline(SafetensorsReader(src), QuantizePipe("W4A16") | DTypeCastPipe("f32"),
                 ShardedWriter(out)).run(show_progress=False)
    assert not out.exists()
    with pytest.raises(ValueError, match="--quantize: .*W9"):
        Pipeline(SafetensorsReader(src), QuantizePipe("W9"), ShardedWriter(out)).run(show_progress=False)
    assert not out.exists()
    with pytest.raises(TypeError, match="Rust job only"):
        list(QuantizePipe("W4A16").process(iter([])))
    with pytest.raises(ValueError, match="fp8-native"):
        QuantizePipe("W4A16", format="gptq")
