"""GGUFWriter's success path: a small Llama-shaped checkpoint with the repository's tokenizer
fixture becomes the same GGUF file, byte for byte, as ``tftf gguf`` writes; ``vocab_pre`` and
``arch`` are ``tftf gguf``'s options."""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import write_safetensors

from tftf import DTypeCastPipe, GGUFWriter, KeyFilterPipe, PassthroughPipe, Pipeline, SafetensorsReader, TftfError

FIXTURES = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "gguf"


def _llama(root: Path) -> Path:
    """Two Llama 3 layers of hidden size 64 (4 heads, 2 key/value heads), vocabulary 410, F32,
    with the config and tokenizer fixtures ``tests/gguf*.rs`` use."""
    rng = np.random.default_rng(3)
    shapes = {"model.embed_tokens.weight": (410, 64), "model.norm.weight": (64,), "lm_head.weight": (410, 64)}
    for layer in range(2):
        p = f"model.layers.{layer}."
        shapes.update({p + "input_layernorm.weight": (64,), p + "post_attention_layernorm.weight": (64,),
                       p + "self_attn.q_proj.weight": (64, 64), p + "self_attn.k_proj.weight": (32, 64),
                       p + "self_attn.v_proj.weight": (32, 64), p + "self_attn.o_proj.weight": (64, 64),
                       p + "mlp.gate_proj.weight": (128, 64), p + "mlp.up_proj.weight": (128, 64),
                       p + "mlp.down_proj.weight": (64, 128)})
    model = root / "llama"
    write_safetensors(model / "model.safetensors",
                      {k: (rng.standard_normal(s) * 0.05).astype(np.float32) for k, s in shapes.items()})
    config = json.loads((FIXTURES / "configs" / "llama3.config.json").read_text())
    config.update(vocab_size=410, eos_token_id=1)
    config.pop("bos_token_id")
    (model / "config.json").write_text(json.dumps(config))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(FIXTURES / "tokenizer" / f, model / f)
    return model


def _cli_gguf(model: Path, out: Path, outtype: str) -> bytes:
    # The tokenizer fixture's pre-tokenizer is not one llama.cpp knows: named, as the Rust
    # tests name it.
    subprocess.run([sys.executable, "-m", "tftf", "gguf", str(model), "-o", str(out), "--outtype", outtype,
                    "--vocab-pre", "test-pre", "-q"], check=True)
    return out.read_bytes()


@pytest.mark.parametrize("outtype", ["auto", "q8_0"])
def test_gguf_writer_writes_the_bytes_of_tftf_gguf(tmp_path, outtype):
    model = _llama(tmp_path)
    out = tmp_path / "api" / "llama.gguf"
    pipeline = Pipeline(SafetensorsReader(model), PassthroughPipe(), GGUFWriter(out, outtype=outtype, vocab_pre="test-pre"))
    assert pipeline.runs_in_rust()
    pipeline.run(show_progress=False)
    assert pipeline.report["status"] == "ok"
    got = out.read_bytes()
    assert got[:4] == b"GGUF" and struct.unpack("<I", got[4:8])[0] == 3
    assert got == _cli_gguf(model, tmp_path / "cli.gguf", outtype)
    assert sorted(p.name for p in out.parent.iterdir()) == ["llama.gguf"]
    # An existing output is refused, and left as it was.
    with pytest.raises(FileExistsError, match="llama.gguf"):
        Pipeline(SafetensorsReader(model), PassthroughPipe(), GGUFWriter(out, outtype=outtype, vocab_pre="test-pre")).run(show_progress=False)
    assert out.read_bytes() == got


def test_gguf_writer_refuses_a_pipe_it_would_leave_out(tmp_path):
    # The GGUF writer converts the checkpoint as it is: a cast or a filter before it is
    # refused (it would be left out silently), and nothing is written.
    model = _llama(tmp_path)
    out = tmp_path / "out" / "m.gguf"
    for pipe in (DTypeCastPipe("bf16"), KeyFilterPipe(exclude=["model.layers.1.*"])):
        with pytest.raises(ValueError, match="a GGUF writer converts the checkpoint as it is and applies no pipe"):
            Pipeline(SafetensorsReader(model), pipe, GGUFWriter(out, vocab_pre="test-pre")).run(show_progress=False)
        assert not out.parent.exists()


def test_gguf_writer_arch_and_vocab_pre_reach_the_rust_writer(tmp_path):
    model = _llama(tmp_path)
    out = tmp_path / "m.gguf"
    # Without vocab_pre the unknown pre-tokenizer is refused, naming the file; nothing written.
    with pytest.raises(TftfError, match="tokenizer.json: the pre-tokenizer is not one llama.cpp knows"):
        Pipeline(SafetensorsReader(model), PassthroughPipe(), GGUFWriter(out)).run(show_progress=False)
    assert not out.exists()
    with pytest.raises(TftfError, match="architecture `nope` is not supported"):
        Pipeline(SafetensorsReader(model), PassthroughPipe(),
                 GGUFWriter(out, arch="nope", vocab_pre="test-pre")).run(show_progress=False)
    assert not out.exists()
    Pipeline(SafetensorsReader(model), PassthroughPipe(),
             GGUFWriter(out, arch="llama", vocab_pre="test-pre")).run(show_progress=False)
    assert out.read_bytes() == _cli_gguf(model, tmp_path / "cli.gguf", "auto")
