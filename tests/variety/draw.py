"""Varied configs of a transformers family, drawn by seed from its default config.

Real checkpoints of a family ship other configs than the one transformers defaults to: other sizes and
vocabularies, head and key/value head counts, expert counts, top-k, shared experts, mixes of layer types. A draw
changes the fields a checkpoint's author would change, by their names (this module writes configs the way a
vendor does; it never reads them for onboard), and builds the family's own config class from the default plus
those changes, so fields the class derives follow. A draw is kept only when that class validates it and the
model builds and runs a forward pass at that config: a config the family's own code refuses describes no
checkpoint, so it is counted as refused, not as a miss. Sizes stay small (hidden at most 512, a few layers, at
most 16 experts), so a draw builds and runs in well under a second.

`draw(family, seed)` is deterministic: the same family and seed give the same config on every machine. A field
that the family's own code names in refusing an attempt is left at its default in the next attempts (ZAYA
routes to one expert per token only).
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field

from onboard.errors import one_line
from onboard.twin.fields import walk

ATTEMPTS = 4  # draws per seed before the seed counts as refused (each refused one is counted)

# Field names by what they size, as transformers' families spell them (a name here is how a config is written,
# never how onboard reads one).
HIDDEN = ("hidden_size", "d_model", "n_embd")
HEADS = ("num_attention_heads", "n_heads", "n_head")
KV_HEADS = ("num_key_value_heads", "kv_n_heads", "num_kv_heads", "n_kv_heads")
HEAD_DIM = ("head_dim", "kv_channels")
LAYERS = ("num_hidden_layers", "n_layers", "num_layers")
VOCAB = ("vocab_size",)
FFN = ("intermediate_size", "ffn_hidden_size", "intermediate_size_mlp", "dense_intermediate_size")
EXPERT_FFN = ("moe_intermediate_size", "expert_ffn_hidden_size")
SHARED_FFN = ("shared_expert_intermediate_size", "moe_shared_expert_intermediate_size", "shared_intermediate_size")
EXPERTS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
TOP_K = ("num_experts_per_tok", "num_experts_per_token", "moe_topk", "moe_k", "moe_top_k")
SHARED = ("n_shared_experts", "num_shared_experts", "moe_num_shared_experts")
GROUPS = ("n_group", "num_expert_group")
TOPK_GROUP = ("topk_group",)
ZERO_EXPERTS = ("zero_expert_num",)
WINDOWS = ("sliding_window", "sliding_window_size", "attention_chunk_size", "keep_window_size")
BLOCKS = ("block_size", "chunk_size", "mamba_chunk_size")
# per-layer-list schedules given as numbers: layer indices scale with the stack, periods are drawn afresh
LAYER_INDEX_WORDS = ("first_k_dense", "num_dense_layers", "_start", "_end", "max_window_layers",
                     "n_layers_per_attn_res_block")
PERIOD_WORDS = ("period", "interval", "_step", "every_n", "window_pattern", "group_size")


@dataclass
class Draw:
    family: str
    seed: int
    config: object | None  # None when every attempt was refused
    changes: dict = field(default_factory=dict)  # dotted field path -> drawn value
    refused: list[str] = field(default_factory=list)  # why each refused attempt was refused

    @property
    def name(self) -> str:
        return f"{self.family}-seed{self.seed}"


def draw(family: str, seed: int) -> Draw:
    """A varied config of `family` for this seed, or every attempt's refusal."""
    refused = []
    kept: set[str] = set()  # fields the family's own code named in refusing a draw: left at their default
    for attempt in range(ATTEMPTS):
        rng = random.Random(f"{family}:{seed}:{attempt}")
        changes = {p: v for p, v in propose(family, rng).items() if p.rsplit(".", 1)[-1] not in kept}
        try:
            config = build_config(family, changes)
            logits = check_runs(config)
            changes = read_changes(family, changes, logits)
            config = build_config(family, changes)
        except Exception as exc:  # the family's own code refused the config: not a checkpoint anyone ships
            refused.append(f"{sorted(changes.items())}: {one_line(exc)[:300]}")
            # a field the refusal names (ZAYA: "supports `num_experts_per_tok=1` only") is one the family fixes
            kept |= {p.rsplit(".", 1)[-1] for p in changes if re.search(rf"\b{re.escape(p.rsplit('.', 1)[-1])}\b",
                                                                         str(exc))}
            continue
        return Draw(family, seed, config, changes, refused)
    return Draw(family, seed, None, {}, refused)


def build_config(family: str, changes: dict):
    """The family's config class from its default (with onboard's completions) plus `changes`."""
    from onboard.review.families import COMPLETIONS, default_config

    base = default_config(family)
    kwargs: dict = {}
    for path, value in {**COMPLETIONS.get(family, {}), **changes}.items():
        head, _, rest = path.partition(".")
        if not rest:
            kwargs[head] = value
            continue
        sub = kwargs.setdefault(head, _plain(getattr(base, head)))
        sub[rest] = value
    return type(base)(**kwargs)


def _plain(sub) -> dict:
    """A nested config (DBRX's ffn_config) as the dict its class accepts."""
    return dict(sub) if isinstance(sub, dict) else sub.to_dict()


def read_changes(family: str, changes: dict, logits):
    """The changes without routing fields the model does not read: a top-k that moves nothing is no statement
    about the model (PhiMoE's sparse mixer picks two experts whatever its config says), so it keeps its default."""
    experts = next((v for p, v in changes.items() if p.rsplit(".", 1)[-1] in EXPERTS), None)
    for path in [p for p in changes if p.rsplit(".", 1)[-1] in TOP_K]:
        default = getattr(build_config(family, {}), path, None)
        if experts is not None and isinstance(default, int) and default > experts:
            continue  # the default would pick more experts than there are: keep the drawn top-k
        other = dict(changes, **{path: 1 if changes[path] != 1 else 2})
        if check_runs(build_config(family, other)).equal(logits):
            changes = {k: v for k, v in changes.items() if k != path}
    return changes


def check_runs(config):
    """Build the model at this config on meta, then for real (seeded), and run one short forward pass; its
    logits."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        AutoModelForCausalLM.from_config(config)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    vocab = model.get_input_embeddings().weight.shape[0]
    with torch.no_grad():
        ids = torch.randint(0, vocab, (1, 16), generator=torch.Generator().manual_seed(0))
        return model(input_ids=ids, use_cache=False).logits


def propose(family: str, rng: random.Random) -> dict:
    """Field changes for one attempt: every size the default config has, drawn small."""
    from onboard.review.families import default_config

    cfg = default_config(family).to_dict()
    have = {path: value for path, _, value in walk(cfg)}
    out: dict = {}

    def put(names, value, *, only_if=lambda v: True):
        for path, current in have.items():
            if path.rsplit(".", 1)[-1] in names and _number(current) and only_if(current):
                out[path] = value

    mla = "kv_lora_rank" in cfg
    heads, head = rng.choice([2, 4, 6, 8]), rng.choice([16, 32, 48, 64])
    while not 64 <= heads * head <= 512:
        heads, head = rng.choice([2, 4, 6, 8]), rng.choice([16, 32, 48, 64])
    hidden = heads * head
    put(HIDDEN, hidden)
    put(HEADS, heads)
    put(KV_HEADS, heads if mla else rng.choice(_divisors(heads)))  # MLA decompresses keys and values per head
    if not mla:
        put(HEAD_DIM, head)
        if "qk_rope_head_dim" in cfg:  # a rotary slice of the head (DeepSeek-V4): at most half of it
            out["qk_rope_head_dim"] = head // 2
    swa_heads = rng.choice([2, 4, 8])  # Inkling's sliding layers count their heads apart
    put(("swa_num_attention_heads",), swa_heads)
    put(("swa_num_key_value_heads",), rng.choice(_divisors(swa_heads)))
    put(("swa_head_dim",), rng.choice([16, 32]))
    put(FFN, rng.choice([64, 96, 128, 256]))
    put(EXPERT_FFN, rng.choice([32, 48, 64, 128]))
    put(("ffn_config.ffn_hidden_size",), rng.choice([32, 48, 64]))
    put(SHARED_FFN, rng.choice([32, 64, 96]), only_if=lambda v: v > 0)
    _vocabulary(have, out, rng)
    _experts(have, out, rng)
    _layers(family, have, out, rng)
    if mla:
        out["kv_lora_rank"] = rng.choice([16, 32, 64])
        if cfg.get("q_lora_rank"):
            out["q_lora_rank"] = rng.choice([24, 48, 96])
        out["qk_rope_head_dim"], out["qk_nope_head_dim"] = rng.choice([8, 16]), rng.choice([16, 32])
        out["v_head_dim"] = rng.choice([16, 32])
    put(("index_n_heads",), rng.choice([2, 4]))
    put(("index_head_dim",), rng.choice([32, 64]))
    put(("index_topk",), rng.choice([4, 16, 2048]))
    put(("linear_num_key_heads",), key_heads := rng.choice([1, 2, 4]))
    put(("linear_num_value_heads",), key_heads * rng.choice([1, 2]))
    put(("linear_key_head_dim", "linear_value_head_dim", "linear_head_dim"), rng.choice([16, 32]))
    put(("linear_num_heads",), rng.choice([2, 4]))
    _state_space(have, out, rng, hidden)
    put(WINDOWS, rng.choice([16, 64, 128, 512]), only_if=lambda v: v > 0)
    # how a linear mixer blocks the sequence (MiniMax's lightning blocks, Mamba's SSD chunks): the same function
    put(BLOCKS, rng.choice([8, 16, 64, 256]), only_if=lambda v: v > 1)
    _keep_equal_head_dims(have, out)
    _routing(have, out, random.Random(rng.random()))  # a stream of its own: the draws above stay as they were
    return out


def _routing(have: dict, out: dict, rng: random.Random) -> None:
    """How a router's weights are finished, where the family has the setting: renormalised over the top-k or not,
    scaled (DeepSeek's routed_scaling_factor)."""
    for path, value in have.items():
        key = path.rsplit(".", 1)[-1]
        if key == "norm_topk_prob" and isinstance(value, bool):
            out[path] = rng.random() < 0.5
        elif key == "routed_scaling_factor" and isinstance(value, int | float) and not isinstance(value, bool):
            out[path] = rng.choice([1.0, 1.5, 2.5])


def _keep_equal_head_dims(have: dict, out: dict) -> None:
    """Head sizes the default keeps equal stay equal (MLA's head_dim is its rotary slice, qk_rope_head_dim): a
    checkpoint whose rotary table is sized by one and its heads by the other does not run."""
    dims = [p for p, v in have.items() if "head_dim" in p.rsplit(".", 1)[-1] and _number(v)]
    for path in dims:
        if path in out:
            continue
        twin = next((p for p in dims if p in out and have[p] == have[path]), None)
        if twin is not None:
            out[path] = out[twin]


def _vocabulary(have: dict, out: dict, rng: random.Random) -> None:
    """A vocabulary from tiny to small, with the special token ids inside it."""
    vocab = rng.choice([97, 128, 200, 256, 320, 1000, 2048, 4096])
    for path, value in have.items():
        key = path.rsplit(".", 1)[-1]
        if key in VOCAB and _number(value):
            out[path] = vocab
        elif key == "unpadded_vocab_size" and _number(value):
            out[path] = vocab - rng.randrange(0, max(1, vocab // 16))
        elif key.endswith("_token_id") and _number(value) and value >= vocab:
            out[path] = value % vocab
        elif key.endswith("_token_id") and isinstance(value, list) and any(_number(v) and v >= vocab for v in value):
            out[path] = [v % vocab if _number(v) else v for v in value]


def _experts(have: dict, out: dict, rng: random.Random) -> None:
    """Expert count, top-k at most that, groups dividing it, shared and zero experts where the family has them."""
    experts = rng.choice([4, 6, 8, 12, 16])
    groups = rng.choice([g for g in (1, 2, 4) if experts % g == 0 and experts // g >= 2])
    topk_group = rng.randint(1, groups)
    top_k = rng.randint(1, min(4, topk_group * experts // groups))
    for path, value in have.items():
        key = path.rsplit(".", 1)[-1]
        if not _number(value):
            continue
        if key in EXPERTS and value > 1:
            out[path] = experts
        elif key in TOP_K and value >= 1:
            out[path] = top_k
        elif key in GROUPS and value >= 1:
            out[path] = groups
        elif key in TOPK_GROUP and value >= 1:
            out[path] = topk_group
        elif key in SHARED and value > 0:
            out[path] = rng.choice([1, 2])
        elif key in ZERO_EXPERTS and value > 0:
            out[path] = rng.choice([1, 2, 4])


def _layers(family: str, have: dict, out: dict, rng: random.Random) -> None:
    """A short stack with its own mix of the family's layer types; schedules follow the new depth."""
    layers_key = next((p for p in LAYERS if _number(have.get(p))), None)
    if layers_key is None:
        return
    full, layers = have[layers_key], rng.randint(2, 6)
    out[layers_key] = layers
    # lists the config class derives from the depth (and the schedule fields) are left for it to derive
    try:
        derived = {path for path, _, value in walk(build_config(family, {layers_key: layers}).to_dict())
                   if isinstance(value, list) and len(value) == layers != full}
    except Exception:  # noqa: BLE001 - validators that tie the per-layer lists to the depth: none is derived
        derived = set()
    heads = out.get("num_attention_heads") or have.get("num_attention_heads") or 1
    for path, value in have.items():
        key = path.rsplit(".", 1)[-1]
        per_layer = isinstance(value, list) and len(value) == full and bool(value)
        if per_layer and all(isinstance(v, str) for v in value):
            out[path] = [rng.choice(sorted(set(value))) for _ in range(layers)]  # a mix of the family's own types
        elif per_layer and "head" in key:  # drawn where the class would derive it too: Laguna's checkpoints vary it
            out[path] = [rng.choice([heads, 2 * heads]) for _ in range(layers)]
        elif path in derived:
            continue
        elif per_layer:
            out[path] = [rng.choice(value) for _ in range(layers)]
        elif _index_list(value, full):
            count = max(1, round(len(value) * layers / full))
            out[path] = sorted(rng.sample(range(layers), min(count, layers)))
        elif _number(value) and "layer" in path and any(w in key for w in LAYER_INDEX_WORDS):
            out[path] = min(layers, max(int(value > 0), round(value * layers / full)))  # a set schedule stays set
        elif _number(value) and value > 0 and any(w in key for w in PERIOD_WORDS):
            out[path] = rng.randint(1, min(4, layers))
    for path in [p for p in have if p.endswith("_offset")]:  # an offset stays inside its period
        period = out.get(path[:-len("_offset")] + "_period", have.get(path[:-len("_offset")] + "_period"))
        if _number(period) and period > 0:
            out[path] = rng.randrange(period)


def _state_space(have: dict, out: dict, rng: random.Random, hidden: int) -> None:
    """Mamba sizes: heads x head size = expand x hidden, groups dividing the heads."""
    expand = next((v for p, v in have.items() if p.rsplit(".", 1)[-1] in ("mamba_expand", "expand") and _number(v)), 2)
    inner = expand * hidden
    head = rng.choice([d for d in (8, 16, 32) if inner % d == 0])
    heads = inner // head
    for path, value in have.items():
        key = path.rsplit(".", 1)[-1]
        if not _number(value):
            continue
        if key in ("mamba_d_state", "ssm_state_size"):
            out[path] = rng.choice([8, 16, 32])
        elif key in ("mamba_d_head", "mamba_head_dim"):
            out[path] = head
        elif key in ("mamba_n_heads", "mamba_num_heads"):
            out[path] = heads
        elif key in ("mamba_n_groups", "n_groups"):
            out[path] = rng.choice([g for g in (1, 2) if heads % g == 0])
        elif key == "mamba_dt_rank":
            out[path] = rng.choice([8, 16])


def _index_list(value, layers: int) -> bool:
    """Layer indices (``moe_layers``), not one value per layer."""
    return (isinstance(value, list) and bool(value) and all(_number(v) and 0 <= v < layers for v in value)
            and all(a < b for a, b in zip(value, value[1:])) and len(value) < layers)


def _number(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
