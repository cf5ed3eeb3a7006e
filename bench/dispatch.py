"""Host-side dispatch per decoder layer: aten operators and microseconds per operator, runtime-adapted layers, CPU.

What `predictors.costmodel` charges a step for eager dispatch (`OPS_PER_LAYER`, and the hardware specs'
`op_dispatch_us`) comes from here. Each architecture is built tiny (hidden 64, 16 tokens: the kernels cost next to
nothing, so the time is the host's) and adapted by its committed bundle; one layer's operators are the difference
between 3 and 1 decoder layers over 2, the time per operator a 4-layer model's median forward + backward over its
operators. Not a ratio against HuggingFace: the
figure is the per-operator host cost itself.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402  bench/common.py

ARCHS = {  # layer kind -> (bundle, model_type, tiny config)
    "dense": ("llama-3.1-8b", "llama", dict(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                            num_key_value_heads=2)),
    "moe": ("mixtral-8x7b", "mixtral", dict(hidden_size=64, intermediate_size=128, num_local_experts=8,
                                            num_experts_per_tok=2, num_attention_heads=4, num_key_value_heads=2)),
}
TOKENS = 16


def build(kind: str, layers: int):
    from transformers import AutoConfig, AutoModelForCausalLM

    from onboard.bundle.files import load_adapter

    bundle, model_type, size = ARCHS[kind]
    config = AutoConfig.for_model(model_type, num_hidden_layers=layers, vocab_size=128, attn_implementation="sdpa",
                                  **size)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    load_adapter(ROOT / "bundles" / bundle).adapt(model)
    return model


def count_layer_ops(kind: str) -> tuple[int, int]:
    """(forward, backward) aten operators of one decoder layer of `kind`, counted by `runtime.op_count.OpCounter`."""
    from runtime.op_count import OpCounter

    counts = []
    for layers in (1, 3):
        model = build(kind, layers)
        ids = torch.randint(0, 128, (1, TOKENS), generator=torch.Generator().manual_seed(0))
        with OpCounter() as forward:
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        with OpCounter() as backward:
            loss.backward()
        counts.append((forward.count, backward.count))
    (f1, b1), (f3, b3) = counts
    return (f3 - f1) // 2, (b3 - b1) // 2


def time_per_op(kind: str, repeats: int) -> float:
    """Seconds per aten operator of a 4-layer model's forward + backward at this size: the median step over its
    operators (embedding and loss included; at this size every operator costs about the same host time)."""
    from runtime.op_count import OpCounter

    model = build(kind, 4)
    ids = torch.randint(0, 128, (1, TOKENS), generator=torch.Generator().manual_seed(0))
    with OpCounter() as ops:
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    for _ in range(10):
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) / ops.count


def main():
    parser = common.parser(__doc__, repeats=200, threads=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    common.scratch_kernel_store(Path("/tmp") / "onboard-bench-kernels")
    rows = {}
    for kind in ARCHS:
        forward, backward = count_layer_ops(kind)
        per_op = time_per_op(kind, args.repeats)
        rows[kind] = {"bundle": ARCHS[kind][0], "forward_ops": forward, "backward_ops": backward,
                      "us_per_op": round(per_op * 1e6, 2)}
        print(f"{kind:6s} ({ARCHS[kind][0]}): {forward} forward + {backward} backward operators per layer, "
              f"{per_op * 1e6:.1f} us per operator ({args.threads} thread)")
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
