#!/usr/bin/python3
"""Converts Ember weights (safetensors) to a PyTorch state_dict file (torch.save), and back.

    /usr/bin/python3 scripts/to_torch.py IN.safetensors OUT.pt
    /usr/bin/python3 scripts/to_torch.py --from-torch IN.pt OUT.safetensors

Ember's state-dict names and layouts are PyTorch's ("0.weight", Linear weight [out, in]), so
the tensors travel unchanged: OUT.pt loads with model.load_state_dict(torch.load(OUT.pt)) into
the equivalent torch model, and a torch state_dict (or a whole saved nn.Module) becomes a file
that Ember's nn::load_safetensors and fashion_mnist --init-weights read. The safetensors side
is read and written here with json and struct (the format is an 8-byte little-endian header
size, a JSON header, then the raw bytes), so the `safetensors` package is not needed; the
files are the ones safetensors.torch.save_file writes, {"format": "pt"} metadata included.

Exit status 1 with a message naming the file for a missing or unreadable file, a file that is
not safetensors (or not a torch state_dict), and a dtype the other side has no type for.
"""
import argparse
import collections
import json
import os
import struct
import sys

import torch

# safetensors dtype -> torch dtype, for the dtypes torch 1.13 has.
TORCH_DTYPE = {
    "BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16,
    "I32": torch.int32, "I64": torch.int64, "F16": torch.float16, "BF16": torch.bfloat16,
    "F32": torch.float32, "F64": torch.float64,
}
# The dtypes Ember's loader accepts (nn/io/serialize.h), by torch dtype.
EMBER_DTYPE = {torch.bool: "BOOL", torch.uint8: "U8", torch.int32: "I32", torch.int64: "I64",
               torch.float16: "F16", torch.bfloat16: "BF16", torch.float32: "F32",
               torch.float64: "F64"}
MAX_HEADER = 100 * 1000 * 1000  # the reference implementation's limit


class ConversionError(Exception):
    pass


def read_safetensors(path):
    """Returns (OrderedDict name -> CPU tensor, metadata dict) for the safetensors file at path."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise ConversionError(f"{path}: cannot read: {e.strerror}") from None
    if len(data) < 8:
        raise ConversionError(f"{path}: not a safetensors file ({len(data)} bytes, less than the "
                              "8-byte header size)")
    (n,) = struct.unpack("<Q", data[:8])
    if n > MAX_HEADER or 8 + n > len(data):
        raise ConversionError(f"{path}: not a safetensors file (header size {n} does not fit the "
                              f"file's {len(data)} bytes)")
    try:
        header = json.loads(data[8:8 + n].decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConversionError(f"{path}: not a safetensors file (the header is not JSON: {e})") from None
    if not isinstance(header, dict):
        raise ConversionError(f"{path}: not a safetensors file (the header is not a JSON object)")
    body = memoryview(data)[8 + n:]
    metadata = header.pop("__metadata__", None) or {}
    tensors = collections.OrderedDict()
    for name, e in header.items():
        try:
            dtype, shape, (begin, end) = e["dtype"], e["shape"], e["data_offsets"]
        except (TypeError, KeyError, ValueError):
            raise ConversionError(f"{path}: tensor '{name}': expected dtype, shape and "
                                  f"data_offsets, got {e!r}") from None
        if dtype not in TORCH_DTYPE:
            raise ConversionError(f"{path}: tensor '{name}': safetensors dtype {dtype} has no "
                                  f"torch equivalent (torch has {', '.join(TORCH_DTYPE)})")
        t = TORCH_DTYPE[dtype]
        numel = 1
        for d in shape:
            numel *= d
        need = numel * torch.empty((), dtype=t).element_size()
        if not 0 <= begin <= end <= len(body) or end - begin != need:
            raise ConversionError(f"{path}: tensor '{name}': data_offsets [{begin}, {end}] do not "
                                  f"hold {dtype} {shape} ({need} bytes) within {len(body)} bytes")
        raw = bytearray(body[begin:end])
        flat = torch.frombuffer(raw, dtype=t) if raw else torch.empty(0, dtype=t)
        tensors[name] = flat.reshape(shape)
    return tensors, metadata


def write_safetensors(path, tensors, metadata):
    """Writes name -> tensor as safetensors: the header lists the tensors in the given order, the
    data is laid out by decreasing element size so each tensor is aligned, as Ember writes."""
    items = [(name, t.detach().cpu().contiguous()) for name, t in tensors.items()]
    header = {"__metadata__": metadata} if metadata else {}
    offset, chunks = 0, {}
    for name, t in sorted(items, key=lambda kv: -kv[1].element_size()):
        raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        chunks[name] = (offset, raw)
        offset += len(raw)
    for name, t in items:
        begin, raw = chunks[name]
        header[name] = {"dtype": EMBER_DTYPE[t.dtype], "shape": list(t.shape),
                        "data_offsets": [begin, begin + len(raw)]}
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        for name, _ in sorted(items, key=lambda kv: -kv[1].element_size()):
            f.write(chunks[name][1])
    os.replace(tmp, path)


def load_torch_state_dict(path):
    if not os.path.isfile(path):
        raise ConversionError(f"{path}: no such file")
    try:
        obj = torch.load(path, map_location="cpu")
    except Exception as e:  # torch.load raises many kinds for a file it cannot read
        raise ConversionError(f"{path}: not a file torch.load reads: {e}") from None
    if isinstance(obj, torch.nn.Module):
        obj = obj.state_dict()
    if not isinstance(obj, dict):
        raise ConversionError(f"{path}: expected a state_dict (a dict of name -> tensor) or an "
                              f"nn.Module, got {type(obj).__name__}")
    for name, t in obj.items():
        if not isinstance(t, torch.Tensor):
            raise ConversionError(f"{path}: entry '{name}' is a {type(t).__name__}, not a tensor "
                                  "(pass the model's state_dict, not a training checkpoint)")
        if t.dtype not in EMBER_DTYPE:
            raise ConversionError(f"{path}: tensor '{name}': dtype {t.dtype} has no Ember "
                                  f"equivalent (Ember has {', '.join(EMBER_DTYPE.values())})")
    return obj


def to_torch(src, dst):
    tensors, metadata = read_safetensors(src)
    torch.save(tensors, dst)
    return len(tensors), metadata


def from_torch(src, dst):
    state = load_torch_state_dict(src)
    write_safetensors(dst, state, {"format": "pt"})
    return len(state), {"format": "pt"}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--from-torch", action="store_true",
                   help="IN is a torch.save file (state_dict or nn.Module), OUT safetensors")
    p.add_argument("input")
    p.add_argument("output")
    args = p.parse_args(argv)
    try:
        n, metadata = (from_torch if args.from_torch else to_torch)(args.input, args.output)
    except ConversionError as e:
        print(f"{os.path.basename(sys.argv[0])}: error: {e}", file=sys.stderr)
        return 1
    print(f"{args.input} -> {args.output}: {n} tensors, metadata {json.dumps(metadata)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
