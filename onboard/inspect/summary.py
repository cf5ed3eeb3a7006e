"""Human-readable summary of a ModelSpec (what `onboard inspect` prints without --json)."""

from __future__ import annotations

from collections import Counter

from onboard.inspect.accounting import costs, memory_bytes
from onboard.inspect.spec import MLP, Attention, ModelSpec


def human(n: float, unit: str = "") -> str:
    for scale, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if abs(n) >= scale:
            return f"{n / scale:.2f}{suffix}{unit}"
    return f"{n:.0f}{unit}"


def gib(n: float) -> str:
    return f"{n / 2**30:,.1f} GiB"


def describe_attention(a: Attention) -> str:
    parts = [a.kind]
    if a.num_heads:
        heads = f"{a.num_heads} heads"
        if a.num_kv_heads and a.num_kv_heads != a.num_heads:
            heads += f" / {a.num_kv_heads} kv"
        parts.append(heads)
    if a.head_dim:
        parts.append(f"head dim {a.head_dim}" + (f" (v {a.v_head_dim})" if a.v_head_dim and a.v_head_dim != a.head_dim else ""))
    if a.q_lora_rank or a.kv_lora_rank:
        parts.append(f"q rank {a.q_lora_rank or '-'}, kv rank {a.kv_lora_rank}, rope {a.rope_head_dim}")
    if a.window:
        parts.append(f"window {a.window}")
    if a.index_topk:
        parts.append(f"indexer {a.index_heads}x{a.index_head_dim}, top-{a.index_topk} keys")
    if a.state_size:
        parts.append(f"state {a.state_size}")
    if a.gate:
        parts.append(f"{a.gate} decay")
    if a.conv_kernel:
        parts.append(f"conv {a.conv_kernel}")
    for flag in ("sinks", "output_gate", "qk_norm"):
        if getattr(a, flag):
            parts.append(flag.replace("_", " "))
    return ", ".join(parts)


def describe_mlp(m: MLP) -> str:
    act = f"{m.activation}{' gated' if m.gated else ''}" if m.activation else "?"
    if m.kind == "dense":
        return f"dense FFN {m.ffn} ({act})"
    if m.kind != "moe":
        return m.kind
    text = f"MoE {m.num_experts} experts, top-{m.top_k}, expert FFN {m.expert_ffn} ({act}, {m.expert_layout})"
    if m.num_shared_experts:
        text += f", {m.num_shared_experts} shared ({m.shared_expert_ffn}{', sigmoid-gated' if m.shared_expert_gated else ''})"
    return text


def describe_router(m: MLP) -> str:
    r = m.router
    if r is None:
        return ""
    steps = [f"{r.score} then top-k" if r.order == "score_then_topk" else f"top-k then {r.score}"]
    if r.group_limited:
        steps.append(f"group-limited ({r.n_group} groups, top-{r.topk_group})")
    if r.bias_correction:
        steps.append("expert-bias correction")
    if r.renormalize:
        steps.append(f"renormalised by their {r.renorm_p:g}-norm" if r.renorm_p is not None else "renormalised")
    if r.scaling:
        steps.append(f"scaled x{r.scaling:g}")
    return "router: " + ", ".join(steps)


def ranges(indices: list[int]) -> str:
    out, start, prev = [], None, None
    for i in indices:
        if start is None:
            start = prev = i
        elif i == prev + 1:
            prev = i
        else:
            out.append(f"{start}-{prev}" if start != prev else f"{start}")
            start = prev = i
    if start is not None:
        out.append(f"{start}-{prev}" if start != prev else f"{start}")
    return ",".join(out)


def compress_pattern(labels: list[str], max_period: int = 8) -> list[tuple[list[str], int]]:
    """Describe a layer sequence as (unit, repeats) pieces: a prefix of runs, then a repeating unit.

    [a, a, b, c, c, c, d, c, c, c, d] -> [([a], 2), ([b], 1), ([c, c, c, d], 2)]
    """
    n = len(labels)
    for start in range(n):
        rest = labels[start:]
        for period in range(1, min(max_period, len(rest)) + 1):
            if len(rest) % period == 0 and len(rest) // period >= 2 and rest == rest[:period] * (len(rest) // period):
                return _runs(labels[:start]) + [(rest[:period], len(rest) // period)]
    return _runs(labels)


def pattern_spans(labels: list[str]):
    """(first layer, last layer, unit, repeats) for each piece of `compress_pattern(labels)`."""
    position = 0
    for unit, repeats in compress_pattern(labels):
        end = position + len(unit) * repeats - 1
        yield position, end, unit, repeats
        position = end + 1


def _runs(labels: list[str]) -> list[tuple[list[str], int]]:
    out: list[tuple[list[str], int]] = []
    for label in labels:
        if out and out[-1][0] == [label]:
            out[-1] = ([label], out[-1][1] + 1)
        else:
            out.append(([label], 1))
    return out


def summary(spec: ModelSpec, seq_len: int = 4096, timings: dict | None = None) -> str:
    c = costs(spec, seq_len)
    lines = [
        f"{spec.name} ({spec.model_type}): {spec.num_layers} layers, hidden {spec.hidden_size}, "
        f"vocab {spec.vocab_size}, {'tied' if spec.tie_embeddings else 'untied'} embeddings",
        f"parameters: {human(spec.params_total)} total, {human(spec.params_active)} active per token "
        f"(embedding {human(spec.params_embedding)} not counted as active)",
        f"training FLOPs per token at seq {seq_len}: {human(c.flops_per_token_training)}FLOP "
        f"({c.attention_share:.1%} in token mixing)",
    ]
    mem = memory_bytes(spec.params_total)
    lines.append(
        f"memory (bf16 weights, fp32 grads + master + AdamW): weights {gib(mem['weights'])}, "
        f"grads {gib(mem['gradients'])}, master {gib(mem['master_weights'])}, optimizer {gib(mem['optimizer'])}, "
        f"total {gib(mem['total'])}"
    )
    lines.append("")
    lines.append("layer pattern:")
    labels = [f"{layer.attention.kind}+{layer.mlp.kind}" for layer in spec.layers]
    for start, end, unit, repeats in pattern_spans(labels):
        span = f"{start}-{end}" if end > start else f"{start}"
        body = unit[0] if len(unit) == 1 else "[" + ", ".join(f"{k} x{n}" for (k,), n in _runs(unit)) + "]"
        lines.append(f"  {span:>9}  {body} x{repeats}")
    lines.append("")
    lines.append("layer kinds:")
    groups: dict[str, list[int]] = {}
    for layer in spec.layers:
        key = describe_attention(layer.attention) + "\n      " + describe_mlp(layer.mlp)
        if layer.mlp.router:
            key += "\n      " + describe_router(layer.mlp)
        groups.setdefault(key, []).append(layer.index)
    for key, indices in groups.items():
        lines.append(f"  layers {ranges(indices)} ({len(indices)}):")
        lines.append(f"      {key}")
    kinds = Counter(layer.attention.kind for layer in spec.layers)
    lines.append("")
    lines.append("attention kinds: " + ", ".join(f"{k} x{n}" for k, n in kinds.most_common()))
    head = spec.head
    lines.append(
        f"head: {head.get('path', '?')}, loss {head.get('loss') or 'not seen'}"
        + (f", logit softcap {head['logit_softcap']}" if head.get("logit_softcap") else "")
    )
    lines.append("captured: " + ", ".join(f"{k} ({v})" for k, v in spec.capture.items()))
    if spec.unmatched:
        lines.append(f"unmatched ({len(spec.unmatched)}): stays HuggingFace code")
        for u in spec.unmatched:
            lines.append(f"  {u.path}: {u.reason}")
    else:
        lines.append("unmatched: none")
    if timings:
        lines.append("time: " + ", ".join(f"{k[:-2]} {v:.1f}s" for k, v in timings.items()))
    return "\n".join(lines)
