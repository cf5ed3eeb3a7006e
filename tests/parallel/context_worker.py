"""One rank of the context-parallel linear attention checks (tests/runtime/test_context_parallel.py).

Usage: python context_worker.py <job.json>, with RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT set; the job is
one case or {"cases": [...]}, run one after another in one process group (a gloo world is started once for all of
them; a case that raises leaves its error beside its outputs, and the next case runs). Every rank draws the same whole sequence from the job's seed, keeps its segments (contiguous or zig-zag), runs the job's core
under `runtime.parallel.context` (the gated delta rule, or scalar-decay linear attention: SSD, lightning) on them,
backpropagates the loss sum(out * weights) and writes its segments' outputs and input gradients, with their token
positions, for the test to compare with one process over the whole sequence.
"""

import json
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

torch.set_num_threads(1)


def inputs(job: dict):
    """The whole sequence's inputs and the loss weights, the same on every rank and in the test."""
    gen = torch.Generator().manual_seed(job["seed"])
    t, hk, h, kd, vd = job["tokens"], job["key_heads"], job["heads"], job["key_dim"], job["value_dim"]
    q = torch.randn(1, t, hk, kd, generator=gen, dtype=torch.float64)
    k = torch.randn(1, t, hk, kd, generator=gen, dtype=torch.float64)
    v = torch.randn(1, t, h, vd, generator=gen, dtype=torch.float64)
    shape = (1, t, h, kd) if job["per_channel"] else (1, t, h)
    g = -torch.rand(*shape, generator=gen, dtype=torch.float64) * 0.5
    beta = torch.rand(1, t, h, generator=gen, dtype=torch.float64)
    weights = torch.randn(1, t, h, vd, generator=gen, dtype=torch.float64)
    if job.get("core") == "scalar_decay":
        return [q, k, v, g], weights
    if job.get("core") == "conv":  # (B, C, T) channels first, a (C, W) depthwise filter and its bias
        x = torch.randn(1, 6, t, generator=gen, dtype=torch.float64)
        w = torch.randn(6, 4, generator=gen, dtype=torch.float64)
        b = torch.randn(6, generator=gen, dtype=torch.float64)
        return [x, w, b], torch.randn(1, 6, t, generator=gen, dtype=torch.float64)
    if job.get("core") == "dsa":  # attention (B, H, T, D), one key head (MLA's); the indexer's own inputs
        # positive index queries and keys: relu leaves no zero scores, so no two keys tie for a place in the top-k
        # (whose order among equals follows the keys' order, which the gather changes)
        iq = torch.rand(1, t, 2, 4, generator=gen, dtype=torch.float64)
        ik = torch.rand(1, t, 4, generator=gen, dtype=torch.float64)
        iw = torch.rand(1, t, 2, generator=gen, dtype=torch.float32)  # the indexer takes fp32 weights
        return [q.transpose(1, 2).repeat_interleave(h // hk, 1), k.transpose(1, 2)[:, :1], v.transpose(1, 2)[:, :1],
                iq, ik, iw], weights.transpose(1, 2)
    if job.get("core") == "softmax":  # (B, H, T, D) as attention takes them
        return [q.transpose(1, 2).repeat_interleave(h // hk, 1), k.transpose(1, 2), v.transpose(1, 2)[:, :hk]], \
            weights.transpose(1, 2)
    return [q, k, v, g, beta], weights


def documents_of(job: dict) -> torch.Tensor | None:
    """Each position's document id (softmax attention's mask)."""
    if not job["documents"]:
        return None
    ids = torch.zeros(job["tokens"], dtype=torch.long)
    ids[job["documents"]] = 1
    return ids.cumsum(0)


def reset_of(job: dict) -> torch.Tensor | None:
    """Scalar-decay cores mark packed documents by the tokens where the state restarts."""
    if not job["documents"]:
        return None
    reset = torch.zeros(1, job["tokens"], dtype=torch.bool)
    reset[0, job["documents"]] = True
    return reset


def main() -> None:
    job = json.loads(Path(sys.argv[1]).read_text())
    dist.init_process_group("gloo")
    for case in job.get("cases", [job]):
        try:
            run(case)
        except Exception:  # noqa: BLE001 - the test reads it and fails that case alone
            (Path(case["out"]) / f"error{dist.get_rank()}.txt").write_text(traceback.format_exc())
    dist.destroy_process_group()


def run(job: dict) -> None:
    from runtime.parallel.context import (context_parallel_attention, context_parallel_conv1d,
                                          context_parallel_gated_delta, context_parallel_scalar_decay,
                                          context_parallel_sparse_attention, zigzag)

    rank, world = dist.get_rank(), dist.get_world_size()
    parts, weights = inputs(job)
    n_segments = 2 * world if job["zigzag"] else world
    segments = zigzag(world)[rank] if job["zigzag"] else [rank]
    segments = sorted(segments)
    per = job["tokens"] // n_segments
    positions = torch.cat([torch.arange(s * per, (s + 1) * per) for s in segments])
    attention = job.get("core") in ("softmax", "dsa", "conv")
    seq = 2 if attention else 1  # the sequence dim
    dsa = job.get("core") == "dsa"  # the indexer's inputs (after the first three) are (B, T, ...) and take no gradient
    if job.get("core") == "conv":  # the filter and bias are whole on every rank (their gradients summed below)
        mine = [parts[0].index_select(2, positions).clone().requires_grad_(True),
                parts[1].clone().requires_grad_(True), parts[2].clone().requires_grad_(True)]
    else:
        mine = [x.index_select(seq if i < 3 or not attention else 1, positions).clone().requires_grad_(i < 3 or not dsa)
                for i, x in enumerate(parts)]
    starts = [[d - s * per for d in job["documents"] if s * per < d < (s + 1) * per] for s in segments]
    if job.get("core") == "conv":
        out = context_parallel_conv1d(*mine, activation="silu", group=dist.group.WORLD, segments=segments,
                                      n_segments=n_segments, documents=documents_of(job))
    elif job.get("core") == "dsa":
        out = context_parallel_sparse_attention(*mine, group=dist.group.WORLD, positions=positions, top_k=job["top_k"],
                                                scale=job["key_dim"] ** -0.5, documents=documents_of(job))
    elif job.get("core") == "softmax":
        out = context_parallel_attention(*mine, group=dist.group.WORLD, positions=positions,
                                         documents=documents_of(job), window=job.get("window"),
                                         chunk=job.get("attention_chunk"))
    elif job.get("core") == "scalar_decay":
        reset = reset_of(job)
        out = context_parallel_scalar_decay(*mine, group=dist.group.WORLD, segments=segments, n_segments=n_segments,
                                            reset=None if reset is None else reset[:, positions],
                                            chunk_size=job["chunk"])
    else:
        out = context_parallel_gated_delta(*mine, group=dist.group.WORLD, segments=segments,
                                           n_segments=n_segments, starts=starts, chunk_size=job["chunk"],
                                           use_qk_l2norm_in_kernel=True)
    (out * weights.index_select(seq, positions)).sum().backward()
    if job.get("core") == "conv":  # parameters' gradients: each rank has its tokens' share; the sum is the whole
        for p in mine[1:]:
            dist.all_reduce(p.grad)
    torch.save({"positions": positions, "out": out.detach(), "grads": [x.grad for x in mine[:5]]},
               Path(job["out"]) / f"rank{rank}.pt")


if __name__ == "__main__":
    main()
