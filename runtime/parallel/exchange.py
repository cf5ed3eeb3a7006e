"""Asynchronous All-to-All with variable splits, differentiable, split in two autograd nodes.

`start` issues the exchange and returns the (not yet filled) receive buffer; `finish` waits for it. Whatever
is computed between the two overlaps the communication. Backward runs the reverse exchange the same way:
`finish`'s backward issues it, `start`'s backward waits for it and hands the result on, and the autograd
engine runs the nodes recorded between them (higher sequence numbers first) while gradients are in flight.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist


class CommTime:
    """Seconds spent blocked on token exchanges (what overlap could not hide), for run logs."""

    def __init__(self):
        self.seconds = 0.0

    def reset(self) -> float:
        seconds, self.seconds = self.seconds, 0.0
        return seconds


class Exchange:
    """One token exchange: its splits, its in-flight work and an optional trace of issue / wait events."""

    def __init__(self, send_splits: list[int], recv_splits: list[int], group, name: str, trace: list | None,
                 clock: CommTime | None = None):
        self.send_splits, self.recv_splits = send_splits, recv_splits
        self.group, self.name, self.trace, self.clock = group, name, trace, clock
        self.work = None
        self.buffers: tuple = ()  # kept alive until the exchange completes

    def log(self, event: str) -> None:
        if self.trace is not None:
            self.trace.append(f"{self.name}:{event}")

    def issue(self, x: torch.Tensor, out_rows: int, out_splits: list[int], in_splits: list[int]) -> torch.Tensor:
        x = x.contiguous()
        out = x.new_empty(out_rows, *x.shape[1:])
        self.work = dist.all_to_all_single(out, x, out_splits, in_splits, group=self.group, async_op=True)
        self.buffers = (x, out)
        return out

    def wait(self) -> None:
        start = time.perf_counter()
        self.work.wait()
        if self.clock is not None:
            self.clock.seconds += time.perf_counter() - start
        self.work, self.buffers = None, ()


class _Start(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, ex: Exchange):
        ctx.ex = ex
        ex.log("start")
        return ex.issue(x, sum(ex.recv_splits), ex.recv_splits, ex.send_splits)

    @staticmethod
    def backward(ctx, grad):
        ex = ctx.ex
        ex.log("backward_wait")
        out = ex.buffers[1]  # filled by the reverse exchange _Finish.backward issued; `grad` is spent
        ex.wait()
        return out, None


class _Finish(torch.autograd.Function):
    @staticmethod
    def forward(ctx, received: torch.Tensor, ex: Exchange):
        ctx.ex = ex
        ex.log("wait")
        ex.wait()
        return received.view_as(received)

    @staticmethod
    def backward(ctx, grad):
        ex = ctx.ex
        ex.log("backward_start")
        ex.issue(grad, sum(ex.send_splits), ex.send_splits, ex.recv_splits)
        # the received buffer is a plain receive target: its gradient only travels on through the exchange
        return grad, None


def start(x: torch.Tensor, ex: Exchange) -> torch.Tensor:
    """Send rows of `x` (grouped by destination, `ex.send_splits` each); returns the receive buffer, unfilled."""
    return _Start.apply(x, ex)


def finish(received: torch.Tensor, ex: Exchange) -> torch.Tensor:
    """Wait for the exchange `start` issued; returns the received rows (grouped by source)."""
    return _Finish.apply(received, ex)


class Mark(torch.autograd.Function):
    """Identity that records when its backward runs (where a branch's gradient computation begins)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, trace: list, event: str):
        ctx.trace, ctx.event = trace, event
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.trace.append(ctx.event)
        return grad, None, None
