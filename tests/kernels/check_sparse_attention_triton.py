"""Rendered Triton DSA sparse attention, loaded by runtime.kernels.loader as a bundle's kernels are, against the
PyTorch reference, forward and backward; then a tiny HF DeepSeek-V3.2 with the kernel selected against
HuggingFace eager.

Run in its own process with TRITON_INTERPRET=1 (Triton reads it at import): tests/test_sparse_attention.py does.
Exits non-zero with the failing check on stderr.
"""

import copy
import sys
from pathlib import Path

import torch

from runtime.attention.dsa import (
    reset_sparse_calls,
    sparse_calls,
    swap_sparse_attention,
)
from runtime.attention.sparse import sparse_attention, sparse_attention_reference
from runtime.kernels import registry
from runtime.kernels.loader import load_rendered


def close(a, b, what, tol=1e-5):
    err = ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()
    if err > tol:
        sys.exit(f"{what}: max |diff| / max |ref| {err:.3g} > {tol}")
    print(f"{what}: ok ({err:.1e})")


def picks(batch, seq, keys_len, top_k, gen):
    """Distinct keys per query, causal ones kept and the rest -1; query 0 of batch 0 sees nothing."""
    idx = torch.stack([torch.randperm(keys_len, generator=gen)[:top_k] for _ in range(batch * seq)])
    idx = idx.view(batch, seq, top_k)
    idx = idx.masked_fill(idx > torch.arange(seq)[:, None] + keys_len - seq, -1)
    idx[0, 0] = -1
    return idx.to(torch.int32)


def check_layouts(kernel):
    gen = torch.Generator().manual_seed(0)
    # (heads, kv heads, qk dim, v dim, top-k): MLA-like per-head keys with Dk != Dv, GQA, MQA, top-k not a
    # multiple of the key block
    for heads, kv_heads, dk, dv, top_k in ((3, 3, 24, 12, 8), (4, 2, 16, 16, 20), (4, 1, 8, 20, 5)):
        batch, seq, keys_len = 2, 11, 23
        q = torch.randn(batch, heads, seq, dk, generator=gen, requires_grad=True)
        kk = torch.randn(batch, kv_heads, keys_len, dk, generator=gen, requires_grad=True)
        # values as a strided view, the way HF splits them out of one projection
        kv = torch.randn(batch, keys_len, kv_heads, dv + 3, generator=gen)
        v = kv[..., 3:].transpose(1, 2).detach().requires_grad_()
        idx = picks(batch, seq, keys_len, top_k, gen)
        ins = [t.detach().clone().requires_grad_() for t in (q, kk, v)]
        got = kernel(q, kk, v, idx, 0.3)
        ref = sparse_attention_reference(*ins, idx, 0.3)
        what = f"H={heads} Hkv={kv_heads} Dk={dk} Dv={dv} K={top_k}"
        close(got, ref, f"forward {what}")
        grad = torch.randn(ref.shape, generator=gen)
        got.backward(grad)
        ref.backward(grad)
        for name, a, b in zip("qkv", (q, kk, v), ins):
            close(a.grad, b.grad, f"d{name} {what}")


def check_hf_model():
    from transformers import AutoModelForCausalLM, DeepseekV32Config

    cfg = DeepseekV32Config(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                            num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=16, q_lora_rank=24,
                            qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, index_topk=4, index_n_heads=2,
                            index_head_dim=16, first_k_dense_replace=1, attn_implementation="eager")
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(cfg)
    ours = copy.deepcopy(hf)
    swap_sparse_attention(ours)
    ids = torch.randint(0, 64, (1, 12))
    ref = hf(input_ids=ids, labels=ids)
    ref.loss.backward()
    reset_sparse_calls()
    out = ours(input_ids=ids, labels=ids)
    out.loss.backward()
    if sparse_calls()["sparse"] != 1:
        sys.exit(f"the runtime's sparse attention did not run: {sparse_calls()}")
    close(out.logits, ref.logits, "HF DeepSeek-V3.2 logits, triton kernel")
    for (name, a), b in zip(ours.named_parameters(), hf.parameters()):
        if b.grad is not None:
            close(a.grad, b.grad, f"grad {name}", 1e-4)


def main(path: str) -> None:
    torch.set_num_threads(1)
    loaded = load_rendered(Path(path).parent)
    if Path(path).name not in loaded:
        sys.exit(f"the loader did not load {path}: {loaded}")
    registry.use("triton")
    kernel = registry.lookup("attention.sparse", sparse_attention_reference)
    if kernel is sparse_attention_reference or registry.backend_of("attention.sparse", sparse_attention) != "triton":
        sys.exit("the rendered kernel did not register as attention.sparse under the triton backend")
    print("loaded and registered under the triton backend: ok")
    check_layouts(kernel)
    check_hf_model()


if __name__ == "__main__":
    main(sys.argv[1])
