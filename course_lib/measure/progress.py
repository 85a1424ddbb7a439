"""The course's recurring figure, "where the time goes now": the recipes built so far, from one recorded `bench` run
on the H200 (data/bench_h200.json, written by `python -m course_lib bench --save`), one more bar per notebook.

    progress.plot(upto="04")    # the recipes of notebooks 01 to 04

Left: tokens per second of each recipe (log scale) against the bandwidth bound of the same run and the fastest
PyTorch peer. Right: each token's wall time split into the GPU's kernels and the rest, when the GPU waits for the
host: the share that says whether a faster kernel can make a faster token.
"""

from __future__ import annotations

import json
from pathlib import Path

from . import records

DATA = records.path("bench_h200.json")


def first_notebook(row: dict) -> str:
    """The notebook that builds a recipe ("03, 04" -> "03")."""
    return min(n.strip() for n in row["notebook"].split(","))


def recipes_upto(upto: str, skip: tuple[str, ...] = (), path: Path = DATA) -> tuple[dict, list[dict]]:
    """(the recorded run, its recipe rows built in notebooks <= upto, in the bench's order, without `skip`)."""
    run = json.loads(Path(path).read_text())
    rows = [r for r in run["rows"] if first_notebook(r) <= upto and r["recipe"] not in skip]
    if not rows:
        raise ValueError(f"no recipe of the recorded run belongs to notebooks up to {upto!r}")
    return run, rows


def waiting_share(row: dict) -> float:
    """% of a recipe's token wall time the GPU waits for the host (not running kernels)."""
    return 100 * (1 - min(row["gpu_ms_per_token"], row["ms_per_token"]) / row["ms_per_token"])


def plot(upto: str, skip: tuple[str, ...] = (), path: Path = DATA):
    """Draw the figure for the notebooks up to `upto` (e.g. "04"); -> the matplotlib figure."""
    import matplotlib.pyplot as plt

    run, rows = recipes_upto(upto, skip, path)
    names = [r["recipe"] for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 0.5 * len(rows) + 2.4), sharey=True)
    tps = [r["tokens_per_s"] for r in rows]
    left.barh(names, tps, color="tab:blue")
    for i, v in enumerate(tps):
        left.text(v * 1.1, i, f"{v:,.0f}", va="center", fontsize=8)
    left.axvline(run["bound_tokens_per_s"], color="k", ls="--", lw=1,
                 label=f"bandwidth bound {run['bound_tokens_per_s']:,.0f}")
    peers = run.get("peers") or {}  # {name: tokens/s}, random weights of the same shapes
    if peers:
        best = max(peers, key=peers.get)
        left.axvline(peers[best], color="tab:red", ls=":", lw=1, label=f"PyTorch {best} {peers[best]:,.0f}")
    left.set_xscale("log")
    left.set_xlabel("tokens per second (log scale)")
    left.invert_yaxis()
    left.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.1 - 0.6 / (len(rows) + 1)), ncol=2)
    gpu = [min(r["gpu_ms_per_token"], r["ms_per_token"]) for r in rows]
    rest = [max(r["ms_per_token"] - g, 0.0) for r, g in zip(rows, gpu, strict=True)]
    share = [100 - waiting_share(r) for r in rows]
    right.barh(names, share, color="tab:green", label="GPU running kernels")
    right.barh(names, [100 - s for s in share], left=share, color="lightgray", label="GPU waiting for the host")
    for i, (r, g, o) in enumerate(zip(rows, gpu, rest, strict=True)):
        right.text(2, i, f"{r['ms_per_token']:.2f} ms/token: {g:.2f} GPU + {o:.2f} waiting, "
                         f"{r['kernels_per_token']} kernels", va="center", fontsize=8)
    right.set_xlim(0, 100)
    right.set_xlabel("share of each token's wall time (%)")
    right.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.1 - 0.6 / (len(rows) + 1)), ncol=2)
    fig.suptitle(f"Where the time goes now: SmolLM2-135M, bf16, {run['gpu']}, one bench run of {run['date']} "
                 "(recorded)", fontsize=10)
    fig.tight_layout()
    return fig
