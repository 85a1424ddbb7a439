"""The recorded H200 results (`data/*.json`) that the notebooks plot when no GPU is present.

A notebook's measuring cell keeps its results with `save(name, result)`. It writes `data/<name>` only in the
maintainers' recording run (COURSE_LIB_RECORD=1, the run whose outputs the committed notebooks carry): a learner's
GPU, or the GPU suite running the notebooks under pytest, measures and shows its own numbers without replacing the
course's recorded ones.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

DIR = Path(__file__).resolve().parents[2] / "data"


def path(name: str) -> Path:
    """data/<name>."""
    return DIR / name


def load(name: str) -> dict:
    """The recorded result data/<name>."""
    return json.loads(path(name).read_text())


def recording() -> bool:
    """Whether this process records the course's results (COURSE_LIB_RECORD=1)."""
    return os.environ.get("COURSE_LIB_RECORD") == "1"


CARDS = ("h100", "h200")  # the GPUs a record's name may end with (`bench_h200.json`): where its numbers were measured


def save(name: str, result: dict) -> str:
    """Write result to data/<name> when recording; -> a line saying what happened, for the notebook's output. A name
    that ends with a card (`_h200.json`) is refused on another GPU: the prose beside it says where it was measured."""
    if not recording():
        return f"not saved to data/{name}: this run's numbers stay here (COURSE_LIB_RECORD=1 records them)"
    card = next((c for c in CARDS if name.endswith(f"_{c}.json")), None)
    other = other_gpu(card) if card is not None else None
    if other is not None:
        raise ValueError(f"data/{name} holds numbers measured on an {card.upper()}, and this GPU is {other}: record "
                         "them on that card, or under a name that says which card ran them")
    DIR.mkdir(exist_ok=True)
    path(name).write_text(json.dumps(result, indent=1))
    return f"saved to data/{name}"


def other_gpu(card: str) -> str | None:
    """None on a GPU of `card` (one of CARDS), else this GPU's name: a record of that card cannot be made here."""
    gpu = _gpu_name()
    return None if card in gpu.lower().replace(" ", "") else gpu


def _gpu_name() -> str:
    from .bench import gpu_name  # (bench imports the kernels: not needed to read the records)

    return gpu_name()
