#!/usr/bin/python3
"""An independent safetensors reader and writer for Ember's interop tests.

Written from the format description at https://github.com/huggingface/safetensors (no code
shared with Ember's C++ implementation, and no `safetensors` package needed): an 8-byte
little-endian unsigned header size N, N bytes of UTF-8 JSON, then the tensors' bytes packed
without gaps. Values are decoded with torch, so the test also checks that PyTorch reads
Ember's bytes as the same numbers.

Usage (run with /usr/bin/python3, Debian's interpreter that has torch):
  safetensors_reader.py dump FILE            validate FILE and describe it as JSON on stdout
  safetensors_reader.py write FILE [--no-pad] write a fixed set of tensors and describe them

The description is {"header_size", "header_padded", "metadata", "order",
"tensors": {name: {"dtype", "shape", "data_offsets", "hex", "values"}}}, where "order" lists
the names in header order, "hex" is the tensor's raw bytes and "values" its elements as
decoded by torch (floats as numbers, or "nan"/"inf"/"-inf"). A file that breaks the format
makes `dump` exit with status 1 and a message on stderr.
"""
import json
import math
import struct
import sys

import torch

DTYPES = {
    "BOOL": (torch.bool, 1),
    "U8": (torch.uint8, 1),
    "I32": (torch.int32, 4),
    "I64": (torch.int64, 8),
    "F16": (torch.float16, 2),
    "BF16": (torch.bfloat16, 2),
    "F32": (torch.float32, 4),
    "F64": (torch.float64, 8),
}
NAME_OF = {t: name for name, (t, _) in DTYPES.items()}


def fail(msg):
    sys.stderr.write("safetensors_reader: " + msg + "\n")
    sys.exit(1)


def no_duplicates(pairs):
    d = {}
    for k, v in pairs:
        if k in d:
            fail("duplicate key %r in the header" % k)
        d[k] = v
    return d


def json_value(x):
    if isinstance(x, float) and not math.isfinite(x):
        return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")
    return x


def decode(raw, dtype_name, shape):
    """The tensor's elements, decoded by torch, as a flat JSON-friendly list."""
    dtype, size = DTYPES[dtype_name]
    n = math.prod(shape)
    if len(raw) != n * size:
        fail("%d bytes cannot hold %s of shape %s" % (len(raw), dtype_name, shape))
    if n == 0:
        t = torch.empty(shape, dtype=dtype)
    else:
        t = torch.frombuffer(bytearray(raw), dtype=dtype).reshape(shape)
    if list(t.shape) != list(shape):
        fail("torch made shape %s, header says %s" % (list(t.shape), shape))
    flat = t.reshape(-1)
    if dtype in (torch.float16, torch.bfloat16):
        flat = flat.double()  # exact: every 16-bit float is a float64
    return [json_value(v) for v in flat.tolist()]


def describe(raw_by_name, entries, header_size, metadata):
    return {
        "header_size": header_size,
        "header_padded": header_size % 8 == 0,
        "metadata": metadata,
        "order": [name for name, _ in entries],
        "tensors": {
            name: {
                "dtype": e["dtype"],
                "shape": e["shape"],
                "data_offsets": e["data_offsets"],
                "hex": raw_by_name[name].hex(),
                "values": decode(raw_by_name[name], e["dtype"], e["shape"]),
            }
            for name, e in entries
        },
    }


def dump(path):
    with open(path, "rb") as f:
        blob = f.read()
    if len(blob) < 8:
        fail("file has %d bytes, fewer than 8" % len(blob))
    (n,) = struct.unpack("<Q", blob[:8])
    if 8 + n > len(blob):
        fail("header size %d runs past the end of the file (%d bytes)" % (n, len(blob)))
    text = blob[8:8 + n]
    if not text.startswith(b"{"):
        fail("header does not start with '{'")
    try:
        header = json.loads(text.decode("utf-8"), object_pairs_hook=no_duplicates)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        fail("header is not UTF-8 JSON: %s" % e)
    # json.loads with object_pairs_hook returns a dict in file order (Python 3.7+).
    if not text.rstrip(b" ").endswith(b"}"):
        fail("header is not a JSON object padded with spaces")
    metadata = header.pop("__metadata__", None)
    if metadata is not None:
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
            fail("__metadata__ must map strings to strings")
    data = blob[8 + n:]
    entries = list(header.items())
    raw_by_name = {}
    for name, e in entries:
        if set(e) != {"dtype", "shape", "data_offsets"}:
            fail("tensor %r has fields %s" % (name, sorted(e)))
        if e["dtype"] not in DTYPES:
            fail("tensor %r has dtype %r" % (name, e["dtype"]))
        if not all(isinstance(d, int) and d >= 0 for d in e["shape"]):
            fail("tensor %r has shape %r" % (name, e["shape"]))
        begin, end = e["data_offsets"]
        if not 0 <= begin <= end <= len(data):
            fail("tensor %r has data_offsets %r" % (name, e["data_offsets"]))
        if end - begin != math.prod(e["shape"]) * DTYPES[e["dtype"]][1]:
            fail("tensor %r: offsets %r do not match its shape" % (name, e["data_offsets"]))
        raw_by_name[name] = data[begin:end]
    cursor = 0
    for name, e in sorted(entries, key=lambda kv: tuple(kv[1]["data_offsets"])):
        begin, end = e["data_offsets"]
        if begin != cursor:
            fail("tensor %r begins at %d, the previous data ends at %d" % (name, begin, cursor))
        cursor = end
    if cursor != len(data):
        fail("tensors cover %d bytes of %d" % (cursor, len(data)))
    return describe(raw_by_name, entries, n, metadata)


def fixed_tensors():
    """The tensors `write` saves: every dtype, special values, a 0-dim and a 0-size tensor."""
    return {
        "f32": torch.tensor([[1.5, -2.25, 3.0], [0.1, 1e-30, -0.0]], dtype=torch.float32),
        "f64": torch.linspace(-1, 1, 5, dtype=torch.float64),
        "f16": torch.tensor([1.0, 65504.0, 6e-8, -0.5, float("inf")], dtype=torch.float16),
        "bf16": torch.tensor([[1.0, 3.140625], [-1e38, float("nan")]], dtype=torch.bfloat16),
        "i64": torch.tensor([-2**63, 2**63 - 1, 0, 42], dtype=torch.int64),
        "i32": (torch.arange(12, dtype=torch.int32) - 6).reshape(3, 4),
        "u8": torch.tensor([0, 1, 255], dtype=torch.uint8),
        "bool": torch.tensor([True, False, True]),
        "scalar": torch.tensor(7.5, dtype=torch.float32),
        "empty": torch.zeros(0, 3, dtype=torch.float32),
        "layer.0/größe": torch.tensor([2.0], dtype=torch.float16),
    }


def write(path, pad):
    tensors = fixed_tensors()
    # Like the reference writer: data sorted by element size (largest first), then name, and
    # the header lists the tensors in that same order after "__metadata__".
    names = sorted(tensors, key=lambda k: (-tensors[k].element_size(), k))
    metadata = {"format": "pt", "source": "safetensors_reader.py"}
    header = {"__metadata__": metadata}
    raw_by_name = {}
    offset = 0
    for name in names:
        t = tensors[name].contiguous()
        raw = t.numpy().tobytes() if t.dtype != torch.bfloat16 else \
            t.view(torch.int16).numpy().tobytes()
        raw_by_name[name] = raw
        header[name] = {"dtype": NAME_OF[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + len(raw)]}
        offset += len(raw)
    text = json.dumps(header, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    if pad:
        text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for name in names:
            f.write(raw_by_name[name])
    entries = [(name, header[name]) for name in names]
    return describe(raw_by_name, entries, len(text), metadata)


def main(argv):
    if len(argv) >= 3 and argv[1] == "dump":
        out = dump(argv[2])
    elif len(argv) >= 3 and argv[1] == "write":
        out = write(argv[2], pad="--no-pad" not in argv[3:])
    else:
        fail("usage: safetensors_reader.py dump FILE | write FILE [--no-pad]")
    json.dump(out, sys.stdout, ensure_ascii=False, allow_nan=False)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main(sys.argv)
