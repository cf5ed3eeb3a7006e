"""Chunked LM-head losses against full logits: plain F.linear + F.cross_entropy written here, and
transformers' own ForCausalLMLoss; values and gradients (hidden, weight, bias), fp32, tiny shapes."""


import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from transformers.loss.loss_utils import ForCausalLMLoss

from runtime.loss import LMHeadLoss, LogitTransform, lm_head_loss

B, S, H, V = 2, 7, 8, 13  # 14 tokens: chunks of 4 tokens and 5 vocabulary entries divide neither
VARIANTS = {"token chunks": {"chunk_tokens": 4}, "vocab chunks": {"chunk_tokens": 4, "chunk_vocab": 5}}


def make(seed=0, bias=True, ignore_index=-100):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, S, H, generator=g)
    weight = torch.randn(V, H, generator=g) * 0.7
    b = torch.randn(V, generator=g) if bias else None
    labels = torch.randint(0, V, (B, S), generator=g)
    labels[0, 2] = labels[1, 4] = labels[1, 5] = ignore_index
    return hidden, weight, b, labels


def plain(hidden, weight, labels, *, bias=None, ignore_index=-100, softcap=None, logit_scale=1.0,
          z_loss_weight=0.0, num_items_in_batch=None, shift_labels=True):
    """Full logits, then F.cross_entropy; the z-loss over the same tokens and with the same divisor."""
    logits = F.linear(hidden, weight, bias) * logit_scale
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    if shift_labels:
        logits, labels = logits[:, :-1], labels[:, 1:]
    logits, labels = logits.reshape(-1, V), labels.reshape(-1)
    keep = labels != ignore_index
    ce = F.cross_entropy(logits, labels, ignore_index=ignore_index, reduction="sum")
    z = torch.logsumexp(logits[keep], dim=-1).square().sum() * z_loss_weight
    divisor = num_items_in_batch if num_items_in_batch is not None else keep.sum()
    return (ce + z) / divisor


def hf(hidden, weight, labels, *, bias=None, ignore_index=-100, softcap=None, logit_scale=1.0,
       num_items_in_batch=None, shift_labels=True):
    logits = F.linear(hidden, weight, bias) * logit_scale
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    extra = {} if shift_labels else {"shift_labels": labels}
    return ForCausalLMLoss(logits, labels, V, num_items_in_batch=num_items_in_batch, ignore_index=ignore_index,
                           **extra)


def value_and_grads(fn, hidden, weight, bias, labels, **options):
    leaves = [t.detach().clone().requires_grad_() for t in (hidden, weight) + ((bias,) if bias is not None else ())]
    loss = fn(leaves[0], leaves[1], labels, bias=leaves[2] if bias is not None else None, **options)
    loss.backward()
    return [loss.detach()] + [t.grad for t in leaves]


def matches(a, b, tol=1e-5) -> bool:
    return all(torch.allclose(x, y, rtol=tol, atol=tol) for x, y in zip(a, b, strict=True))


OPTIONS = [
    {},
    {"softcap": 2.5},
    {"logit_scale": 0.6},
    {"logit_scale": 1.7, "softcap": 4.0},
    {"num_items_in_batch": 17},
    {"num_items_in_batch": torch.tensor(9)},
    {"shift_labels": False},
    {"ignore_index": -1, "softcap": 3.0, "num_items_in_batch": 11, "shift_labels": False},
]


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: ",".join(o) or "defaults")
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
def test_matches_plain_and_transformers(variant, options, bias):
    hidden, weight, b, labels = make(bias=bias, ignore_index=options.get("ignore_index", -100))
    ours = value_and_grads(lm_head_loss, hidden, weight, b, labels, **options, **VARIANTS[variant])
    assert matches(ours, value_and_grads(plain, hidden, weight, b, labels, **options))
    assert matches(ours, value_and_grads(hf, hidden, weight, b, labels, **options))


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("options", [{"z_loss_weight": 0.05}, {"z_loss_weight": 0.2, "softcap": 3.0,
                                     "logit_scale": 0.8, "num_items_in_batch": 20, "shift_labels": False}])
def test_z_loss(variant, options):
    hidden, weight, b, labels = make()
    ours = value_and_grads(lm_head_loss, hidden, weight, b, labels, **options, **VARIANTS[variant])
    assert matches(ours, value_and_grads(plain, hidden, weight, b, labels, **options))
    # the z-loss term is really in there, and the part handed back for logging is that term
    without = {**options, "z_loss_weight": 0.0}
    assert not matches(ours, value_and_grads(plain, hidden, weight, b, labels, **without))
    loss, z_part = lm_head_loss(hidden, weight, labels, bias=b, return_z_loss=True, **options, **VARIANTS[variant])
    assert torch.allclose(loss - z_part, plain(hidden, weight, labels, bias=b, **without), atol=1e-5)


@pytest.mark.parametrize("variant", VARIANTS)
def test_all_ignored_batch(variant):
    hidden, weight, b, labels = make()
    labels = torch.full_like(labels, -100)
    loss, *grads = value_and_grads(lm_head_loss, hidden, weight, b, labels, **VARIANTS[variant])
    # HF's mean is 0/0 = nan here; ours is 0 with zero gradients so that a training step survives it
    assert loss.item() == 0.0 and all(torch.equal(g, torch.zeros_like(g)) for g in grads)
    summed = value_and_grads(lm_head_loss, hidden, weight, b, labels, num_items_in_batch=5, **VARIANTS[variant])
    assert matches(summed, value_and_grads(hf, hidden, weight, b, labels, num_items_in_batch=5))


@pytest.mark.parametrize("tokens,vocab", [(1, None), (100, None), (None, None), (1, 1), (100, 100), (3, 12), (None, 5)])
def test_chunk_sizes(tokens, vocab):
    """One token or one vocabulary entry at a time, chunks larger than the problem, automatic sizes."""
    hidden, weight, b, labels = make(seed=3)
    options = {"chunk_tokens": tokens, "chunk_vocab": vocab}
    ours = value_and_grads(lm_head_loss, hidden, weight, b, labels, softcap=5.0, **options)
    assert matches(ours, value_and_grads(plain, hidden, weight, b, labels, softcap=5.0))


def test_planted_bugs_are_caught(monkeypatch):
    hidden, weight, b, labels = make()
    reference = value_and_grads(hf, hidden, weight, b, labels, softcap=2.5)
    assert matches(value_and_grads(lm_head_loss, hidden, weight, b, labels, softcap=2.5, chunk_tokens=4), reference)
    # a wrong shift: unshifted labels read as already shifted
    wrong_shift = value_and_grads(lm_head_loss, hidden, weight, b, labels, softcap=2.5, shift_labels=False)
    assert not matches(wrong_shift, reference)
    # a backward that forgets the soft cap's derivative: the value still matches, the gradients do not
    monkeypatch.setattr(LogitTransform, "slope", lambda self, y: self.scale)
    for variant in VARIANTS.values():
        broken = value_and_grads(lm_head_loss, hidden, weight, b, labels, softcap=2.5, **variant)
        assert torch.allclose(broken[0], reference[0], atol=1e-5) and not matches(broken, reference)


@pytest.mark.parametrize("variant", VARIANTS)
def test_upstream_gradient_no_grad_and_one_backward(variant):
    hidden, weight, b, labels = make()
    h = hidden.clone().requires_grad_()
    (lm_head_loss(h, weight, labels, bias=b, **VARIANTS[variant]) * 3.0).backward()
    h2 = hidden.clone().requires_grad_()
    (plain(h2, weight, labels, bias=b) * 3.0).backward()
    assert torch.allclose(h.grad, h2.grad, atol=1e-5)
    with torch.no_grad():
        assert torch.allclose(lm_head_loss(h, weight, labels, bias=b, **VARIANTS[variant]),
                              plain(hidden, weight, labels, bias=b), atol=1e-5)
    loss = lm_head_loss(h, weight, labels, bias=b, **VARIANTS[variant])
    loss.backward(retain_graph=True)
    if "chunk_vocab" in VARIANTS[variant]:  # recomputes in its backward: a second one is fine
        loss.backward()
    else:
        with pytest.raises(RuntimeError, match="one backward"):
            loss.backward()


class LargestTensor(TorchDispatchMode):
    """Records the largest tensor any op produces."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.parametrize("chunks,block", [({"chunk_tokens": 8}, 8 * 120),
                                          ({"chunk_tokens": 8, "chunk_vocab": 32}, 8 * 32)])
def test_full_logits_never_exist(chunks, block):
    tokens, hidden_size, vocab = 40, 4, 120
    hidden = torch.randn(1, tokens, hidden_size, requires_grad=True)
    weight = torch.randn(vocab, hidden_size, requires_grad=True)
    labels = torch.randint(0, vocab, (1, tokens))
    with LargestTensor() as seen:
        lm_head_loss(hidden, weight, labels, softcap=3.0, z_loss_weight=0.1, **chunks).backward()
    assert seen.largest <= max(block, vocab * hidden_size, tokens * hidden_size) < tokens * vocab
    with LargestTensor() as seen:  # the same watch sees full logits where they exist
        plain(hidden, weight[:V], labels % V).backward()
    assert seen.largest >= tokens * V


def test_bf16_close_to_fp32():
    hidden, weight, b, labels = make()
    ref = value_and_grads(plain, hidden, weight, b, labels, softcap=3.0)
    for variant in VARIANTS.values():
        ours = value_and_grads(lm_head_loss, hidden.bfloat16(), weight.bfloat16(), b.bfloat16(), labels, softcap=3.0,
                               **variant)
        assert all(t.dtype == torch.bfloat16 for t in ours[1:])
        assert all(torch.allclose(x.float(), y, rtol=3e-2, atol=3e-2) for x, y in zip(ours, ref))


def test_module_wraps_the_heads_own_parameters():
    hidden, weight, b, labels = make()
    head = torch.nn.Linear(H, V)
    with torch.no_grad():
        head.weight.copy_(weight)
        head.bias.copy_(b)
    module = LMHeadLoss.from_linear(head, softcap=2.5, chunk_vocab=5)
    assert module.weight is head.weight and module.bias is head.bias
    module(hidden, labels).backward()
    ref = value_and_grads(hf, hidden, weight, b, labels, softcap=2.5)
    assert torch.allclose(head.weight.grad, ref[2], atol=1e-5) and torch.allclose(head.bias.grad, ref[3], atol=1e-5)
    assert "vocab=13" in repr(module)


@pytest.mark.parametrize("change,message", [
    ({"weight": torch.randn(V, H + 1)}, "does not fit"),
    ({"labels": torch.zeros(B, S + 1, dtype=torch.long)}, "leading shape"),
    ({"labels": torch.full((B, S), V)}, "outside the vocabulary"),
    ({"labels": torch.zeros(B, S)}, "integer"),
    ({"bias": torch.randn(V + 1)}, "bias"),
    ({"num_items_in_batch": 0}, "positive"),
    ({"softcap": 0.0}, "softcap"),
    ({"chunk_vocab": 0}, "chunk_vocab"),
    ({"weight": torch.randn(V, H, dtype=torch.float64)}, "dtype|float64"),
])
def test_bad_input_is_a_clear_error(change, message):
    hidden, weight, b, labels = make()
    args = {"hidden": hidden, "weight": weight, "labels": labels, "bias": b} | change
    with pytest.raises(ValueError, match=message):
        lm_head_loss(args.pop("hidden"), args.pop("weight"), args.pop("labels"), **args)


@pytest.mark.interpreter
def test_rendered_triton_rows_match_the_reference():
    """The Triton cross-entropy rows (templates/kernels/loss_triton.py.j2) under the CPU interpreter: against
    the PyTorch rows, then the whole loss with the kernel picked by backend dispatch."""
    pytest.importorskip("triton")
    from tests.helpers import run_kernel_check, stored_kernel

    # a vocabulary that the block (64) does not divide: the masked tail of each row is exercised
    key = stored_kernel("kernels/loss_triton.py.j2", name="twin", vocab=300, block=64)
    result = run_kernel_check("check_loss_triton.py", key, threads=2)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "token-chunked loss through the registry: ok" in result.stdout


def test_loss_swap_changes_one_model_and_undo_restores_it():
    """The loss swap gives this one model a forward of its own: another model of the same class (and config)
    keeps transformers' loss and logits; the swapped one computes the same loss without logits, counted on its
    handle; undo gives its class's forward back."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from runtime.loss.causal_lm import swap_causal_lm_loss

    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    model, other = Qwen3ForCausalLM(config), Qwen3ForCausalLM(config)
    other.load_state_dict(model.state_dict())
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(1))
    want = other(input_ids=ids, labels=ids)
    swap = swap_causal_lm_loss(model, "lm_head", decoder_path="model")
    got = model(input_ids=ids, labels=ids)
    assert got.logits is None or got.logits.numel() == 0  # the [tokens, vocabulary] logits never existed
    assert float(got.loss) == pytest.approx(float(want.loss), rel=1e-6) and swap.calls["loss"] == 1
    assert "forward" not in vars(other) and other(input_ids=ids, labels=ids).logits.shape == (2, 12, 96)
    assert torch.equal(model(input_ids=ids).logits, want.logits)  # without labels: logits as before
    swap.undo()
    assert "forward" not in vars(model)
    again = model(input_ids=ids, labels=ids)
    assert torch.equal(again.logits, want.logits) and swap.calls["loss"] == 1
