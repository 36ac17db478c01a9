#!/usr/bin/env python3
"""Checks every command the docs show against the option parser of the program it runs.

Reads README.md, CONTRIBUTING.md, docs/*.md (fenced blocks and inline code) and the sbatch
scripts under examples/slurm/, finds each call of a program this build makes (emberrun, the
examples, the benchmarks), and checks it two ways:
  - every option it names (--flag, --flag=value, -f) is one the program's --help lists (for a
    program with subcommands, the subcommand's --help);
  - a command without placeholders (N, <dir>, ..., $VAR) is parsed for real by the programs
    that support it (emberrun, fashion_mnist, gpt): EMBER_CHECK_ARGS=1 makes them parse and
    exit without running anything, so a bad value or a missing argument fails too.
emberrun's program and its arguments are checked as a command of their own.

Exits 1 naming the file, line and problem of each bad command; 0 otherwise. --self-test checks
that a doc naming a flag a program lacks is caught.
"""
import argparse
import glob
import os
import re
import shlex
import subprocess
import sys
import tempfile

# The programs whose parsers honour EMBER_CHECK_ARGS=1 (examples/example_util.h's
# parse_command_line and launcher/main.cpp).
FULL_PARSE = {"emberrun", "fashion_mnist", "gpt"}
# A token that stands for something the reader fills in.
PLACEHOLDER = re.compile(r"^[A-Z][A-Z0-9_]*$|[<>\[\]{}*|$…]|\.\.\.")
# The start of one option line in CLI11's --help ("  -h,--help", "  --nnodes TEXT ...").
HELP_OPTION = re.compile(r"^\s{2,}(-[^\s,]+(?:,\s?-[^\s,]+)*)(?:\s+(\S+))?")
CLI_TYPE = re.compile(r"^[A-Z][A-Z0-9_]*(?::\S*)?$")
# Shell prompts that docs put before a command ("node0$ ", "$ ").
PROMPT = re.compile(r"^\s*(?:[\w.-]*\$\s+)")


class Program:
    """One executable and what its --help says it takes."""

    def __init__(self, name, path):
        self.name, self.path = name, path
        self._help = {}  # subcommand ("" for none) -> (options dict, subcommand names)

    def options(self, sub=""):
        if sub not in self._help:
            cmd = [self.path] + ([sub] if sub else []) + ["--help"]
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=60,
                                 env=dict(os.environ, EMBER_CHECK_ARGS="")).stdout
            opts, subs, section = {"-h": False, "--help": False, "--version": False}, [], ""
            for line in out.splitlines():
                if re.match(r"^\S.*:\s*$", line):
                    section = line.strip().rstrip(":").lower()
                    continue
                m = HELP_OPTION.match(line)
                if m and section != "subcommands":
                    takes = bool(m.group(2) and CLI_TYPE.match(m.group(2)))
                    for n in re.split(r",\s?", m.group(1)):
                        opts[n] = takes
                elif section == "subcommands" and re.match(r"^\s{2,}\w", line):
                    subs.append(line.split()[0])
            self._help[sub] = (opts, subs)
        return self._help[sub]


def find_programs(build):
    progs = {}
    for pattern in ("launcher/emberrun", "examples/*", "benchmarks/**/bench_*"):
        for path in glob.glob(os.path.join(os.path.abspath(build), pattern), recursive=True):
            if os.path.isfile(path) and os.access(path, os.X_OK):
                progs.setdefault(os.path.basename(path), Program(os.path.basename(path), path))
    return progs


def commands_in(path):
    """(line number, command text, whole command?) for each command-like text of a file: a
    fenced block's lines (continuations joined) are whole commands; inline code is often an
    excerpt (`gpt --pp`), so only its option names are checked."""
    with open(path, encoding="utf-8") as f:
        lines = f.read().split("\n")
    out, in_fence, pending, start = [], path.endswith(".sbatch"), "", 0
    for i, line in enumerate(lines, 1):
        if line.lstrip().startswith("```"):
            in_fence = not in_fence
            continue
        if in_fence:
            if pending:
                pending += " " + line.strip()
            else:
                pending, start = PROMPT.sub("", line), i
            if pending.endswith("\\"):
                pending = pending[:-1]
                continue
            out.append((start, pending, True))
            pending = ""
        else:
            for span in re.findall(r"`([^`]+)`", line):
                out.append((i, span, False))
    return out


def split_commands(text):
    """A command line split into simple commands (at ;, &&, ||, |), each a token list."""
    lex = shlex.shlex(text, posix=True, punctuation_chars=";&|<>()")
    lex.whitespace_split = True
    lex.commenters = "#"
    cmds, cur = [], []
    try:
        for tok in lex:
            if tok and set(tok) <= set(";&|()"):
                cmds.append(cur)
                cur = []
            elif tok and set(tok) <= set("<>"):
                cur.append(None)  # a redirection: its target is not an argument
            else:
                cur.append(tok)
    except ValueError:  # an unbalanced quote in prose: not a command
        return []
    cmds.append(cur)
    out = []
    for c in cmds:
        args, skip = [], False
        for tok in c:
            if tok is None:
                skip = True
            elif skip:
                skip = False
            else:
                args.append(tok)
        out.append(args)
    return out


def program_of(token, progs):
    base = token.rstrip("/").split("/")[-1]
    return progs.get(base) if base in progs and (token == base or "/" in token) else None


class Checker:
    def __init__(self, progs):
        self.progs, self.problems, self.checked, self.parsed = progs, [], 0, 0

    def check(self, where, tokens, whole):
        for i, tok in enumerate(tokens):
            prog = program_of(tok, self.progs)
            if prog:
                self.check_call(where, prog, tokens[i + 1:], whole)
                return

    def check_call(self, where, prog, args, whole):
        sub = ""
        opts, subs = prog.options()
        rest = args
        if subs and args and args[0] in subs:
            sub, rest = args[0], args[1:]
            opts, _ = prog.options(sub)
        elif subs and args and not args[0].startswith("-") and not PLACEHOLDER.search(args[0]):
            self.problems.append(f"{where}: {prog.name}: no subcommand '{args[0]}' "
                                 f"(it has {', '.join(subs)})")
            return
        # emberrun's own options end at the program; the rest is the program's command line.
        inner = None
        if prog.name == "emberrun":
            j = 0
            while j < len(rest):
                a = rest[j]
                if not a.startswith("-"):
                    inner = rest[j:]
                    rest = rest[:j]
                    break
                name = a.split("=", 1)[0]
                j += 2 if (opts.get(name) and "=" not in a) else 1
        self.checked += 1
        bad = [a.split("=", 1)[0] for a in rest
               if a.startswith("-") and not re.match(r"^-\d", a) and a != "-"
               and not PLACEHOLDER.search(a.split("=", 1)[0]) and a.split("=", 1)[0] not in opts]
        for b in bad:
            self.problems.append(f"{where}: {prog.name}{' ' + sub if sub else ''} has no option "
                                 f"'{b}'")
        if (whole and not bad and prog.name in FULL_PARSE
                and not any(PLACEHOLDER.search(a) for a in rest)):
            argv = rest if prog.name != "emberrun" else rest + ["true"]
            with tempfile.TemporaryDirectory() as cwd:
                r = subprocess.run([prog.path] + argv, capture_output=True, text=True,
                                   timeout=60, cwd=cwd, env=dict(os.environ, EMBER_CHECK_ARGS="1"))
            self.parsed += 1
            # Status 2 is a usage error; 1 is the machine's (no GPU, a file the example names
            # is not here), which is not the doc's fault.
            # A file the command names that is not here (a certificate, a checkpoint) is the
            # reader's to supply, whichever status the program gives it.
            missing_file = re.search(r"No such file|does not exist", r.stderr)
            if (r.returncode == 2 and not missing_file) or (
                    r.returncode == 0 and "arguments ok" not in r.stdout):
                msg = (r.stderr.strip() or r.stdout.strip()).splitlines()
                self.problems.append(f"{where}: {prog.name} {' '.join(argv)}: "
                                     f"{msg[0] if msg else 'exit ' + str(r.returncode)}")
        if inner:
            self.check(where, inner, whole)


def doc_files(root):
    files = [os.path.join(root, f) for f in ("README.md", "CONTRIBUTING.md")]
    files += sorted(glob.glob(os.path.join(root, "docs", "*.md")))
    files += sorted(glob.glob(os.path.join(root, "examples", "slurm", "*.sbatch")))
    return [f for f in files if os.path.isfile(f)]


# The exit status that tells ctest the check was skipped (SKIP_RETURN_CODE in tests/CMakeLists.txt).
SKIPPED = 77


def run(root, build, files):
    progs = find_programs(build)
    missing = [p for p in ("emberrun", "fashion_mnist", "gpt") if p not in progs]
    if missing:
        # A build folder that builds only some targets (the sanitizer builds build the tests
        # alone) has nothing to check the docs against.
        print(f"check_doc_commands: skipped: {', '.join(missing)} not built in {build}")
        sys.exit(SKIPPED)
    checker = Checker(progs)
    for path in files:
        for line, text, whole in commands_in(path):
            for tokens in split_commands(text):
                checker.check(f"{os.path.relpath(path, root)}:{line}", tokens, whole)
    return checker


def self_test(build):
    with tempfile.TemporaryDirectory() as d:
        doc = os.path.join(d, "doc.md")
        with open(doc, "w") as f:
            f.write("```\nemberrun --nproc-per-node 2 build/examples/fashion_mnist --epochs 1\n```\n"
                    "and `build/examples/gpt --no-such-flag 3`, `emberrun --nprocs 2 ./train`,\n"
                    "`build/examples/emberckpt frob x`, `gpt --pp` (an excerpt: fine)\n"
                    "```sh\nbuild/examples/fashion_mnist --epochs many\n```\n")
        c = run(d, build, [doc])
    want = ["gpt has no option '--no-such-flag'", "emberrun has no option '--nprocs'",
            "fashion_mnist --epochs many", "no subcommand 'frob'"]
    missed = [w for w in want if not any(w in p for p in c.problems)]
    if missed or len(c.problems) != len(want) or c.parsed < 2:
        print("self-test failed: problems found:", *c.problems, "expected:", *want, sep="\n  ")
        return 1
    print(f"self-test: the {len(want)} planted mistakes were found, the good command passed")
    return 0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--root", default=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    ap.add_argument("--build", default="build")
    ap.add_argument("--self-test", action="store_true")
    a = ap.parse_args()
    if a.self_test:
        return self_test(a.build)
    c = run(a.root, a.build, doc_files(a.root))
    for p in c.problems:
        print(p)
    print(f"check_doc_commands: {c.checked} commands checked ({c.parsed} parsed by their "
          f"programs), {len(c.problems)} problems")
    return 1 if c.problems else 0


if __name__ == "__main__":
    sys.exit(main())
