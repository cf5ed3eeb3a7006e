"""One chunk of queries of the sparse-attention reference, two ways; `runtime.attention.sparse` walks the chunks.

Both give each query a softmax over its picked keys only (every other key has probability exactly zero) and keep
nothing larger than one chunk between calls; they differ in how they reach the picks:

- `PickedKeys` gathers each query's K picked keys and values (one index_select per chunk) and multiplies only
  those: O(S * K * D) work. It is what the Triton kernel does, and what wins when the context is long against K.
- `MaskedKeys` multiplies the chunk's queries with all T keys in one GEMM and masks the scores to the picks:
  O(S * T * D) work, but at GEMM speed; gathers of rows are bandwidth-bound, so on CPU this is the faster one
  until T is many times K (`DENSE_RATIO`). Its chunk is (B, H, C, T) scores, C chosen to keep that bounded.

Interface: `forward(start, end)` -> (output (B, C, H, Dv), lse (B, C, H)); `backward(start, end, grad_out, delta,
lse)` -> dq (B, H, C, Dk), accumulating key and value gradients, read at the end by `key_grads()`.
"""

from __future__ import annotations

import torch

from runtime.subnormals import LOG_PROB_ZERO, exp_or_zero_

CHUNK_BYTES = 256 * 2**20  # working set of one chunk: fewer, larger GEMMs run faster on several threads
DENSE_RATIO = 48  # MaskedKeys while T <= DENSE_RATIO * K (CPU crossover measured near T = 50-60 K, fp32, 1 thread)


def _acc(x: torch.Tensor) -> torch.dtype:
    """Accumulation dtype: fp32, or wider when the inputs are (float64 in gradient checks)."""
    return torch.promote_types(x.dtype, torch.float32)


def probabilities_(scores: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """exp(scores - lse) in place; a query with no valid key (lse -inf) gets zeros, not NaN; probabilities
    below e^LOG_PROB_ZERO are exact zeros (see runtime.subnormals), never subnormal."""
    return exp_or_zero_(scores.sub_(torch.where(torch.isfinite(lse), lse, float("inf"))[..., None]), LOG_PROB_ZERO)


def softmax_lse_(scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over the last dim in place, and its log-sum-exp; rows of -inf only: zeros and -inf."""
    top = scores.amax(dim=-1, keepdim=True)
    top = torch.where(torch.isfinite(top), top, 0.0)
    probs = exp_or_zero_(scores.sub_(top), LOG_PROB_ZERO)
    total = probs.sum(dim=-1, keepdim=True)
    lse = (top + torch.log(total)).squeeze(-1)
    return probs.mul_(1.0 / torch.where(total > 0, total, 1.0)), lse


class PickedKeys:
    """Scores against the gathered picks. Keys and values are read as (B*Hkv*T, D) row tables, so one
    index_select puts every head's picks in (B, C, Hkv, K, D) order, rows of D contiguous values."""

    def __init__(self, q, k, v, indices, scale):
        self.q, self.indices, self.scale = q, indices, scale
        batch, self.kv_heads, keys_len, _ = k.shape
        self.groups = q.shape[1] // self.kv_heads
        self.keys, self.values = k.reshape(-1, k.shape[-1]), v.reshape(-1, v.shape[-1])
        self.row_base = torch.arange(batch * self.kv_heads, device=q.device).view(batch, 1, self.kv_heads, 1) * keys_len
        per_query = batch * indices.shape[-1] * (self.kv_heads * (k.shape[-1] + v.shape[-1] + 2) + 4 * q.shape[1]) * 4
        self.step = max(1, CHUNK_BYTES // max(per_query, 1))
        self.dk = torch.zeros(self.keys.shape, dtype=_acc(q), device=q.device)
        self.dv = torch.zeros(self.values.shape, dtype=_acc(q), device=q.device)

    def _gather(self, table, rows, chunk):
        return table.index_select(0, rows).view(self.q.shape[0], chunk, self.kv_heads, -1, table.shape[-1]).to(
            _acc(self.q))

    def _scores(self, start, end):
        batch, _, _, dk = self.q.shape
        picks = self.indices[:, start:end, None, :].long()
        rows = (self.row_base + picks.clamp(min=0)).reshape(-1)  # (B, C, Hkv, K) flattened
        qc = self.q[:, :, start:end].to(_acc(self.q)).reshape(batch, self.kv_heads, self.groups, end - start, dk)
        # (B, C, Hkv, G, Dk): the query heads sharing a key head side by side, scaled (C*Dk products, not C*K)
        qc = qc.permute(0, 3, 1, 2, 4) * self.scale
        keys = self._gather(self.keys, rows, end - start)
        scores = torch.matmul(qc, keys.transpose(-1, -2))
        return scores.masked_fill_((picks < 0)[:, :, :, None], float("-inf")), qc, keys, rows

    def forward(self, start, end):
        scores, _, _, rows = self._scores(start, end)
        probs, lse = softmax_lse_(scores)
        out = torch.matmul(probs, self._gather(self.values, rows, end - start))
        return out.flatten(2, 3), lse.flatten(2, 3)

    def backward(self, start, end, grad_out, delta, lse):
        batch, heads, chunk = self.q.shape[0], self.q.shape[1], end - start
        scores, qc, keys, rows = self._scores(start, end)
        values = self._gather(self.values, rows, chunk)
        probs = probabilities_(scores, lse.view(scores.shape[:-1]))
        go = grad_out.reshape(batch, chunk, self.kv_heads, self.groups, -1)
        # gradient of the scaled scores; the scale is already in qc and goes onto dq at the end
        dscores = torch.matmul(go, values.transpose(-1, -2)).sub_(delta.view(scores.shape[:-1])[..., None]).mul_(probs)
        self.dk.index_add_(0, rows, torch.matmul(dscores.transpose(-1, -2), qc).reshape(-1, self.dk.shape[-1]))
        self.dv.index_add_(0, rows, torch.matmul(probs.transpose(-1, -2), go).reshape(-1, self.dv.shape[-1]))
        return (torch.matmul(dscores, keys) * self.scale).reshape(batch, chunk, heads, -1).transpose(1, 2)

    def key_grads(self):
        batch = self.q.shape[0]
        return self.dk.view(batch, self.kv_heads, -1, self.dk.shape[-1]), self.dv.view(batch, self.kv_heads, -1,
                                                                                       self.dv.shape[-1])


class MaskedKeys:
    """Scores against all keys by GEMM, masked to the picks: (B, Hkv, G*C, T) per chunk."""

    def __init__(self, q, k, v, indices, scale):
        self.q, self.indices, self.scale = q, indices, scale
        self.k, self.v = k.to(_acc(q)), v.to(_acc(q))
        batch, self.kv_heads, self.keys_len, _ = k.shape
        self.groups = q.shape[1] // self.kv_heads
        self.step = max(1, CHUNK_BYTES // (batch * self.keys_len * (12 * q.shape[1] + 9)))
        self.dk = torch.zeros_like(self.k)
        self.dv = torch.zeros_like(self.v)

    def _rows(self, x, start, end):
        """(B, C, H, D) -> (B, Hkv, G*C, D): the chunk's rows of one key head, ready for one GEMM."""
        batch, chunk = x.shape[0], end - start
        x = x.reshape(batch, chunk, self.kv_heads, self.groups, -1).permute(0, 2, 3, 1, 4)
        return x.reshape(batch, self.kv_heads, self.groups * chunk, -1)

    def _per_head(self, x, start, end):
        """(B, C, H) -> (B, Hkv, G*C), the row order of `_rows`."""
        return self._rows(x[..., None], start, end)[..., 0]

    def _scores(self, start, end):
        batch, chunk = self.q.shape[0], end - start
        qc = self._rows(self.q[:, :, start:end].transpose(1, 2).to(_acc(self.q)), start, end) * self.scale
        picks = self.indices[:, start:end].long()
        keep = torch.zeros(batch, chunk, self.keys_len + 1, dtype=torch.bool, device=picks.device)
        keep = keep.scatter_(2, torch.where(picks < 0, self.keys_len, picks), True)[..., : self.keys_len]
        scores = torch.matmul(qc, self.k.transpose(-1, -2)).view(batch, self.kv_heads, self.groups, chunk,
                                                                 self.keys_len)
        return scores.masked_fill_(~keep[:, None, None], float("-inf")).flatten(2, 3), qc

    def forward(self, start, end):
        batch, chunk = self.q.shape[0], end - start
        scores, _ = self._scores(start, end)
        probs, lse = softmax_lse_(scores)
        out = torch.matmul(probs, self.v)  # (B, Hkv, G*C, Dv)
        out = out.view(batch, self.kv_heads, self.groups, chunk, -1).permute(0, 3, 1, 2, 4).flatten(2, 3)
        lse = lse.view(batch, self.kv_heads, self.groups, chunk).permute(0, 3, 1, 2).flatten(2, 3)
        return out, lse

    def backward(self, start, end, grad_out, delta, lse):
        batch, heads, chunk = self.q.shape[0], self.q.shape[1], end - start
        scores, qc = self._scores(start, end)
        probs = probabilities_(scores, self._per_head(lse, start, end))
        go = self._rows(grad_out, start, end)
        # gradient of the scaled scores; the scale is already in qc and goes onto dq at the end
        dscores = torch.matmul(go, self.v.transpose(-1, -2)).sub_(self._per_head(delta, start, end)[..., None])
        dscores.mul_(probs)
        self.dk += torch.matmul(dscores.transpose(-1, -2), qc)
        self.dv += torch.matmul(probs.transpose(-1, -2), go)
        return (torch.matmul(dscores, self.k) * self.scale).view(batch, heads, chunk, -1)

    def key_grads(self):
        return self.dk, self.dv


def chunk_walker(q, k, v, indices, scale):
    """The chunk walker for these shapes: GEMM over all keys while the context is short against K."""
    dense = k.shape[2] <= DENSE_RATIO * max(indices.shape[-1], 1)
    return (MaskedKeys if dense else PickedKeys)(q, k, v, indices, scale)
