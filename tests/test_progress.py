"""The recurring figure of the notebooks (course_lib.measure.progress), on the recorded bench run in data/."""

import matplotlib
import pytest

from course_lib.measure import progress

matplotlib.use("Agg")


def test_each_notebook_adds_its_recipes():
    _, rows = progress.recipes_upto("01")
    assert [r["recipe"] for r in rows] == ["baseline"]
    _, rows = progress.recipes_upto("03")
    assert [r["recipe"] for r in rows] == ["baseline", "narrow", "paged"]  # paged: notebooks "03, 04"
    _, rows = progress.recipes_upto("06", skip=("megakernel",))
    assert "megakernel" not in [r["recipe"] for r in rows] and "graph" in [r["recipe"] for r in rows]


def test_no_recipe_is_a_clear_error():
    with pytest.raises(ValueError, match="no recipe"):
        progress.recipes_upto("00")


def test_the_figure_draws_a_bar_per_recipe():
    import matplotlib.pyplot as plt

    fig = progress.plot("04")
    left, right = fig.axes
    assert len(left.patches) == 3 and len(right.patches) == 2 * 3  # tokens/s; GPU share + waiting share
    shares = [p.get_width() for p in right.patches]
    assert all(0 <= s <= 100 for s in shares)
    plt.close(fig)


def test_results_are_recorded_only_in_the_recording_run(tmp_path, monkeypatch):
    """records.save writes data/<name> only with COURSE_LIB_RECORD=1: a learner's GPU or the GPU suite keeps its
    numbers in the notebook and leaves the course's recorded H200 results as they are."""
    from course_lib.measure import records

    monkeypatch.setattr(records, "DIR", tmp_path)
    monkeypatch.delenv("COURSE_LIB_RECORD", raising=False)
    assert "not saved" in records.save("x.json", {"a": 1}) and not (tmp_path / "x.json").exists()
    monkeypatch.setenv("COURSE_LIB_RECORD", "1")
    assert records.save("x.json", {"a": 1}) == "saved to data/x.json"
    assert records.load("x.json") == {"a": 1}
    monkeypatch.setattr(records, "_gpu_name", lambda: "NVIDIA H100 80GB HBM3")  # a record named for another card
    with pytest.raises(ValueError, match="measured on an H200, and this GPU is NVIDIA H100"):
        records.save("x_h200.json", {"a": 2})
    assert not (tmp_path / "x_h200.json").exists()
    assert records.save("x_h100.json", {"a": 2}) == "saved to data/x_h100.json"


def test_the_recording_tool_refuses_what_it_cannot_record(monkeypatch, capsys):
    """tools/record_notebooks.py: an unknown notebook number is a clear error before anything runs; without a GPU, or
    on a GPU other than the H200 whose numbers the records and the prose quote, it records nothing and says why."""
    import importlib.util
    from pathlib import Path

    import course_lib.device
    import course_lib.measure.bench

    path = Path(__file__).resolve().parents[1] / "tools" / "record_notebooks.py"
    spec = importlib.util.spec_from_file_location("record_notebooks", path)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    assert tool.ORDER[0] == "06" and sorted(tool.ORDER) == [f"0{i}" for i in range(1, 8)]
    assert all(tool.notebook(n).name.startswith(n) for n in tool.ORDER)
    with pytest.raises(SystemExit, match="no single notebook 09_"):
        tool.main(["09"])
    monkeypatch.setattr(tool.os, "environ", dict(tool.os.environ))  # the tool sets COURSE_LIB_RECORD for its run
    monkeypatch.setattr(course_lib.device, "gpu_available", lambda: False)
    assert tool.main(["07"]) == 2 and "no CUDA GPU here" in capsys.readouterr().err
    monkeypatch.setattr(course_lib.device, "gpu_available", lambda: True)
    monkeypatch.setattr(course_lib.measure.bench, "gpu_name", lambda: "NVIDIA H100 80GB HBM3")
    assert tool.main(["07"]) == 2 and "this GPU is NVIDIA H100 80GB HBM3" in capsys.readouterr().err
