"""Verification's rule for one tensor against its fp64 truth (issue 36): the adapted error may be at most
ERR_FACTOR x HuggingFace's own fp32 error on the same tensor plus ERR_FLOOR, both relative to that tensor's own
largest true value, never the model's. A gradient 10 % off is caught however small the tensor is."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from onboard.adapt.verify import ERR_FACTOR, ERR_FLOOR, TENSOR_SCALE_MIN, against_truth, judge, same_function


def _tensors(scale: float, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    truth = torch.randn(64, generator=gen, dtype=torch.float64) * scale
    hf = truth.float()  # fp32 rounding: HuggingFace's error is fp32's resolution
    return truth, hf


def test_a_tenth_off_fails_at_any_scale():
    for scale in (1.0, 1e-4, 1e-9, 1e-30):
        truth, hf = _tensors(scale)
        _, error, excess = judge(hf, (truth * 1.1).float(), truth)
        assert excess > 0 and 0.09 < error < 0.11, (scale, error)


def test_an_error_like_huggingfaces_passes_at_any_scale():
    for scale in (1.0, 1e-4, 1e-9, 1e-30):
        truth, hf = _tensors(scale)
        adapted = (truth * (1 + 3e-7)).float()  # a few roundings off, as another summation order gives
        e_hf, e_ad, excess = judge(hf, adapted, truth)
        assert excess <= 0 and e_ad <= ERR_FACTOR * e_hf + ERR_FLOOR, (scale, e_hf, e_ad)


def test_a_tensor_below_fp32s_range_is_measured_against_its_smallest_normal():
    """True values under fp32's smallest normal number (a gradient the decays pushed out of fp32): fp32 holds them
    only as subnormals or zero, in HuggingFace's run and the adapted one alike; a zero there is no failure."""
    truth = torch.full((8,), TENSOR_SCALE_MIN / 100, dtype=torch.float64)
    e_hf, e_ad, excess = judge(torch.zeros(8), torch.zeros(8), truth)
    assert e_hf == e_ad == 0.01 and excess < 0


def test_the_scale_is_the_tensors_own_not_the_models():
    """A decay gradient 1e-4 of the largest: measured against the model's largest gradient its 10 % error would be
    1e-5, at the floor; measured against its own, 0.1."""
    big, _ = _tensors(1.0, seed=1)
    truth, hf = _tensors(1e-4)
    wrong = (truth * 1.1).float()
    model_scale_error = float((wrong.double() - truth).abs().max() / big.abs().max())
    assert model_scale_error < ERR_FLOOR * 3  # what a model-wide scale would see
    assert judge(hf, wrong, truth)[2] > 0


def _scalar_model(grad: torch.Tensor, dtype=torch.float32) -> torch.nn.Module:
    model = torch.nn.Module()
    model.scale = torch.nn.Parameter(torch.zeros(grad.shape, dtype=dtype))
    model.scale.grad = grad.to(dtype)
    return model


def _run(logits: torch.Tensor, loss: torch.Tensor):
    return SimpleNamespace(logits=logits, loss=loss)


def test_a_tensor_huggingface_summed_luckily_is_held_to_fp32_not_to_the_luck():
    """A gradient that is a cancelling sum (DeepSeek-V4's hc_scale: terms of 1e-3 summing to 3e-5) lands, in one
    summation order, ten times closer to the truth than fp32 promises. Judged on that run alone, an adapter
    summing in another order fails; with HuggingFace's error also taken in a second order (the batch reversed),
    it passes. A tenth off still fails with both orders."""
    truth_grad = torch.tensor([2.9e-5, -1.1e-5], dtype=torch.float64)
    logits, loss = torch.randn(1, 2, 4, dtype=torch.float64), torch.tensor(2.0, dtype=torch.float64)
    truth = _scalar_model(truth_grad, torch.float64)
    out_truth = out_hf = _run(logits, loss)
    lucky = _scalar_model(truth_grad * (1 + 5e-7))  # HuggingFace's order: 5e-7 off
    other_order = {"logits": logits.float(), "loss": loss.float(),
                   "grads": {"scale": (truth_grad * (1 + 2e-6)).float()}}  # the same sum, another order: 2e-6
    for error, verdict_alone, verdict_both in ((1.7e-5, 1, 0), (0.1, 1, 1)):
        adapted = _scalar_model(truth_grad * (1 + error))
        args = (lucky, out_hf, loss.float(), logits.float(), dict(adapted.named_parameters()), truth, out_truth)
        assert len(against_truth(*args).failures) == verdict_alone, error
        assert len(against_truth(*args, again=other_order).failures) == verdict_both, error


def test_a_reversed_run_that_computes_something_else_is_not_taken_as_fp32s_noise():
    """The reversed batch is a second sample of fp32's error only for a model whose output does not depend on the
    batch's order. A model that drops tokens past an expert's capacity, first come first served, computes something
    else reversed: its logits move by far more than fp32's agreement, and its errors, which would loosen every
    bound, are not taken. A reversal that moves only the last digits is."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 8, 16, generator=gen)
    first = _run(logits, torch.tensor(2.5))
    noise = {"logits": logits * (1 + 1e-7), "loss": torch.tensor(2.5 * (1 + 1e-7))}
    assert same_function(first, noise)
    dropped = logits.clone()
    dropped[1, 5:] = 0.0  # the second row's last tokens routed nowhere when it came first
    assert not same_function(first, {"logits": dropped, "loss": torch.tensor(2.5)})
    assert not same_function(first, {"logits": logits, "loss": torch.tensor(2.6)})
