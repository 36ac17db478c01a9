#!/usr/bin/env python3
"""Writes the fuzz targets' seed corpora (fuzz/corpus/<target>/): small valid inputs, in the
input layout each fuzz/<target>_fuzzer.cpp describes, so the fuzzers start from the formats'
real structure. Deterministic: rerunning it rewrites the same files."""
import gzip
import json
import os
import struct
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "corpus")


def write(target, name, data):
    d = os.path.join(ROOT, target)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, name), "wb") as f:
        f.write(data)


# ---- store_protocol: flags byte, then frames (distributed/store/detail/store_protocol.h) ---------
MAGIC, VERSION = 0x53424D45, 1
T = dict(auth=10, set=11, get=12, add=13, compare_set=14, check=15, wait=16, delete=17,
         num_keys=18, join=19)


def frame(kind, *fields):
    payload = b""
    for f in fields:
        if isinstance(f, int):
            payload += struct.pack("<Q", f & (2**64 - 1))
        else:
            f = f.encode() if isinstance(f, str) else f
            payload += struct.pack("<I", len(f)) + f
    return struct.pack("<IBBHI", MAGIC, VERSION, T[kind], 0, len(payload)) + payload


def store_corpus():
    authed = b"\x01"
    write("store_protocol", "set_get", authed + frame("set", "k", b"v" * 8) + frame("get", "k", 100))
    write("store_protocol", "add", authed + frame("add", "n", 5) + frame("add", "n", -7))
    write("store_protocol", "compare_set",
          authed + frame("compare_set", "c", b"", b"x") + frame("compare_set", "c", b"x", b"y"))
    write("store_protocol", "check_wait",
          authed + frame("set", "a", b"1") + frame("check", 2, "a", "b") + frame("wait", 50, 1, "a"))
    write("store_protocol", "get_missing", authed + frame("get", "missing", 10))
    write("store_protocol", "delete_numkeys_join",
          authed + frame("set", "d", b"") + frame("delete", "d") + frame("num_keys") + frame("join"))
    write("store_protocol", "handshake", b"\x00" + frame("auth", b"") + frame("num_keys"))
    write("store_protocol", "handshake_proof", b"\x00" + frame("auth", b"p" * 32))
    big = frame("set", "big", b"z" * 1000)
    write("store_protocol", "partial_frame", authed + big[: len(big) // 2])


# ---- safetensors: the whole file (nn/io/serialize.h) --------------------------------------------
def safetensors(tensors, metadata=None):
    header, data = {}, b""
    for name, dtype, shape, raw in tensors:
        header[name] = {"dtype": dtype, "shape": shape,
                        "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    if metadata is not None:
        header["__metadata__"] = metadata
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % 8)
    return struct.pack("<Q", len(text)) + text + data


def safetensors_corpus():
    write("safetensors", "f32", safetensors(
        [("w", "F32", [2, 3], struct.pack("<6f", *range(6)))], {"format": "pt"}))
    write("safetensors", "mixed", safetensors([
        ("a", "F64", [2], struct.pack("<2d", 1.5, -2)),
        ("b", "I64", [1, 2], struct.pack("<2q", 7, -9)),
        ("c", "I32", [3], struct.pack("<3i", 1, 2, 3)),
        ("d", "F16", [2], b"\x00\x3c\x00\xc0"),
        ("e", "BF16", [2], b"\x80\x3f\x00\x40"),
        ("f", "U8", [3], b"\x01\x02\xff"),
        ("g", "BOOL", [2, 2], b"\x00\x01\x01\x00"),
    ]))
    write("safetensors", "empty_tensor", safetensors([("z", "F32", [0, 4], b""), ("s", "F32", [], b"\0\0\x80\x3f")]))
    write("safetensors", "metadata_only", safetensors([], {"step": "12", "note": "x"}))


# ---- idx: flags, u16 images length, images file, labels file (fuzz/idx_fuzzer.cpp) -----------
def idx(n, dims, fill):
    return struct.pack(">I", 0x800 | (1 + len(dims))) + struct.pack(">I", n) + b"".join(
        struct.pack(">I", d) for d in dims) + fill


def idx_input(flags, images, labels):
    return bytes([flags]) + struct.pack("<H", len(images)) + images + labels


def idx_corpus():
    images = idx(2, [28, 28], bytes(range(256)) * 6 + bytes(2 * 784 - 1536))
    labels = idx(2, [], b"\x03\x07")
    write("idx", "raw", idx_input(0, images, labels))
    write("idx", "harness_gzip", idx_input(7, images, labels))
    write("idx", "gzip_bytes", idx_input(3, gzip.compress(images, 9, mtime=0),
                                         gzip.compress(labels, 9, mtime=0)))
    write("idx", "zero_items", idx_input(0, idx(0, [28, 28], b""), idx(0, [], b"")))


# ---- launcher_config: one argument per line, EMBER_/PET_ lines set variables ---------------
def launcher_corpus():
    lines = {
        "standalone": ["--standalone", "--nproc-per-node", "2", "prog", "--lr", "0.1"],
        "multinode": ["--nnodes", "1:4", "--rdzv-endpoint", "[::1]:29400", "--rdzv-backend",
                      "c10d", "--rdzv-conf", "join_timeout=5,last_call_timeout=1,read_timeout=2",
                      "--max-restarts", "2", "--", "prog"],
        "static": ["--nnodes=2", "--node-rank=1", "--master-addr=10.0.0.1", "--master-port=29501",
                   "-r", "0:3,1:1", "-t", "2", "--local-ranks-filter", "0,1",
                   "--nproc-per-node=2", "prog"],
        "env": ["EMBER_NPROC_PER_NODE=cpu", "PET_NNODES=1", "PET_RDZV_CONF=timeout=9",
                "EMBER_GRACE_PERIOD=0.5", "--monitor-interval", "0.2", "prog"],
        "python": ["--no-python", "--start-method", "spawn", "--role", "trainer", "python3", "x.py"],
        "help": ["--help"],
    }
    for name, args in lines.items():
        write("launcher_config", name, "\n".join(args).encode())


# ---- checkpoint_index: a selector byte (even: index.json, odd: the HF index), then the file ----
def checkpoint_index_corpus():
    piece = lambda rank, off, n, fo, **kw: dict(rank=rank, offset=off, numel=n, file_offset=fo,
                                               xxh3="c77b3abb6f87acd9", **kw)
    index = {
        "format": "ember.sharded_checkpoint", "version": 3, "world_size": 2,
        "save_id": "d3e4dd2289cfef9f",
        "metadata": {"checkpoint.objects": "[\"model\",\"rng\"]", "step": "7"},
        "rank_metadata": [{"rng.seed": "1"}, {"rng.seed": "2"}],
        "tensors": [
            {"name": "model.b", "dtype": "float32", "shape": [2], "pieces": [piece(0, 0, 2, 136)]},
            {"name": "model.w", "dtype": "bfloat16", "shape": [4, 6], "pieces": [
                piece(0, 0, 12, 144, box=dict(view=[4, 6], offset=[0, 0], shape=[2, 6])),
                piece(1, 0, 12, 136, box=dict(view=[4, 6], offset=[2, 0], shape=[2, 6]))]},
        ],
    }
    write("checkpoint_index", "sharded", b"\x00" + json.dumps(index, indent=1).encode())
    empty = dict(index, world_size=1, tensors=[], rank_metadata=[{}])
    write("checkpoint_index", "sharded_empty", b"\x02" + json.dumps(empty).encode())
    hf = {"metadata": {"total_size": 10272},
          "weight_map": {"transformer.wte.weight": "model-00001-of-00002.safetensors",
                         "transformer.h.0.ln_1.bias": "model-00002-of-00002.safetensors"}}
    write("checkpoint_index", "hf", b"\x01" + json.dumps(hf, indent=2).encode())


if __name__ == "__main__":
    store_corpus()
    safetensors_corpus()
    idx_corpus()
    launcher_corpus()
    checkpoint_index_corpus()
    sys.exit(0)
