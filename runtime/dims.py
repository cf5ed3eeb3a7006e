"""A model's key dimensions, one record for the accounting, the run logs and the predictors, and the one
model of what its token mixing costs.

`Dims` is built from a run log's `model` record (`runtime.runlog.model_record` writes one from a ModelSpec):
the sizes the cost model reads and `mixers`, the model's token mixers grouped by kind and shape. Records
without a mixer list (run logs written before it existed, the converted published runs) carry only counts
of linear and sparse layers; their mixers are rebuilt from those counts and the first attention's heads
and head_dim (`counted_mixers`), which prices them as the predictors always did, bit for bit, except for
sparse layers: those now take the DSA formula below (the mean of min(i, top-k) over positions, where the
predictors used to take min((S + 1) / 2, top-k)); no shipped run has one. Published runs carry only shapes,
so the parameter counts are rebuilt here when a record has none (gated MLPs, untied embeddings unless told).

FLOP conventions (stated because published figures differ on them): 2 FLOPs per multiply-add; forward
FLOPs per token = 2 per active matmul parameter + token mixing (scores and weighted sums, not the
projections, which are parameters), averaged over the positions of a causal sequence; training = 3 x
forward (backward costs twice the forward).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

RECORD_DIM_MAX = 2**31  # a dimension of a run log's model record (layers, hidden, vocab, experts, ...)
RECORD_PARAMS_MAX = 2**50  # its parameter counts (a 10T model is 2**43)

LINEAR_CHUNK = 64  # chunk length of chunk-parallel linear attention (flash-linear-attention's default)
SPARSE_TOPK = 2048  # keys a sparse-attention query attends to when the record does not say (DSA default)
# the shape fields of a mixer, named as ModelSpec attention fields are (but heads for num_heads)
MIXER_SIZES = ("heads", "head_dim", "v_head_dim", "window", "index_topk", "index_heads", "index_head_dim",
               "state_size")


def avg_context(seq_len: int, window: int | None) -> float:
    """Mean number of keys a causal query sees, with an optional sliding window."""
    if not window or window >= seq_len:
        return (seq_len + 1) / 2
    # positions < window see i+1 keys, the rest see `window`
    head = window * (window + 1) / 2
    return (head + (seq_len - window) * window) / seq_len


@dataclass(frozen=True)
class Mixer:
    """`layers` layers whose token mixer has one kind and shape (ModelSpec `attention.kind` names)."""

    kind: str
    layers: int
    heads: int | None = None
    head_dim: int | None = None
    v_head_dim: int | None = None
    window: int | None = None
    index_topk: int | None = None
    index_heads: int | None = None
    index_head_dim: int | None = None
    state_size: int | None = None  # state-space mixers: the state dim per head (Mamba's d_state)

    @property
    def linear(self) -> bool:
        """Linear attention or a state-space scan: a fixed-size state instead of a growing key cache."""
        return self.kind.startswith(("linear:", "ssm:"))

    @property
    def sparse(self) -> bool:
        return self.kind.startswith("sparse:")

    def flops(self, seq_len: int) -> float:
        """Forward FLOPs per token of these layers' token mixing, averaged over a causal sequence of seq_len.

        With h heads, query/key head dim dk and value head dim dv (dk when not given), a query that sees c
        keys costs 2 h c (dk + dv): a dk-long dot product for each score and a dv-long weighted sum.
        - softmax, mla, sliding: c averaged over positions i = 1..S of min(i, window) (`avg_context`);
        - chunked: keys in the query's own chunk of `window`, c = (min(window, S) + 1) / 2 (exact when S
          is a multiple of the chunk);
        - sparse:dsa: c = min(i, index_topk) selected keys, plus the indexer scoring every earlier key with
          index_heads heads of index_head_dim: 2 index_heads index_head_dim (S + 1) / 2;
        - linear:* and ssm:* (chunk-parallel, chunk C = LINEAR_CHUNK): a state of dk x d per head, dk the
          state size for a state-space head and the head dim d otherwise; per token its update and readout,
          2 dk d multiply-adds, and the intra-chunk quadratic part, C (dk + d); constant in S;
        - anything else (convolutions, no mixer): no score or weighted-sum term.
        """
        n, h = self.layers, self.heads or 0
        dk = self.head_dim or 0
        dv = self.v_head_dim or dk
        # integer coefficients first, one float multiply last: a softmax-only model's figure stays bit-identical
        # to the one the shipped predictor models were trained on
        if self.kind in ("softmax", "mla", "sliding"):
            return 2 * n * h * (dk + dv) * avg_context(seq_len, self.window)
        if self.kind == "chunked":
            return 2 * n * h * (dk + dv) * avg_context(min(self.window or seq_len, seq_len), None)
        if self.kind == "sparse:dsa":
            selected = 2 * n * h * (dk + dv) * avg_context(seq_len, self.index_topk)
            return selected + 2 * n * (self.index_heads or 0) * (self.index_head_dim or 0) * avg_context(seq_len, None)
        if self.linear:
            d = dk
            state = self.state_size or d
            return 2 * n * h * (2 * state * d + LINEAR_CHUNK * (state + d))
        return 0.0

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, m: dict) -> Mixer:
        """A run-log mixer entry; ValueError when it is not one (fields this code does not know are ignored)."""
        if not isinstance(m, dict) or not isinstance(m.get("kind"), str):
            raise ValueError(f"mixer entry {m!r} has no kind")
        sizes = {k: m.get(k) for k in ("layers", *MIXER_SIZES)}
        whole = all(v is None or (isinstance(v, int) and not isinstance(v, bool) and v >= 0) for v in sizes.values())
        if not whole or not sizes["layers"]:
            raise ValueError(f"mixer {m['kind']!r}: layers must be positive and {', '.join(MIXER_SIZES)} "
                             f"whole numbers or null, got {sizes}")
        return cls(kind=m["kind"], **sizes)


def grouped(mixers) -> tuple[Mixer, ...]:
    """Mixers of one kind and shape merged into one, in the order of their first appearance."""
    counts: dict[Mixer, int] = {}
    for m in mixers:
        shape = dataclasses.replace(m, layers=0)
        counts[shape] = counts.get(shape, 0) + m.layers
    return tuple(dataclasses.replace(shape, layers=n) for shape, n in counts.items())


def mixers_of(attentions) -> tuple[Mixer, ...]:
    """The mixers of ModelSpec attention dicts (one per layer; the spec's num_heads is a mixer's heads)."""
    return grouped(Mixer(kind=str(a.get("kind") or "softmax"), layers=1, heads=a.get("num_heads"),
                         **{f: a.get(f) for f in MIXER_SIZES[1:]}) for a in attentions)


def mixing_flops(mixers, seq_len: int) -> float:
    """Forward FLOPs per token of token mixing, summed over the mixers (see `Mixer.flops`)."""
    return sum((m.flops(seq_len) for m in mixers), 0.0)


def counted_mixers(layers: int, heads: int, head_dim: int, linear: int, sparse: int) -> tuple[Mixer, ...]:
    """Mixers of a record that has only layer counts: every layer at the first attention's shape, sparse
    layers at the DSA default top-k with no indexer, linear ones with a head_dim x head_dim state."""
    counted = (("softmax", layers - linear - sparse, None), ("sparse:dsa", sparse, SPARSE_TOPK),
               ("linear:unknown", linear, None))
    return tuple(Mixer(kind=kind, layers=n, heads=heads, head_dim=head_dim, index_topk=topk)
                 for kind, n, topk in counted if n > 0)


@dataclass(frozen=True)
class Dims:
    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    experts: int
    top_k: int
    expert_ffn: int
    shared_experts: int
    moe_layers: int
    params_total: int
    params_active: int
    mixers: tuple[Mixer, ...]
    # the decoder stack in order, where it is known (a ModelSpec; not a run log): per layer, the index of its
    # mixer in `mixers` and whether its MLP is MoE. Pipeline stages are balanced over it (predictors.pipeline).
    stack: tuple[tuple[int, bool], ...] = ()

    @classmethod
    def from_record(cls, m: dict) -> Dims:
        """From a run-log `model` record (`runtime.runlog.MODEL_FIELDS`, and `mixers` when it has them)."""
        def num(key, default=0):
            v = m.get(key)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not v > 0:
                return default
            if v > (RECORD_PARAMS_MAX if key.startswith("params") else RECORD_DIM_MAX):  # inf and 1e308 too
                raise ValueError(f"model {m.get('name')!r}: {key} {v!r} is beyond any model's")
            return int(v)

        layers, hidden = num("layers"), num("hidden")
        if not layers or not hidden:
            raise ValueError(f"model {m.get('name')!r} needs positive layers and hidden")
        heads = num("heads", max(1, hidden // 128))
        experts = num("experts")
        moe_layers = m.get("moe_layers")
        moe_layers = layers if experts and moe_layers is None else num("moe_layers") if experts else 0
        base = {
            "name": str(m.get("name") or "unnamed"), "layers": layers, "hidden": hidden, "heads": heads,
            "kv_heads": num("kv_heads", heads), "head_dim": num("head_dim", hidden // heads), "ffn": num("ffn", 4 * hidden),
            "vocab": num("vocab", 32000), "experts": experts, "top_k": num("top_k", 1) if experts else 0,
            "expert_ffn": num("expert_ffn"), "shared_experts": num("shared_experts"), "moe_layers": moe_layers,
        }
        if m.get("mixers") is not None:
            if not isinstance(m["mixers"], list):
                raise ValueError(f"model {base['name']!r}: mixers must be a list, got {type(m['mixers']).__name__}")
            mixers = tuple(Mixer.from_dict(x) for x in m["mixers"])
        else:
            mixers = counted_mixers(layers, base["heads"], base["head_dim"], num("linear_attention_layers"),
                                    num("sparse_attention_layers"))
        total, active = count_params(**base)
        return cls(**base, params_total=num("params_total", total), params_active=num("params_active", active),
                   mixers=mixers)

    def layer_flops(self, seq_len: int) -> list[float]:
        """Forward FLOPs per token of each decoder layer of `stack` (empty when it is not known): its attention
        projections and token mixing, and its MLP's active parameters (routed top-k, shared experts, router).
        Kept per sequence length on the instance (a planner prices thousands of layouts of one model)."""
        cache = self.__dict__.setdefault("_layer_flops", {})  # frozen fields; the cache is no field
        if seq_len not in cache:
            dense = 2 * 3 * self.hidden * self.ffn
            moe = (2 * (self.top_k + self.shared_experts) * 3 * self.hidden * self.expert_ffn
                   + 2 * self.hidden * self.experts)
            mixing = [2 * self.attention_params_per_layer + m.flops(seq_len) / m.layers for m in self.mixers]
            cache[seq_len] = tuple(mixing[i] + (moe if is_moe else dense) for i, is_moe in self.stack)
        return list(cache[seq_len])

    def routed_flops_per_token(self) -> float:
        """Forward FLOPs of the routed experts per token: 2 x 3 x hidden x expert_ffn (gate, up and down
        projections) for each of the top-k experts chosen, in every MoE layer."""
        return 2 * self.moe_layers * self.top_k * 3 * self.hidden * self.expert_ffn if self.moe_layers else 0.0

    def head_flops(self) -> float:
        """Forward FLOPs per token of the LM head (the last pipeline stage's)."""
        return 2 * self.vocab * self.hidden

    @property
    def dense_layers(self) -> int:
        return self.layers - self.moe_layers

    @property
    def linear_layers(self) -> int:
        return sum(m.layers for m in self.mixers if m.linear)

    @property
    def sparse_layers(self) -> int:
        return sum(m.layers for m in self.mixers if m.sparse)

    @property
    def expert_params(self) -> int:
        """Routed-expert parameters (gated: three matrices each); the part expert parallelism splits."""
        return self.moe_layers * self.experts * 3 * self.hidden * self.expert_ffn

    @property
    def attention_params_per_layer(self) -> int:
        return 2 * self.hidden * self.head_dim * (self.heads + self.kv_heads)

    def mixing_flops(self, seq_len: int) -> float:
        """Forward FLOPs per token of token mixing (scores and weighted sums), summed over layers; kept per
        sequence length on the instance, as `layer_flops` is."""
        cache = self.__dict__.setdefault("_mixing_flops", {})
        if seq_len not in cache:
            cache[seq_len] = mixing_flops(self.mixers, seq_len)
        return cache[seq_len]

    def forward_flops_per_token(self, seq_len: int) -> float:
        return 2 * self.params_active + self.mixing_flops(seq_len)

    def training_flops_per_token(self, seq_len: int) -> float:
        """Forward + backward (twice the forward) FLOPs per token."""
        return 3 * self.forward_flops_per_token(seq_len)


def count_params(*, layers, hidden, heads, kv_heads, head_dim, ffn, vocab, experts, top_k, expert_ffn,
                 shared_experts, moe_layers, gated: bool = True, tied: bool = False, **_) -> tuple[int, int]:
    """(total, active) parameters; active leaves out the input embedding and the unchosen experts."""
    mats = 3 if gated else 2
    attn = 2 * hidden * head_dim * (heads + kv_heads)
    routed = experts * 3 * hidden * expert_ffn
    moe = routed + shared_experts * 3 * hidden * expert_ffn + hidden * experts
    dense = mats * hidden * ffn
    body = layers * attn + (layers - moe_layers) * dense + moe_layers * moe
    embed = vocab * hidden
    total = body + embed * (1 if tied else 2)
    unused = moe_layers * (experts - top_k) * 3 * hidden * expert_ffn if experts else 0
    return int(total), int(body - unused + embed)  # the LM head does arithmetic whether tied or not
