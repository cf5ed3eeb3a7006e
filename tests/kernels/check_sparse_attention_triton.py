"""Rendered Triton DSA sparse attention, loaded from the kernel store as a bundle's kernels are, against the
PyTorch reference, forward and backward, without and with per-head attention sinks (the sinks' gradient too);
then tiny HF DeepSeek-V3.2 and HunYuan-V4 (whose attention has sinks) models with the kernel selected against
HuggingFace eager.

Run in its own process with TRITON_INTERPRET=1 (Triton reads it at import): tests/runtime/test_sparse_attention.py does.
Exits non-zero with the failing check on stderr.
"""

import copy
import sys

import torch

from runtime.attention.dsa import find_sparse_attention, swap_sparse_attention
from runtime.attention.sparse import sparse_attention, sparse_attention_reference
from runtime.kernels import registry
from runtime.kernels.store import load_kernels
from tests.helpers import check_close


def picks(batch, seq, keys_len, top_k, gen):
    """Distinct keys per query, causal ones kept and the rest -1; query 0 of batch 0 sees nothing."""
    idx = torch.stack([torch.randperm(keys_len, generator=gen)[:top_k] for _ in range(batch * seq)])
    idx = idx.view(batch, seq, top_k)
    idx = idx.masked_fill(idx > torch.arange(seq)[:, None] + keys_len - seq, -1)
    idx[0, 0] = -1
    return idx.to(torch.int32)


def sinks_for(heads, gen):
    """Sinks of both signs and sizes: one that outweighs every pick (the running max moves to the sink) and, with
    three heads or more, one at -inf (no sink for that head: the sink-free softmax)."""
    sinks = torch.randn(heads, generator=gen) * 2
    sinks[0] = 6.0
    if heads >= 3:
        sinks[1] = float("-inf")
    return sinks


def check_layouts(kernel):
    gen = torch.Generator().manual_seed(0)
    # (heads, kv heads, qk dim, v dim, top-k): MLA-like per-head keys with Dk != Dv, GQA, MQA, top-k not a
    # multiple of the key block
    for heads, kv_heads, dk, dv, top_k in ((3, 3, 24, 12, 8), (4, 2, 16, 16, 20), (4, 1, 8, 20, 5)):
        batch, seq, keys_len = 2, 11, 23
        q = torch.randn(batch, heads, seq, dk, generator=gen)
        kk = torch.randn(batch, kv_heads, keys_len, dk, generator=gen)
        # values as a strided view, the way HF splits them out of one projection
        kv = torch.randn(batch, keys_len, kv_heads, dv + 3, generator=gen)
        v = kv[..., 3:].transpose(1, 2)
        idx = picks(batch, seq, keys_len, top_k, gen)
        grad = torch.randn(batch, heads, seq, dv, generator=gen)
        what = f"H={heads} Hkv={kv_heads} Dk={dk} Dv={dv} K={top_k}"
        compare(kernel, (q, kk, v), idx, None, grad, what)
        compare(kernel, (q, kk, v), idx, sinks_for(heads, gen), grad, f"{what} sinks")


def compare(kernel, tensors, idx, sinks, grad, what):
    """Kernel against reference, output and the gradients of q, k, v (and the sinks when there are)."""
    leaves = tensors if sinks is None else (*tensors, sinks)
    ours = [t.detach().clone().requires_grad_() for t in leaves]
    ins = [t.detach().clone().requires_grad_() for t in leaves]
    got = kernel(*ours[:3], idx, 0.3, *ours[3:])
    ref = sparse_attention_reference(*ins[:3], idx, 0.3, *ins[3:])
    check_close(got, ref, f"forward {what}", 1e-5)
    got.backward(grad)
    ref.backward(grad)
    for name, a, b in zip(("q", "k", "v", "sinks"), ours, ins):
        check_close(a.grad, b.grad, f"d{name} {what}", 1e-5)


def ran(*args) -> str:
    """The module of the autograd Function `sparse_attention` ran: the rendered kernel's or the reference's."""
    return sparse_attention(*args).grad_fn._forward_cls.__module__


def check_dispatch(kernel):
    """`sparse_attention` hands sinks to the kernel when the triton backend is active, as it does the sink-free
    call; a kernel without a `sinks` parameter (one an older bundle rendered) keeps the sink-free calls and leaves
    attention with sinks to the reference."""
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(1, 2, 5, 8, generator=gen, requires_grad=True)
    kk, v = (torch.randn(1, 2, 5, 8, generator=gen) for _ in range(2))
    idx, sinks = picks(1, 5, 5, 3, gen), torch.randn(2, generator=gen)
    args = (q, kk, v, idx, 0.3)
    reference = sparse_attention_reference.__module__
    if (ran(*args), ran(*args, sinks)) != (kernel.__module__, kernel.__module__):
        sys.exit(f"the triton backend should run both calls: {ran(*args)}, with sinks {ran(*args, sinks)}")

    def older(q, k, v, indices, scale):  # the kernel's contract before it had sinks
        return kernel(q, k, v, indices, scale)

    registry.register("attention.sparse", "triton", older)
    try:
        if (ran(*args), ran(*args, sinks)) != (kernel.__module__, reference):
            sys.exit(f"a sink-free kernel: {ran(*args)}, with sinks {ran(*args, sinks)}")
    finally:
        registry.register("attention.sparse", "triton", kernel)
    print("dispatch: sinks to the triton kernel, to the reference past a kernel without sinks: ok")


def kernel_nodes(loss, module: str) -> int:
    """How many autograd nodes of `module`'s Functions the loss's graph holds: the kernel calls backward runs."""
    seen, todo, count = set(), [loss.grad_fn], 0
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        count += getattr(getattr(node, "_forward_cls", None), "__module__", None) == module
        todo.extend(next_node for next_node, _ in node.next_functions)
    return count


def check_hf_model(what, hf, layers, kernel):
    """`hf` swapped onto the runtime (the kernel selected) against itself in eager: logits and every gradient,
    the sinks' included where the attention has them; each of the `layers` sparse layers ran the kernel."""
    ours = copy.deepcopy(hf)
    swaps = [swap_sparse_attention(ours.get_submodule(p), path=p) for p in find_sparse_attention(ours)]
    ids = torch.randint(0, hf.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(0))
    ref = hf(input_ids=ids, labels=ids)
    ref.loss.backward()
    out = ours(input_ids=ids, labels=ids)
    sparse = sum(s.calls["sparse"] for s in swaps)
    if sparse != layers or kernel_nodes(out.loss, kernel.__module__) != layers:
        sys.exit(f"{what}: the kernel did not run in each of {layers} sparse layers: {sparse} sparse calls, "
                 f"{kernel_nodes(out.loss, kernel.__module__)} kernel calls")
    out.loss.backward()
    check_close(out.logits, ref.logits, f"HF {what} logits, triton kernel")
    for (name, a), b in zip(ours.named_parameters(), hf.parameters()):
        if b.grad is not None:
            check_close(a.grad, b.grad, f"grad {name}", 1e-4)


def deepseek_v32():
    from transformers import AutoModelForCausalLM, DeepseekV32Config

    cfg = DeepseekV32Config(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                            num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=16, q_lora_rank=24,
                            qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, index_topk=4, index_n_heads=2,
                            index_head_dim=16, first_k_dense_replace=1, attn_implementation="eager")
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg)


def hunyuan_v4():
    """Two DSA layers, the second reusing the first's picks; sinks drawn large enough to matter (HF starts them
    at 0)."""
    from transformers import AutoModelForCausalLM, HYV4Config

    cfg = HYV4Config(vocab_size=64, pad_token_id=0, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4,
                     num_experts_per_tok=2, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, head_dim=8,
                     qk_nope_head_dim=8, v_head_dim=8, index_topk=4, index_n_heads=2, index_head_dim=16,
                     indexer_types=["full", "shared"], mlp_layer_types=["dense", "dense"], bos_token_id=1,
                     eos_token_id=2, attn_implementation="eager")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("sinks"):
                p.normal_(0, 1.0)
    return model


def main(key: str) -> None:
    torch.set_num_threads(1)
    loaded = load_kernels([key])
    if key not in loaded:
        sys.exit(f"the store did not load {key}: {loaded}")
    registry.use("triton")
    kernel = registry.lookup("attention.sparse", sparse_attention_reference)
    if kernel is sparse_attention_reference or registry.backend_of("attention.sparse", sparse_attention) != "triton":
        sys.exit("the rendered kernel did not register as attention.sparse under the triton backend")
    print("loaded and registered under the triton backend: ok")
    check_layouts(kernel)
    check_dispatch(kernel)
    check_hf_model("DeepSeek-V3.2", deepseek_v32(), 1, kernel)
    check_hf_model("HunYuan-V4", hunyuan_v4(), 2, kernel)


if __name__ == "__main__":
    main(sys.argv[1])
