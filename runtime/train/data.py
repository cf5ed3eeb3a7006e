"""Training data: token windows from a tokenized file, packed documents of a corpus, or synthetic tokens.

Every sequence has a global index, a pure function of (step, micro-step, data-parallel rank, row), so the
batch a rank sees never depends on what ran before: resuming at step s reads exactly what an
uninterrupted run reads at step s, and the data position saved in a checkpoint is just that index.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch


def sequence_index(step: int, micro: int, rank: int, row: int, *, grad_accum: int, dp: int, micro_batch: int) -> int:
    return ((step * grad_accum + micro) * dp + rank) * micro_batch + row


class SyntheticTokens:
    """A short random pattern repeated to the sequence length, its tokens drawn with Zipf frequencies
    (token k about 1/(k+1)): a model learns the frequencies within a few steps and the repetition after
    that, so the loss falls the way it does on text. Each sequence comes from its own seeded generator."""

    PERIOD = 8

    def __init__(self, vocab_size: int, seq_len: int, seed: int = 0):
        if vocab_size < 2:
            raise ValueError(f"synthetic tokens need a vocabulary of at least 2, got {vocab_size}")
        self.vocab, self.seq_len, self.seed = vocab_size, seq_len, seed
        self.weights = 1.0 / torch.arange(1, vocab_size + 1, dtype=torch.float64)

    def sequence(self, index: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        pattern = torch.multinomial(self.weights, self.PERIOD, replacement=True, generator=gen)
        return pattern.repeat(-(-self.seq_len // self.PERIOD))[: self.seq_len]


class TokenFile:
    """Consecutive windows of a tokenized corpus: a `.npy` array of token ids, or a raw `.bin` of uint16
    (uint32 with `.u32.bin`), memory-mapped."""

    def __init__(self, path, seq_len: int, vocab_size: int | None = None):
        path = Path(path)
        try:
            if path.suffix == ".npy":
                tokens = np.load(path, mmap_mode="r")
            elif path.suffix == ".bin":
                tokens = np.memmap(path, dtype=np.uint32 if path.name.endswith(".u32.bin") else np.uint16, mode="r")
            else:
                raise ValueError(f"token file {path} must be .npy or .bin")
        except OSError as e:
            raise ValueError(f"cannot read token file {path}: {e.strerror or e}") from None
        except ValueError as e:  # numpy's own complaint about a file that is not an array
            raise ValueError(f"token file {path} is not a readable array: {' '.join(str(e).split())}") from None
        if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
            raise ValueError(f"token file {path} must hold a 1-D array of integer token ids")
        if len(tokens) < seq_len:
            raise ValueError(f"token file {path} holds {len(tokens)} tokens, fewer than one sequence of {seq_len}")
        if len(tokens) and int(tokens.min()) < 0:
            raise ValueError(f"token file {path} holds id {int(tokens.min())}: token ids are never negative")
        if vocab_size is not None and len(tokens) and int(tokens.max()) >= vocab_size:
            raise ValueError(f"token file {path} holds id {int(tokens.max())}, outside the model's vocabulary "
                             f"of {vocab_size}")
        self.tokens, self.seq_len = tokens, seq_len
        self.windows = len(tokens) // seq_len

    def sequence(self, index: int) -> torch.Tensor:
        start = (index % self.windows) * self.seq_len
        return torch.from_numpy(np.asarray(self.tokens[start:start + self.seq_len], dtype=np.int64))


class PackedCorpus:
    """Consecutive windows of a tokenized corpus of documents: token ids one document after another, where each
    document starts, and, for instruction data, a loss mask (1 where a token is trained on, 0 on prompts). On disk
    (`open`; `onboard.train.data` writes it) a folder of `tokens.npy`, `starts.npy` and `loss_mask.npy`.

    A window may hold the end of one document and the start of others; `sequence(i)` says where each begins so
    that the model keeps them apart (`model_inputs`): positions restart at every document (and at the window's
    start), and the first token of a document is no target of the one before it."""

    def __init__(self, tokens, starts, seq_len: int, loss_mask=None):
        if starts.ndim != 1 or not len(starts) or starts[0] != 0 or np.any(np.diff(starts) <= 0):
            raise ValueError("document starts must rise from 0")
        if loss_mask is not None and len(loss_mask) != len(tokens):
            raise ValueError("the loss mask and the tokens differ in length")
        if len(tokens) < seq_len:
            raise ValueError(f"{len(tokens)} tokens, fewer than one sequence of {seq_len}")
        self.tokens, self.starts, self.loss_mask, self.seq_len = tokens, starts, loss_mask, seq_len
        self.windows = len(tokens) // seq_len

    @classmethod
    def open(cls, folder, seq_len: int, vocab_size: int | None = None) -> PackedCorpus:
        folder = Path(folder)
        tokens = TokenFile(folder / "tokens.npy", seq_len, vocab_size).tokens
        try:
            starts = np.load(folder / "starts.npy")
            mask = folder / "loss_mask.npy"
            return cls(tokens, starts, seq_len, np.load(mask, mmap_mode="r") if mask.is_file() else None)
        except (OSError, ValueError) as e:
            raise ValueError(f"packed corpus {folder}: {' '.join(str(e).split())}") from None

    def sequence(self, index: int) -> dict[str, torch.Tensor]:
        lo = (index % self.windows) * self.seq_len
        hi = lo + self.seq_len
        ids = torch.from_numpy(np.asarray(self.tokens[lo:hi], dtype=np.int64))
        inside = self.starts[(self.starts > lo) & (self.starts < hi)] - lo  # documents starting in the window
        begins = np.concatenate([[0], inside]).astype(np.int64)
        lengths = np.diff(np.concatenate([begins, [self.seq_len]]))
        positions = torch.from_numpy(np.concatenate([np.arange(n) for n in lengths]))
        labels = ids.clone()
        labels[torch.from_numpy(inside.astype(np.int64))] = -100
        if self.loss_mask is not None:
            labels[torch.from_numpy(np.asarray(self.loss_mask[lo:hi]) == 0)] = -100
        return {"input_ids": ids, "labels": labels, "position_ids": positions,
                "lengths": torch.from_numpy(lengths.astype(np.int64))}


def model_inputs(source, step: int, micro: int, rank: int, *, grad_accum: int, dp: int,
                 micro_batch: int) -> dict[str, torch.Tensor]:
    """The keyword arguments of one rank's micro-step for a HuggingFace causal LM: input_ids and labels
    (micro_batch, seq_len); for packed documents the rows are laid end to end in one (1, micro_batch * seq_len)
    with the packed-sequence inputs transformers' models read, `position_ids` (restarting per document: the
    softmax attention masks by them) and `cu_seq_lens_q` / `cu_seq_lens_k` / `max_length_q` / `max_length_k`
    (the linear-attention and convolution cores start each document from a zero state)."""
    rows = [source.sequence(sequence_index(step, micro, rank, r, grad_accum=grad_accum, dp=dp,
                                           micro_batch=micro_batch)) for r in range(micro_batch)]
    if not isinstance(rows[0], dict):
        ids = torch.stack(rows)
        return {"input_ids": ids, "labels": ids}
    lengths = torch.cat([r["lengths"] for r in rows])
    bounds = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)]).to(torch.int32)
    out = {k: torch.cat([r[k] for r in rows]).unsqueeze(0) for k in ("input_ids", "labels", "position_ids")}
    longest = int(lengths.max())
    return {**out, "cu_seq_lens_q": bounds, "cu_seq_lens_k": bounds, "max_length_q": longest,
            "max_length_k": longest}


def batch(source, step: int, micro: int, rank: int, *, grad_accum: int, dp: int, micro_batch: int) -> torch.Tensor:
    """(micro_batch, seq_len) token ids for one rank's micro-step."""
    rows = [source.sequence(sequence_index(step, micro, rank, r, grad_accum=grad_accum, dp=dp,
                                           micro_batch=micro_batch)) for r in range(micro_batch)]
    return torch.stack(rows)
