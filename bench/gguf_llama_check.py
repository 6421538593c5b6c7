#!/usr/bin/env python3
"""Loads `tftf gguf` and convert_hf_to_gguf.py outputs in llama.cpp and compares their logits, on
the small random models of bench/gguf_reference.py (every supported architecture, 2 layers,
hidden 64, the fixture tokenizer), per outtype (f32, f16, bf16, q8_0):

- both files load (libllama, CPU, through bench/gguf_llama_logits.c, path in $LLAMA_LOGITS) and
  give the logits of every position of the same TOKENS;
- tftf's logits equal the reference's bit for bit (the tensor bytes are equal, so anything else
  would be a difference in what llama.cpp reads from the KVs);
- each is compared with transformers' f32 logits of the checkpoint (FP8 and MXFP4 weights
  dequantised by transformers): max |difference| and the largest |logit|, a tolerance applying
  to f32 output only (the others round the weights).

Two differences are llama.cpp's, not the converters', and are taken out of the f32 check:
- ggml's CPU MXFP4 matmul quantises the activations to Q8_0 (`vec_dot_type`), so an output with
  MXFP4 experts (gpt-oss, any outtype) computes like a q8_0 one. For those, a copy of tftf's f32
  file with the MXFP4 tensors dequantised to F32 by gguf-py is run too (`f32, MXFP4 as F32`),
  and the tolerance applies to it.
- ggml's CPU GELU (Gemma's activation) rounds its input to F16 and reads the result from an F16
  table (`GGML_GELU_FP16` in ggml-cpu/vec.h): those models get `GELU_TOL` in f32.
- llama.cpp's YaRN always rounds the correction range to whole dimensions
  (`ggml_rope_yarn_corr_dims`); gpt-oss's config says `"truncate": false` and GGUF has no key
  for it, so transformers runs with `truncate: true` here (with `false` the f32 gap is about
  0.04).

The fixture tokenizer's pre-tokenizer is in no table, and llama.cpp refuses names it does not
know, so both converters are told `default` (the token ids are given directly, so the
pre-tokenizer never runs). Prints a table; exits non-zero on a load failure, a logit that
differs between the two files, transformers failing to run the checkpoint, or an f32
difference over the tolerance.

Usage: LLAMA_LOGITS=BIN gguf_llama_check.py LLAMA_CPP_DIR TFTF WORKDIR [ARCH...]"""
import os, subprocess, sys
import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gguf_reference as R  # noqa: E402  (same arguments: LLAMA_CPP_DIR TFTF WORKDIR [ARCH...])

LOGITS = os.environ["LLAMA_LOGITS"]
OUTTYPES = ["f32", "f16", "bf16", "q8_0"]
# BOS, then ids spread over the vocabulary (fixture tokens, added tokens and padding).
# Models with fewer ids (the SentencePiece fixtures' 400) draw below their vocabulary.
TOKENS = [0] + [int(x) for x in np.random.default_rng(1).integers(2, R.VOCAB, 23)]


def tokens_for(c):
    n = min(R.VOCAB, c.get("vocab_size") or c.get("text_config", {}).get("vocab_size") or R.VOCAB)
    return [0] + [int(x) for x in np.random.default_rng(1).integers(2, n, 23)]
F32_TOL = 1e-3
GELU_TOL = 5e-3
REF = R.REF.replace('"test-pre"', '"default"')


def llama_logits(path):
    out = path + ".logits"
    r = subprocess.run([LOGITS, path, out] + [str(t) for t in TOKENS], capture_output=True, text=True)
    if r.returncode:
        return None, (r.stderr.strip().splitlines() or [f"exit {r.returncode}"])[-1][:200]
    return np.fromfile(out, dtype=np.float32).reshape(len(TOKENS), -1), None


def hf_logits(d, c):
    from transformers import AutoModelForCausalLM
    kw = {}
    if c.get("model_type") == "kimi_k2":
        # Kimi K2's remote code is DeepSeek-V3's model; transformers runs it as deepseek_v3
        # (the FP8 branch below writes this config next to the dequantised weights).
        c = dict(c, model_type="deepseek_v3")
    if (c.get("rope_scaling") or {}).get("truncate") is False:
        import json, shutil
        c = dict(c, rope_scaling=dict(c["rope_scaling"], truncate=True))
        shutil.copytree(d, d + "-truncate", dirs_exist_ok=True)
        d = d + "-truncate"
        json.dump(c, open(os.path.join(d, "config.json"), "w"))
    vocab = c.get("vocab_size") or c.get("text_config", {}).get("vocab_size")
    if isinstance(c.get("pad_token_id"), int) and vocab and c["pad_token_id"] >= vocab:
        # The small models keep the real config's pad id (GLM-4.5's 151329, Phi-4's 100349),
        # past their 410 ids; transformers 5.24 refuses that in nn.Embedding. Padding plays no
        # part in the logits of given ids, so transformers runs without it.
        import json, shutil
        c = dict(c, pad_token_id=None)
        shutil.copytree(d, d + "-nopad", dirs_exist_ok=True)
        d = d + "-nopad"
        json.dump(c, open(os.path.join(d, "config.json"), "w"))
    q = (c.get("quantization_config") or {}).get("quant_method")
    if q == "fp8":
        # transformers' own FP8 dequantisation needs accelerate; the block-scaled formula is
        # short: weight * weight_scale_inv, each scale covering a BxB block.
        import json
        from safetensors.torch import load_file, save_file
        sd = load_file(os.path.join(d, "model.safetensors"))
        bs = c["quantization_config"]["weight_block_size"]
        for k in [k for k in sd if k.endswith(".weight_scale_inv")]:
            w = sd[k[: -len("_scale_inv")]]
            s = sd.pop(k).float().repeat_interleave(bs[0], 0).repeat_interleave(bs[1], 1)
            sd[k[: -len("_scale_inv")]] = w.float() * s[: w.shape[0], : w.shape[1]]
        d = d + "-dequant"
        os.makedirs(d, exist_ok=True)
        save_file({k: v.float().contiguous() for k, v in sd.items()}, os.path.join(d, "model.safetensors"))
        json.dump({k: v for k, v in c.items() if k != "quantization_config"}, open(os.path.join(d, "config.json"), "w"))
    if q == "mxfp4":
        from transformers import Mxfp4Config
        kw["quantization_config"] = Mxfp4Config(dequantize=True)
    m = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, **kw).float().eval()
    with torch.no_grad():
        return m(torch.tensor([TOKENS])).logits[0].float().numpy()


def mxfp4_as_f32(src, dst):
    """Rewrites SRC with every MXFP4 tensor dequantised to F32 (gguf-py); False if it has none."""
    from gguf import GGUFReader, GGUFWriter, GGUFValueType, GGMLQuantizationType
    from gguf.quants import dequantize
    r = GGUFReader(src)
    if not any(t.tensor_type == GGMLQuantizationType.MXFP4 for t in r.tensors):
        return False
    w = GGUFWriter(dst, arch=r.fields["general.architecture"].contents())
    for k, f in r.fields.items():
        if not k.startswith("GGUF.") and k != "general.architecture":
            t = f.types[0]
            w.add_key_value(k, f.contents(), t, sub_type=f.types[-1] if t == GGUFValueType.ARRAY else None)
    for t in r.tensors:
        data = np.asarray(t.data)
        if t.tensor_type == GGMLQuantizationType.MXFP4:
            data = dequantize(data, GGMLQuantizationType.MXFP4).astype(np.float32)
        w.add_tensor(t.name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return True


def vs_hf(lo, hf, checked):
    if hf is None:
        return None, False
    n = min(hf.shape[1], lo.shape[1])
    diff = float(np.abs(lo[:, :n] - hf[:, :n]).max())
    vs = f"{diff:.2e} (largest logit {float(np.abs(hf).max()):.2f})"
    over = checked and diff > F32_TOL
    return vs + (f" OVER {F32_TOL}" if over else ""), over


# Models llama.cpp cannot run, whichever converter wrote them (the reference's file alike).
SKIP = {
    "llama4text": "llama.cpp aborts (`GGML_ASSERT(f_attn_temp_scale != 0.0f)`) on a Llama 4 model "
                  "whose layers are all full attention: its graph scales the last layer's queries "
                  "by a temperature it sets only for chunked attention",
}


def main():
    rows, bad = [], False
    for arch, (make, _) in R.ARCHS.items():
        if R.ONLY and arch not in R.ONLY:
            continue
        if arch in SKIP:
            rows.append((arch, "all", "skipped: " + SKIP[arch], "", ""))
            continue
        d = R.build(arch, make)
        c = R.build.inputs[0]
        global TOKENS, F32_TOL
        TOKENS = tokens_for(c)
        F32_TOL = GELU_TOL if c.get("model_type", "").startswith("gemma") else 1e-3
        try:
            hf, hf_err = hf_logits(d, c), None
        except Exception as e:  # reported in the table (and fails the run); llama.cpp's still runs
            hf, hf_err = None, f"{type(e).__name__}: {e}"[:120]
            bad = True
        for ot in OUTTYPES:
            ref, ours = (os.path.join(R.WORK, f"{arch}.{ot}.{w}.gguf") for w in ("ref", "tftf"))
            for p in (ref, ours):
                if os.path.exists(p):
                    os.remove(p)
            r = subprocess.run([sys.executable, "-c", REF, d, "--outfile", ref, "--outtype", ot],
                               capture_output=True, text=True)
            t = subprocess.run([R.TFTF, "gguf", "-i", d, "-o", ours, "--outtype", ot, "--vocab-pre", "default", "-q"],
                               capture_output=True, text=True)
            if r.returncode or t.returncode:
                why = (r.stderr.strip().splitlines() or [""])[-1] if r.returncode else t.stderr.strip()
                rows.append((arch, ot, f"{'reference' if r.returncode else 'tftf'} failed: {why[:200]}", "", ""))
                bad = True
                continue
            kv_diff, t_diff, b_diff, _, _, _ = R.compare(ours, ref)
            same_tensors = not (t_diff or b_diff)
            lo, eo = llama_logits(ours)
            lr, er = llama_logits(ref)
            if eo or er:
                rows.append((arch, ot, f"load/decode failed: tftf: {eo or 'ok'}; reference: {er or 'ok'}", "", ""))
                bad = True
                continue
            if lo.shape != lr.shape:
                eq = f"shapes differ {lo.shape} vs {lr.shape}"
                bad = True
            elif lo.tobytes() == lr.tobytes():
                eq = "bit-equal"
            else:
                eq = f"DIFFER (max {np.abs(lo - lr).max():.3g})"
                bad = True
            has_mxfp4 = ot == "f32" and mxfp4_as_f32(ours, ours + ".deq.gguf")
            vs, over = vs_hf(lo, hf, ot == "f32" and not has_mxfp4)
            bad |= over
            tens = "tensors equal" if same_tensors else f"tensors DIFFER ({len(t_diff) + len(b_diff)})"
            rows.append((arch, ot, f"both load; {lo.shape[0]}x{lo.shape[1]} logits {eq}", tens,
                         vs or f"transformers failed: {hf_err}"))
            if has_mxfp4:
                ld, ed = llama_logits(ours + ".deq.gguf")
                if ed:
                    rows.append((arch, "f32, MXFP4 as F32", f"load/decode failed: {ed}", "", ""))
                    bad = True
                    continue
                vs, over = vs_hf(ld, hf, True)
                bad |= over
                rows.append((arch, "f32, MXFP4 as F32", "tftf's f32 file, MXFP4 tensors dequantised by gguf-py", "",
                             vs or f"transformers failed: {hf_err}"))
    print(f"tokens: {TOKENS}")
    print("| architecture | outtype | llama.cpp: tftf vs reference | tensor bytes | max abs diff vs transformers f32 |")
    print("|---|---|---|---|---|")
    for r in rows:
        print("| " + " | ".join(r) + " |")
    sys.exit(1 if bad else 0)


main()
