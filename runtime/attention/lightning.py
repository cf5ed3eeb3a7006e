"""Run a lightning-attention block (MiniMax-Text-01 / M1 style) on the runtime's chunked constant-decay core.

    swap = swap_lightning_attention(module, *, chunk_size=None, probe=True)   # a runtime.swap.Swap

Lightning attention is linear attention with a fixed exponential decay per head and no delta rule:
S_t = exp(-slope) S_{t-1} + k_t v_t^T, o_t = q_t S_t. transformers writes the block scan inline in the module's
forward (a Python loop over blocks, each with dense block x block products), so there is no core function to
rebind as `swap_linear_core` does. Instead the runtime reads the block as a whole:

    qkv = act(qkv_proj(x)) (padding tokens zeroed), split per head into q, k, v
    o   = chunk_constant_decay(qkv, log decay = -slope_rate per head)
    out = out_proj(sigmoid(output_gate(x)) * norm(o))          returns (out, final state)

That reading is a hypothesis about the module's parts (names of its projections and buffers), so with `probe`
(default) the swapped forward is run once against the module's own forward on a random input spanning several of
its blocks, and refused (ValueError, module unchanged) unless both agree. The module stays the same object with
the same parameters and class; it gets a forward of its own (`runtime.swap.Swap.set_forward`) that runs the
runtime's scan and falls back to the class's forward whenever a cache is passed (the single-token decode path
stays HuggingFace code). Packed documents (`cu_seq_lens_q`, as the training loop passes them) are scanned
each from a zero state. Calls are counted on the handle, as `swap.calls["lightning"]`.
"""

from __future__ import annotations

import torch

from runtime.attention.probes import close
from runtime.attention.constant_decay import chunk_constant_decay
from runtime.sequence_split import active
from runtime.swap import LINEAR_CORE, Swap

CHUNK = 64  # the scan's chunk length unless overridden, whatever the module's block_size: fastest on CPU (bench)
PARTS = ("qkv_proj", "output_gate", "out_proj", "norm", "act_fn", "slope_rate")


def lightning_forward(module, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                      chunk_size: int = 64, cu_seqlens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The block's output and final state, computed by the runtime from the module's own parameters.
    `cu_seqlens` (batch 1): packed documents, each scanned from a zero state (the final state is the last's)."""
    batch, length, _ = hidden_states.shape
    heads = module.num_attention_heads
    qkv = module.act_fn(module.qkv_proj(hidden_states))
    if attention_mask is not None and attention_mask.dim() == 2:  # a padding mask: padded tokens add nothing
        qkv = (qkv * attention_mask[:, :, None]).to(qkv.dtype)
    qkv, log_decay = qkv.reshape(batch, length, heads, -1), -module.slope_rate.reshape(heads)
    if (split := active()) is not None:  # context parallelism: the state carried across the cp ranks' segments
        decay = log_decay.view(1, 1, heads).expand(batch, length, heads)
        out, state = split.scalar_decay(*qkv.chunk(3, -1), decay, chunk_size=chunk_size), None
    elif cu_seqlens is None:
        out, state = chunk_constant_decay(qkv, log_decay, chunk_size=chunk_size, output_final_state=True)
    else:
        if batch != 1:
            raise ValueError(f"cu_seqlens needs the packed sequences in one batch row, got batch {batch}")
        bounds = cu_seqlens.tolist()
        pieces = [chunk_constant_decay(qkv[:, a:b], log_decay, chunk_size=chunk_size, output_final_state=True)
                  for a, b in zip(bounds[:-1], bounds[1:]) if b > a]
        out, state = torch.cat([o for o, _ in pieces], dim=1), pieces[-1][1]
    # the scan computes in fp32 at least; the block's projections run in the model's dtype, as transformers' do
    out, state = out.to(qkv.dtype), None if state is None else state.to(qkv.dtype)
    out = module.norm(out.reshape(batch, length, -1))
    out = torch.sigmoid(module.output_gate(hidden_states)) * out
    return module.out_proj(out), state


def _probe(module) -> str | None:
    """Why the runtime's reading of `module` differs from its own forward, or None when they agree."""
    block = int(getattr(module, "block_size", 16))
    hidden = module.qkv_proj.in_features
    gen = torch.Generator().manual_seed(0)
    param = next(module.parameters())
    x = torch.randn(2, 2 * block + 3, hidden, generator=gen).to(param.dtype)
    try:
        with torch.no_grad():
            theirs = module.forward(x, None, None)
            ours = lightning_forward(module, x, None, chunk_size=max(1, block // 2))
    except (RuntimeError, ValueError, TypeError, IndexError, AttributeError) as exc:
        return f"its forward does not run as a lightning block on a probe ({type(exc).__name__}: {exc})"
    # a reading of the wrong parts is off by O(1); a bf16 / fp16 model agrees only to its rounding
    tol = 1e-4 if param.dtype in (torch.float32, torch.float64) else 3e-2
    if not isinstance(theirs, tuple) or not close(ours[0].float(), theirs[0].float(), tol):
        return "its output differs from the runtime's lightning scan on a probe"
    return None


def swap_lightning_attention(module: torch.nn.Module, *, chunk_size: int | None = None, probe: bool = True,
                             path: str = "") -> Swap:
    """Make `module` run the runtime's chunked scalar-decay scan (see the module docstring).
    Raises ValueError, leaving the module unchanged, when it lacks the parts of a lightning block or the probe
    finds that the runtime's reading computes something else."""
    missing = [name for name in PARTS if not hasattr(module, name)]
    if missing or not hasattr(module, "num_attention_heads"):
        raise ValueError(f"{type(module).__name__} has no {', '.join(missing) or 'num_attention_heads'}: not a "
                         f"lightning-attention block the runtime reads")
    if probe and (why := _probe(module)):
        raise ValueError(f"{type(module).__name__}: {why}; not swapped")
    swap = Swap(LINEAR_CORE, path)
    swap.parts = {"forward": "lightning"}
    chunk = chunk_size or CHUNK

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, *args, **kwargs):
        if kwargs.get("cache") is not None or kwargs.get("past_key_values") is not None or args:
            return type(self).forward(self, hidden_states, position_embeddings, attention_mask, *args, **kwargs)
        swap.count("lightning")
        return lightning_forward(self, hidden_states, attention_mask, chunk_size=chunk,
                                 cu_seqlens=kwargs.get("cu_seq_lens_q"))

    swap.set_forward(module, forward)
    return swap
