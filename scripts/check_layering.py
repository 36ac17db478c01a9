#!/usr/bin/env python3
"""Checks Ember's include structure (docs/architecture.md, "Layers and rooms").

From the `#include <ember/...>` lines of every source under the layers' folders:
  1. layers: tensor <- autograd <- nn <- distributed; launcher uses only the store;
  2. rooms of distributed/: each room includes only the rooms below it (ROOMS);
  3. unit cycles: no two units (a header with its .cpp, wherever its detail/ header sits in the
     same room) include each other, directly or through other units, in distributed/ and
     launcher/ (UNIT_LAYERS: the tensor layer's Tensor and its ops are one knot by design);
  4. internal is physical: no installed header (one outside detail/, tensor/cpu/, tensor/cuda/
     and launcher/) includes an internal one, directly or through others; installed headers
     would not compile.
Prints each violation and exits 1 if there is any; with --graph prints the room graph.
Usage: check_layering.py [--root DIR] [--graph]
"""
import argparse
import os
import re
import sys

LAYERS = ["tensor", "autograd", "nn", "distributed", "launcher"]
# What each layer may include (besides itself).
LAYER_DEPS = {
    "tensor": set(),
    "autograd": {"tensor"},
    "nn": {"tensor", "autograd"},
    "distributed": {"tensor", "autograd", "nn"},
    # The launcher links ember_store and ember_log only: the stores, the distributed errors they
    # throw, tensor/observe/ (ember_log: the logger and the trace recorder), and the header-only
    # tensor/error.h.
    "launcher": {"distributed/store", "distributed/errors.h", "tensor/error.h", "tensor/observe"},
}
# distributed/'s rooms, bottom up; each may include the rooms listed (and itself).
# "top" is the layer's front door: distributed/*.h|cpp outside any room.
ROOMS = {
    "errors": set(),  # distributed/errors.h
    "store": {"errors"},
    "top": {"errors", "store"},
    "debug": {"errors", "store", "top"},
    "backends": {"errors", "store", "top", "debug"},
    "ddp": {"errors", "store", "top", "debug"},
    "mesh": {"errors", "store", "top"},
    "sharding": {"errors", "store", "top", "debug", "ddp", "mesh"},
    "functional": {"errors", "store", "top"},
    "dtensor": {"errors", "store", "top", "mesh", "functional"},
    "tensor_parallel": {"errors", "store", "top", "mesh", "functional", "dtensor", "sharding"},
    "checkpoint": {"errors", "store", "top", "debug", "ddp", "sharding", "mesh", "functional",
                   "dtensor"},
    "pipelining": {"errors", "store", "top", "debug", "ddp", "sharding", "mesh"},
}
# Headers users never include, so not installed (cmake/EmberInstall.cmake installs the rest).
# Where unit cycles are refused.
UNIT_LAYERS = ("distributed/", "launcher/")
INTERNAL_DIRS = ("tensor/cpu/", "tensor/cuda/", "launcher/")
SOURCE_EXT = (".h", ".cuh", ".cpp", ".cu")
INCLUDE = re.compile(r'^\s*#\s*include\s+<ember/([^>]+)>', re.M)


def is_internal(path):
    return "/detail/" in path or path.startswith(INTERNAL_DIRS) or path.endswith("_impl.h")


def room_of(path):
    """distributed/<room>/... -> room; distributed/errors.h -> errors; other files at the top,
    and the top's detail/, -> top."""
    rest = path[len("distributed/"):]
    if rest == "errors.h":
        return "errors"
    if "/" not in rest or rest.startswith("detail/"):
        return "top"
    return rest.split("/", 1)[0]


def unit_of(path):
    """A unit is a stem in a folder with its internal half: ddp/detail/reducer.h and
    ddp/reducer.cpp are one unit, and so are x.h and x_impl.h."""
    folder, name = os.path.split(path)
    if os.path.basename(folder) == "detail":
        folder = os.path.dirname(folder)
    stem = os.path.splitext(name)[0]
    if stem.endswith("_impl"):
        stem = stem[:-len("_impl")]
    return os.path.join(folder, stem)


def read_sources(root):
    files = {}
    for layer in LAYERS:
        for dirpath, _, names in os.walk(os.path.join(root, layer)):
            for n in names:
                if n.endswith(SOURCE_EXT):
                    p = os.path.relpath(os.path.join(dirpath, n), root)
                    with open(os.path.join(root, p), encoding="utf-8", errors="replace") as f:
                        files[p] = INCLUDE.findall(f.read())
    return files


def check_layers(files):
    errors = []
    for p, incs in sorted(files.items()):
        layer = p.split("/", 1)[0]
        for inc in incs:
            dep = inc.split("/", 1)[0]
            if dep == layer and layer != "launcher":
                continue
            if layer == "launcher" and dep == "launcher":
                continue
            allowed = LAYER_DEPS[layer]
            if dep in allowed or any(inc == a or inc.startswith(a + "/") for a in allowed):
                continue
            if dep in LAYERS:
                errors.append(f"layer: {p} includes <ember/{inc}> ({layer} may use "
                              f"{', '.join(sorted(allowed)) or 'no other layer'})")
    return errors


def check_rooms(files):
    errors = []
    for p, incs in sorted(files.items()):
        if not p.startswith("distributed/"):
            continue
        mine = room_of(p)
        if mine not in ROOMS:
            errors.append(f"room: {p} is in distributed/{mine}/, which ROOMS does not list")
            continue
        for inc in incs:
            if not inc.startswith("distributed/"):
                continue
            theirs = room_of(inc)
            if theirs != mine and theirs not in ROOMS[mine]:
                errors.append(f"room: {p} ({mine}) includes <ember/{inc}> ({theirs}); {mine} "
                              f"may include {', '.join(sorted(ROOMS[mine]))}")
    return errors


def unit_cycles(files):
    """Strongly connected components of more than one unit in the unit graph."""
    graph = {}
    for p, incs in files.items():
        if not p.startswith(UNIT_LAYERS):
            continue
        u = unit_of(p)
        graph.setdefault(u, set())
        for inc in incs:
            if inc in files:
                v = unit_of(inc)
                if v != u:
                    graph[u].add(v)
    index, low, on, stack, out = {}, {}, set(), [], []
    counter = [0]

    def strong(v):  # Tarjan, iterative enough for the depth of an include graph
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in sorted(graph):
        if v not in index:
            strong(v)
    return out, graph


def check_units(files):
    comps, graph = unit_cycles(files)
    errors = []
    for comp in comps:
        edges = [f"{u} -> {v}" for u in comp for v in sorted(graph[u]) if v in comp]
        errors.append("unit cycle: " + ", ".join(comp) + " (" + "; ".join(edges) + ")")
    return errors


def check_installed(files):
    errors = []
    for p in sorted(files):
        if not p.endswith((".h", ".cuh")) or is_internal(p):
            continue
        seen, todo, parent = set(), [p], {p: None}
        while todo:
            h = todo.pop()
            for inc in files.get(h, []):
                if inc in seen or inc not in files:
                    continue
                seen.add(inc)
                parent[inc] = h
                if is_internal(inc):
                    chain, x = [inc], h
                    while x is not None:
                        chain.append(x)
                        x = parent[x]
                    errors.append(f"installed: {p} includes the internal {inc} (via "
                                  f"{' <- '.join(reversed(chain[1:]))})")
                else:
                    todo.append(inc)
    return errors


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", default=os.path.join(os.path.dirname(__file__), ".."))
    ap.add_argument("--graph", action="store_true", help="print distributed/'s room graph")
    args = ap.parse_args()
    files = read_sources(os.path.abspath(args.root))
    if args.graph:
        edges = set()
        for p, incs in files.items():
            if p.startswith("distributed/"):
                for inc in incs:
                    if inc.startswith("distributed/") and room_of(inc) != room_of(p):
                        edges.add((room_of(p), room_of(inc)))
        for a, b in sorted(edges):
            print(f"{a} -> {b}")
    errors = check_layers(files) + check_rooms(files) + check_units(files) + check_installed(files)
    for e in errors:
        print(e)
    print(f"check_layering: {len(files)} files, {len(errors)} problem(s)")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
