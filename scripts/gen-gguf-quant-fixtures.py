#!/usr/bin/env python3
"""Golden data for tests/gguf_quant.rs: ggml's own encoders (libggml-base from llama.cpp 0c1e570,
as vendored by llama-cpp-python 0.3.36, built with GGML_NATIVE=OFF) run on fixed rows, with and
without an importance matrix, through `ggml_quantize_chunk` (what llama-quantize calls).

Usage: gen-gguf-quant-fixtures.py LIBGGML_BASE_SO OUT_DIR   (needs numpy)
Writes OUT_DIR/legacy_input.f32 (ROWS × COLS little-endian f32), legacy_imatrix.f32 (COLS),
and legacy_{q4_0,q4_1,q5_0,q5_1}{,_imatrix}.bin."""
import ctypes, os, sys
import numpy as np

lib = ctypes.CDLL(sys.argv[1])
out = sys.argv[2]
lib.ggml_quantize_chunk.restype = ctypes.c_size_t
lib.ggml_quantize_chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                    ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
TYPES = {"q4_0": (2, 18), "q4_1": (3, 20), "q5_0": (6, 22), "q5_1": (7, 24)}
ROWS, COLS = 12, 128

rng = np.random.default_rng(25)
x = np.empty((ROWS, COLS), dtype=np.float32)
for r in range(ROWS):
    x[r] = rng.standard_normal(COLS) * [0.02, 1.0, 300.0, 1e-4][r % 4]
x[1, :32] = 0.0                                  # an all-zero block
x[2, 32:64] = np.abs(x[2, 32:64])                # all positive: the offset types' min > 0
x[3, 64:96] = 0.75                               # a constant block
x[5, :32] = np.arange(32, dtype=np.float32) - 16  # exact ties at the grid points
x[6, :32] = 1e-20                                # below GROUP_MAX_EPS
x[7, 96:] = np.float32(65504.0) * np.sign(rng.standard_normal(32)).astype(np.float32)  # f16 max
x[9, :32] = -x[9, :32].max()                     # equal magnitudes, sign of the first kept
x = np.ascontiguousarray(x)
imatrix = (rng.random(COLS).astype(np.float32) * 4 + 0.01).astype(np.float32)
imatrix[:8] = 0.0                                # zero weights: the degenerate fits

x.tofile(os.path.join(out, "legacy_input.f32"))
imatrix.tofile(os.path.join(out, "legacy_imatrix.f32"))
for name, (ty, bb) in TYPES.items():
    for suffix, im in (("", None), ("_imatrix", imatrix)):
        dst = np.zeros(ROWS * COLS // 32 * bb, dtype=np.uint8)
        n = lib.ggml_quantize_chunk(ty, x.ctypes.data, dst.ctypes.data, 0, ROWS, COLS,
                                    None if im is None else im.ctypes.data)
        assert n == dst.size, (name, n)
        dst.tofile(os.path.join(out, f"legacy_{name}{suffix}.bin"))
print("wrote", out)
