#!/usr/bin/env python3
"""Baselines and the output check of bench/torch.sh.

  torch_check.py bin-st IN.bin OUT.safetensors    torch.load(mmap=False) + safetensors save_file
  torch_check.py dcp-pt IN_DIR OUT.pt             torch.distributed.checkpoint.format_utils
                                                  .dcp_to_torch_save
  torch_check.py dcp-st IN_DIR OUT.safetensors    dcp_to_torch_save's load (the whole state dict
                                                  in memory, no process group) + save_file
  torch_check.py compare A B                      A, B: a .safetensors file or a folder of them,
                                                  or a torch.save file (mmap-loaded); same names,
                                                  dtypes, shapes and bytes, tensor by tensor"""
import glob, os, sys
import torch


def load_dcp(d):
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict
    sd = {}
    _load_state_dict(sd, storage_reader=FileSystemReader(d), planner=_EmptyStateDictLoadPlanner(),
                     no_dist=True)
    return sd


class Side:
    """Tensors of one side, opened lazily (safetensors by mmap, torch.save by mmap)."""

    def __init__(self, path):
        from safetensors import safe_open
        self.get, self.keys = {}, []
        if path.endswith((".pt", ".bin")):
            sd = torch.load(path, mmap=True, weights_only=True)
            self.keys = list(sd)
            self.get = {k: (lambda k=k: sd[k]) for k in sd}
            return
        files = sorted(glob.glob(os.path.join(path, "*.safetensors"))) if os.path.isdir(path) else [path]
        for f in files:
            h = safe_open(f, framework="pt")
            for k in h.keys():
                self.keys.append(k)
                self.get[k] = lambda k=k, h=h: h.get_tensor(k)


def compare(a, b):
    A, B = Side(a), Side(b)
    if set(A.keys) != set(B.keys):
        sys.exit(f"MISMATCH: names differ: only in {a}: {sorted(set(A.keys) - set(B.keys))[:5]}, "
                 f"only in {b}: {sorted(set(B.keys) - set(A.keys))[:5]}")
    n = 0
    for k in A.keys:
        x, y = A.get[k](), B.get[k]()
        if x.dtype != y.dtype or x.shape != y.shape:
            sys.exit(f"MISMATCH: {k}: {x.dtype} {tuple(x.shape)} vs {y.dtype} {tuple(y.shape)}")
        if not torch.equal(x.contiguous().reshape(-1).view(torch.uint8),
                           y.contiguous().reshape(-1).view(torch.uint8)):
            sys.exit(f"MISMATCH: {k}: bytes differ")
        n += x.numel() * x.element_size()
    print(f"equal: {len(A.keys)} tensors, {n} bytes, names, dtypes, shapes and bytes")


def main():
    mode = sys.argv[1]
    if mode == "bin-st":
        from safetensors.torch import save_file
        save_file(torch.load(sys.argv[2], mmap=False, weights_only=True), sys.argv[3])
    elif mode == "dcp-pt":
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
        dcp_to_torch_save(sys.argv[2], sys.argv[3])
    elif mode == "dcp-st":
        from safetensors.torch import save_file
        save_file(load_dcp(sys.argv[2]), sys.argv[3])
    elif mode == "compare":
        compare(sys.argv[2], sys.argv[3])
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main()
