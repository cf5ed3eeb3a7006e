"""Run a HuggingFace linear-attention or state-space module on the runtime's chunked sequence cores.

    swap = swap_linear_core(module, *, chunk_size=None, probe=True)   # a runtime.swap.Swap
    swap.parts    # what it took over: {global name: core kind}, or {"forward": "lightning"}
    swap.calls    # how often each core ran, by kind
    swap.undo()   # the module as it was

`module` is an instance of any linear-attention block whose forward calls, through its modeling module's
globals, a chunked delta-rule core and/or a causal conv: transformers' Qwen3NextGatedDeltaNet,
Qwen3_5(Moe)GatedDeltaNet, OlmoHybrid / LaraMini GatedDeltaNet, KimiLinearDeltaAttention, BailingHybrid /
Glm5Next delta attention, and families never seen. The functions are found by signature, not name:

- chunk core: parameters (query, key, value, g, beta, ..., chunk_size, initial_state, ...), called with g
  (B, T, H) (one decay per head) or (B, T, H, K) (per key channel) and beta (B, T, H);
- Mamba2 SSD chunk scan (NemotronH, GraniteMoeHybrid, Bamba, ...): parameters (hidden_states, dt, A, B, C,
  chunk_size, initial_states, ...), run by `runtime.attention.ssd.ssd_chunk_scan`;
- Mamba1 selective scan (Jamba, ...): parameters (hidden_states, dt, A, B, C, delta_bias, delta_softplus, ...),
  run by `runtime.attention.selective_scan.selective_scan`;
- conv: parameters (hidden_states, weight, bias, activation, ...) and no conv_state (the decode-step update).

With `probe` (default) each one is also run once on small random inputs against the runtime's version and
refused (ValueError, nothing changed) unless both agree: a function with the right parameters but another
meaning never gets replaced. Then this one module gets its own forward (`runtime.swap.Swap.set_forward`):
the class's forward code, run against an overlay of its modeling module's namespace in which those names
are the runtime's functions (`runtime.swap.forward_with_globals`; every other name is read from the module). Nothing else changes: not the class, not the
modeling module, not another instance; parameters, buffers, submodules and their names are untouched. The
single-token decode functions (recurrent step, conv update) stay HuggingFace code. Only names the forward
itself looks up are found (not functions reached through helper methods), which is how transformers'
modeling files are written.

The runtime core takes packed sequences (`cu_seqlens` / `cu_seq_lens_q`, which transformers' torch
fallback refuses) and keeps the conv from reaching across them. `chunk_size` overrides the chunk length the
module asks for (the result does not depend on it; the rendered Triton kernels run only at the chunk length
they were rendered for).

A block whose only mixer is the causal conv (a gated short convolution, as in LFM) has the conv swapped
(counted as "short_conv"; the runtime's conv also keeps packed sequences apart, which transformers' fallback
does not). A block that writes its scan inline instead of calling such a function is handed to
`runtime.attention.lightning.swap_lightning_attention`, which takes it only if it is lightning attention.
`find_linear_cores(module)` says what would be swapped, without probing or changing anything.
"""

from __future__ import annotations

import inspect
import sys

import torch

from runtime.attention.conv import causal_conv1d
from runtime.attention.gated_delta import chunk_gated_delta_rule
from runtime.attention.probes import agrees
from runtime.sequence_split import active
from runtime.swap import LINEAR_CORE, Swap, forward_with_globals

_CHUNK_PARAMS = {"g", "beta", "initial_state", "chunk_size"}
_CONV_PARAMS = {"hidden_states", "weight", "bias", "activation"}
# Mamba2's chunked SSD scan and Mamba1's selective scan (not their single-token state updates, which take `state`)
_SSD_PARAMS = {"hidden_states", "dt", "A", "B", "C", "chunk_size", "initial_states"}
_SELECTIVE_PARAMS = {"hidden_states", "dt", "A", "B", "C", "delta_bias", "delta_softplus"}
SEQUENCE_CORES = ("chunk_gated_delta", "ssd_chunk_scan", "selective_scan")


def _parameters(fn) -> list[str] | None:
    try:
        return list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return None


def _kind(fn) -> str | None:
    """What a global of a modeling module is, judged by its parameters."""
    if not callable(fn) or isinstance(fn, type):
        return None
    params = _parameters(fn)
    if params is None:
        return None
    names = set(params)
    if _CHUNK_PARAMS <= names and len(params) >= 5:
        return "chunk_gated_delta"
    if _SSD_PARAMS <= names and "state" not in names:
        return "ssd_chunk_scan"
    if _SELECTIVE_PARAMS <= names and "chunk_size" not in names and "state" not in names:
        return "selective_scan"
    if _CONV_PARAMS <= names and "conv_state" not in names:
        return "causal_conv1d"
    return None


def _forward_names(cls: type) -> set[str]:
    """Global names the (undecorated) forward of `cls` looks up."""
    code = getattr(inspect.unwrap(cls.forward), "__code__", None)
    return set(code.co_names) if code is not None else set()


def _not_split(kind: str) -> None:
    """A core whose model-level context parallelism is not wired refuses to run on a rank's segments alone."""
    if active() is not None:
        raise ValueError(f"{kind} under context parallelism is not built (the runtime carries the gated delta rule, "
                         f"Mamba2's SSD and lightning attention across cp ranks)")


def _runtime_function(kind: str, swap: Swap, override_chunk: int | None, conv_mixer: bool = False):
    if kind == "chunk_gated_delta":
        def chunk_core(query, key, value, g, beta, chunk_size=64, initial_state=None, output_final_state=False,
                       use_qk_l2norm_in_kernel=False, scale=None, cu_seqlens=None, **kwargs):
            swap.count(kind)
            if (split := active()) is not None:  # context parallelism: the state carried across the cp ranks
                if initial_state is not None or output_final_state:
                    raise ValueError("context parallelism trains from a zero state and keeps no final state")
                return split.gated_delta(query, key, value, g, beta, chunk_size=override_chunk or chunk_size,
                                         use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, scale=scale), None
            # transformers passes packed-sequence boundaries under either name, depending on the family
            cu = cu_seqlens if cu_seqlens is not None else kwargs.get("cu_seq_lens_q")
            return chunk_gated_delta_rule(query, key, value, g, beta, chunk_size=override_chunk or chunk_size,
                                          initial_state=initial_state, output_final_state=output_final_state,
                                          use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, scale=scale,
                                          cu_seqlens=cu)
        return chunk_core

    if kind == "ssd_chunk_scan":
        from runtime.attention.ssd import ssd_chunk_scan

        def ssd_core(hidden_states, dt, A, B, C, chunk_size=256, *args, **kwargs):
            swap.count(kind)
            return ssd_chunk_scan(hidden_states, dt, A, B, C, override_chunk or chunk_size, *args, **kwargs)
        return ssd_core

    if kind == "selective_scan":
        from runtime.attention.selective_scan import selective_scan

        def selective_core(*args, **kwargs):
            swap.count(kind)
            _not_split(kind)
            return selective_scan(*args, **kwargs)
        return selective_core

    # counted apart when the conv is the block's only mixer: verification then needs it to have run
    label = "short_conv" if conv_mixer else kind

    def conv(hidden_states, weight, bias=None, activation=None, **kwargs):
        swap.count(label)
        if (split := active()) is not None:  # each segment sees its predecessor's last taps
            return split.conv1d(hidden_states, weight, bias, activation)
        return causal_conv1d(hidden_states, weight, bias, activation, seq_idx=kwargs.get("seq_idx"),
                             cu_seqlens=kwargs.get("cu_seqlens", kwargs.get("cu_seq_lens_q")))
    return conv


def find_linear_cores(module: torch.nn.Module) -> dict[str, str]:
    """{global name: kind} for the chunk cores and convs that `module`'s forward calls (by signature only)."""
    cls = type(module)
    namespace = sys.modules[cls.__module__].__dict__
    found = {}
    for name in sorted(_forward_names(cls)):
        kind = _kind(namespace.get(name))
        if kind is not None:
            found[name] = kind
    return found


def swap_linear_core(module: torch.nn.Module, *, chunk_size: int | None = None, probe: bool = True,
                     path: str = "") -> Swap:
    """Make `module` run the runtime's chunked sequence cores (see the module docstring).
    `chunk_size` overrides the chunk length the module asks for (the result does not depend on it).
    Raises ValueError, leaving the module unchanged, when its forward calls no chunk core, or when a
    candidate fails the probe."""
    found = find_linear_cores(module)
    conv_mixer = set(found.values()) == {"causal_conv1d"}  # a gated short conv (LFM): the conv is its mixer
    if not set(SEQUENCE_CORES) & set(found.values()) and not conv_mixer:
        from runtime.attention.lightning import swap_lightning_attention

        try:  # a block that writes its scan inline: the runtime reads it whole, if it is lightning attention
            return swap_lightning_attention(module, chunk_size=chunk_size, probe=probe, path=path)
        except ValueError as exc:
            raise ValueError(f"{type(module).__name__}.forward calls no chunked sequence core (delta rule, Mamba2 SSD "
                             f"or Mamba1 selective scan) and is not a lightning block ({exc})") from None
    namespace = sys.modules[type(module).__module__].__dict__
    if probe:
        for name, kind in found.items():
            if not agrees(kind, namespace[name]):
                raise ValueError(f"{type(module).__module__}.{name} has the parameters of a {kind} but does not "
                                 f"compute the same thing as the runtime's on a probe; not swapped")
    swap = Swap(LINEAR_CORE, path)
    swap.parts = dict(found)
    swap.set_forward(module, forward_with_globals(type(module), {
        name: _runtime_function(kind, swap, chunk_size, conv_mixer) for name, kind in found.items()}))
    return swap
