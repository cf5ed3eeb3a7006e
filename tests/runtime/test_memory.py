"""Memory policies: activation offload and recompute change where activations live, never the numbers."""

import copy
import gc
import weakref

import pytest
import torch

from onboard.train.model import build_model
from runtime.memory import ActivationOffload, apply_recompute
from runtime.memory.offload import FileStore, selected


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
    offload = ActivationOffload(policy, store, min_bytes=0)
    with offload:
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    offload.close()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, offload


@pytest.mark.parametrize("policy", ["moe", "all"])
def test_offload_gives_identical_loss_and_gradients(pristine, policy):
    loss, grads, _ = _loss_and_grads(_model(pristine))
    offloaded_loss, offloaded_grads, offload = _loss_and_grads(_model(pristine), policy)
    assert offload.offloaded_bytes > 0 and offload.store.bytes_out == offload.offloaded_bytes
    assert torch.equal(loss, offloaded_loss)
    assert grads.keys() == offloaded_grads.keys()
    for name in grads:
        assert torch.equal(grads[name], offloaded_grads[name]), name


def test_moe_policy_offloads_only_grouped_matmul_outputs(pristine):
    moe = _loss_and_grads(_model(pristine), "moe")[2].offloaded_bytes
    every = _loss_and_grads(_model(pristine), "all")[2].offloaded_bytes
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


def _alive_after_forward(model, offload: bool) -> list[bool]:
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
    context = ActivationOffload("moe", store, min_bytes=0) if offload else torch.autograd.graph.saved_tensors_hooks(
        keep, lambda t: t)
    with context:
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    store._io.submit(lambda: None).result()  # every write has finished
    gc.collect()
    alive = [r() is not None for r in refs]
    loss.backward()
    store.close()
    return alive


def test_offloaded_activations_leave_memory_until_backward(pristine):
    """With offload the originals are freed after forward (the store holds the bytes); without, they stay."""
    offloaded = _alive_after_forward(_model(pristine), offload=True)
    kept = _alive_after_forward(_model(pristine), offload=False)
    assert offloaded and not any(offloaded)
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


def test_recompute_and_offload_together(pristine):
    """Recomputed blocks save only their inputs (so nothing inside them is offloaded); the rest still is."""
    loss, grads, alone = _loss_and_grads(_model(pristine), "all")
    rloss, rgrads, offload = _loss_and_grads(_model(pristine), "all", "selective")
    assert 0 < offload.offloaded_bytes < alone.offloaded_bytes
    assert torch.equal(loss, rloss)
    for name in grads:
        assert torch.equal(grads[name], rgrads[name]), name


def test_recompute_wraps_what_the_policy_names(pristine):
    assert len(apply_recompute(_model(pristine), "full").parts) == 2
    assert len(apply_recompute(_model(pristine), "selective").parts) == 2  # two runtime MoE blocks
    assert not apply_recompute(_model(pristine), "none").parts
    with pytest.raises(ValueError, match="recompute policy"):
        apply_recompute(_model(pristine), "everything")
    with pytest.raises(ValueError, match="offload policy"):
        ActivationOffload("disk")
