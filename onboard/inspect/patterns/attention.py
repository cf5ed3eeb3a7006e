"""Recognise the token mixer of a layer (the part that moves information between positions) by its ops.

- softmax attention: a scaled-dot-product op, or a softmax over a (query x key) score matrix;
  MLA when keys/values come out of a low-rank projection chain; sliding / chunked windows read from the
  real mask the layer received; sinks (a learned per-head logit concatenated before the softmax); an
  output gate (sigmoid scaling the attention output before the output projection); QK-norm.
- sparse attention (DSA): a top-k over key positions inside the mixer selects which keys each query sees.
- linear attention: no key softmax; a short causal convolution, decays accumulated with cumsum / exp.
  Delta-rule forms (L2-normalised q/k, a sigmoid "beta" per head) are Gated DeltaNet when the decay is a
  scalar per head and KDA when it is per key channel; a state-space scan with a per-channel skip (D)
  and softplus step is Mamba-style; a fixed per-head exponential decay with no convolution is lightning.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from onboard.inspect.graph import GraphView, common_prefix, op_name, within

SDPA = ("scaled_dot_product_attention", "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_efficient_attention", "_scaled_dot_product_flash_attention", "flex_attention")
NORM_OPS = ("rsqrt", "sqrt", "linalg_vector_norm", "norm")


@dataclass
class AttentionMatch:
    kind: str
    path: str
    facts: dict = field(default_factory=dict)  # twin-scale numbers and flags
    note: str = ""


def _mixers(view: GraphView, nodes, seq_len: int) -> list:
    out = []
    for n in nodes:
        name = op_name(n)
        shape = view.shape(n) or ()
        if name in SDPA or name in ("conv1d", "convolution", "cumsum"):
            out.append(n)
        elif name in ("softmax", "_softmax") and len(shape) >= 2 and shape[-1] >= seq_len and shape[-2] == seq_len:
            out.append(n)
        elif name in ("matmul", "bmm", "einsum") and len(shape) >= 2 and shape[-1] == shape[-2] == seq_len:
            out.append(n)
        elif name in ("matmul", "bmm", "einsum") and len(shape) >= 3 and _block_square(shape, seq_len):
            out.append(n)  # position-by-position products over blocks of the sequence (lightning's blocks)
    return out


def _block_square(shape, seq_len: int) -> bool:
    """A (batch, heads, B, B) product with B a proper divisor of the sequence and no token dimension beside it:
    token-by-token scores computed one block of the sequence at a time (a per-token (n x n) mixing, as
    hyper-connections do, keeps the token dimension)."""
    block = shape[-1]
    return shape[-2] == block and 1 < block < seq_len and seq_len % block == 0 and seq_len not in shape[:-2]


def _mask_window(inputs: dict, seq_len: int) -> tuple[str | None, int | None]:
    """Read a sliding or chunked window off the real attention mask the layer received."""
    masks = []

    def collect(v):
        if isinstance(v, torch.Tensor) and v.dim() >= 2 and v.shape[-1] == seq_len and v.shape[-2] == seq_len:
            masks.append(v)
        elif isinstance(v, dict):
            for x in v.values():
                collect(x)
        elif isinstance(v, (list, tuple)):
            for x in v:
                collect(x)

    collect(inputs)
    for mask in masks:
        m = mask.reshape(-1, seq_len, seq_len)[0]
        allowed = m if m.dtype == torch.bool else m == 0
        firsts = []
        for i in range(seq_len):
            row = torch.nonzero(allowed[i]).flatten()
            firsts.append(int(row.min()) if len(row) else i)
        spans = [i - f + 1 for i, f in enumerate(firsts)]
        if max(spans) >= seq_len:
            continue
        if all(firsts[i] <= firsts[i + 1] for i in range(seq_len - 1)) and any(
            spans[i + 1] < spans[i] for i in range(seq_len - 1)
        ):
            return "chunked", max(spans)
        return "sliding", max(spans)
    return None, None


def match_attention(view: GraphView, inputs: dict, seq_len: int, exclude: list[str]) -> AttentionMatch | None:
    nodes = [n for n in view.under("") if not any(within(view.path(n), x) for x in exclude if x)]
    mixers = _mixers(view, nodes, seq_len)
    if not mixers:
        return None
    paths = [view.path(n) for n in mixers]
    path = common_prefix(paths) or paths[0].split(".")[0]
    region = view.under(path)
    facts: dict = {}
    attn_ops = [n for n in region if op_name(n) in SDPA or (op_name(n) in ("softmax", "_softmax") and n in mixers)]
    if attn_ops:
        return _softmax_family(view, path, region, attn_ops[0], inputs, seq_len, facts)
    return _linear_family(view, path, region, seq_len, facts)


def _softmax_family(view, path, region, attn, inputs, seq_len, facts) -> AttentionMatch:
    if op_name(attn) in SDPA:
        q, k, v = view.inputs(attn)[:3]
    else:  # eager: softmax(q @ k^T) @ v
        scores = max((n for n in view.ancestors(attn) if op_name(n) in ("matmul", "bmm")),
                     key=lambda n: view.index[n], default=None)
        q, k = (view.inputs(scores)[:2] if scores is not None else (None, None))
        after = sorted((n for n in view.descendants(attn) if op_name(n) in ("matmul", "bmm")),
                       key=lambda n: view.index[n])
        v = next((i for i in view.inputs(after[0]) if i not in view.descendants(attn) and i is not attn),
                 None) if after else None
    qs = view.shape(q) if q is not None else None
    if qs and len(qs) == 4:
        facts["num_heads"], facts["head_dim"] = qs[1], qs[-1]
        vs = view.shape(v) if v is not None else None
        facts["v_head_dim"] = vs[-1] if vs else qs[-1]
        facts["num_kv_heads"] = _kv_heads(view, k, facts["head_dim"]) or facts["num_heads"]
    # MLA: a projection whose output, through a norm, feeds another projection (low-rank chain)
    lora = _low_rank_chains(view, region, attn)
    kind = "softmax"
    if lora.get("kv"):
        kind = "mla"
        facts["kv_lora_rank"] = lora["kv"]
        facts["q_lora_rank"] = lora.get("q")
    # sparse attention: a top-k over key positions (not over experts or heads) picks each query's keys, by scores
    # that pair each query with each key (an indexer's q . k). A top-k over scores that are the keys' alone (Doge's
    # dynamic mask: a value-side projection per key, the causal mask added) is a mask, and the attention softmax.
    # An indexer's top-k may keep every key at the twin's short length (its k clamped to the keys there, DeepSeek-V4's
    # compressed keys): what it computes, not whether it drops keys at this length, says it picks them.
    inside = set(region)
    picks = [n for n in region if op_name(n) == "topk" and len(view.shape(view.inputs(n)[0]) or ()) >= 2
             and view.shape(view.inputs(n)[0])[-2] == seq_len and view.topk_k(n) <= view.shape(view.inputs(n)[0])[-1]]
    dsa = [n for n in picks if _scores_pair_queries_with_keys(view, inside, view.inputs(n)[0])]
    if dsa:
        facts["index_topk"] = view.topk_k(dsa[0])
        kind = "sparse:dsa"
    else:
        # indices chosen elsewhere (an indexer shared with an earlier layer, or one that picks per query in a loop)
        # scattered into a query x key mask (with at most one spare column the unused slots are sent to)
        for n in region:
            shape = view.shape(n) or ()
            if op_name(n) == "scatter" and len(shape) >= 2 and shape[-2] == seq_len and shape[-1] in (seq_len,
                                                                                                     seq_len + 1):
                index = view.arg(n, 2, "index")
                k = (view.shape(index) or (seq_len,))[-1] if hasattr(index, "op") else seq_len
                own = [t for t in (view.ancestors(index) | {index}) & inside if op_name(t) == "topk"] \
                    if hasattr(index, "op") else []
                if own and not any(_scores_pair_queries_with_keys(view, inside, view.inputs(t)[0]) for t in own):
                    continue  # keys picked by one score per key: a dynamic mask, not an indexer
                if k < seq_len:
                    facts["index_topk"], kind = k, "sparse:dsa"
                    facts["shared_indexer"] = not own
                    break
    window_kind, window = _mask_window(inputs, seq_len)
    if window_kind and kind == "softmax":
        kind = window_kind
    if window:
        facts["window"] = window
    facts["sinks"] = _has_sinks(view, region, facts.get("num_heads"))
    facts["output_gate"] = _has_output_gate(view, region, attn)
    facts["qk_norm"] = any(
        op_name(n) in NORM_OPS and len(view.shape(n) or ()) == 4 and view.index[n] < view.index[attn]
        for n in region)
    return AttentionMatch(kind, path, facts)


PRODUCTS = ("matmul", "bmm", "einsum", "mm", "baddbmm")


def _scores_pair_queries_with_keys(view: GraphView, inside: set, node) -> bool:
    """Whether `node` is computed, among the mixer's nodes `inside`, from a product of two activations (an indexer's
    queries with its keys, whole or one query at a time), rather than from one score per key (a projection of
    the keys alone: a product with a weight)."""
    for a in view.ancestors(node) & inside:
        if op_name(a) not in PRODUCTS:
            continue
        activations = [i for i in view.inputs(a) if hasattr(i, "op") and view.param(i) is None]
        if len(activations) >= 2:
            return True
    return False


def _kv_heads(view: GraphView, k, head_dim: int) -> int | None:
    """Key heads before any GQA expansion: the key projection's width over the head size."""
    if k is None:
        return None
    best = None
    for n in view.ancestors(k) | {k}:
        w = view.linear_weight(n)
        if w and (best is None or view.index[n] > view.index[best[0]]):
            best = (n, w)
    if best is None:
        return None
    width = view.param_shapes[best[1]][0]
    return width // head_dim if width % head_dim == 0 and width >= head_dim else None


def _low_rank_chains(view: GraphView, region, attn) -> dict:
    """Projection A -> (norm) -> projection B inside the mixer: ranks of the query and key/value paths."""
    linears = [n for n in region if view.linear_weight(n)]
    out: dict = {}
    for b in linears:
        for a in linears:
            if a is b or a not in view.ancestors(b):
                continue
            between = view.between(a, b)
            if attn in between or any(view.linear_weight(n) for n in between):
                continue
            if not any(op_name(n) in NORM_OPS for n in between):
                continue
            rank = view.param_shapes[view.linear_weight(b)][1]
            a_out = view.param_shapes[view.linear_weight(a)][0]
            if a_out > rank:  # the compressed KV also carries the shared rope key
                out["kv"] = rank
            else:
                out.setdefault("q", rank)
    # with both chains present and equal-width outputs, the key/value one is the one split for rope
    return out


def _has_sinks(view: GraphView, region, num_heads) -> bool:
    for n in region:
        if op_name(n) != "cat":
            continue
        for arg in view.inputs(n):
            p = next((view.param(a) for a in [arg, *view.ancestors(arg)] if view.param(a)), None)
            if p and view.param_shapes.get(p) and len(view.param_shapes[p]) == 1 and view.param_shapes[p][0] == num_heads:
                return True
    return False


def _has_output_gate(view: GraphView, region, attn) -> bool:
    """A positive gate computed beside the attention, not from it, that multiplies its result: sigmoid (Qwen3-Next)
    or softplus (Laguna)."""
    after = view.descendants(attn)
    for n in region:
        if op_name(n) in ("sigmoid", "softplus") and n not in after and view.index[n] > 0:
            if any(op_name(u) == "mul" and u in after for u in view.descendants(n)):
                return True
    return False


def _linear_family(view: GraphView, path, region, seq_len, facts) -> AttentionMatch:
    convs = [n for n in region if op_name(n) in ("conv1d", "convolution")]
    if convs:
        weight = next((view.param(a) for a in view.inputs(convs[0]) if view.param(a)), None)
        if weight:
            facts["conv_kernel"] = view.param_shapes[weight][-1]
    # L2-normalised queries/keys: a norm over the head dim of a per-head (4-D) tensor
    l2 = [n for n in region if op_name(n) in ("rsqrt", "sqrt", "linalg_vector_norm", "norm")
          and len(view.shape(n) or ()) == 4]
    hidden = (view.shape(next((n for n in view.nodes if n.op == "placeholder" and n.name not in view.param_of), None))
              or (0,))[-1] if view.nodes else 0
    # beta: one sigmoid per token and head (narrower than the hidden state, unlike an output gate)
    betas = [n for n in region if op_name(n) == "sigmoid" and len(view.shape(n) or ()) == 3
             and view.shape(n)[1] == seq_len and view.shape(n)[-1] < hidden]
    softplus = [n for n in region if op_name(n) == "softplus"]
    cumsums = [n for n in region if op_name(n) == "cumsum"]
    exps = [n for n in region if op_name(n) == "exp"]
    if betas:
        facts["num_heads"] = view.shape(betas[0])[-1]
        # the head size: the first tensor split into those heads, (batch, tokens, heads, head size)
        heads = facts["num_heads"]
        split = next((s for n in region if len(s := view.shape(n) or ()) == 4 and s[1:3] == (seq_len, heads)
                      and s[-1] > 1), None)
        if split:
            facts["head_dim"] = split[-1]
    gate = _decay_granularity(view, region, facts.get("num_heads"))
    if gate:
        facts["gate"] = gate
    skip_d = any(
        len(view.param_shapes.get(p) or ()) == 1 and any(op_name(u) == "mul" for u in n.users)
        for n in view.nodes if n.op == "placeholder" and (p := view.param_of.get(n.name)) and p.endswith(".D")
    )
    if betas and l2 and (cumsums or exps):
        kind = "linear:kda" if gate == "channel" else "linear:gated_deltanet"
    elif softplus and convs and not betas:
        kind = "ssm:mamba"
    elif skip_d and convs:
        kind = "ssm:mamba"
    elif not convs and exps and not softplus:
        kind = "linear:lightning"
    elif convs and not exps and not cumsums:
        kind = "conv"
    else:
        kind = "linear:other"
    return AttentionMatch(kind, path, facts)


def _decay_granularity(view: GraphView, region, heads) -> str | None:
    """Scalar decay per head (shape ends in H) or per key channel (shape ends in H, Dk)."""
    for n in region:
        if op_name(n) not in ("softplus", "exp", "logsigmoid"):
            continue
        s = view.shape(n) or ()
        if len(s) >= 3 and s[1] > 1 and (heads is None or heads in s):
            if s[-1] == heads:
                return "scalar"
            if len(s) >= 4 and s[-2] == heads:
                return "channel"
    return None
