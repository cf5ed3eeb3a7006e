"""Attention cores of the shared runtime: chunked linear attention (gated delta rule) and DSA sparse attention."""
