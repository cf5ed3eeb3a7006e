"""Run a HuggingFace linear-attention or state-space module on the runtime's chunked sequence cores.

    swap_linear_core(module, *, chunk_size=None, probe=True) -> dict

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
meaning never gets replaced. Then the instance's class is replaced by a subclass, made once per class, whose
forward rebinds those globals to the runtime's functions for the duration of the call (restored after, even
on error). Parameters, buffers, submodules and their names are untouched: the module is the same object with
the same tensors. The single-token decode functions (recurrent step, conv update) stay HuggingFace code.
The rebinding is process-global while a swapped forward runs: do not run an unswapped instance of the same
family concurrently in another thread. Only names the forward itself looks up are found (not functions
reached through helper methods), which is how transformers' modeling files are written.

The runtime core takes packed sequences (`cu_seqlens` / `cu_seq_lens_q`, which transformers' torch
fallback refuses) and keeps the conv from reaching across them. `chunk_size` overrides the chunk length the
module asks for (the result does not depend on it; the rendered Triton kernels run only at the chunk length
they were rendered for).

A block whose only mixer is the causal conv (a gated short convolution, as in LFM) has the conv swapped
(counted as "short_conv"; the runtime's conv also keeps packed sequences apart, which transformers' fallback
does not). A block that writes its scan inline instead of calling such a function is handed to
`runtime.attention.lightning.swap_lightning_attention`, which takes it only if it is lightning attention.

Returns what was swapped: {global name: kind}, kind one of "chunk_gated_delta", "ssd_chunk_scan",
"selective_scan", "causal_conv1d" (or {"forward": "lightning"}). `unswap_linear_core(module)`
restores the original class. Calls are counted per kind in `CALLS` (process-wide, exported as
`runtime.attention.LINEAR_CORE_CALLS`) and in `module.runtime_core_calls`, so verification can show that the
runtime ran. `find_linear_cores(module)` says what would be swapped, without probing or changing anything.
"""

from __future__ import annotations

import collections
import contextlib
import inspect
import sys

import torch
import torch.nn.functional as F

from runtime.attention.conv import causal_conv1d
from runtime.attention.gated_delta import chunk_gated_delta_rule

CALLS: collections.Counter = collections.Counter()

_CHUNK_PARAMS = {"g", "beta", "initial_state", "chunk_size"}
_CONV_PARAMS = {"hidden_states", "weight", "bias", "activation"}
# Mamba2's chunked SSD scan and Mamba1's selective scan (not their single-token state updates, which take `state`)
_SSD_PARAMS = {"hidden_states", "dt", "A", "B", "C", "chunk_size", "initial_states"}
_SELECTIVE_PARAMS = {"hidden_states", "dt", "A", "B", "C", "delta_bias", "delta_softplus"}
SEQUENCE_CORES = ("chunk_gated_delta", "ssd_chunk_scan", "selective_scan")
_SUBCLASSES: dict[type, type] = {}
_PROBED: dict = {}  # function -> probe verdict: every layer of a model shares its family's functions


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


def _close(a: torch.Tensor, b: torch.Tensor, tol: float = 1e-4) -> bool:
    return a.shape == b.shape and bool(((a - b).abs().max() <= tol * (1 + b.abs().max())).item())


def _call(fn, *args, **kwargs):
    """fn's result, or None when these inputs are not of the shape it expects."""
    try:
        with torch.no_grad():
            return fn(*args, **kwargs)
    except (RuntimeError, ValueError, TypeError, IndexError):
        return None


def _probe_chunk(fn) -> bool:
    """Same outputs as the runtime's core on a small random problem, with either gate kind."""
    gen = torch.Generator().manual_seed(0)
    b, t, h, d = 1, 11, 2, 4
    q, k, v = (torch.randn(b, t, h, d, generator=gen) for _ in range(3))
    beta = torch.rand(b, t, h, generator=gen)
    kw = {"initial_state": torch.randn(b, h, d, d, generator=gen), "output_final_state": True,
          "use_qk_l2norm_in_kernel": True}
    for gate_shape in ((b, t, h), (b, t, h, d)):
        g = -F.softplus(torch.randn(gate_shape, generator=gen))
        if _same_pair(_call(fn, q, k, v, g=g, beta=beta, chunk_size=8, **kw),
                      chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=4, **kw)):
            return True
    return False


def _probe_conv(fn) -> bool:
    gen = torch.Generator().manual_seed(0)
    x, w, bias = torch.randn(2, 3, 9, generator=gen), torch.randn(3, 4, generator=gen), torch.randn(3, generator=gen)
    theirs = _call(fn, x, w, bias, activation="silu")
    return theirs is not None and _close(theirs, causal_conv1d(x, w, bias, activation="silu"))


def _probe_ssd(fn) -> bool:
    """Mamba2's chunked scan: same output and final state as the runtime's, grouped B/C, D, dt bias and softplus."""
    from runtime.attention.ssd import ssd_chunk_scan

    gen = torch.Generator().manual_seed(0)
    b, t, h, p, g, n = 2, 11, 4, 3, 2, 5
    x, dt = torch.randn(b, t, h, p, generator=gen), torch.randn(b, t, h, generator=gen)
    bc = [torch.randn(b, t, g, n, generator=gen) for _ in range(2)]
    kw = {"D": torch.randn(h, generator=gen), "dt_bias": torch.randn(h, generator=gen), "dt_softplus": True,
          "initial_states": torch.randn(b, h, p, n, generator=gen), "return_final_states": True}
    a = -torch.rand(h, generator=gen) * 2
    return _same_pair(_call(fn, x, dt, a, *bc, chunk_size=8, **kw),
                      ssd_chunk_scan(x, dt, a, *bc, chunk_size=4, **kw))


def _probe_selective(fn) -> bool:
    """Mamba1's selective scan: same output and last state as the runtime's, with D, z and a softplus dt bias."""
    from runtime.attention.selective_scan import selective_scan

    gen = torch.Generator().manual_seed(0)
    b, d, t, n = 2, 6, 11, 4
    x, dt, z = (torch.randn(b, d, t, generator=gen) for _ in range(3))
    bc = [torch.randn(b, n, t, generator=gen) for _ in range(2)]
    kw = {"D": torch.randn(d, generator=gen), "z": z, "delta_bias": torch.randn(d, generator=gen),
          "delta_softplus": True, "return_last_state": True}
    a = -torch.rand(d, n, generator=gen) * 2
    return _same_pair(_call(fn, x, dt, a, *bc, **kw), selective_scan(x, dt, a, *bc, **kw))


def _same_pair(theirs, ours: tuple) -> bool:
    """Whether a probed function returned the runtime's (output, final state)."""
    return (isinstance(theirs, tuple) and len(theirs) == 2 and theirs[1] is not None
            and _close(theirs[0], ours[0]) and _close(theirs[1], ours[1]))


_PROBES = {"chunk_gated_delta": _probe_chunk, "causal_conv1d": _probe_conv, "ssd_chunk_scan": _probe_ssd,
           "selective_scan": _probe_selective}


def _runtime_function(kind: str, module, override_chunk: int | None, conv_mixer: bool = False):
    counts = module.runtime_core_calls

    if kind == "chunk_gated_delta":
        def chunk_core(query, key, value, g, beta, chunk_size=64, initial_state=None, output_final_state=False,
                       use_qk_l2norm_in_kernel=False, scale=None, cu_seqlens=None, **kwargs):
            CALLS[kind] += 1
            counts[kind] += 1
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
            CALLS[kind] += 1
            counts[kind] += 1
            return ssd_chunk_scan(hidden_states, dt, A, B, C, override_chunk or chunk_size, *args, **kwargs)
        return ssd_core

    if kind == "selective_scan":
        from runtime.attention.selective_scan import selective_scan

        def selective_core(*args, **kwargs):
            CALLS[kind] += 1
            counts[kind] += 1
            return selective_scan(*args, **kwargs)
        return selective_core

    # counted apart when the conv is the block's only mixer: verification then needs it to have run
    label = "short_conv" if conv_mixer else kind

    def conv(hidden_states, weight, bias=None, activation=None, **kwargs):
        CALLS[label] += 1
        counts[label] += 1
        return causal_conv1d(hidden_states, weight, bias, activation, seq_idx=kwargs.get("seq_idx"),
                             cu_seqlens=kwargs.get("cu_seqlens", kwargs.get("cu_seq_lens_q")))
    return conv


@contextlib.contextmanager
def _rebound(namespace: dict, replacements: dict):
    saved = {name: namespace[name] for name in replacements}
    namespace.update(replacements)
    try:
        yield
    finally:
        namespace.update(saved)


def _swapped_class(cls: type) -> type:
    if cls not in _SUBCLASSES:
        def forward(self, *args, **kwargs):
            namespace = sys.modules[cls.__module__].__dict__
            with _rebound(namespace, self._runtime_functions):
                return cls.forward(self, *args, **kwargs)

        _SUBCLASSES[cls] = type(f"Runtime{cls.__name__}", (cls,), {"forward": forward, "_runtime_base": cls,
                                                                  "__module__": __name__})
    return _SUBCLASSES[cls]


def find_linear_cores(module: torch.nn.Module) -> dict[str, str]:
    """{global name: kind} for the chunk cores and convs that `module`'s forward calls (by signature only)."""
    cls = getattr(type(module), "_runtime_base", type(module))
    namespace = sys.modules[cls.__module__].__dict__
    found = {}
    for name in sorted(_forward_names(cls)):
        kind = _kind(namespace.get(name))
        if kind is not None:
            found[name] = kind
    return found


def swap_linear_core(module: torch.nn.Module, *, chunk_size: int | None = None, probe: bool = True) -> dict[str, str]:
    """Make `module` run the runtime's chunked gated delta rule and conv (see the module docstring).
    `chunk_size` overrides the chunk length the module asks for (the result does not depend on it).
    Raises ValueError, leaving the module unchanged, when its forward calls no chunk core, or when a
    candidate fails the probe."""
    if getattr(type(module), "_runtime_base", None) is not None:
        return dict(module._runtime_kinds)
    found = find_linear_cores(module)
    conv_mixer = set(found.values()) == {"causal_conv1d"}  # a gated short conv (LFM): the conv is its mixer
    if not set(SEQUENCE_CORES) & set(found.values()) and not conv_mixer:
        from runtime.attention.lightning import swap_lightning_attention

        try:  # a block that writes its scan inline: the runtime reads it whole, if it is lightning attention
            return swap_lightning_attention(module, chunk_size=chunk_size, probe=probe)
        except ValueError as exc:
            raise ValueError(f"{type(module).__name__}.forward calls no chunked sequence core (delta rule, Mamba2 SSD "
                             f"or Mamba1 selective scan) and is not a lightning block ({exc})") from None
    namespace = sys.modules[type(module).__module__].__dict__
    if probe:
        for name, kind in found.items():
            fn = namespace[name]
            if fn not in _PROBED:
                _PROBED[fn] = _PROBES[kind](fn)
            if not _PROBED[fn]:
                raise ValueError(f"{type(module).__module__}.{name} has the parameters of a {kind} but does not "
                                 f"compute the same thing as the runtime's on a probe; not swapped")
    module.runtime_core_calls = collections.Counter()
    module._runtime_kinds = dict(found)
    module._runtime_functions = {name: _runtime_function(kind, module, chunk_size, conv_mixer)
                                 for name, kind in found.items()}
    module.__class__ = _swapped_class(type(module))
    return dict(found)


def unswap_linear_core(module: torch.nn.Module) -> None:
    base = getattr(type(module), "_runtime_base", None)
    if base is not None:
        module.__class__ = base
        for attr in ("_runtime_functions", "_runtime_kinds"):
            module.__dict__.pop(attr, None)
