"""The recording run: execute the course's notebooks in place on an H200, with COURSE_LIB_RECORD=1, so that their
stored outputs and the records they write in data/ come from one run at one commit.

    python tools/record_notebooks.py            # all seven, notebook 06 first
    python tools/record_notebooks.py 07 05      # some of them, in this order

Notebook 06 goes first by default: its bench writes data/bench_h200.json, which the closing figure of the others
plots. Each notebook is written back as soon as it has run; one that fails is left as it was, its partial outputs
written beside it (NAME.ipynb.failed), and the run stops there. Needs nbclient and ipykernel (the test extra).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
ORDER = ("06", "01", "02", "03", "04", "05", "07")  # 06 first: the others' closing figure reads its bench


def notebook(number: str) -> Path:
    found = sorted(NOTEBOOKS.glob(f"{number}_*.ipynb"))
    if len(found) != 1:
        raise SystemExit(f"error: no single notebook {number}_*.ipynb in {NOTEBOOKS} (found {len(found)})")
    return found[0]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("numbers", nargs="*", default=list(ORDER), help="notebook numbers (default: all, 06 first)")
    parser.add_argument("--timeout", type=int, default=900, help="seconds a cell may run")
    args = parser.parse_args(argv)
    paths = [notebook(n) for n in args.numbers]

    os.environ["COURSE_LIB_RECORD"] = "1"  # inherited by the notebooks' kernels
    import course_lib  # noqa: F401 (decides the mode before numba.cuda is imported)
    from course_lib.device import gpu_available

    if not gpu_available():
        print("error: the recording run measures the GPU: no CUDA GPU here", file=sys.stderr)
        return 2
    from course_lib.measure.records import other_gpu

    other = other_gpu("h200")
    if other is not None:
        print(f"error: the records and the notebooks' prose are the H200's, and this GPU is {other}", file=sys.stderr)
        return 2

    import nbformat
    from nbclient import NotebookClient

    for path in paths:
        nb, start = nbformat.read(path, as_version=4), time.perf_counter()
        client = NotebookClient(nb, timeout=args.timeout, kernel_name="python3",
                                resources={"metadata": {"path": str(NOTEBOOKS)}})
        try:
            client.execute()
        except Exception as error:  # the cell's traceback is in the partial outputs
            nbformat.write(nb, path.with_name(path.name + ".failed"))
            print(f"{path.name} failed after {time.perf_counter() - start:.0f} s: {type(error).__name__}; its "
                  f"partial outputs are in {path.name}.failed", file=sys.stderr)
            return 1
        nbformat.write(nb, path)
        print(f"{path.name}: {time.perf_counter() - start:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
