"""The recurring figure of the notebooks (course_lib.measure.progress), on the recorded bench run in data/; and the
tools that make those runs (tools/record_notebooks.py, tools/ab_recipes.py, tools/in_graph_costs.py)."""

import importlib.util
import json
import os
from pathlib import Path

import matplotlib
import numpy as np
import pytest

from course_lib.measure import progress
from course_lib.model.safetensors_io import bf16_to_f32

matplotlib.use("Agg")
ROOT = Path(__file__).resolve().parents[1]


def load_tool(name: str):
    """The module tools/<name>.py (the tools are scripts, not a package)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


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
    import course_lib.device
    import course_lib.measure.bench

    tool = load_tool("record_notebooks")
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


def test_the_ab_tool_averages_each_tree_and_refuses_bad_input(monkeypatch, capsys, tmp_path):
    """tools/ab_recipes.py: the summary is each tree's mean tokens/s and NEW's gain at every context both trees ran;
    a directory without course_lib, a single tree, bad prompt lengths or no GPU are each a clear error before any
    run."""
    import course_lib.device

    root, tool = ROOT, load_tool("ab_recipes")

    def run(name, **tokens_per_s):
        rows = {c: {"tokens_per_s": t, "gpu_ms_per_token": 1.0} for c, t in tokens_per_s.items()}
        return {"tree": name, "rows": rows}

    runs = [run("base", **{"64": 100.0, "1000": 50.0}), run("new", **{"64": 110.0, "1000": 60.0, "4000": 9.0}),
            run("base", **{"64": 102.0}), run("new", **{"64": 112.0})]
    table = tool.summary(runs)
    assert list(table) == [64, 1000]  # 4000: the new tree alone
    assert table[64]["base"] == pytest.approx(101.0) and table[64]["new"] == pytest.approx(111.0)
    assert table[64]["gain"] == pytest.approx(100 * (111 / 101 - 1))
    assert table[1000]["gain"] == pytest.approx(20.0)

    assert tool.contexts("64, 1000") == [64, 1000]
    for bad in ("64,-1", "x", "64,,1000"):
        with pytest.raises(Exception, match="positive integers"):
            tool.contexts(bad)
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit) as stop:
        tool.main([str(root), str(tmp_path / "empty")])
    assert stop.value.code == 2 and "no course_lib package" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        tool.main([str(root)])
    assert "give two trees" in capsys.readouterr().err
    monkeypatch.setattr(course_lib.device, "gpu_available", lambda: False)
    assert tool.main([str(root), str(root)]) == 2 and "no CUDA GPU here" in capsys.readouterr().err
    installed = Path(course_lib.device.__file__).resolve().parents[1]  # the tree this course_lib comes from
    assert tool.main(["--child", str(installed)]) == 2 and "no CUDA GPU here" in capsys.readouterr().err  # a run
    assert tool.main(["--child", str(tmp_path)]) == 2 and "not from" in capsys.readouterr().err  # another tree's

    # the turns, with each run's process faked: BASE, NEW, BASE, NEW, each tree first on the path of its own runs and
    # with a kernel cache of its own, every run kept in the saved file
    other = tmp_path / "other"
    (other / "course_lib").mkdir(parents=True)
    (other / "course_lib" / "__init__.py").write_text("")
    calls = []

    def fake_run(command, env, cwd, capture_output, text):
        calls.append((command[command.index("--child") + 1], env["PYTHONPATH"], env["COURSE_LIB_KERNEL_CACHE"]))
        speed = 100.0 if command[command.index("--child") + 1] == str(root) else 105.0
        rows = {"64": {"tokens_per_s": speed, "gpu_ms_per_token": 0.5, "kernels_per_token": 152}}
        return tool.subprocess.CompletedProcess(command, 0, "compiling...\n" + json.dumps({"gpu": "G", "rows": rows}),
                                                "")

    monkeypatch.setattr(course_lib.device, "gpu_available", lambda: True)
    monkeypatch.setattr(tool.subprocess, "run", fake_run)
    saved = tmp_path / "ab.json"
    assert tool.main([str(root), str(other), "--contexts", "64", "--save", str(saved)]) == 0
    assert [c[0] for c in calls] == [str(root), str(other)] * 2
    assert all(path.startswith(tree + os.pathsep) for tree, path, _ in calls)
    assert calls[0][2] == calls[2][2] != calls[1][2] == calls[3][2]
    assert "+5.0%" in capsys.readouterr().out
    record = json.loads(saved.read_text())
    assert [r["tree"] for r in record["runs"]] == ["base", "new", "base", "new"]
    assert record["summary"]["64"]["gain"] == pytest.approx(5.0)

    # with --set, NEW is a copy of BASE with the constant changed, there while NEW's runs read it
    seen = []
    monkeypatch.setattr(tool.subprocess, "run", lambda command, **kw: (
        seen.append((Path(command[command.index("--child") + 1]) / "course_lib" / "kernels" / "sampling.py")
                    .read_text()), fake_run(command, **kw))[1])
    calls.clear()
    assert tool.main([str(root), "--set", "kernels/sampling.py:SLICES=8", "--contexts", "64", "--save",
                      str(saved)]) == 0
    assert [c[0] == str(root) for c in calls] == [True, False] * 2
    assert ["\nSLICES = 8  #" in text for text in seen] == [False, True] * 2
    assert json.loads(saved.read_text())["new_settings"] == ["kernels/sampling.py:SLICES=8"]


def test_the_ab_tool_sets_a_constant_in_a_copy_of_base(capsys, tmp_path):
    """tools/ab_recipes.py --set: NEW is a copy of BASE's course_lib in which the one top-level assignment of each
    named constant takes the value given, every other line as it was; a file or a name that is not there, a value
    that is not an expression, or --set beside two trees are clear errors."""
    tool = load_tool("ab_recipes")
    sets = [tool.setting("kernels/paged_attention.py:ONE_CHUNK_KEYS=384"), tool.setting("kernels/sampling.py:SLICES=8")]
    new = tool.variant(ROOT, tool.edited_files(ROOT, sets), tmp_path / "new")
    for file, name, value in sets:
        before = (ROOT / "course_lib" / file).read_text().splitlines()
        after = (new / "course_lib" / file).read_text().splitlines()
        changed = [(b, a) for b, a in zip(before, after, strict=True) if a != b]
        assert len(changed) == 1 and changed[0][1].startswith(f"{name} = {value}  # tools/ab_recipes.py --set (was: ")
        assert changed[0][0].startswith(f"{name} = ")
    unchanged = "kernels/row_dot.py"
    assert (new / "course_lib" / unchanged).read_text() == (ROOT / "course_lib" / unchanged).read_text()
    assert not list((new / "course_lib").rglob("__pycache__"))
    source = ('"""A module.\n\nN = 1 in its docstring\n"""\nN = (1,\n     2)  # two lines\nM = K = 3\n\n\n'
              'def f():\n    N = 4\n')
    edited = tool.set_constant(source, "m.py", "N", "5")  # the whole statement, not the docstring, not f's N
    assert edited.splitlines()[4:6] == ["N = 5  # tools/ab_recipes.py --set (was: N = (1, 2))", "M = K = 3"]
    assert "N = 1 in its docstring" in edited and "    N = 4" in edited
    with pytest.raises(SystemExit, match="alone at its top level 0 times"):
        tool.set_constant(source, "m.py", "K", "5")  # chained: not NAME alone
    for bad, message in (("kernels/nowhere.py:X=1", "no course_lib/kernels/nowhere.py"),
                         ("kernels/paged_attention.py:NOT_A_CONSTANT=1", "0 times, not once"),
                         ("kernels/paged_attention.py:ONE_CHUNK=1", "0 times")):  # a prefix of a name is no name
        with pytest.raises(SystemExit, match=message):
            tool.edited_files(ROOT, [tool.setting(bad)])
    assert list(tmp_path.iterdir()) == [tmp_path / "new"]  # the settings checked: nothing written
    for bad in ("paged_attention:X=1", "kernels/paged_attention.py:X=", "kernels/paged_attention.py:X=1 +",
                f"{ROOT}/course_lib/kernels/sampling.py:SLICES=8"):  # an absolute path would edit the checkout
        with pytest.raises(Exception, match="--set"):
            tool.setting(bad)
    with pytest.raises(SystemExit):
        tool.main([str(ROOT), str(ROOT), "--set", "kernels/sampling.py:SLICES=8"])
    assert "give BASE and --set" in capsys.readouterr().err


def test_the_in_graph_costs_tool_refuses_bad_input_and_computes_each_kernels_cost(monkeypatch, capsys):
    """tools/in_graph_costs.py: an unknown recipe, one without a step graph, a prompt length below 1 or no GPU are
    each a clear error before any model is built; each kernel's cost per launch is the change of the step's time with
    its launches doubled, removed or emptied, divided by their count (here with a step whose time is known)."""
    import course_lib.device

    tool = load_tool("in_graph_costs")
    for argv, message in ((["--recipe", "nope"], "unknown recipe"), (["--recipe", "plan"], "replays no step graph"),
                          (["--context", "0"], "positive prompt length")):
        with pytest.raises(SystemExit) as stop:
            tool.main(argv)
        assert stop.value.code == 2 and message in capsys.readouterr().err
    monkeypatch.setattr(course_lib.device, "gpu_available", lambda: False)
    assert tool.main([]) == 2 and "no CUDA GPU here" in capsys.readouterr().err

    cost = {"qkv": 2.0, "logits": 5.0, "empty": 0.5}  # µs of a launch; the step's fixed part: 10 µs

    class Plan:
        recorded = [(name, name, 1, 32, ()) for name in ("qkv", "logits", "qkv")]
        names = [name for name, *_ in recorded]

        class rt:
            @staticmethod
            def prepared(kernel, grid, block, args):
                return kernel if isinstance(kernel, str) else "empty"  # the tool's own empty kernel

    monkeypatch.setattr(tool, "time_step", lambda plan, launches, context: 10 + sum(cost[go] for go in launches))
    out = tool.kernel_costs(Plan(), 64)
    assert out["step_us"] == out["step_us_again"] == 19 and out["every_kernel_emptied_us"] == 11.5
    assert out["per_launch_us"]["qkv"] == {"count": 2, "doubled": 2.0, "removed": 2.0, "emptied": 1.5}
    assert out["per_launch_us"]["logits"] == {"count": 1, "doubled": 5.0, "removed": 5.0, "emptied": 4.5}


def run_stand_in(feeds_x, advances, before="nothing", logits=(0.0,)):
    """One block of tools/in_graph_costs.py's stand_in on poisoned outputs, the position at 6 and a page table of two
    pages of 4 (3, 1), the settings (0.5, 0.25) and (40, 2): {buffer: its contents after}, x as its one row."""
    from checks import dev, poisoned

    from course_lib.kernels import sampling

    table = np.random.default_rng(7).integers(0, 0x7F80, (5, 40), dtype=np.uint16)  # finite bf16 bits
    out = {"token": poisoned(1, np.int32), "position": dev(np.array([6], np.int32)), "slot": poisoned(1, np.int32),
           "history": poisoned(9, np.int32), "x": poisoned((1, 40)), "part_v": poisoned(1),
           "part_i": poisoned(1, np.int32), "part_nan": poisoned(1, np.int32), "counters": dev(np.zeros(1, np.int32))}
    load_tool("in_graph_costs").stand_in(feeds_x, advances, sampling.embed_into(table), before)[1, 32](
        dev(np.array(logits, np.float32)), dev(np.zeros(5, np.uint64)), dev(np.array([0.5, 0.25])),
        dev(np.array([40, 2], np.int64)), out["token"], out["position"], out["slot"], dev(np.array([3, 1], np.int32)),
        4, out["history"], dev(table), out["x"], out["part_v"], out["part_i"], out["part_nan"], out["counters"])
    got = {name: array.copy_to_host() for name, array in out.items()}
    return got | {"x": got["x"][0], "rows": bf16_to_f32(table)}


@pytest.mark.parametrize("feeds_x,advances", [(False, False), (True, False), (False, True), (True, True)])
def test_the_in_graph_costs_tools_sampler_stand_ins_write_what_they_say(feeds_x, advances):
    """tools/in_graph_costs.py --sampler's stand-ins for sample_next: x = token 0's embedding row when feeds_x, the
    token, position, slot and history of token 0 when advances, and nothing else (every output poisoned first)."""
    from checks import poison

    got = run_stand_in(feeds_x, advances)
    assert np.array_equal(got["x"], got["rows"][0]) if feeds_x else np.isnan(got["x"]).all()
    want = (0, 7, 1 * 4 + 3, 0) if advances else (poison(np.int32), 6, poison(np.int32), poison(np.int32))
    # position 7: page 1 of the table (physical page 1), row 3
    assert (got["token"][0], got["position"][0], got["slot"][0], got["history"][7]) == want


@pytest.mark.parametrize("before", ["settings", "counter", "greedy"])
def test_the_in_graph_costs_tools_working_stand_ins_do_what_they_say(before):
    """tools/in_graph_costs.py --sampler's stand-ins that do one part of the sampler's work before feeding the next
    step: read its settings into part_v[0] and part_i[0], count on counters[0] (back to 0 after), or choose the
    greedy token of the logits given (the lowest index of the largest), as sample_next does without its draw."""
    from course_lib.kernels import sampling

    with pytest.raises(ValueError, match="before 'draw'"):
        load_tool("in_graph_costs").stand_in(True, True, sampling.embed_into(np.zeros((1, 8), np.uint16)), "draw")
    got = run_stand_in(True, True, before, logits=(1.0, 3.0, 3.0, -2.0, 0.0))  # a tie: greedy takes index 1
    chosen = 1 if before == "greedy" else 0
    assert np.array_equal(got["x"], got["rows"][chosen])
    assert (got["token"][0], got["position"][0], got["slot"][0], got["history"][7]) == (chosen, 7, 1 * 4 + 3, chosen)
    assert got["counters"][0] == 0
    if before == "settings":
        assert (got["part_v"][0], got["part_i"][0]) == (0.75, 42)
    if before == "greedy":
        assert (got["part_v"][0], got["part_i"][0], got["part_nan"][0]) == (3.0, 1, 0)
