"""The Python API: built-in pipelines run as one Rust job and write what the command line
writes; user pipes run in the stream; failures leave no output."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from conftest import read_safetensors, write_safetensors

import tftf
from tftf import (DTypeCastPipe, KeyFilterPipe, KeyRenamePipe, NullWriter, Pipe, Pipeline, SafetensorsReader,
                  ShardedWriter, StreamingWriter, TensorRecord)
from tftf import _tensor


def _values(tensor):
    return np.asarray(tensor.float().numpy() if hasattr(tensor, "float") else tensor, dtype=np.float32)


def test_builtin_pipeline_is_one_rust_job_with_the_cli_bytes(model, tmp_path):
    pipe = KeyRenamePipe([(r"^model\.", "")]) | DTypeCastPipe("f16")
    out = tmp_path / "api.safetensors"
    pipeline = Pipeline(SafetensorsReader(model), pipe, StreamingWriter(out))
    assert pipeline.runs_in_rust()
    pipeline.run(show_progress=False)
    assert pipeline.report["status"] == "ok"
    cli_out = tmp_path / "cli.safetensors"
    subprocess.run([sys.executable, "-m", "tftf", "run", str(model), "-o", str(cli_out), "--quiet",
                    "--key-rename", "--rule", r"^model\.", "", "--dtype-cast", "f16"], check=True)
    assert out.read_bytes() == cli_out.read_bytes()
    got = read_safetensors(out)
    assert got["layers.0.q_proj.weight"][0] == "F16"
    assert got["position_ids"][0] == "I64"


class Scale(Pipe):
    """A user pipe: doubles every float tensor and records the order it saw."""

    def __init__(self):
        self.seen = []

    def process(self, records):
        for r in records:
            self.seen.append(r.key)
            t = r.tensor
            yield TensorRecord(r.key, t * 2 if _tensor.dtype_of(t) == "F32" else t)


def test_user_pipe_runs_in_the_stream_between_rust_ops(model, tmp_path):
    user = Scale()
    out = tmp_path / "out.safetensors"
    pipeline = Pipeline(SafetensorsReader(model), user | DTypeCastPipe("f32") | KeyFilterPipe(exclude=["*k_proj*"]),
                        StreamingWriter(out))
    assert not pipeline.runs_in_rust()
    pipeline.run(show_progress=False)
    src, got = read_safetensors(model), read_safetensors(out)
    assert user.seen == list(src)
    assert list(got) == ["model.layers.0.q_proj.weight", "model.position_ids"]
    want = np.frombuffer(src["model.layers.0.q_proj.weight"][2], np.float32) * 2
    assert got["model.layers.0.q_proj.weight"][2] == want.tobytes()
    assert got["model.position_ids"] == src["model.position_ids"]


class Hoard(Pipe):
    """A user pipe that keeps a view of every record's tensor (and, with *hold*, the records
    themselves until the end), noting each tensor's bytes as they arrived."""

    def __init__(self, hold):
        self.hold, self.views, self.first_seen = hold, [], []

    def process(self, records):
        held = []
        for r in records:
            self.views.append(r.tensor.reshape(-1)[:3])
            self.first_seen.append(bytes(_tensor.raw_bytes(r.tensor)))
            if self.hold:
                held.append(r)
            else:
                yield r
        yield from held


@pytest.mark.parametrize("hold", [False, True])
def test_streamed_tensors_keep_their_bytes_while_a_user_pipe_holds_them(tmp_path, hold):
    # The engine reuses a streamed tensor's memory once Python has dropped every view of it:
    # tensors (or views) still held must keep their bytes while later, differently sized
    # tensors stream through.
    rng = np.random.default_rng(3)
    tensors = {f"model.layers.{i}.w": rng.standard_normal((8 + 4 * (i % 3), 16)).astype(np.float16)
               for i in range(8)}
    model = write_safetensors(tmp_path / "in" / "model.safetensors", tensors)
    builtin, mixed = tmp_path / "builtin.safetensors", tmp_path / "mixed.safetensors"
    Pipeline(SafetensorsReader(model), DTypeCastPipe("f32"), StreamingWriter(builtin)).run(show_progress=False)
    user = Hoard(hold)
    pipeline = Pipeline(SafetensorsReader(model), DTypeCastPipe("f32") | user, StreamingWriter(mixed))
    assert not pipeline.runs_in_rust()
    pipeline.run(show_progress=False)
    assert read_safetensors(mixed) == read_safetensors(builtin)
    for (name, array), view, seen in zip(tensors.items(), user.views, user.first_seen):
        assert seen == array.astype(np.float32).tobytes(), name
        assert _values(view).tolist() == array.reshape(-1)[:3].astype(np.float32).tolist(), name


@pytest.mark.parametrize("sharded", [False, True])
def test_user_pipe_exception_is_raised_and_leaves_no_output(model, tmp_path, sharded, boom):
    out = tmp_path / ("out" if sharded else "out.safetensors")
    writer = ShardedWriter(out, max_shard_bytes=600) if sharded else StreamingWriter(out)
    with pytest.raises(KeyError, match="boom at model.layers.0.k_proj.weight"):
        Pipeline(SafetensorsReader(model), boom(1), writer).run(show_progress=False)
    leftovers = sorted(p.name for p in tmp_path.rglob("*") if p.is_file() and p.parent != model.parent)
    assert leftovers == []


def test_existing_output_is_refused_without_force(model, tmp_path):
    out = tmp_path / "out.safetensors"
    out.write_bytes(b"keep me")
    for pipe in (DTypeCastPipe("f16"), Scale()):
        with pytest.raises(FileExistsError):
            Pipeline(SafetensorsReader(model), pipe, StreamingWriter(out)).run(show_progress=False)
        assert out.read_bytes() == b"keep me"
    Pipeline(SafetensorsReader(model), Scale(), StreamingWriter(out, force=True)).run(show_progress=False)
    assert len(read_safetensors(out)) == 3


def test_process_meta_and_process_must_agree(model, tmp_path):
    class Liar(Pipe):
        def process(self, records):
            for r in records:
                yield TensorRecord(r.key, r.tensor[:1])

    out = tmp_path / "out.safetensors"
    with pytest.raises(ValueError, match="model.layers.0.q_proj.weight"):
        Pipeline(SafetensorsReader(model), Liar(), StreamingWriter(out)).run(show_progress=False)
    assert not out.exists() and list(tmp_path.glob(".*")) == []


def test_dtype_cast_process_on_records_rounds_like_numpy(tmp_path):
    values = np.array([1.0, 1 / 3, 65504.0, 70000.0, -2.5e-8, np.nan], np.float32)
    record = TensorRecord("w", _tensor.from_buffer(bytearray(values.tobytes()), "F32", values.shape))
    (out,) = DTypeCastPipe("float16").process(iter([record]))
    assert _tensor.dtype_of(out.tensor) == "F16"
    with np.errstate(over="ignore"):
        want = values.astype(np.float16)
    assert bytes(_tensor.raw_bytes(out.tensor)) == want.tobytes()


def test_fp8_dequant_process_on_records(tmp_path):
    # E4M3: 0x38 = 1.0, 0x40 = 2.0, 0xB8 = -1.0; one 2x2 block per scale.
    weight = np.array([[0x38, 0x40, 0x38, 0x38], [0xB8, 0x38, 0x40, 0x40]], np.uint8)
    scale = np.array([[0.5, 3.0]], np.float32)
    path = write_safetensors(tmp_path / "fp8.safetensors", {"m.weight": weight, "m.weight_scale_inv": scale},
                             dtypes={"m.weight": "F8_E4M3"})
    pipe = tftf.FP8DequantPipe("f32", block_size=2)
    reader = SafetensorsReader(path)
    metas = list(pipe.process_meta(reader.iter_meta()))
    assert [m.key for m in metas] == ["m.weight"]
    (out,) = pipe.process(reader.iter_records())
    assert _values(out.tensor).tolist() == [[0.5, 1.0, 3.0, 3.0], [-0.5, 0.5, 6.0, 6.0]]


def test_dry_run_reports_problems_without_writing(model, tmp_path):
    writer = NullWriter()
    Pipeline(SafetensorsReader(model), DTypeCastPipe("bf16"), writer).run(show_progress=False)
    assert writer.report.ok, writer.report.summary()
    assert writer.report.n_tensors == 3
    assert writer.report.dtype_counts == {"BF16": 2, "I64": 1}
    with open(model, "r+b") as f:
        f.truncate(model.stat().st_size - 4)
    writer = NullWriter()
    Pipeline(SafetensorsReader(model), DTypeCastPipe("bf16"), writer).run(show_progress=False)
    assert not writer.report.ok
    assert "model.safetensors" in writer.report.summary()


def test_core_errors_name_the_file(tmp_path):
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}      ")
    with pytest.raises(tftf.TftfError, match="bad.safetensors"):
        Pipeline(SafetensorsReader(bad), DTypeCastPipe("f16"), StreamingWriter(tmp_path / "o.safetensors")).run()
    assert not (tmp_path / "o.safetensors").exists()


def test_an_exception_in_the_progress_callback_stops_the_rust_run(model, tmp_path):
    from tftf import _core

    out = tmp_path / "out"

    def progress(done, total, file):
        raise InterruptedError(f"stop at {done} of {total}")

    spec = {"kind": "sharded", "path": str(out), "max_shard_size": 256, "outtype": None, "force": False,
            "arch": None, "vocab_pre": None}
    with pytest.raises(InterruptedError, match="stop at"):
        _core.run_pipeline(str(model), ["--dtype-cast", "--dtype=f16"], spec, threads=1, progress=progress)
    assert not out.exists() or list(out.iterdir()) == []


def test_run_chain_tokens_build_the_same_pipeline(model, tmp_path):
    from tftf.cli import _parse_pipe_chain

    pipe = _parse_pipe_chain(["--key-filter", "*q_proj*", "--dtype-cast", "bf16"])
    dtype = "bfloat16" if _tensor.HAVE_TORCH else "BF16"
    assert repr(pipe) == f"(KeyFilterPipe(include=['*q_proj*']) | DTypeCastPipe('{dtype}'))"
    out = tmp_path / "o.safetensors"
    pipeline = Pipeline(SafetensorsReader(model), pipe, StreamingWriter(out))
    assert pipeline.runs_in_rust()
    pipeline.run(show_progress=False)
    assert {k: v[0] for k, v in read_safetensors(out).items()} == {"model.layers.0.q_proj.weight": "BF16"}
    with pytest.raises(Exception, match="Unknown option '--typo'"):
        _parse_pipe_chain(["--dtype-cast", "--typo", "bf16"])


def test_gguf_writer_runs_the_rust_gguf_writer(tmp_path):
    # A checkpoint the GGUF writer cannot describe: its refusal names config.json's missing
    # key, and nothing is written.
    model = write_safetensors(tmp_path / "m" / "model.safetensors", {"w": np.ones((2, 2), np.float32)})
    (model.parent / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    out = tmp_path / "out" / "m.gguf"
    pipeline = Pipeline(SafetensorsReader(model.parent), tftf.PassthroughPipe(), tftf.GGUFWriter(out, outtype="q8_0"))
    assert pipeline.runs_in_rust()
    with pytest.raises(tftf.TftfError, match="config.json"):
        pipeline.run(show_progress=False)
    assert not out.parent.exists()
    with pytest.raises(ValueError, match="GGUFWriter needs"):
        Pipeline(SafetensorsReader(model), Scale(), tftf.GGUFWriter(out)).run(show_progress=False)


def test_write_behind_names_a_file_it_cannot_follow(tmp_path):
    from tftf import _core

    path = tmp_path / "out.safetensors"
    with pytest.raises(ValueError, match="out.safetensors: not an open file"):
        _core.WriteBehind(-1, str(path), 0)
    f = open(path, "wb")
    fd = f.fileno()
    f.close()
    with pytest.raises(_core.TftfError, match="out.safetensors"):
        _core.WriteBehind(fd, str(path), 0)
