"""Attention cores of the shared runtime: chunked linear attention (gated delta rule) and DSA sparse attention."""

from runtime.attention.conv import causal_conv1d
from runtime.attention.delta_reference import recurrent_gated_delta_rule
from runtime.attention.dsa import (
    reset_sparse_calls,
    sparse_calls,
    swap_sparse_attention,
)
from runtime.attention.gated_delta import chunk_gated_delta_rule
from runtime.attention.indexer import LightningIndexer, indexer_topk
from runtime.attention.sparse import sparse_attention
from runtime.attention.swap import CALLS as LINEAR_CORE_CALLS
from runtime.attention.swap import (
    find_linear_cores,
    swap_linear_core,
    unswap_linear_core,
)

__all__ = ["LINEAR_CORE_CALLS", "causal_conv1d", "chunk_gated_delta_rule", "find_linear_cores",
           "recurrent_gated_delta_rule", "swap_linear_core", "unswap_linear_core"]
__all__ += ["LightningIndexer", "indexer_topk", "reset_sparse_calls", "sparse_attention", "sparse_calls",
            "swap_sparse_attention"]
