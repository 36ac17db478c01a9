#!/usr/bin/python3
"""An independent reader of TensorBoard event files for Ember's SummaryWriter tests.

Shares no code or schema with Ember's C++ writer: the record framing is checked here from the
TFRecord description (uint64 little-endian length, uint32 masked CRC32C of the length's 8
bytes, the data, uint32 masked CRC32C of the data; mask(c) = ((c >> 15) | (c << 17)) +
0xa282ead8), with the CRC32C of the `crc32c` package (Debian's python3-crc32c), and the Event
messages are decoded by Google's protobuf runtime (python3-protobuf) through descriptors built
below from TensorFlow's field numbers (event.proto, summary.proto, tensor.proto,
tensor_shape.proto), not from nn/io/tensorboard.proto, so a wrong number on either side shows.

Usage (with /usr/bin/python3): tfevents_reader.py PATH...
  PATH is an event file, or a folder searched recursively for events.out.tfevents.* files.
Prints one JSON object {path: [event, ...]} (a folder's files by their path relative to it),
where an event is {"wall_time", "step"} plus "file_version" or "values": [{"tag", and one of
"simple_value", "histo": {min, max, num, sum, sum_squares, bucket_limit, bucket},
"tensor": {dtype, shape, string_val}}, with "plugin_name" and "plugin_content" (hex) when the
value has metadata]. A broken file (bad CRC, truncated record, undecodable Event) makes it exit
with status 1 and a message naming the file, the record and its offset on stderr.
"""
import json
import os
import struct
import sys

import crc32c
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

F = descriptor_pb2.FieldDescriptorProto
OPT, REP = F.LABEL_OPTIONAL, F.LABEL_REPEATED

# (message, [(field, number, type, label, message type name or None)]), TensorFlow's numbers.
MESSAGES = [
    ("Dim", [("size", 1, F.TYPE_INT64, OPT, None)]),
    ("TensorShapeProto", [("dim", 2, F.TYPE_MESSAGE, REP, "Dim")]),
    ("TensorProto", [("dtype", 1, F.TYPE_INT32, OPT, None),
                     ("tensor_shape", 2, F.TYPE_MESSAGE, OPT, "TensorShapeProto"),
                     ("string_val", 8, F.TYPE_BYTES, REP, None)]),
    ("HistogramProto", [("min", 1, F.TYPE_DOUBLE, OPT, None),
                        ("max", 2, F.TYPE_DOUBLE, OPT, None),
                        ("num", 3, F.TYPE_DOUBLE, OPT, None),
                        ("sum", 4, F.TYPE_DOUBLE, OPT, None),
                        ("sum_squares", 5, F.TYPE_DOUBLE, OPT, None),
                        ("bucket_limit", 6, F.TYPE_DOUBLE, REP, None),
                        ("bucket", 7, F.TYPE_DOUBLE, REP, None)]),
    ("PluginData", [("plugin_name", 1, F.TYPE_STRING, OPT, None),
                    ("content", 2, F.TYPE_BYTES, OPT, None)]),
    ("SummaryMetadata", [("plugin_data", 1, F.TYPE_MESSAGE, OPT, "PluginData")]),
    ("Value", [("tag", 1, F.TYPE_STRING, OPT, None),
               ("simple_value", 2, F.TYPE_FLOAT, OPT, None),
               ("histo", 5, F.TYPE_MESSAGE, OPT, "HistogramProto"),
               ("tensor", 8, F.TYPE_MESSAGE, OPT, "TensorProto"),
               ("metadata", 9, F.TYPE_MESSAGE, OPT, "SummaryMetadata")]),
    ("Summary", [("value", 1, F.TYPE_MESSAGE, REP, "Value")]),
    ("Event", [("wall_time", 1, F.TYPE_DOUBLE, OPT, None),
               ("step", 2, F.TYPE_INT64, OPT, None),
               ("file_version", 3, F.TYPE_STRING, OPT, None),
               ("summary", 5, F.TYPE_MESSAGE, OPT, "Summary")]),
]


def event_class():
    fd = descriptor_pb2.FileDescriptorProto(name="tfevents_reader.proto", package="reader",
                                            syntax="proto2")
    for name, fields in MESSAGES:
        m = fd.message_type.add(name=name)
        for fname, number, ftype, label, type_name in fields:
            f = m.field.add(name=fname, number=number, type=ftype, label=label)
            if type_name:
                f.type_name = ".reader." + type_name
    pool = descriptor_pool.DescriptorPool()
    pool.Add(fd)
    desc = pool.FindMessageTypeByName("reader.Event")
    if hasattr(message_factory, "GetMessageClass"):
        return message_factory.GetMessageClass(desc)
    return message_factory.MessageFactory(pool).GetPrototype(desc)


Event = event_class()


def masked_crc(data):
    c = crc32c.crc32c(data)
    return (((c >> 15) | (c << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def fail(msg):
    print("tfevents_reader: " + msg, file=sys.stderr)
    sys.exit(1)


def records(path):
    with open(path, "rb") as f:
        buf = f.read()
    pos, n = 0, 0
    while pos < len(buf):
        where = f"{path}: record {n} at offset {pos}"
        if len(buf) - pos < 12:
            fail(f"{where}: truncated header ({len(buf) - pos} of 12 bytes)")
        (length,) = struct.unpack_from("<Q", buf, pos)
        (length_crc,) = struct.unpack_from("<I", buf, pos + 8)
        if masked_crc(buf[pos:pos + 8]) != length_crc:
            fail(f"{where}: length CRC mismatch")
        start = pos + 12
        if len(buf) - start < length + 4:
            fail(f"{where}: truncated data ({len(buf) - start} bytes for {length} + 4)")
        data = buf[start:start + length]
        (data_crc,) = struct.unpack_from("<I", buf, start + length)
        if masked_crc(data) != data_crc:
            fail(f"{where}: data CRC mismatch")
        yield where, data
        pos, n = start + length + 4, n + 1


def describe_value(v):
    d = {"tag": v.tag}
    if v.HasField("metadata"):
        d["plugin_name"] = v.metadata.plugin_data.plugin_name
        d["plugin_content"] = v.metadata.plugin_data.content.hex()
    if v.HasField("simple_value"):
        d["simple_value"] = v.simple_value
    if v.HasField("histo"):
        h = v.histo
        d["histo"] = {"min": h.min, "max": h.max, "num": h.num, "sum": h.sum,
                      "sum_squares": h.sum_squares, "bucket_limit": list(h.bucket_limit),
                      "bucket": list(h.bucket)}
    if v.HasField("tensor"):
        t = v.tensor
        d["tensor"] = {"dtype": t.dtype, "shape": [dim.size for dim in t.tensor_shape.dim],
                       "string_val": [s.decode("utf-8") for s in t.string_val]}
    return d


def read_file(path):
    events = []
    for where, data in records(path):
        e = Event()
        try:
            e.ParseFromString(data)
        except Exception as err:  # the runtime's DecodeError differs between implementations
            fail(f"{where}: not an Event ({err})")
        d = {"wall_time": e.wall_time, "step": e.step}
        if e.HasField("file_version"):
            d["file_version"] = e.file_version
        if e.HasField("summary"):
            d["values"] = [describe_value(v) for v in e.summary.value]
        events.append(d)
    return events


def main(paths):
    out = {}
    for p in paths:
        if os.path.isdir(p):
            for root, _, names in os.walk(p):
                for name in sorted(names):
                    if name.startswith("events.out.tfevents."):
                        full = os.path.join(root, name)
                        out[os.path.relpath(full, p)] = read_file(full)
        else:
            out[p] = read_file(p)
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    if len(sys.argv) < 2:
        fail("usage: tfevents_reader.py PATH...")
    main(sys.argv[1:])
