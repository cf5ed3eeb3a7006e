# coding=utf-8
"""Configuration for the synthetic *onboard flagship* hybrid MoE model.

The flagship does not exist as a released checkpoint: it is a design assembled from transformers' own building
blocks, namely

* Kimi Delta Attention (KDA) linear-attention layers, reused from `transformers.models.kimi_linear`;
* DeepSeek Sparse Attention (DSA: MLA + lightning indexer + top-k key selection) layers, reused from
  `transformers.models.deepseek_v32`;
* DeepSeek-V3-style MoE feed-forward blocks (sigmoid router with expert-bias correction, group-limited routing,
  routed scaling factor, one shared expert), also reused from `deepseek_v32`.

Because those modules are reused *unchanged*, this config must expose every attribute they read, under the exact
names they use (e.g. `linear_num_heads` for KDA, `index_topk` for the DSA indexer, `n_routed_experts` /
`num_local_experts` for the MoE). Each group of fields below says which reused class reads it.
"""

from huggingface_hub.dataclasses import strict

from transformers.configuration_utils import PreTrainedConfig


# The two attention flavours a decoder layer can use. `layer_types` must only contain these values.
LINEAR_ATTENTION = "linear_attention"  # KDA (kimi_linear's `KimiLinearDeltaAttention`)
SPARSE_ATTENTION = "sparse_attention"  # DSA (deepseek_v32's `DeepseekV32Attention`, MLA + indexer)
ATTENTION_LAYER_TYPES = (LINEAR_ATTENTION, SPARSE_ATTENTION)
MLP_LAYER_TYPES = ("dense", "sparse")


@strict
class OnboardFlagshipConfig(PreTrainedConfig):
    r"""
    Configuration of [`OnboardFlagshipForCausalLM`]. Defaults describe the ~2.8T-parameter flagship.

    Layer layout:
        num_hidden_layers (`int`): number of decoder layers.
        layer_types (`list[str]`, *optional*): one entry per layer, `"linear_attention"` (KDA) or
            `"sparse_attention"` (DSA). Defaults to `sparse_attention_interval - 1` KDA layers followed by one DSA
            layer, repeated (so with a multiple of the interval, the last layer is DSA).
        sparse_attention_interval (`int`): only used to derive the default `layer_types`.
        first_k_dense_replace (`int`): the first `first_k_dense_replace` layers use a dense MLP, the rest MoE.
        mlp_layer_types (`list[str]`, *optional*): `"dense"` / `"sparse"` per layer; derived from
            `first_k_dense_replace` when not given (this is the attribute the reused decoder logic reads).

    MoE (read by `DeepseekV32MoE`, `DeepseekV32TopkRouter`, `DeepseekV32Experts`):
        n_routed_experts (`int`, aliased as `num_local_experts`), num_experts_per_tok, n_shared_experts,
        moe_intermediate_size, n_group, topk_group, routed_scaling_factor, norm_topk_prob.

    DSA / MLA (read by `DeepseekV32Attention` and `DeepseekV32Indexer`):
        num_attention_heads, num_key_value_heads, q_lora_rank, kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim,
        v_head_dim, attention_bias, attention_dropout, rope_parameters, index_n_heads, index_head_dim, index_topk.

    KDA (read by `KimiLinearDeltaAttention` and `KimiLinearForgetGate`):
        linear_num_heads, linear_head_dim, linear_conv_kernel_dim, hidden_act (short-conv activation),
        rms_norm_eps (gated output norm), layer_types.
    """

    model_type = "onboard_flagship"
    keys_to_ignore_at_inference = ["cache"]
    # `DeepseekV32TopkRouter` / `DeepseekV32Experts` read `config.num_local_experts`, DeepSeek checkpoints call it
    # `n_routed_experts`: keep DeepSeek's name as the stored field and alias the other one, as deepseek_v32 does.
    attribute_map = {"num_local_experts": "n_routed_experts"}
    base_model_pp_plan = {
        "embed_tokens": (["input_ids"], ["inputs_embeds"]),
        "layers": (["hidden_states", "attention_mask"], ["hidden_states"]),
        "norm": (["hidden_states"], ["hidden_states"]),
    }

    # Trunk
    vocab_size: int = 163840
    hidden_size: int = 7168
    num_hidden_layers: int = 72
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-6
    initializer_range: float = 0.02
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 1048576

    # Layer layout
    layer_types: list[str] | None = None
    sparse_attention_interval: int = 4
    first_k_dense_replace: int = 2
    mlp_layer_types: list[str] | None = None

    # Dense MLP (first_k_dense_replace layers) and MoE
    intermediate_size: int = 18432
    moe_intermediate_size: int = 2048
    n_routed_experts: int = 896
    num_experts_per_tok: int = 16
    n_shared_experts: int = 1
    n_group: int = 16
    topk_group: int = 8
    routed_scaling_factor: float = 2.827
    norm_topk_prob: bool = True
    mlp_bias: bool = False
    output_router_logits: bool = False

    # DSA layers: MLA projections
    num_attention_heads: int = 64
    num_key_value_heads: int = 64
    q_lora_rank: int = 1536
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    attention_bias: bool = False
    attention_dropout: float | int = 0.0
    rope_parameters: dict | None = None

    # DSA layers: lightning indexer
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 2048

    # KDA layers
    linear_num_heads: int = 64
    linear_head_dim: int = 128
    linear_conv_kernel_dim: int = 4

    # Generation / tokens (Kimi-K2 tokenizer ids)
    use_cache: bool = True
    pad_token_id: int | None = 163839
    bos_token_id: int | None = 163584
    eos_token_id: int | list[int] | None = 163585

    def __post_init__(self, **kwargs):
        # Derived attributes are always recomputed (a saved config.json carries them too; ignore the stored copies
        # so that changing e.g. `qk_rope_head_dim` can never leave a stale `head_dim` behind).
        kwargs.pop("qk_head_dim", None)
        kwargs.pop("head_dim", None)
        self.qk_head_dim = self.qk_nope_head_dim + self.qk_rope_head_dim
        # RoPE only touches the `qk_rope_head_dim` slice of MLA queries/keys (and of the indexer's). The reused
        # `DeepseekV32RotaryEmbedding` sizes its frequencies from `config.head_dim`, so point it at that slice.
        self.head_dim = self.qk_rope_head_dim

        if self.layer_types is None:
            interval = self.sparse_attention_interval
            self.layer_types = [
                SPARSE_ATTENTION if (i + 1) % interval == 0 else LINEAR_ATTENTION
                for i in range(self.num_hidden_layers)
            ]
        if self.mlp_layer_types is None:
            n_dense = min(self.first_k_dense_replace, self.num_hidden_layers)
            self.mlp_layer_types = ["dense"] * n_dense + ["sparse"] * (self.num_hidden_layers - n_dense)

        if self.rope_parameters is None:
            # YaRN-extended RoPE on the DSA layers (KDA layers are position-free): 32x over a 32k pre-training
            # window gives the 1M (1048576) context.
            self.rope_parameters = {
                "rope_type": "yarn",
                "rope_theta": 50000.0,
                "factor": 32.0,
                "original_max_position_embeddings": 32768,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "mscale": 1.0,
                "mscale_all_dim": 1.0,
            }
        super().__post_init__(**kwargs)

    # --- `@strict` class validators: run after every instantiation (and again on save) ---

    def validate_layer_type(self):
        """Overrides the base check: our attention vocabulary ("sparse_attention") is model specific."""
        for name, allowed in (("layer_types", ATTENTION_LAYER_TYPES), ("mlp_layer_types", MLP_LAYER_TYPES)):
            values = getattr(self, name)
            if len(values) != self.num_hidden_layers:
                raise ValueError(
                    f"`{name}` has {len(values)} entries but `num_hidden_layers` is {self.num_hidden_layers}; "
                    "it needs exactly one entry per decoder layer."
                )
            unknown = sorted(set(values) - set(allowed))
            if unknown:
                raise ValueError(f"`{name}` entries must be in {allowed}, got {unknown}.")

    def validate_moe_routing(self):
        """Shape constraints of `DeepseekV32TopkRouter`'s group-limited routing."""
        if self.n_routed_experts % self.n_group != 0:
            raise ValueError(
                f"n_routed_experts ({self.n_routed_experts}) must be divisible by n_group ({self.n_group})."
            )
        if not 1 <= self.topk_group <= self.n_group:
            raise ValueError(f"topk_group ({self.topk_group}) must be in [1, n_group={self.n_group}].")
        experts_per_group = self.n_routed_experts // self.n_group
        if experts_per_group < 2:
            raise ValueError("The router scores each group by its top-2 experts: need >= 2 experts per group.")
        if self.num_experts_per_tok > self.topk_group * experts_per_group:
            raise ValueError(
                f"num_experts_per_tok ({self.num_experts_per_tok}) exceeds the experts reachable in topk_group "
                f"({self.topk_group}) groups of {experts_per_group}."
            )

    def validate_attention_dims(self):
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads.")
        if self.index_head_dim < self.qk_rope_head_dim:
            raise ValueError(
                "The DSA indexer applies RoPE to its first qk_rope_head_dim dims: "
                "need index_head_dim >= qk_rope_head_dim."
            )
        if self.qk_rope_head_dim % 2 != 0:
            raise ValueError("qk_rope_head_dim must be even (RoPE rotates pairs of dims).")


__all__ = ["OnboardFlagshipConfig"]
