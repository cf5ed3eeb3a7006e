"""Memory policies: activation swap and recompute change where activations live, never the numbers."""

import copy
import gc
import weakref

import pytest
import torch

from onboard.train import build_model
from runtime.memory import ActivationSwap, apply_recompute
from runtime.memory.swap import FileStore, selected


@pytest.fixture(scope="module")
def bundle(mixtral_bundle):
    return mixtral_bundle


@pytest.fixture(scope="module")
def pristine(bundle):
    torch.manual_seed(0)
    return build_model(bundle, layers=2)[0]


def _model(pristine):
    return copy.deepcopy(pristine)  # the same weights each time, and untouched by recompute wrappers


def _loss_and_grads(model, policy="none", recompute="none", store=None):
    apply_recompute(model, recompute)
    ids = torch.randint(0, model.config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(1))
    swap = ActivationSwap(policy, store, min_bytes=0)
    with swap:
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    swap.close()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, swap


@pytest.mark.parametrize("policy", ["moe", "all"])
def test_swap_gives_identical_loss_and_gradients(pristine, policy):
    loss, grads, _ = _loss_and_grads(_model(pristine))
    swapped_loss, swapped_grads, swap = _loss_and_grads(_model(pristine), policy)
    assert swap.swapped_bytes > 0 and swap.store.bytes_out == swap.swapped_bytes
    assert torch.equal(loss, swapped_loss)
    assert grads.keys() == swapped_grads.keys()
    for name in grads:
        assert torch.equal(grads[name], swapped_grads[name]), name


def test_moe_policy_swaps_only_grouped_matmul_outputs(pristine):
    moe = _loss_and_grads(_model(pristine), "moe")[2].swapped_bytes
    every = _loss_and_grads(_model(pristine), "all")[2].swapped_bytes
    assert 0 < moe < every


def test_selection_by_producing_op():
    x = torch.randn(4, 8, requires_grad=True)
    w = torch.randn(8, 8, requires_grad=True)
    y = x @ w
    assert selected(y, "all") and not selected(y, "moe")
    assert selected(y.t(), "all")  # a view of a matmul output is still one
    assert not selected(torch.relu(y), "all")
    assert not selected(w, "all")  # parameters stay: they are not activations
    assert not selected(y, "none")


def _alive_after_forward(model, swap: bool) -> list[bool]:
    """Which grouped-matmul outputs saved for backward are still alive once forward has finished."""
    refs = []
    store = FileStore()
    put = store.put

    def recording_put(t):
        refs.append(weakref.ref(t))
        return put(t)

    def keep(t):
        if selected(t, "moe"):
            refs.append(weakref.ref(t))
        return t

    store.put = recording_put
    ids = torch.randint(0, model.config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(1))
    context = ActivationSwap("moe", store, min_bytes=0) if swap else torch.autograd.graph.saved_tensors_hooks(
        keep, lambda t: t)
    with context:
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    store._io.submit(lambda: None).result()  # every write has finished
    gc.collect()
    alive = [r() is not None for r in refs]
    loss.backward()
    store.close()
    return alive


def test_swapped_activations_leave_memory_until_backward(pristine):
    """With swap the originals are freed after forward (the store holds the bytes); without, they stay."""
    swapped = _alive_after_forward(_model(pristine), swap=True)
    kept = _alive_after_forward(_model(pristine), swap=False)
    assert swapped and not any(swapped)
    assert kept and all(kept)


@pytest.mark.parametrize("policy", ["full", "selective"])
def test_recompute_gives_identical_gradients_and_keeps_names(pristine, policy):
    loss, grads, _ = _loss_and_grads(_model(pristine))
    model = _model(pristine)
    names = list(model.state_dict())
    rloss, rgrads, _ = _loss_and_grads(model, recompute=policy)
    assert list(model.state_dict()) == names
    assert torch.equal(loss, rloss)
    for name in grads:
        assert torch.equal(grads[name], rgrads[name]), name


def test_recompute_and_swap_together(pristine):
    """Recomputed blocks save only their inputs (so nothing inside them is swapped); the rest still is."""
    loss, grads, alone = _loss_and_grads(_model(pristine), "all")
    rloss, rgrads, swap = _loss_and_grads(_model(pristine), "all", "selective")
    assert 0 < swap.swapped_bytes < alone.swapped_bytes
    assert torch.equal(loss, rloss)
    for name in grads:
        assert torch.equal(grads[name], rgrads[name]), name


def test_recompute_wraps_what_the_policy_names(pristine):
    assert apply_recompute(_model(pristine), "full") == 2
    assert apply_recompute(_model(pristine), "selective") == 2  # two runtime MoE blocks
    assert apply_recompute(_model(pristine), "none") == 0
    with pytest.raises(ValueError, match="recompute policy"):
        apply_recompute(_model(pristine), "everything")
    with pytest.raises(ValueError, match="swap policy"):
        ActivationSwap("disk")
