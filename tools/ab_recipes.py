"""A/B of two code trees of course_lib on the GPU: the decode speed of one recipe, the two trees taking turns.

    python tools/ab_recipes.py BASE NEW [--contexts 64,1000] [--rounds 2] [--recipe five] [--steps 200]
                               [--model random:SmolLM2-135M-Instruct] [--save FILE.json]
    python tools/ab_recipes.py BASE --set kernels/paged_attention.py:ONE_CHUNK_KEYS=384 [--set ...] [...]

BASE and NEW are directories that each hold a course_lib package: a worktree of an earlier commit (`git worktree
add /tmp/base HEAD~1`), or a copy of course_lib/ in a folder of its own. With --set, NEW is a copy of BASE's
course_lib in a temporary folder with module constants given other values (FILE:NAME=VALUE, FILE under course_lib/:
the statement `NAME = ...` at the top level of FILE becomes `NAME = VALUE`): one constant tried without a tree made
by hand. The new value reaches what reads the constant later, when a kernel compiles or the host calls; constants
computed from it at import follow it too, since the copy is imported afresh. Each run is a process of its own, its tree
first on the module path and with the tree's own kernel cache (neither tree loads the other's compiled kernels), and
the trees take turns, BASE, NEW, BASE, NEW, ..., so that a drift of the GPU's clocks or temperature falls on both.
A run decodes `steps` greedy tokens after a random prompt of each length (measure.bench.bench_recipe: the
generator's tokens/s and the GPU time of one replayed step). The tool prints each run as it ends, then each
context's mean tokens/s for each tree and NEW's gain.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

TREES = ("base", "new")


def contexts(text: str) -> list[int]:
    """'64,1000' -> [64, 1000]: prompt lengths, positive integers (as bench's --batch reads its sizes)."""
    from course_lib.__main__ import positive_ints

    try:
        return positive_ints(text, "--contexts", "a prompt length")
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def tree(text: str) -> Path:
    """A directory holding a course_lib package, resolved."""
    path = Path(text).resolve()
    if not (path / "course_lib" / "__init__.py").is_file():
        raise argparse.ArgumentTypeError(f"{text}: no course_lib package in this directory")
    return path


def setting(text: str) -> tuple[str, str, str]:
    """'kernels/paged_attention.py:ONE_CHUNK_KEYS=384' -> (file under course_lib, constant, value: a Python
    expression)."""
    match = re.fullmatch(r"(\w[\w/]*\.py):([A-Za-z_]\w*)=(.+)", text.strip())  # a relative path: no "/" first, no ".."
    if match is None:
        raise argparse.ArgumentTypeError(f"--set {text!r}: FILE:NAME=VALUE, FILE a module under course_lib/")
    try:
        compile(match[3], "--set", "eval")
    except SyntaxError:
        raise argparse.ArgumentTypeError(f"--set {text!r}: {match[3]!r} is not a Python expression") from None
    return match[1], match[2], match[3]


def set_constant(source: str, file: str, name: str, value: str) -> str:
    """source (the text of course_lib/FILE) with its one top-level statement `NAME = ...` (or `NAME: type = ...`,
    however many lines it spans) replaced by `NAME = value`. SystemExit (a clear error) when NAME is not assigned
    alone at the top level exactly once."""
    found = [node for node in ast.parse(source).body
             if (isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == [name])
             or (isinstance(node, ast.AnnAssign) and getattr(node.target, "id", None) == name)]
    if len(found) != 1:
        raise SystemExit(f"error: --set: course_lib/{file} assigns {name} alone at its top level {len(found)} times, "
                         "not once")
    lines = source.splitlines(keepends=True)
    first, last = found[0].lineno - 1, found[0].end_lineno
    was = " ".join(ast.get_source_segment(source, found[0]).split())
    return "".join(lines[:first] + [f"{name} = {value}  # tools/ab_recipes.py --set (was: {was})\n"] + lines[last:])


def edited_files(base: Path, settings: list[tuple[str, str, str]]) -> dict[str, str]:
    """{file under course_lib: its text with every (file, NAME, value) of settings applied (set_constant)}, read from
    base and checked (nothing written). SystemExit (a clear error) for a file that is not there or a NAME that
    set_constant refuses."""
    edited = {}
    for file, name, value in settings:
        path = base / "course_lib" / file
        if not path.is_file():
            raise SystemExit(f"error: --set: no course_lib/{file} in {base}")
        edited[file] = set_constant(edited.get(file, path.read_text()), file, name, value)
    return edited


def variant(base: Path, edited: dict[str, str], dest: Path) -> Path:
    """A copy of base/course_lib in dest (compiled files left out) with the files of `edited` (edited_files) in
    place of base's. -> dest."""
    shutil.copytree(base / "course_lib", dest / "course_lib", ignore=shutil.ignore_patterns("__pycache__"))
    for file, text in edited.items():
        (dest / "course_lib" / file).write_text(text)
    return dest


def summary(runs: list[dict]) -> dict[int, dict[str, float]]:
    """{context: {"base": mean tokens/s, "new": mean tokens/s, "gain": percent}} over runs [{"tree", "rows":
    {context: {"tokens_per_s", ...}}}], each tree's runs averaged; a context that a tree never ran is left out."""
    out = {}
    for context in sorted({int(c) for r in runs for c in r["rows"]}):
        mean = {}
        for name in TREES:
            values = [r["rows"][str(context)]["tokens_per_s"] for r in runs
                      if r["tree"] == name and str(context) in r["rows"]]
            if values:
                mean[name] = sum(values) / len(values)
        if len(mean) == len(TREES):
            out[context] = mean | {"gain": 100 * (mean["new"] / mean["base"] - 1)}
    return out


def run_one(args) -> int:
    """The child: the recipe's decode at each context, with the course_lib found first on the path (its tree's),
    printed as one line of JSON."""
    import course_lib
    from course_lib.__main__ import _bench_model
    from course_lib.device import gpu_available
    from course_lib.measure import bench

    if not Path(course_lib.__file__).resolve().is_relative_to(args.child):
        print(f"error: course_lib was imported from {course_lib.__file__}, not from {args.child}", file=sys.stderr)
        return 2
    if not gpu_available():
        print("error: no CUDA GPU here", file=sys.stderr)
        return 2
    model, bandwidth = _bench_model(args.model), bench.bound_bandwidth()  # (the bound's bandwidth: not compared)
    rows = {}
    for context in args.contexts:
        r = bench.bench_recipe(model, args.recipe, bandwidth, context=context, steps=args.steps)
        rows[str(context)] = {key: r[key] for key in ("tokens_per_s", "gpu_ms_per_token", "kernels_per_token")}
    print(json.dumps({"gpu": bench.gpu_name(), "rows": rows}), flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trees", nargs="*", type=tree, help="BASE and NEW: directories holding a course_lib package")
    parser.add_argument("--set", type=setting, action="append", default=[], metavar="FILE:NAME=VALUE",
                        help="NEW is BASE with this module constant changed (repeatable; then give BASE alone)")
    parser.add_argument("--contexts", type=contexts, default=[64, 1000], help="prompt lengths (default 64,1000)")
    parser.add_argument("--rounds", type=int, default=2, help="runs of each tree, in turns (default 2)")
    parser.add_argument("--recipe", default="five", help="the recipe timed (default five, the default on a GPU)")
    parser.add_argument("--steps", type=int, default=200, help="decode steps timed per context (default 200)")
    parser.add_argument("--model", default="random:SmolLM2-135M-Instruct", help="as for bench (default random "
                        "weights of SmolLM2-135M-Instruct's shapes)")
    parser.add_argument("--save", metavar="FILE.json", help="keep every run and the summary")
    parser.add_argument("--child", type=Path, help=argparse.SUPPRESS)  # a run of one tree (set by the tool)
    args = parser.parse_args(argv)
    if args.child is not None:
        return run_one(args)
    if len(args.trees) != (1 if args.set else 2):
        parser.error("give BASE and --set, or two trees, BASE and NEW" if args.set else "give two trees, BASE and NEW")
    if args.rounds < 1 or args.steps < 1:
        parser.error("--rounds and --steps are positive")
    edited = edited_files(args.trees[0], args.set)  # a setting that does not apply: an error before any run
    from course_lib.device import gpu_available

    if not gpu_available():
        print("error: an A/B of decode speed measures the GPU: no CUDA GPU here", file=sys.stderr)
        return 2

    runs = []
    with tempfile.TemporaryDirectory() as caches:
        trees = args.trees if not args.set else [args.trees[0], variant(args.trees[0], edited,
                                                                        Path(caches).resolve() / "new_tree")]
        for round_ in range(1, args.rounds + 1):
            for name, path in zip(TREES, trees, strict=True):
                env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(path), os.environ.get("PYTHONPATH", "")]),
                           COURSE_LIB_KERNEL_CACHE=os.path.join(caches, name))
                command = [sys.executable, __file__, "--child", str(path), "--contexts",
                           ",".join(map(str, args.contexts)), "--recipe", args.recipe, "--steps", str(args.steps),
                           "--model", args.model]
                done = subprocess.run(command, env=env, cwd=caches, capture_output=True, text=True)
                lines = done.stdout.strip().splitlines()
                if done.returncode != 0 or not lines:
                    print(f"error: the {name} run ({path}) failed:\n{done.stderr[-3000:]}", file=sys.stderr)
                    return 1
                runs.append({"tree": name, "round": round_} | json.loads(lines[-1]))
                print(f"{name} (round {round_}): " + ", ".join(
                    f"{c} positions {r['tokens_per_s']:,.1f} tokens/s ({r['gpu_ms_per_token']:.3f} GPU ms a step)"
                    for c, r in runs[-1]["rows"].items()), flush=True)
    table = summary(runs)
    for context, row in table.items():
        print(f"{context:6d} positions: base {row['base']:,.1f}, new {row['new']:,.1f} tokens/s ({row['gain']:+.1f}%)")
    if args.save:
        with open(args.save, "w") as f:
            json.dump({"recipe": args.recipe, "model": args.model, "steps": args.steps, "gpu": runs[0]["gpu"],
                       "trees": {"base": str(trees[0]), "new": str(trees[1]) if not args.set else
                                 f"a copy of {trees[0]} with new_settings"},
                       "new_settings": [f"{file}:{name}={value}" for file, name, value in args.set], "runs": runs,
                       "summary": {str(c): row for c, row in table.items()}}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
