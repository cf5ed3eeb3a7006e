# coding=utf-8
"""PyTorch *onboard flagship*: a synthetic hybrid KDA / DSA Mixture-of-Experts decoder.

No such checkpoint exists. The model is assembled, HF-modeling-file style, from building blocks that ship with
transformers, reused *unchanged*:

* `KimiLinearDeltaAttention` (Kimi Delta Attention, a gated delta rule with per-channel decay) from
  `transformers.models.kimi_linear` for the `"linear_attention"` layers (~3/4 of the stack);
* `DeepseekV32Attention` (MLA + lightning indexer, DeepSeek Sparse Attention: each query attends to the top
  `index_topk` keys picked by the indexer) from `transformers.models.deepseek_v32` for the `"sparse_attention"`
  layers;
* `DeepseekV32MLP` (dense, first `first_k_dense_replace` layers), `DeepseekV32MoE` (sigmoid router with
  expert-bias correction, group-limited routing, routed scaling, one shared expert), `DeepseekV32RMSNorm` and
  `DeepseekV32RotaryEmbedding`.

Only the glue lives here: the decoder layer that picks the attention / MLP flavour per layer, the model that builds
one mask per attention flavour, the causal-LM head, weight init for the parameters the reused modules create
uninitialised, and a cache whose per-layer slots match the hybrid layout.

This file is loaded as remote code (copied into transformers' dynamic-modules cache), so it only imports from
`transformers` / `torch` and from its sibling configuration file.
"""

import math

import torch
from torch import nn

from transformers import initialization as init
from transformers.cache_utils import Cache, DynamicCache, DynamicIndexedLayer, LinearAttentionLayer
from transformers.generation import GenerationMixin
from transformers.masking_utils import create_causal_mask, create_recurrent_attention_mask
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.modeling_utils import PreTrainedModel, slice_logits_to_keep
from transformers.models.deepseek_v32.modeling_deepseek_v32 import (
    DeepseekV32Attention,
    DeepseekV32Experts,
    DeepseekV32MLP,
    DeepseekV32MoE,
    DeepseekV32RMSNorm,
    DeepseekV32RotaryEmbedding,
    DeepseekV32TopkRouter,
)
from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearDeltaAttention, KimiLinearForgetGate
from transformers.processing_utils import Unpack
from transformers.utils import TransformersKwargs, can_return_tuple
from transformers.utils.deprecation import deprecate_kwarg
from transformers.utils.generic import merge_with_config_defaults
from transformers.utils.output_capturing import capture_outputs

from .configuration_onboard_flagship import LINEAR_ATTENTION, SPARSE_ATTENTION, OnboardFlagshipConfig


class OnboardFlagshipDynamicCache(DynamicCache):
    """
    `DynamicCache` laid out for the hybrid stack: a recurrent-state slot (conv + KDA state) for every KDA layer and
    an indexed KV slot (compressed MLA latents + indexer keys) for every DSA layer.

    Why not `DynamicCache(config=config)`: it maps `config.layer_types` through transformers' own layer-type names,
    which call DSA layers `"indexed_attention"`; the flagship's `"sparse_attention"` has no entry there.
    """

    LAYER_CLASSES = {LINEAR_ATTENTION: LinearAttentionLayer, SPARSE_ATTENTION: DynamicIndexedLayer}

    def __init__(self, config: OnboardFlagshipConfig, offloading: bool = False):
        layers = [self.LAYER_CLASSES[layer_type]() for layer_type in config.layer_types]
        # Skip `DynamicCache.__init__` (it would re-derive the layers from `config`), keep the rest of its behaviour.
        Cache.__init__(self, layers=layers, offloading=offloading)


class OnboardFlagshipDecoderLayer(GradientCheckpointingLayer):
    """Pre-norm residual block: (KDA | DSA) attention, then (dense MLP | MoE)."""

    def __init__(self, config: OnboardFlagshipConfig, layer_idx: int):
        super().__init__()
        self.hidden_size = config.hidden_size
        self.layer_type = config.layer_types[layer_idx]
        # The reused attention classes read their hyper-parameters straight from `config`.
        if self.layer_type == SPARSE_ATTENTION:
            self.self_attn = DeepseekV32Attention(config, layer_idx)
        else:
            self.self_attn = KimiLinearDeltaAttention(config, layer_idx)

        # Dense vs MoE is decided by layer index (first `first_k_dense_replace` layers dense), via `mlp_layer_types`.
        self.mlp = DeepseekV32MoE(config) if config.mlp_layer_types[layer_idx] == "sparse" else DeepseekV32MLP(config)

        self.input_layernorm = DeepseekV32RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = DeepseekV32RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    @deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")
    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        use_cache: bool | None = False,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> torch.Tensor:
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        if self.layer_type == LINEAR_ATTENTION:
            # KDA is position-free (its short convolution + decay encode order) and takes a 2D padding mask.
            hidden_states = self.self_attn(
                hidden_states=hidden_states,
                cache=cache,
                attention_mask=attention_mask,
                **kwargs,
            )
        else:
            # DSA needs RoPE for its MLA rope slice and for the indexer, and a materialised 4D causal mask (the
            # indexer scores keys against it before the top-k selection).
            hidden_states, _ = self.self_attn(
                hidden_states=hidden_states,
                position_embeddings=position_embeddings,
                attention_mask=attention_mask,
                cache=cache,
                position_ids=position_ids,
                **kwargs,
            )
        hidden_states = residual + hidden_states

        residual = hidden_states
        hidden_states = self.post_attention_layernorm(hidden_states)
        hidden_states = self.mlp(hidden_states)
        hidden_states = residual + hidden_states
        return hidden_states


class OnboardFlagshipPreTrainedModel(PreTrainedModel):
    config: OnboardFlagshipConfig
    config_class = OnboardFlagshipConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["OnboardFlagshipDecoderLayer"]
    # DSA folds its top-k selection into the attention mask for eager / sdpa; the flash-mla path is not wired up in
    # deepseek_v32 either, and flex would need a block mask.
    _supports_sdpa = True
    _supports_flash_attn = False
    _supports_flex_attn = False
    # KDA layers carry recurrent state: the cache cannot be rolled back (no assisted decoding / cropping).
    _is_stateful = True
    _can_record_outputs = {
        "hidden_states": OnboardFlagshipDecoderLayer,
        "attentions": DeepseekV32Attention,  # KDA layers have no attention matrix to return
    }
    # Same precision-sensitive parameters as the two parent models (router, expert bias, KDA decay bias).
    _keep_in_fp32_modules_strict = ["e_score_correction_bias", "gate.weight", "dt_bias"]
    _keep_in_fp32_modules = ["indexer.weights_proj"]

    def _init_weights(self, module):
        # Linear / conv / embedding / norms / rotary buffers are handled generically by the base class.
        super()._init_weights(module)
        std = self.config.initializer_range
        if isinstance(module, KimiLinearForgetGate):
            # Created with `torch.empty`; follow kimi_linear (FLA) init: A_log = log(U[1, 16]) and dt_bias the inverse
            # softplus of dt ~ logU[1e-3, 1e-1].
            init.copy_(module.A_log, init.uniform_(module.A_log, a=1.0, b=16.0).log())
            init.uniform_(module.dt_bias, a=math.log(1e-3), b=math.log(1e-1))
            dt = module.dt_bias.exp().clamp_min(1e-4)
            init.copy_(module.dt_bias, dt + torch.log(-torch.expm1(-dt)))
        elif isinstance(module, DeepseekV32Experts):
            # 3D expert weight banks are plain `nn.Parameter`s (created with `torch.empty`).
            init.normal_(module.gate_up_proj, mean=0.0, std=std)
            init.normal_(module.down_proj, mean=0.0, std=std)
        elif isinstance(module, DeepseekV32TopkRouter):
            init.normal_(module.weight, mean=0.0, std=std)
            init.zeros_(module.e_score_correction_bias)


class OnboardFlagshipModel(OnboardFlagshipPreTrainedModel):
    def __init__(self, config: OnboardFlagshipConfig):
        super().__init__(config)
        self.padding_idx = config.pad_token_id
        self.vocab_size = config.vocab_size
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        self.layers = nn.ModuleList(
            [OnboardFlagshipDecoderLayer(config, layer_idx) for layer_idx in range(config.num_hidden_layers)]
        )
        self.norm = DeepseekV32RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        # One rotary table shared by all DSA layers (sized by `config.head_dim == qk_rope_head_dim`).
        self.rotary_emb = DeepseekV32RotaryEmbedding(config=config)
        self.gradient_checkpointing = False

        self.post_init()

    @merge_with_config_defaults
    @capture_outputs
    @deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.FloatTensor | None = None,
        use_cache: bool | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> BaseModelOutputWithPast:
        if (input_ids is None) ^ (inputs_embeds is not None):
            raise ValueError("You must specify exactly one of input_ids or inputs_embeds")

        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)

        if use_cache and cache is None:
            cache = OnboardFlagshipDynamicCache(self.config)

        if position_ids is None:
            # `get_seq_length` skips the leading KDA (recurrent) layers and reads the first DSA layer.
            past_seen_tokens = cache.get_seq_length() if cache is not None else 0
            position_ids = torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device) + past_seen_tokens
            position_ids = position_ids.unsqueeze(0)

        # One mask per attention flavour. `generate` may hand us a prepared mapping; otherwise build it here.
        if not isinstance(mask_mapping := attention_mask, dict):
            mask_kwargs = {
                "config": self.config,
                "inputs_embeds": inputs_embeds,
                "attention_mask": attention_mask,
                "cache": cache,
                "position_ids": position_ids,
            }
            mask_mapping = {
                # The DSA indexer needs the causal mask materialised (no sdpa `is_causal` shortcut): it masks the
                # index scores with it and then ANDs its top-k selection into it.
                SPARSE_ATTENTION: create_causal_mask(**mask_kwargs, allow_is_causal_skip=False),
                # KDA only needs the 2D padding mask (None when there is no padding).
                LINEAR_ATTENTION: create_recurrent_attention_mask(**mask_kwargs),
            }

        hidden_states = inputs_embeds
        position_embeddings = self.rotary_emb(hidden_states, position_ids=position_ids)

        for decoder_layer in self.layers[: self.config.num_hidden_layers]:
            hidden_states = decoder_layer(
                hidden_states,
                attention_mask=mask_mapping[decoder_layer.layer_type],
                position_ids=position_ids,
                cache=cache,
                use_cache=use_cache,
                position_embeddings=position_embeddings,
                **kwargs,
            )

        hidden_states = self.norm(hidden_states)
        return BaseModelOutputWithPast(last_hidden_state=hidden_states, cache=cache)


class OnboardFlagshipForCausalLM(OnboardFlagshipPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}  # only tied if tie_word_embeddings=True
    _pp_plan = {"lm_head": (["hidden_states"], ["logits"])}

    def __init__(self, config: OnboardFlagshipConfig):
        super().__init__(config)
        self.model = OnboardFlagshipModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

        self.post_init()

    def _prepare_cache_for_generation(self, generation_config, model_kwargs, *args, **kwargs):
        # `generate` would build `DynamicCache(config=...)`, which cannot map "sparse_attention" layers (see
        # `OnboardFlagshipDynamicCache`): provide the default dynamic cache ourselves, defer everything else.
        if (
            model_kwargs.get("cache") is None
            and generation_config.use_cache is not False
            and generation_config.cache_implementation in (None, "dynamic")
        ):
            model_kwargs["cache"] = OnboardFlagshipDynamicCache(self.config)
            return
        return super()._prepare_cache_for_generation(generation_config, model_kwargs, *args, **kwargs)

    @can_return_tuple
    @deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.FloatTensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        **kwargs: Unpack[TransformersKwargs],
    ) -> CausalLMOutputWithPast:
        r"""
        labels (`torch.LongTensor` of shape `(batch_size, sequence_length)`, *optional*):
            Labels for the causal-LM loss (shifted inside the loss). Positions set to `-100` are ignored.
        logits_to_keep (`int` or `torch.Tensor`, *optional*, defaults to 0):
            If an int, compute logits only for the last `logits_to_keep` positions (0 = all); if a 1D tensor, the
            sequence indices to keep.
        """
        outputs: BaseModelOutputWithPast = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            **kwargs,
        )

        hidden_states = outputs.last_hidden_state
        # Only compute the logits that are needed (a 163840-wide vocab makes this the largest activation).
        hidden_states = slice_logits_to_keep(hidden_states, logits_to_keep)
        logits = self.lm_head(hidden_states)

        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)

        return CausalLMOutputWithPast(
            loss=loss,
            logits=logits,
            cache=outputs.cache,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
        )


__all__ = [
    "OnboardFlagshipDynamicCache",
    "OnboardFlagshipPreTrainedModel",
    "OnboardFlagshipModel",
    "OnboardFlagshipForCausalLM",
]
