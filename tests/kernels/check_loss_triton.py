"""The rendered Triton cross-entropy rows against the PyTorch reference, then the whole token-chunked loss
through the registry against full logits. Run with TRITON_INTERPRET=1 (tests/runtime/test_loss.py does); exits
non-zero with the failing check on stderr."""

import sys

import torch
import torch.nn.functional as F

from runtime.kernels import registry, store
from runtime.loss import LogitTransform, lm_head_loss
from runtime.loss.blocks import cross_entropy_rows_
from tests.helpers import check_close


def main(key: str) -> None:
    k = store.load(key)
    torch.manual_seed(0)
    rows, vocab = 5, k.VOCAB
    labels = torch.randint(0, vocab, (rows,))
    for transform, z_weight in ((LogitTransform(), 0.0), (LogitTransform(0.7, 3.0), 0.1)):
        for want in (False, True):
            z = torch.randn(rows, vocab) * 4
            z_ref = z.clone()
            got = k.cross_entropy_rows(z, labels, transform, z_weight, 0.25, want)
            ref = cross_entropy_rows_(z_ref, labels, transform, z_weight, 0.25, want)
            what = f"rows (scale {transform.scale}, cap {transform.softcap}, grad {want})"
            check_close(got[0], ref[0], what + " lse", 1e-5)
            check_close(got[1], ref[1], what + " label logit", 1e-5)
            if want:
                check_close(z, z_ref, what + " gradient", 1e-5)
    k.register()
    registry.use("triton")
    try:
        assert registry.lookup("loss.cross_entropy_rows", cross_entropy_rows_) is k.cross_entropy_rows
        hidden = torch.randn(2, 7, 16, requires_grad=True)
        weight = (torch.randn(vocab, 16) * 0.3).requires_grad_()
        labels = torch.randint(0, vocab, (2, 7))
        labels[0, 3] = -100
        loss = lm_head_loss(hidden, weight, labels, softcap=3.0, z_loss_weight=0.05, chunk_tokens=4)
        loss.backward()
        h2, w2 = hidden.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
        logits = 3.0 * torch.tanh(F.linear(h2[:, :-1], w2) / 3.0).reshape(-1, vocab)
        target = labels[:, 1:].reshape(-1)
        keep = target != -100
        ref = F.cross_entropy(logits, target) + 0.05 * torch.logsumexp(logits[keep], -1).square().mean()
        ref.backward()
        check_close(loss, ref, "token-chunked loss through the registry", 1e-5)
        check_close(hidden.grad, h2.grad, "its hidden gradient", 1e-5)
        check_close(weight.grad, w2.grad, "its weight gradient", 1e-5)
    finally:
        registry.use(None)
    print("registered under the triton backend: ok")


if __name__ == "__main__":
    main(sys.argv[1])
