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

from tftf import (DTypeCastPipe, GGUFWriter, KeyRenamePipe, MergeReader, PassthroughPipe, Pipeline, QuantizePipe,
                  SafetensorsReader, TftfError)

FIXTURES = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "gguf"


def _llama(root: Path, seed: int = 3) -> Path:
    """Two Llama 3 layers of hidden size 64 (4 heads, 2 key/value heads), vocabulary 410, F32,
    with the config and tokenizer fixtures ``tests/gguf*.rs`` use."""
    rng = np.random.default_rng(seed)
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


def test_gguf_writer_applies_the_pipes_before_it_as_tftf_run_does(tmp_path):
    # The pipes before a GGUF writer run in the same pass: the bytes of
    # `tftf run … --gguf`, here a cast to F16 kept by outtype auto, and a rename.
    model = _llama(tmp_path)
    out = tmp_path / "api" / "m.gguf"
    pipe = DTypeCastPipe("float16") | KeyRenamePipe([(r"^model\.norm\.", "model.norm.")])
    pipeline = Pipeline(SafetensorsReader(model), pipe, GGUFWriter(out, vocab_pre="test-pre"))
    assert pipeline.runs_in_rust()
    pipeline.run(show_progress=False)
    cli = tmp_path / "cli" / "m.gguf"
    subprocess.run([sys.executable, "-m", "tftf", "run", "-i", str(model), "-o", str(cli), "-q", "--dtype-cast",
                    "--dtype", "f16", "--key-rename", "--rule", r"^model\.norm\.", "model.norm.", "--gguf",
                    "--vocab-pre", "test-pre"], check=True)
    assert out.read_bytes() == cli.read_bytes()
    # A quantising pipe writes tensors a GGUF cannot take: refused, nothing written.
    bad = tmp_path / "bad" / "m.gguf"
    with pytest.raises(ValueError, match="GGUF output does not take"):
        Pipeline(SafetensorsReader(model), QuantizePipe("FP8_BLOCK"), GGUFWriter(bad, vocab_pre="test-pre")).run(
            show_progress=False)
    assert not bad.parent.exists()


def test_a_merge_becomes_a_q4_k_m_gguf_in_one_pass(tmp_path):
    # MergeReader then GGUFWriter: `tftf run --merge CONFIG --gguf --outtype q4_k_m`, with no
    # merged copy on disk.
    models = [_llama(tmp_path / name, seed) for name, seed in (("a", 3), ("b", 4))]
    cfg = tmp_path / "merge.yml"
    cfg.write_text("merge_method: linear\nmodels:\n" + "".join(
        f"  - model: {m}\n    parameters:\n      weight: {w}\n" for m, w in zip(models, (0.7, 0.3))) + "dtype: float32\n")
    out = tmp_path / "api" / "m.gguf"
    pipeline = Pipeline(MergeReader(cfg), PassthroughPipe(), GGUFWriter(out, outtype="q4_k_m", vocab_pre="test-pre"))
    assert pipeline.runs_in_rust()
    pipeline.run(show_progress=False)
    cli = tmp_path / "cli" / "m.gguf"
    subprocess.run([sys.executable, "-m", "tftf", "run", "-o", str(cli), "-q", "--merge", str(cfg), "--gguf",
                    "--outtype", "q4_k_m", "--vocab-pre", "test-pre"], check=True)
    assert out.read_bytes() == cli.read_bytes()
    assert sorted(p.name for p in out.parent.iterdir()) == ["m.gguf"]


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
