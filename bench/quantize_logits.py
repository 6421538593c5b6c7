"""Helper of `PYTHON=... bench/quantize_logits.sh`: quantised outputs loaded in transformers.

    python quantize_logits.py gen DIR LAYERS              # small random bf16 Llama
    python quantize_logits.py fp8native IN OUT            # transformers' own FineGrainedFP8, on the CPU
    python quantize_logits.py logits BF16 NAME OURS LIB   # load, run, compare logits

`gen` is `quantize_reference.gen` with small dimensions that every scheme's groups and blocks
divide: hidden 512, intermediate 1536, 8 heads of 64, 2 key-value heads (k/v_proj [128, 512]),
vocab 4096, untied lm_head (2 layers = 20 MB).

`fp8native` is the library side of `tftf quantize --format fp8-native`: `from_pretrained(IN,
quantization_config=FineGrainedFP8Config())` + `save_pretrained(OUT)`. transformers refuses
to quantise without a GPU or XPU (`validate_environment` raises "No GPU or XPU found"), so the
check is replaced by a no-op; the quantisation itself (`Fp8Quantize`) is plain torch and runs
on the CPU.

`logits` loads the BF16 model and both quantised outputs with `AutoModelForCausalLM.
from_pretrained` (dtype from config.json: bfloat16), each in two ways: as stored (default
arguments; compressed-tensors puts the compressed parameters in the modules and decompresses
them after loading, FineGrainedFP8 dequantises on a machine without a GPU) and with
`dequantize=True` in the quantisation config (transformers' own dequantising load operation),
runs one forward pass over a fixed batch of 4 × 32 random token ids, and prints one line:
whether each load ran, max |Δ| of our logits against the library's (and whether they are
exactly equal), max |Δ| and relative error (‖Δ‖₂ / ‖ref‖₂) against the BF16 model, and how
many of the 128 positions keep the BF16 model's top-1 token.
"""

import json
import os
import sys
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

DIMS = dict(h=512, inter=1536, vocab=4096, heads=8, kv_heads=2)


def gen(path, layers):
    import quantize_reference

    quantize_reference.gen(path, layers, **DIMS)


def fp8native(src, dst):
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config
    from transformers.quantizers import quantizer_finegrained_fp8 as q

    try:
        AutoModelForCausalLM.from_pretrained(src, quantization_config=FineGrainedFP8Config())
        print("fp8native: transformers quantised without a GPU check")
    except RuntimeError as e:
        print(f"fp8native: as shipped, transformers refuses on the CPU: RuntimeError: {e}")
    q.FineGrainedFP8HfQuantizer.validate_environment = lambda self, *a, **k: None
    model = AutoModelForCausalLM.from_pretrained(src, quantization_config=FineGrainedFP8Config())
    model.save_pretrained(dst)


def tokens():
    import torch

    g = torch.Generator().manual_seed(2026)
    return torch.randint(0, DIMS["vocab"], (4, 32), generator=g)


def load_and_run(path, dequantize):
    import torch
    from transformers import AutoModelForCausalLM

    kw = {}
    if dequantize:
        method = json.load(open(os.path.join(path, "config.json")))["quantization_config"]["quant_method"]
        if method == "compressed-tensors":
            from transformers import CompressedTensorsConfig

            kw["quantization_config"] = CompressedTensorsConfig(dequantize=True)
        elif method == "fp8":
            from transformers import FineGrainedFP8Config

            kw["quantization_config"] = FineGrainedFP8Config(dequantize=True)
        else:
            raise ValueError(f"unknown quant_method {method}")
    model = AutoModelForCausalLM.from_pretrained(path, **kw)
    model.eval()
    with torch.no_grad():
        out = model(tokens()).logits.float()
    # What the first q_proj holds after loading, e.g. "Linear weight bfloat16"
    m = model.model.layers[0].self_attn.q_proj
    held = ",".join(f"{n}:{str(p.dtype).replace('torch.', '')}" for n, p in m.named_parameters())
    act = getattr(getattr(m, "quantization_scheme", None), "input_activations", None)
    if act is not None:  # the module fake-quantises its input at run time, as the scheme says
        held += f"; input {act.type}{act.num_bits} {act.strategy} dynamic={act.dynamic}"
    return out, f"{type(m).__name__}({held})"


def logits(bf16, name, ours, lib):
    import torch

    torch.manual_seed(0)
    ref, _ = load_and_run(bf16, False)
    res, fails = {}, []
    for side, path in (("ours", ours), ("lib", lib)):
        for mode in ("default", "dequantize"):
            try:
                res[side, mode] = load_and_run(path, mode == "dequantize")
            except Exception as e:  # a scheme that cannot load on the CPU: say why
                fails.append(f"{side} {mode}: {type(e).__name__}: {e}")
                traceback.print_exc()

    def loads(side):
        return "/".join("yes" if (side, m) in res else "NO" for m in ("default", "dequantize"))

    def vs_lib(mode):
        if ("ours", mode) not in res or ("lib", mode) not in res:
            return "n/a"
        a, b = res["ours", mode][0], res["lib", mode][0]
        return f"{(a - b).abs().max().item():.3g}{' (equal)' if torch.equal(a, b) else ' (DIFFERENT)'}"

    cols = [name, f"ours {loads('ours')}", f"lib {loads('lib')}",
            f"ours-vs-lib default {vs_lib('default')}", f"dequantize {vs_lib('dequantize')}"]
    for mode in ("default", "dequantize"):
        if ("ours", mode) in res:
            a = res["ours", mode][0]
            d = a - ref
            top1 = (a.argmax(-1) == ref.argmax(-1)).sum().item()
            cols += [f"{mode} vs-bf16 max {d.abs().max().item():.4g} rel {(d.norm() / ref.norm()).item():.4g} "
                     f"top1 {top1}/{ref.shape[0] * ref.shape[1]}"]
    if ("ours", "default") in res and ("ours", "dequantize") in res:
        cols.append(f"default-vs-dequantize {(res['ours', 'default'][0] - res['ours', 'dequantize'][0]).abs().max().item():.3g}")
    for mode in ("default", "dequantize"):
        if ("ours", mode) in res:
            cols.append(f"{mode} holds {res['ours', mode][1]}")
    cols.append(f"bf16 max|logit| {ref.abs().max().item():.4g}")
    print("RESULT " + " | ".join(cols))
    for f in fails:
        print(f"FAILED {name} {f}")
    return 1 if fails else 0


if __name__ == "__main__":
    import quantize_reference

    quantize_reference.main(
        {"gen": lambda path, layers: gen(path, int(layers)), "fp8native": fp8native, "logits": logits}
    )
