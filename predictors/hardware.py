"""Named accelerator specs (YAML): peak FLOP/s per dtype, memory, bandwidths, devices per node.

The bundled specs live in `predictors/hardware/*.yaml`; a user adds one by passing the path of a YAML
file with the same fields wherever a hardware name is accepted. Bandwidths are GB/s per device in one
direction, which is what a ring collective or an All-to-All is limited by.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import yaml

from predictors.errors import PredictorError
from runtime import bounded

HARDWARE_DIR = Path(__file__).parent / "hardware"
# Fraction of peak a large matmul-bound step reaches (the cost model's rate; the learned part corrects it per regime)
MATMUL_EFFICIENCY = 0.55
# What an FP8 GEMM gains over a BF16 one of the same shape, where the chip's FP8 peak is twice its BF16 peak. Read off
# torchao's Float8Linear microbenchmark on H100 (pytorch/ao torchao/float8/README.md @0cf1281, "Performance"): forward
# + backward of a linear with M, K, N = 4096, 8192, 16384 runs 1.39x faster in float8 than in bf16, casts included.
# Less the casts (5 bytes an element as `costmodel.fp8_cast_bytes_per_token` counts them, for the input and output
# gradient, 4096 x (8192 + 16384), and the weight's 8192 x 16384: about 0.35 ms at 3.35 TB/s; the cost model charges
# the first two per token and leaves the weight's once-a-step cast out), three GEMMs of 4.6 ms in bf16 (at a
# cuBLAS-like 72 % of peak; 6.1 ms at MATMUL_EFFICIENCY) take 3.0 ms (4.0 ms) in float8: 1.55x (1.51x), not the 2x of
# the peaks. The same README has "the gemm speedup approaching 2x as M, K, N increase": this is a training-sized
# GEMM's figure, not an upper bound.
FP8_GEMM_SPEEDUP = 1.5
REQUIRED = ("name", "peak_tflops", "memory_gb", "memory_bw_gbs", "scale_up_gbs", "scale_out_gbs",
            "devices_per_node")


@dataclass(frozen=True)
class Hardware:
    name: str
    peak_tflops: dict
    memory_gb: float
    memory_bw_gbs: float
    scale_up_gbs: float
    scale_out_gbs: float
    devices_per_node: int
    scale_up_domain: int = 0  # devices that reach each other at scale-up bandwidth; 0: one node
    host_gbs: float = 25.0
    # Host time to issue one eager aten operator (Python, dispatcher, autograd recording, kernel launch), and whether
    # the device runs it asynchronously (a stream the host queues ahead on) or on the dispatching threads (a CPU).
    # The default is an accelerator under eager PyTorch: 11 us measured on the project's EPYC host for the
    # runtime's layers (bench/dispatch.py) plus ~2 us for cudaLaunchKernel (sources/hardware.md).
    op_dispatch_us: float = 13.0
    # The same for an operator of an MoE layer, where it was measured apart (bench/dispatch.py on the CPU: the runtime's
    # MoE layer issues index and scatter bookkeeping that costs the host more per operator); None: op_dispatch_us. No
    # accelerator framework's MoE layer has been measured, so none gives one.
    moe_op_dispatch_us: float | None = None
    dispatch_overlaps: bool = True
    # Share of `peak_tflops` the cost model's matmuls reach (`matmul_rate`): MATMUL_EFFICIENCY for a vendor's peak; 1
    # for a chip whose peaks are themselves measured matmul rates (the CPU's), which must not be discounted twice.
    matmul_efficiency: float = MATMUL_EFFICIENCY
    # A GEMM of M rows, reduction depth K and N columns reaches M / (M + gemm_fill_rows) x K / (K + gemm_fill_depth) x
    # N / (N + gemm_fill_width) of a large GEMM's rate (`predictors.moe_cost.gemm_efficiency`). The defaults are a
    # GPU's tiled kernels, read from DeepGEMM's published GEMM tables (H800; derivation beside moe_cost.M_FILL); a
    # chip whose kernels differ gives its own (the CPU's: bench/moe.py --curve)
    gemm_fill_rows: float = 128.0  # predictors.moe_cost.M_FILL, K_FILL, N_FILL
    gemm_fill_depth: float = 384.0
    gemm_fill_width: float = 1500.0
    aliases: tuple = ()
    source: str = ""
    confidence: str = "high"
    extra: dict = field(default_factory=dict, compare=False, hash=False)

    @property
    def memory_bytes(self) -> float:
        return self.memory_gb * 1e9

    @property
    def domain(self) -> int:
        return self.scale_up_domain or self.devices_per_node

    def peak_flops(self, dtype: str) -> float:
        """FLOP/s for matmuls in `dtype`; a dtype the chip lacks (FP8 on A100) runs at the BF16 rate."""
        table = self.peak_tflops
        for key in (dtype, "bf16", "fp16", "fp32"):
            if table.get(key):
                return float(table[key]) * 1e12
        raise PredictorError(f"hardware {self.name} has no peak_tflops entry")

    def matmul_rate(self, dtype: str) -> float:
        """FLOP/s a large matmul-bound step reaches in `dtype`: the peak times `matmul_efficiency`; FP8 at most
        FP8_GEMM_SPEEDUP times the BF16 rate (training-sized FP8 GEMMs do not reach the FP8 peak's 2x)."""
        cache = self.__dict__.setdefault("_matmul_rate", {})  # frozen fields; a planner asks thousands of times
        if dtype not in cache:
            peak = self.peak_flops(dtype)
            if dtype == "fp8":
                peak = min(peak, FP8_GEMM_SPEEDUP * self.peak_flops("bf16"))
            cache[dtype] = peak * self.matmul_efficiency
        return cache[dtype]

    def link_gbs(self, span: int) -> float:
        """Bandwidth of a group whose members lie within `span` consecutive devices."""
        return self.scale_up_gbs if span <= self.domain else self.scale_out_gbs


def _key(text: str) -> str:
    return re.sub(r"[^a-z0-9]", "", text.lower())


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _problems(data: dict) -> list[str]:
    """What is wrong with a hardware spec's fields, one phrase each."""
    out = []
    if not isinstance(data["name"], str) or not data["name"].strip():
        out.append("name must be a non-empty string")
    peaks = data["peak_tflops"]
    if not isinstance(peaks, dict) or not peaks:
        out.append("peak_tflops must map dtype names to TFLOP/s")
    else:
        out += [f"peak_tflops.{k} must be a positive number, got {v!r}" for k, v in peaks.items()
                if not (_number(v) and v > 0)]
    for name in ("memory_gb", "memory_bw_gbs", "scale_up_gbs", "scale_out_gbs", "host_gbs"):
        if name in data and not (_number(data[name]) and data[name] > 0):
            out.append(f"{name} must be a positive number, got {data[name]!r}")
    for name, low in (("devices_per_node", 1), ("scale_up_domain", 0)):
        value = data.get(name, low)
        if not (isinstance(value, int) and not isinstance(value, bool) and value >= low):
            out.append(f"{name} must be a whole number of at least {low}, got {value!r}")
    for name in ("gemm_fill_rows", "gemm_fill_depth", "gemm_fill_width"):
        if name in data and not (_number(data[name]) and data[name] >= 0):
            out.append(f"{name} must be a number of at least 0, got {data[name]!r}")
    for name in ("op_dispatch_us", "moe_op_dispatch_us"):
        if name in data and not (_number(data[name]) and data[name] >= 0):
            out.append(f"{name} must be a number of at least 0, got {data[name]!r}")
    if "matmul_efficiency" in data and not (_number(data["matmul_efficiency"]) and 0 < data["matmul_efficiency"] <= 1):
        out.append(f"matmul_efficiency must be a number above 0 and at most 1, got {data['matmul_efficiency']!r}")
    if "dispatch_overlaps" in data and not isinstance(data["dispatch_overlaps"], bool):
        out.append(f"dispatch_overlaps must be true or false, got {data['dispatch_overlaps']!r}")
    if "layer_overhead_ms" in data:
        out.append("layer_overhead_ms is gone: give op_dispatch_us (host microseconds per operator) and "
                   "dispatch_overlaps (false for a CPU) instead")
    aliases = data.get("aliases") or []
    if not isinstance(aliases, list) or not all(isinstance(a, str) for a in aliases):
        out.append("aliases must be a list of names")
    known = set(Hardware.__dataclass_fields__) - {"extra"}
    unknown = sorted(str(k) for k in data if k not in known and k != "layer_overhead_ms")
    if unknown:  # a misspelt field would otherwise leave its default in place, unnoticed (plans refuse theirs too)
        out.append(f"unknown field(s) {', '.join(unknown)} (known: {', '.join(sorted(known))})")
    return out


def _from_mapping(data: dict, where: str) -> Hardware:
    if not isinstance(data, dict):
        raise PredictorError(f"{where}: a hardware spec is a YAML mapping")
    missing = [k for k in REQUIRED if k not in data]
    if missing:
        raise PredictorError(f"{where}: missing field(s) {', '.join(missing)}")
    problems = _problems(data)
    if problems:
        raise PredictorError(f"{where}: {'; '.join(problems)}")
    known = {f for f in Hardware.__dataclass_fields__} - {"extra"}
    values = {k: v for k, v in data.items() if k in known}
    values["aliases"] = tuple(values.get("aliases") or ())
    return Hardware(**values, extra={k: v for k, v in data.items() if k not in known})


def load_file(path) -> Hardware:
    try:
        data = yaml.safe_load(bounded.read_text(path, "hardware spec"))
    except bounded.Refused as e:
        raise PredictorError(str(e)) from None
    except yaml.YAMLError as e:
        raise PredictorError(f"hardware spec {path} is not valid YAML: {str(e).splitlines()[0]}") from None
    except RecursionError as e:  # YAML nested past the parser's depth (the bounded reader decoded the text)
        raise PredictorError(f"hardware spec {path} is not a YAML text: {type(e).__name__}") from None
    return _from_mapping(data, str(path))


@lru_cache(maxsize=1)
def _bundled() -> tuple[Hardware, ...]:
    return tuple(load_file(p) for p in sorted(HARDWARE_DIR.glob("*.yaml")))


def bundled() -> dict[str, Hardware]:
    return {hw.name: hw for hw in _bundled()}


def find(name_or_path) -> Hardware:
    """A bundled spec by name or alias (case and punctuation ignored), or a YAML file by path."""
    text = str(name_or_path)
    if text.endswith((".yaml", ".yml")) or Path(text).is_file():
        return load_file(text)
    specs = bundled()
    wanted = _key(text)
    for hw in specs.values():
        if wanted in {_key(hw.name), *map(_key, hw.aliases)}:
            return hw
    raise PredictorError(f"unknown hardware {text!r}; known: {', '.join(specs)} (or a path to a YAML spec)")


def identify(described: dict) -> Hardware:
    """The spec for a run log's `hardware` record, whose name may be what the driver reports
    ("NVIDIA H100 80GB HBM3", "AMD EPYC 9654"): an exact name or alias first, then the longest bundled
    name or alias inside it, then the CPU spec for a CPU run."""
    name = str(described.get("name") or "")
    try:
        return find(name)
    except PredictorError:
        pass
    text = _key(name)
    keys = sorted(((_key(k), hw) for hw in _bundled() for k in (hw.name, *hw.aliases)), key=lambda kv: -len(kv[0]))
    for key, hw in keys:
        if len(key) >= 4 and key in text:
            return hw
    if described.get("device_type") == "cpu":
        return find("cpu")
    raise PredictorError(f"unknown hardware {name!r}; add a spec to predictors/hardware/")
