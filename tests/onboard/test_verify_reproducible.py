"""Verification's numbers go into the bundle: the same twin and adapter give the same bytes of verification.json
on every run, whatever the machine's load or core count (`onboard.adapt.verify.reproducible`)."""

import torch

from onboard.adapt.verify import THREADS, reproducible, verify


def _gather_backward(threads: int) -> set[bytes]:
    """What transformers' grouped-GEMM experts do to route tokens: gather each token once per expert it goes to
    (duplicate indices), then add the duplicates' gradients back; the distinct results of 20 runs."""
    torch.set_num_threads(threads)
    tokens, width, top_k = 320, 64, 4
    index = torch.randint(0, tokens, (tokens * top_k,), generator=torch.Generator().manual_seed(0))
    grad = torch.randn(tokens * top_k, width, generator=torch.Generator().manual_seed(1))
    seen = set()
    for _ in range(20):
        x = torch.zeros(tokens, width, requires_grad=True)
        x[index].backward(grad)
        seen.add(x.grad.numpy().tobytes())
    return seen


def test_inside_verification_a_gather_backward_gives_one_result_on_any_thread_count():
    threads, deterministic = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    try:
        with reproducible():
            assert torch.get_num_threads() == THREADS and torch.are_deterministic_algorithms_enabled()
            assert len(_gather_backward(THREADS)) == 1
        with reproducible():
            one = _gather_backward(1)
        with reproducible():
            three = _gather_backward(3)
        assert len(one) == 1 and one == three
    finally:
        torch.set_num_threads(threads)
    assert torch.get_num_threads() == threads and torch.are_deterministic_algorithms_enabled() == deterministic


def test_verification_of_a_routed_twin_is_the_same_bytes_on_every_run(twin_adapter, tmp_path):
    """Qwen3-Next's twin: its HuggingFace reference routes tokens through transformers' grouped-GEMM experts; the
    strong-decay seed runs the longest sequence."""
    spec, twin, decision, adapt = twin_adapter(tmp_path, ref="qwen3-next-80b-a3b")
    runs = set()
    for threads in (2, 1, 2):
        torch.set_num_threads(threads)
        runs.add(verify(spec, twin, adapt, decision.taken(), seeds=(2,)).to_json())
    torch.set_num_threads(2)
    assert len(runs) == 1
