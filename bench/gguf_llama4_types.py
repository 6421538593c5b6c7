#!/usr/bin/env python3
"""`tftf gguf --outtype T [--imatrix F]` against `convert_hf_to_gguf.py --outtype f32` +
`llama-quantize [--imatrix F] ref.gguf out.gguf T` on a Llama 4 model (bench/gguf_reference.py's
`llama4`: the multimodal class, dense and MoE layers alternating, 4 experts, a stand-in vision
tower) widened so every row is a multiple of 256 (hidden 256, experts' ff 256, dense ff 512,
head_dim 64, 4 layers): every k-quant family, IQ4_XS and a legacy type, then three with an
importance matrix that `llama-imatrix` computes for the model from TEXT. Prints one line per
type (tensor count, KV, tensor and byte differences, order) and exits non-zero on any
difference.

Usage: gguf_llama4_types.py LLAMA_CPP_DIR TFTF WORKDIR LLAMA_BIN_DIR TEXT
  (needs torch, transformers, safetensors, numpy; llama-quantize and llama-imatrix in
  LLAMA_BIN_DIR)"""
import os, subprocess, sys

LCP, TFTF, WORK, BIN, TEXT = sys.argv[1:6]
sys.argv = sys.argv[:4]
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gguf_reference as R  # noqa: E402

TYPES = ["Q4_K_M", "Q3_K_M", "Q5_K_S", "Q6_K", "IQ4_XS", "Q2_K", "Q4_0"]
IMATRIX_TYPES = ["Q4_K_M", "IQ4_XS", "Q3_K_S"]


def widened(name, **edit):
    c = base_config(name, **edit)
    c["text_config"].update(hidden_size=256, intermediate_size=256, intermediate_size_mlp=512, head_dim=64)
    return c


def main():
    global base_config
    os.makedirs(WORK, exist_ok=True)
    base_config, R.config = R.config, widened
    d = R.build("llama4-256", R.llama4("llama4", num_hidden_layers=4))
    R.config = base_config
    # llama-imatrix needs a pre-tokenizer llama.cpp knows; the token ids never differ.
    ref = os.path.join(WORK, "ref.f32.gguf")
    subprocess.run([sys.executable, "-c", R.REF.replace('"test-pre"', '"default"'), d, "--outfile", ref,
                    "--outtype", "f32"], check=True, capture_output=True)
    im = os.path.join(WORK, "imatrix.gguf")
    subprocess.run([os.path.join(BIN, "llama-imatrix"), "-m", ref, "-f", TEXT, "-o", im, "-c", "64",
                    "--chunks", "8"], check=True, capture_output=True)
    bad = False
    for ty, imatrix in [(t, None) for t in TYPES] + [(t, im) for t in IMATRIX_TYPES]:
        extra = ["--imatrix", imatrix] if imatrix else []
        rq, ours = (os.path.join(WORK, f"{w}.{ty}{'.im' if imatrix else ''}.gguf") for w in ("ref", "tftf"))
        for p in (rq, ours):
            if os.path.exists(p):
                os.remove(p)
        subprocess.run([os.path.join(BIN, "llama-quantize")] + extra + [ref, rq, ty], check=True, capture_output=True)
        t = subprocess.run([TFTF, "gguf", "-i", d, "-o", ours, "--outtype", ty.lower(), "--vocab-pre", "default", "-q"]
                           + extra, capture_output=True, text=True)
        what = f"{ty}{' --imatrix' if imatrix else ''}"
        if t.returncode:
            print(f"{what}: tftf failed: {t.stderr.strip()[:200]}")
            bad = True
            continue
        kv, td, bd, order, n, _ = R.compare(ours, rq)
        bad |= bool(kv or td or bd or not order)
        print(f"{what}: {n} tensors; KVs {'equal' if not kv else kv}; tensors "
              f"{'equal' if not td else td}; bytes {'equal' if not bd else bd[:5]}; order {'same' if order else 'differs'}")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
