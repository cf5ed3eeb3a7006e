"""Attention cores of the shared runtime: chunked linear attention (gated delta rule, scalar decay for lightning
attention and Mamba2's SSD, Mamba1's selective scan) and DSA sparse attention; and the swaps that make a
HuggingFace module run them (each returns a `runtime.swap.Swap`)."""

from runtime.attention.conv import causal_conv1d
from runtime.attention.delta_reference import recurrent_gated_delta_rule
from runtime.attention.dsa import find_sparse_attention, swap_sparse_attention
from runtime.attention.gated_delta import chunk_gated_delta_rule
from runtime.attention.indexer import LightningIndexer, indexer_topk
from runtime.attention.lightning import swap_lightning_attention
from runtime.attention.linear_core import find_linear_cores, swap_linear_core
from runtime.attention.constant_decay import chunk_constant_decay
from runtime.attention.scalar_decay import chunk_scalar_decay
from runtime.attention.sparse import sparse_attention
from runtime.attention.ssd import ssd_chunk_scan

# (Mamba1's `selective_scan` is not re-exported: the name would hide its module, runtime.attention.selective_scan)
__all__ = [
    "LightningIndexer",
    "causal_conv1d",
    "chunk_gated_delta_rule",
    "chunk_constant_decay",
    "chunk_scalar_decay",
    "find_linear_cores",
    "find_sparse_attention",
    "indexer_topk",
    "recurrent_gated_delta_rule",
    "sparse_attention",
    "ssd_chunk_scan",
    "swap_lightning_attention",
    "swap_linear_core",
    "swap_sparse_attention",
]
