"""Stage: adapting a model. The adapt decision (which runtime piece takes each part, or why none), the code and
kernels rendered from templates (codegen), and verification of the adapted twin against HuggingFace (verify).

May import: onboard.source, onboard.twin, onboard.inspect, onboard.errors, runtime."""
