"""The MoE and hybrid-attention causal-LM families the installed transformers ships.

Discovered from transformers' own causal-LM registry and each family's default config, so a new
transformers release brings its new families in without a code change here. `onboard families` inspects
each one and prints the support table that README carries.
"""

from __future__ import annotations

import functools
import time
import warnings

from onboard.twin.fields import is_size

EXPERT_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
HYBRID_LAYER_WORDS = ("linear", "mamba", "indexed", "sparse", "hybrid", "conv", "ssm", "recurrent")

# Values that transformers' default configs leave as None, taken from the released models of the family.
COMPLETIONS = {
    "deepseek_v2": {"num_experts_per_tok": 6},  # DeepSeek-V2(-Lite): 6 routed experts per token
    "dots1": {"n_routed_experts": 128, "num_experts_per_tok": 6, "n_shared_experts": 2},  # dots.llm1 release
    "hunyuan_v1_moe": {"head_dim": 128},  # Hunyuan-A13B: 4096 hidden / 32 heads
    # databricks/dbrx-base config.json (the default has neither; transformers 5.24 clamps q, k, v unconditionally,
    # so a config without a clip does not run)
    "dbrx": {"attn_config.rope_theta": 500000.0, "attn_config.clip_qkv": 8},
    # no release to read: the indexer sized as DeepSeek-V3.2-Exp's (config.json: index_n_heads 64, index_topk
    # 2048), its head as wide as the attention's (the family's validator: the rotary part must fit it), one key head,
    # blocks of 4 tokens (onboard's choice; the default leaves all None)
    "qwen4_exp_text": {"indexer_n_heads": 64, "indexer_kv_heads": 1, "indexer_head_dim": 256,
                       "indexer_budget": 2048, "indexer_compress_ratio": 4},
    # LiquidAI/LFM2-8B-A1B config.json: its 24 layers, 6 of them attention (the default's 32 layers have no types)
    "lfm2_moe": {"num_hidden_layers": 24, "layer_types": (["conv", "conv", "full_attention", "conv"]
                                                          + ["conv", "conv", "full_attention", "conv"] * 4
                                                          + ["conv", "full_attention", "conv", "conv"])},
}

# Families that cannot be inspected, and why.
UNSUPPORTED = {
    "gemma4_assistant": "transformers' default config fails its own validation",
}


def _int(cfg: dict, names) -> int | None:
    """The first positive whole-number field of these names, at the top or in a nested part that is no model of its own
    (DBRX's ffn_config; not a multimodal model's text_config, a family of its own)."""
    parts = [cfg] + [v for v in cfg.values() if isinstance(v, dict) and not v.get("model_type")]
    for part in parts:
        for name in names:
            if is_size(value := part.get(name)):
                return value
    return None


def layer_types(cfg: dict) -> list | None:
    for key in ("layer_types", "layers_block_type", "block_types"):
        value = cfg.get(key)
        if isinstance(value, list) and value:
            return value
    return None


def is_moe_or_hybrid(cfg: dict) -> bool:
    """What the config declares: routed experts, or layers of linear / state-space / sparse attention."""
    if cfg.get("is_moe") is False or cfg.get("enable_moe_block") is False:
        return False
    experts = _int(cfg, EXPERT_FIELDS)
    if experts and experts > 1:
        return True
    if any(any(word in str(t) for word in HYBRID_LAYER_WORDS) for t in set(layer_types(cfg) or [])):
        return True
    return "index_topk" in cfg


def default_config(model_type: str):
    """transformers' default config of a family, with the completions above applied."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    config = CONFIG_MAPPING[model_type]()
    for path, value in COMPLETIONS.get(model_type, {}).items():
        *parents, key = path.split(".")
        owner = config
        for name in parents:  # a nested part (DBRX's attn_config)
            owner = getattr(owner, name)
        setattr(owner, key, value)
    return config


@functools.lru_cache(maxsize=1)
def discover() -> tuple[str, ...]:
    """Model types with a causal-LM head whose default config is MoE or hybrid (or known unsupported). Once per
    process: it builds every causal-LM family's default config (5 s), and test collection asks from several files."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    found = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for model_type in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
            try:
                cfg = default_config(model_type).to_dict()
            except Exception:  # a default config that fails its own validation
                if model_type in UNSUPPORTED:
                    found.append(model_type)
                continue
            if is_moe_or_hybrid(cfg):
                found.append(model_type)
    return tuple(found)


def support_row(model_type: str, adapt_dir=None) -> dict:
    """Inspect one family through its tiny twin (and, when `adapt_dir` is given, adapt + verify it with the
    agent's rules policy taking on what no pattern matches); never raises."""
    from onboard.inspect.inspection import inspect_source
    from onboard.source import from_config

    if model_type in UNSUPPORTED:
        return {"family": model_type, "status": "unsupported", "why": UNSUPPORTED[model_type]}
    start = time.perf_counter()
    source = from_config(default_config(model_type), model_type)
    try:
        spec, _ = inspect_source(source)
    except Exception as exc:  # report, do not stop the table
        return {"family": model_type, "status": "error", "why": " ".join(str(exc).split())[:200]}
    row = {
        "family": model_type, "status": "inspected" if not spec.unmatched else "partial",
        "attention": sorted({layer.attention.kind for layer in spec.layers}),
        "mlp": sorted({layer.mlp.kind for layer in spec.layers}), "unmatched": len(spec.unmatched),
        "seconds": round(time.perf_counter() - start, 1),
    }
    if adapt_dir is not None:
        row.update(_adapt_row(source, spec, adapt_dir))
    return row


def _adapt_row(source, spec, adapt_dir) -> dict:
    from pathlib import Path

    from onboard.adapt.decision import by_reason
    from onboard.agent.loop import run
    from onboard.bundle.files import read_decision

    out = Path(adapt_dir) / source.name
    try:
        _, verification, _ = run(source, out, force=True)  # adapt, with the rules policy on the leftovers
    except Exception as exc:
        return {"adapt": "error", "adapt_why": " ".join(str(exc).split())[:200]}
    decision = read_decision(out)
    partial = {e.why for e in decision.moe if e.takes == "experts"}
    reasons = sorted(f"experts only ({why})" for why in partial)
    reasons += sorted(set(decision.kept_moe().values()) - partial)
    seeds = verification.seeds
    return {"adapt": "verified" if verification.passed else "FAILED", "replaced": verification.replaced,
            "adapt_why": "; ".join(reasons),
            "attention_swapped": bool(seeds) and all(r.runtime_attention_calls for r in seeds),
            "loss_swapped": bool(seeds) and all(r.runtime_loss_calls for r in seeds),
            "loss_why": decision.loss.why or "",
            "attention_why": "; ".join(why for _, why in by_reason(decision.kept_attention())),
            "unmatched": len(decision.still_unmatched(spec)),
            "generated": sorted(e.path for e in decision.generated if e.takes)}


def markdown(rows: list[dict]) -> str:
    lines = ["| family | inspect | attention kinds | MLP kinds | adapt: verified, MoE blocks swapped in the twin | "
             "attention in runtime | loss in runtime | notes |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["status"] in ("unsupported", "error"):
            lines.append(f"| {r['family']} | no | | | | | | {r['why']} |")
            continue
        notes = [f"{r['unmatched']} module(s) left as HuggingFace code"] if r["unmatched"] else []
        if r.get("generated"):
            notes.append(f"generated by the agent (rules): {', '.join(r['generated'])}")
        adapt, attention, loss = "", "", ""
        if "attention_swapped" in r:
            hybrid = any(k.startswith(("linear:", "sparse:", "ssm:", "conv")) for k in r["attention"])
            attention = "yes" if r["attention_swapped"] else ("no" if hybrid else "n/a (softmax)")
            loss = "yes" if r["loss_swapped"] else "no"
            if r.get("attention_why"):
                notes.append("attention kept as HuggingFace code: " + r["attention_why"])
            if r.get("loss_why"):
                notes.append("loss kept as HuggingFace code: " + r["loss_why"])
        if r.get("adapt") == "error":
            adapt = "error"
            notes.append("adapt raised: " + r.get("adapt_why", ""))
        elif "adapt" in r:
            adapt = f"{r['adapt']}, {r.get('replaced', 0)} swapped"
            if r.get("adapt_why"):
                notes.append("MoE: " + r["adapt_why"])
        lines.append(f"| {r['family']} | yes | {', '.join(r['attention'])} | {', '.join(r['mlp'])} | {adapt} | "
                     f"{attention} | {loss} | {'; '.join(notes)} |")
    return "\n".join(lines)
