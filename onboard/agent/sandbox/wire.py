"""Messages between the agent's processes: a JSON header and tensors (safetensors), framed on a byte stream.

    write(stream, {"op": "call", ...}, {"t0": tensor, ...})
    header, tensors = read(stream)                     # WireError for anything that is not one frame
    structure, tensors = pack(value)                   # a tensor, or tuples / lists / dicts of them, and plain values
    value = unpack(structure, tensors)

A frame is MAGIC, the header's length (4 bytes), the header (UTF-8 JSON object), the payload's length (8 bytes)
and the payload (a safetensors file, or nothing; written here byte by byte, `safetensors_bytes`, because
safetensors' own writer reaches raw memory through ctypes, which a candidate's process may not use). Every length is checked against a limit before anything is
read, and a frame from a candidate's process is parsed by the JSON and safetensors parsers only: no pickle,
nothing a sender can make the reader call. Values travel as a structure (JSON) naming tensors by key.
"""

from __future__ import annotations

import json
import struct

import torch
from safetensors.torch import load as load_tensors

MAGIC = b"OBW1"
MAX_HEADER = 4 << 20
MAX_PAYLOAD = 4 << 30
PLAIN = (bool, int, float, str, type(None))


class WireError(Exception):
    """A frame that cannot be read, or a value that cannot be sent."""


def _exactly(stream, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        chunk = stream.read(n - len(out))
        if not chunk:
            raise EOFError("the stream ended inside a frame" if out else "the stream ended")
        out += chunk
    return bytes(out)


DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
          torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
          torch.bool: "BOOL"}
AS_NUMPY = {torch.bfloat16: torch.int16}  # dtypes numpy has no name for travel as their bits


def safetensors_bytes(tensors: dict[str, torch.Tensor]) -> bytes:
    """The safetensors file of `tensors` (8-byte header length, JSON header, the data in header order)."""
    header, chunks, offset = {}, [], 0
    for name in sorted(tensors):
        t = tensors[name].detach()
        if t.dtype not in DTYPES:
            raise WireError(f"a tensor of dtype {t.dtype} cannot be sent")
        data = t.contiguous().cpu().view(AS_NUMPY.get(t.dtype, t.dtype)).numpy().tobytes()
        header[name] = {"dtype": DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + len(data)]}
        chunks.append(data)
        offset += len(data)
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    return struct.pack("<Q", len(head)) + head + b"".join(chunks)


def write(stream, header: dict, tensors: dict[str, torch.Tensor] | None = None) -> None:
    head = json.dumps(header, sort_keys=True, allow_nan=True).encode()
    payload = safetensors_bytes(tensors) if tensors else b""
    stream.write(MAGIC + struct.pack("<I", len(head)) + head + struct.pack("<Q", len(payload)) + payload)
    stream.flush()


def read(stream, *, max_payload: int = MAX_PAYLOAD) -> tuple[dict, dict[str, torch.Tensor]]:
    """One frame: (header, tensors). EOFError at the end of the stream; WireError for a malformed frame."""
    magic = _exactly(stream, len(MAGIC))
    if magic != MAGIC:
        raise WireError("not a frame (bad magic)")
    (size,) = struct.unpack("<I", _exactly(stream, 4))
    if size > MAX_HEADER:
        raise WireError(f"a header of {size} bytes (limit {MAX_HEADER})")
    try:
        header = json.loads(_exactly(stream, size))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise WireError(f"a header that is not JSON ({exc})") from None
    if not isinstance(header, dict):
        raise WireError("a header that is not an object")
    (size,) = struct.unpack("<Q", _exactly(stream, 8))
    if size > max_payload:
        raise WireError(f"a payload of {size} bytes (limit {max_payload})")
    tensors = {}
    if size:
        try:
            tensors = load_tensors(_exactly(stream, size))
        except EOFError:
            raise
        except Exception as exc:  # noqa: BLE001 - safetensors' own parse errors, whatever their class
            raise WireError(f"a payload that is not safetensors ({type(exc).__name__})") from None
    return header, tensors


def pack(value, tensors: dict[str, torch.Tensor] | None = None, prefix: str = "t") -> tuple[object, dict]:
    """(structure, tensors) of `value`: tensors become {"t": key}; tuples, lists and string-keyed dicts keep their
    kind; dtypes and plain values travel as they are. WireError for anything else (a cache object, a config)."""
    tensors = {} if tensors is None else tensors

    def go(v):
        if isinstance(v, torch.Tensor):
            key = f"{prefix}{len(tensors)}"
            tensors[key] = v
            return {"t": key}
        if isinstance(v, torch.dtype):
            return {"dtype": str(v).removeprefix("torch.")}
        if isinstance(v, tuple | list):
            return {"tuple" if isinstance(v, tuple) else "list": [go(x) for x in v]}
        if isinstance(v, dict):
            if not all(isinstance(k, str) for k in v):
                raise WireError("a dict with keys that are not strings")
            return {"dict": [[k, go(x)] for k, x in v.items()]}
        if isinstance(v, PLAIN):
            return {"v": v}
        raise WireError(f"a {type(v).__name__} (only tensors, plain values and tuples / lists / dicts of them)")

    return go(value), tensors


def unpack(structure, tensors: dict[str, torch.Tensor], *, depth: int = 0):
    """The value `pack` described (WireError for a structure that is not one, or names a missing tensor)."""
    if depth > 64 or not isinstance(structure, dict) or len(structure) != 1:
        raise WireError("a malformed value structure")
    (kind, body), = structure.items()
    if kind == "t":
        if not isinstance(body, str) or body not in tensors:
            raise WireError(f"a structure naming a tensor that was not sent ({str(body)[:40]})")
        return tensors[body]
    if kind == "v" and isinstance(body, PLAIN):
        return body
    if kind == "dtype" and isinstance(body, str) and isinstance(getattr(torch, body, None), torch.dtype):
        return getattr(torch, body)
    if kind in ("tuple", "list") and isinstance(body, list):
        items = [unpack(x, tensors, depth=depth + 1) for x in body]
        return tuple(items) if kind == "tuple" else items
    if kind == "dict" and isinstance(body, list) and all(
            isinstance(p, list) and len(p) == 2 and isinstance(p[0], str) for p in body):
        return {k: unpack(x, tensors, depth=depth + 1) for k, x in body}
    raise WireError("a malformed value structure")


def leaves(value) -> list:
    """The tensors of a value, in `pack`'s order."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, tuple | list):
        return [t for v in value for t in leaves(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in leaves(v)]
    return []
