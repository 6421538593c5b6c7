"""With torch installed: records carry torch tensors viewing the reader's buffer, and pipes
take torch dtypes as upstream's do."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from conftest import read_safetensors  # noqa: E402

from tftf import DTypeCastPipe, FP8DequantPipe, Pipe, Pipeline, SafetensorsReader, StreamingWriter, TensorRecord  # noqa: E402


def test_records_are_torch_tensors_over_the_read_buffer(model):
    record = next(SafetensorsReader(model).iter_records())
    assert isinstance(record.tensor, torch.Tensor)
    assert record.tensor.dtype == torch.float32 and record.tensor.shape == (16, 8)
    # A view onto the bytes the Rust reader filled: writing through it shows in a second view.
    view = record.tensor.view(-1)
    view[0] = 42.0
    assert record.tensor[0, 0].item() == 42.0


def test_torch_dtypes_are_taken(model, tmp_path):
    assert DTypeCastPipe(torch.bfloat16).target_dtype == torch.bfloat16
    assert FP8DequantPipe(torch.float16).target_dtype == torch.float16
    out = tmp_path / "o.safetensors"
    Pipeline(SafetensorsReader(model), DTypeCastPipe(torch.bfloat16), StreamingWriter(out)).run(show_progress=False)
    got = read_safetensors(out)
    want = next(SafetensorsReader(model).iter_records()).tensor.to(torch.bfloat16)
    assert got["model.layers.0.q_proj.weight"][2] == want.view(torch.uint8).numpy().tobytes()


def test_user_pipe_sees_torch_tensors(model, tmp_path):
    class Negate(Pipe):
        def process(self, records):
            for r in records:
                assert isinstance(r.tensor, torch.Tensor)
                yield TensorRecord(r.key, -r.tensor if r.tensor.is_floating_point() else r.tensor)

    out = tmp_path / "o.safetensors"
    Pipeline(SafetensorsReader(model), Negate(), StreamingWriter(out)).run(show_progress=False)
    src = {r.key: r.tensor for r in SafetensorsReader(model).iter_records()}
    dst = {r.key: r.tensor for r in SafetensorsReader(out).iter_records()}
    assert torch.equal(dst["model.layers.0.k_proj.weight"], -src["model.layers.0.k_proj.weight"])
    assert torch.equal(dst["model.position_ids"], src["model.position_ids"])
