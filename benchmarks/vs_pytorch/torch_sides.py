"""The PyTorch columns of the side-by-side benchmarks (run.py, run_gpt.py): each interpreter
given with --torch-python (Debian's /usr/bin/python3, torch 1.13, by default), eager, and with
--torch-compile also compiled where its torch has torch.compile (PyTorch 2)."""
import subprocess
import sys

DEBIAN = "/usr/bin/python3"


class Side:
    """One PyTorch column: an interpreter, its torch version, eager or torch.compile."""

    def __init__(self, python, version, compiled):
        self.python, self.version, self.compiled = python, version, compiled
        self.name = f"PyTorch {version.split('+')[0]}" + (" compile" if compiled else "")

    @property
    def is_1x(self):
        return self.version.startswith("1.")


def add_arguments(ap, compile_warmup):
    ap.add_argument("--torch-python", action="append", default=[],
                    help="an interpreter whose torch runs the PyTorch side (repeatable: a column "
                         f"each; default Debian's {DEBIAN}; benchmarks/vs_pytorch/"
                         "setup_torch.sh makes a current one)")
    ap.add_argument("--torch-compile", action="store_true",
                    help="also each PyTorch 2's torch.compile, a column each; its first "
                         f"{compile_warmup} steps (compilation) are not timed")


def sides(args):
    """A Side per --torch-python (Debian's when none), each followed by its compiled twin with
    --torch-compile and PyTorch 2."""
    out = []
    for python in args.torch_python or [DEBIAN]:
        version = subprocess.run([python, "-c", "import torch; print(torch.__version__)"],
                                 capture_output=True, text=True).stdout.strip()
        if not version:
            sys.exit(f"{python} cannot import torch")
        out.append(Side(python, version, False))
        if args.torch_compile and not out[-1].is_1x:
            out.append(Side(python, version, True))
    return out
