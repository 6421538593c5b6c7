#!/usr/bin/env python3
"""Compiles kernels/tftf.cu to PTX with NVRTC and writes kernels/tftf.ptx.

Used where no CUDA toolkit is installed (build.rs embeds the committed PTX then). NVRTC comes
from NVIDIA's pinned PyPI wheel, CUDA 12.2: its PTX ISA 8.2 is what R535 drivers (the oldest we
support) can JIT, for compute_80 and every later GPU (A100, H100/H200, GB10).

    python3 scripts/gen-ptx.py            # regenerate kernels/tftf.ptx
    python3 scripts/gen-ptx.py --check    # exit 1 when the committed PTX differs
    python3 scripts/gen-ptx.py --out F    # write elsewhere

The first line of the PTX records a SHA-256 of the kernel sources and options; the test suite
(tests/kernels.rs) recomputes it, so a source change without regenerated PTX fails CI.
"""
import argparse
import ctypes
import hashlib
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KERNELS = os.path.join(ROOT, "kernels")
WHEELS = os.path.join(ROOT, "target", "cuda-wheels")
NVRTC_WHEEL = "nvidia-cuda-nvrtc-cu12==12.2.140"
NVCC_WHEEL = "nvidia-cuda-nvcc-cu12==12.2.140"  # ptxas, for --validate
# Keep in step with build.rs (NVCC_FLAGS) and tests/kernels.rs (PTX_OPTIONS).
OPTIONS = ["--gpu-architecture=compute_80", "--fmad=false", "--std=c++17"]


def sources():
    """Kernel sources in hashing order: every .cu and .cuh, sorted by name."""
    names = sorted(n for n in os.listdir(KERNELS) if n.endswith((".cu", ".cuh")))
    return [(n, open(os.path.join(KERNELS, n), "rb").read()) for n in names]


def source_hash(srcs):
    h = hashlib.sha256()
    h.update(" ".join(OPTIONS).encode() + b"\0")
    for name, text in srcs:
        h.update(name.encode() + b"\0" + text + b"\0")
    return h.hexdigest()


def install_wheels():
    marker = os.path.join(WHEELS, ".installed-12.2.140")
    if not os.path.exists(marker):
        env = dict(os.environ, PIP_ROOT_USER_ACTION="ignore", PIP_DISABLE_PIP_VERSION_CHECK="1")
        subprocess.check_call([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps",
                               "--target", WHEELS, NVRTC_WHEEL, NVCC_WHEEL], env=env)
        open(marker, "w").close()
    return os.path.join(WHEELS, "nvidia")


def compile_ptx(nvidia):
    lib = ctypes.CDLL(os.path.join(nvidia, "cuda_nvrtc", "lib", "libnvrtc.so.12"))
    srcs = dict(sources())
    headers = [n for n in srcs if n.endswith(".cuh")]
    prog = ctypes.c_void_p()
    arr = lambda items: (ctypes.c_char_p * len(items))(*items)
    check(lib, lib.nvrtcCreateProgram(ctypes.byref(prog), srcs["tftf.cu"], b"tftf.cu",
                                      len(headers), arr([srcs[h] for h in headers]),
                                      arr([h.encode() for h in headers])))
    opts = [o.encode() for o in OPTIONS]
    rc = lib.nvrtcCompileProgram(prog, len(opts), arr(opts))
    size = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetProgramLog(prog, log)
    if rc != 0:
        sys.exit("NVRTC failed:\n" + log.value.decode())
    if log.value.strip():
        print(log.value.decode(), file=sys.stderr)
    lib.nvrtcGetPTXSize(prog, ctypes.byref(size))
    ptx = ctypes.create_string_buffer(size.value)
    check(lib, lib.nvrtcGetPTX(prog, ptx))
    lib.nvrtcDestroyProgram(ctypes.byref(prog))
    header = "// tftf-kernels-sha256: %s\n// options: %s\n" % (
        source_hash(sources()), " ".join(OPTIONS))
    return header + ptx.value.decode()


def check(lib, rc):
    if rc != 0:
        lib.nvrtcGetErrorString.restype = ctypes.c_char_p
        sys.exit("NVRTC error %d: %s" % (rc, lib.nvrtcGetErrorString(rc).decode()))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(KERNELS, "tftf.ptx"))
    ap.add_argument("--check", action="store_true", help="compare with the committed PTX")
    ap.add_argument("--validate", action="store_true",
                    help="assemble the PTX with ptxas for sm_80 and sm_90")
    args = ap.parse_args()
    nvidia = install_wheels()
    ptx = compile_ptx(nvidia)
    committed = os.path.join(KERNELS, "tftf.ptx")
    if args.check:
        old = open(committed).read() if os.path.exists(committed) else ""
        if old != ptx:
            sys.exit("kernels/tftf.ptx is stale: run python3 scripts/gen-ptx.py")
        print("kernels/tftf.ptx matches the kernel sources")
    else:
        with open(args.out, "w") as f:
            f.write(ptx)
        print("wrote", os.path.relpath(args.out, ROOT))
    if args.validate:
        ptxas = os.path.join(nvidia, "cuda_nvcc", "bin", "ptxas")
        os.chmod(ptxas, 0o755)
        for arch in ("sm_80", "sm_90"):
            subprocess.check_call([ptxas, "-arch=" + arch, committed if args.check else args.out,
                                   "-o", os.devnull])
            print("ptxas", arch, "ok")


if __name__ == "__main__":
    main()
