#!/usr/bin/env python3
"""Writes the PyTorch inputs of bench/torch.sh (random values, fixed seeds), with torch itself:

  torch_model.py bin OUT.bin GIB   one torch.save zip file (torch.save's default format)
  torch_model.py dcp OUT_DIR GIB   a 2-rank PyTorch Distributed Checkpoint: two gloo ranks
                                   (torch.multiprocessing) each hold their dim-0 half of every
                                   tensor as a DTensor (Shard(0), FSDP2's layout) and call
                                   torch.distributed.checkpoint.save -> .metadata,
                                   __0_0.distcp, __1_0.distcp

Layout for GIB GiB (the same for both): `model.embed_tokens.weight` BF16 [rows, 4096] holding
half the bytes (1 GiB at GIB=2), then `model.layers.{i}.mlp.weight` BF16 [4096, 4096] (32 MiB)
and `model.layers.{i}.norm.weight` F32 [4096] until the total reaches GIB GiB, and
`lm_head.weight` F32 [2048, 4096] (32 MiB). Every row count is even, so the two ranks' halves
are equal."""
import os, sys
import torch

COLS = 4096
MIB = 1 << 20


def layout(gib):
    total = int(gib * (1 << 30))
    big_rows = max(2, (total // 2) // (COLS * 2) // 2 * 2)
    t = [("model.embed_tokens.weight", (big_rows, COLS), torch.bfloat16)]
    left = total - big_rows * COLS * 2 - 32 * MIB
    for i in range(max(0, -(-left // (32 * MIB + COLS * 4)))):  # at least GIB GiB in all
        t += [(f"model.layers.{i}.mlp.weight", (COLS, COLS), torch.bfloat16),
              (f"model.layers.{i}.norm.weight", (COLS,), torch.float32)]
    t.append(("lm_head.weight", (2048, COLS), torch.float32))
    return t


def values(k, rank, shape, dtype):
    g = torch.Generator().manual_seed(1000 * k + rank)
    return torch.randn(shape, generator=g, dtype=torch.float32).to(dtype)


def rank_main(rank, out, gib, port):
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    mesh = init_device_mesh("cpu", (2,))
    sd = {}
    for k, (name, shape, dtype) in enumerate(layout(gib)):
        local = values(k, rank, (shape[0] // 2,) + shape[1:], dtype)
        sd[name] = DTensor.from_local(local, mesh, [Shard(0)], shape=torch.Size(shape),
                                      stride=torch.empty(shape, device="meta").stride())
    dcp.save(sd, checkpoint_id=out)
    dist.barrier()
    dist.destroy_process_group()


def main():
    kind, out, gib = sys.argv[1], sys.argv[2], float(sys.argv[3])
    if kind == "bin":
        # torch.save writes each tensor's storage contiguously in the zip (stored, 64-byte aligned).
        sd = {name: values(k, 0, shape, dtype) for k, (name, shape, dtype) in enumerate(layout(gib))}
        torch.save(sd, out)
    elif kind == "dcp":
        import torch.multiprocessing as mp
        os.makedirs(out, exist_ok=True)
        mp.spawn(rank_main, args=(out, gib, 29500 + os.getpid() % 1000), nprocs=2)
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main()
