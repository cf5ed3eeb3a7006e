"""Attention cores of the shared runtime: chunked linear attention (gated delta rule, scalar decay for lightning
attention and Mamba2's SSD, Mamba1's selective scan) and DSA sparse attention."""

from runtime.attention.conv import causal_conv1d
from runtime.attention.delta_reference import recurrent_gated_delta_rule
from runtime.attention.dsa import (
    reset_sparse_calls,
    sparse_calls,
    swap_sparse_attention,
)
from runtime.attention.gated_delta import chunk_gated_delta_rule
from runtime.attention.indexer import LightningIndexer, indexer_topk
from runtime.attention.lightning import swap_lightning_attention
from runtime.attention.scalar_decay import chunk_scalar_decay
from runtime.attention.sparse import sparse_attention
from runtime.attention.ssd import ssd_chunk_scan
from runtime.attention.swap import CALLS as LINEAR_CORE_CALLS
from runtime.attention.swap import (
    find_linear_cores,
    swap_linear_core,
    unswap_linear_core,
)

# (Mamba1's `selective_scan` is not re-exported: the name would hide its module, runtime.attention.selective_scan)
__all__ = [
    "LINEAR_CORE_CALLS",
    "causal_conv1d",
    "chunk_gated_delta_rule",
    "chunk_scalar_decay",
    "find_linear_cores",
    "recurrent_gated_delta_rule",
    "ssd_chunk_scan",
    "swap_lightning_attention",
    "swap_linear_core",
    "unswap_linear_core",
]
__all__ += ["LightningIndexer", "indexer_topk", "reset_sparse_calls", "sparse_attention", "sparse_calls",
            "swap_sparse_attention"]
