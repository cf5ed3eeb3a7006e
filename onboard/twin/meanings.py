"""What a config field means, by its name: the one table of field meanings. Names are hints: where a twin found
by behaviour what a field drives (`onboard.twin.behaviour`), that finding wins over the name (`Shrink.meaning`).

Also here, in the same words: which meanings grow when a trained model is made wider (`WIDENED`), and which
meaning holds each full-scale number of a ModelSpec (`SPEC`, `MIXER`, `MIXER_FAMILY`), so that a number of the
spec is read back from the config field that holds it.
"""

from __future__ import annotations

import re

# Field-name patterns by meaning. Order matters: the first pattern that matches a key decides.
# Each entry: (meaning, regex on the key).
MEANINGS: list[tuple[str, str]] = [
    ("shared_ffn", r"(moe_)?shared_expert_intermediate_size|shared_expert_ffn.*|moe_shared_expert_intermediate_size"),
    ("expert_ffn", r"moe_intermediate_size|expert_intermediate_size|moe_ffn_hidden_size|expert_ffn_size|moe_dim|moe_hidden_size|expert_ffn_hidden_size"),
    ("zero_experts", r"zero_expert_num|num_zero_experts|n_null_experts"),
    ("ffn", r"intermediate_size|ffn_hidden_size|ffn_dim|n_inner|dense_intermediate_size"),
    ("n_shared", r"n_shared_experts|num_shared_experts|moe_num_shared_experts|shared_expert_count"),
    ("experts", r"num_experts|num_local_experts|n_routed_experts|moe_num_experts|num_routed_experts|n_experts"),
    ("top_k", r"num_experts_per_tok|num_experts_per_token|moe_topk|moe_k|top_k|moe_top_k|num_selected_experts"),
    ("n_group", r"n_group|num_expert_group|moe_n_group|n_expert_groups"),
    ("topk_group", r"topk_group|moe_topk_group|topk_groups"),
    ("index_topk", r"index_topk|indexer_budget|indexer_topk"),
    ("index_heads", r"index_n_heads|index_num_heads|indexer_n_heads"),
    ("index_head_dim", r"index_head_dim|indexer_head_dim"),
    ("window", r"sliding_window|attention_window|attention_window_size|sliding_window_size|window_size|attention_chunk_size|local_window"),
    ("q_lora_rank", r"q_lora_rank"),
    ("kv_lora_rank", r"kv_lora_rank"),
    ("rope_head_dim", r"qk_rope_head_dim"),
    ("nope_head_dim", r"qk_nope_head_dim"),
    ("v_head_dim", r"v_head_dim"),
    ("linear_k_heads", r"linear_num_key_heads"),
    ("linear_v_heads", r"linear_num_value_heads"),
    ("linear_heads", r"linear_num_heads|linear_attn_num_heads"),
    ("linear_head_dim", r"linear_key_head_dim|linear_value_head_dim|linear_head_dim|linear_attn_head_dim"),
    ("ssm_state", r"mamba_d_state|state_size|ssm_state_size|d_state"),
    ("ssm_heads", r"mamba_n_heads|mamba_num_heads|n_mamba_heads"),
    ("ssm_head_dim", r"mamba_head_dim|mamba_d_head|mamba_headdim"),
    ("ssm_groups", r"mamba_n_groups|n_groups|mamba_ngroups"),
    ("ssm_inner", r"mamba_d_ssm|mamba_d_inner|d_inner|ssm_intermediate_size"),
    ("dt_rank", r"time_step_rank|mamba_dt_rank|dt_rank"),
    ("kv_heads", r"num_key_value_heads|num_kv_heads|n_kv_heads|multi_query_group_num|num_global_key_value_heads"),
    ("heads", r"num_attention_heads|n_head|num_heads|n_heads"),
    ("head_dim", r"head_dim|attention_head_dim|kv_channels|global_head_dim"),
    ("hidden", r"hidden_size|d_model|n_embd|dim|model_dim"),
    ("vocab", r"vocab_size|unpadded_vocab_size"),  # the second sizes the output head where the table is padded
]
_COMPILED = [(meaning, re.compile(rf"(?:{pattern})$")) for meaning, pattern in MEANINGS]


def meaning_of(key: str) -> str | None:
    """The meaning of a config field by its name (its last key, at any depth), or None."""
    for meaning, regex in _COMPILED:
        if regex.fullmatch(key):
            return meaning
    return None


# meanings that grow with --width: more heads of the same size, wider MLPs (head sizes stay)
WIDENED = ("hidden", "heads", "kv_heads", "ffn", "expert_ffn", "shared_ffn")
# a ModelSpec / run-log number -> the meaning of the config field that holds it
SPEC = {"hidden": "hidden", "heads": "heads", "kv_heads": "kv_heads", "head_dim": "head_dim", "ffn": "ffn",
        "vocab": "vocab", "experts": "experts", "top_k": "top_k", "expert_ffn": "expert_ffn",
        "shared_experts": "n_shared"}
# a token mixer's size -> the meaning of the field that holds it; linear attention and state-space mixers keep
# their head counts and head sizes in fields of their own (MIXER_FAMILY, by kind prefix), looked at first
MIXER = {"heads": "heads", "head_dim": "head_dim", "v_head_dim": "v_head_dim", "window": "window",
         "index_topk": "index_topk", "index_heads": "index_heads", "index_head_dim": "index_head_dim",
         "state_size": "ssm_state"}
MIXER_FAMILY = {"linear:": {"heads": ("linear_v_heads", "linear_heads", "linear_k_heads"),
                            "head_dim": ("linear_head_dim",)},
                "ssm:": {"heads": ("ssm_heads",), "head_dim": ("ssm_head_dim",)}}
