"""The bench command: refused plainly without a GPU (simulator timings mean nothing); its table, from the results
recorded on the H200 (data/06_launches_h200.json), shows every recipe and peer. On a GPU notebook 06 runs it."""

import json

import pytest

from course_lib import __main__ as cli
from course_lib import gpu_available
from course_lib.measure import records
from course_lib.measure.bench import format_bench
from course_lib.recipes import RECIPES

RECORDED = records.path("06_launches_h200.json")


def test_recorded_results_format_as_a_table():
    result = json.loads(RECORDED.read_text())["bench"]
    lines = format_bench(result).splitlines()
    assert [row["recipe"] for row in result["rows"]] == list(RECIPES)  # the recorded run has every recipe
    for row in result["rows"]:
        [line] = [x for x in lines if x.startswith(row["recipe"] + " ")]
        assert f"{row['tokens_per_s']:.1f}" in line and line.endswith("yes")
    for mode in result["peers"]:
        assert any(x.startswith(f"torch {mode} ") for x in lines)


@pytest.mark.skipif(gpu_available(), reason="with a GPU bench runs: notebook 06")
def test_bench_without_a_gpu_is_a_clear_error(capsys):
    assert cli.main(["bench", "--model", "tiny"]) == 2
    assert "no CUDA GPU" in capsys.readouterr().err


def test_bench_batch_sizes_are_checked(capsys):
    assert cli.main(["bench", "--batch", "1,x,8"]) == 2
    assert "'x' is not a batch size" in capsys.readouterr().err
    assert cli.main(["bench", "--batch", ""]) == 2  # not the same as no --batch
    assert "'' is not a batch size" in capsys.readouterr().err
    assert cli.main(["bench", "--steps", "0"]) == 2
    assert "--steps must be >= 1, got 0" in capsys.readouterr().err


def test_bench_random_weights_of_known_shapes():
    """bench --model random:NAME: random weights of a known config's shapes (here SmolLM2's, cut to 2 layers to
    stay small, through the same function); an unknown name is a clear error."""
    import dataclasses

    from course_lib.model.config import SMOLLM2_135M
    from course_lib.model.tiny import random_model

    model = random_model(dataclasses.replace(SMOLLM2_135M, n_layers=2))
    assert model.weights.embed.shape == (49152, 576) and len(model.weights.layers) == 2
    assert model.weights.layers[0].w_gate.shape == (576, 1536)
    with pytest.raises(ValueError, match="Llama-3.2-1B"):
        cli._bench_model("random:gpt-5")


def test_microseconds_per_call_from_the_timed_bandwidth(monkeypatch):
    """us_per_call converts _gb_per_s's GB/s of the bytes a call reads back to its time: 2 MB at 1,000 GB/s is 2 us
    (notebook 05 once wrote the conversion out by hand, a factor 1e6 off)."""
    from course_lib.measure import bench

    monkeypatch.setattr(bench, "_gb_per_s", lambda run, buffers, nbytes, repeats, graph=False: 1000.0)
    assert bench.us_per_call(None, [], 2_000_000, 20, graph=True) == pytest.approx(2.0)
    monkeypatch.setattr(bench, "_gb_per_s", lambda run, buffers, nbytes, repeats, graph=False: 250.0)
    assert bench.us_per_call(None, [], 2_000_000, 20) == pytest.approx(8.0)


@pytest.mark.gpu
@pytest.mark.skipif(not gpu_available(), reason="bench measures the GPU")
def test_bench_command_on_the_gpu(tmp_path, capsys):
    """The command itself on a GPU: random SmolLM2 weights, two recipes, a few steps; the saved rows are the table's,
    each with a positive speed and the reference's text."""
    saved = tmp_path / "bench.json"
    assert cli.main(["bench", "--model", "random:SmolLM2-135M-Instruct", "--recipes", "graph,fused", "--steps", "16",
                     "--context", "16", "--no-peers", "--save", str(saved)]) == 0
    result, table = json.loads(saved.read_text()), capsys.readouterr().out
    assert [row["recipe"] for row in result["rows"]] == ["graph", "fused"]
    for row in result["rows"]:
        assert row["tokens_per_s"] > 0 and row["gpu_ms_per_token"] > 0 and row["same_text"]
        assert f"{row['tokens_per_s']:.1f}" in table
    assert 0 < result["bound_tokens_per_s"]


def test_batch_step_profile_names_every_kernel_of_the_step(tiny):
    """batch_step_profile runs the bucket's recorded step launch by launch (gpu.plan.Recorded.timeline): every
    kernel of the step is counted once per launch, and the table names each with its share. In the simulator the
    times are the host's (only the names and counts are checked)."""
    from collections import Counter

    from course_lib.batch import CudaBatch
    from course_lib.gpu.plan import BatchPlan
    from course_lib.measure.bench import batch_step_profile, format_batch_profile

    profile = batch_step_profile(tiny, 1, context=2)
    runner = CudaBatch(tiny, pages=1, max_len=10)  # the same model's step: the same kernels, recorded (not run)
    names = Counter(BatchPlan(runner.backend, 1, runner.pad_slot).names)
    assert {name: count for name, count, _ in profile["kernels"]} == names and profile["rows"] == 1
    table = format_batch_profile(profile)
    assert all(name in table for name in names) and "1 sequences (1 rows)" in table


def test_bench_batch_times_the_periods_between_step_starts(monkeypatch):
    """bench_batch's clock: the last `steps` periods between decode step starts, each one step in steady state;
    neither the first steps (the bucket's graph captured), nor the last step's drain, the sequences' finishing or
    generate_batch's release of the runner's memory. A fake generate_batch on a fake clock: 7 slow first periods
    (50 ms), then 2 ms each, and 41 ms between the last step's start and the return."""
    from types import SimpleNamespace

    from course_lib import batch
    from course_lib.measure import bench

    clock = [0.0]

    def fake_generate_batch(model, prompts, *, max_new_tokens, on_step, stats, **kw):
        stats.update(queue=[], wait=[])
        for step in range(max_new_tokens - 1):  # the first token comes from the prefill
            on_step(list(range(len(prompts))))
            stats["queue"].append(0.0005)
            stats["wait"].append(0.001 if step >= 7 else 0.03)
            clock[0] += 0.002 if step >= 7 else 0.05
        clock[0] += 0.041  # the last step drained, the sequences finished, the runner released
        return [SimpleNamespace(token_ids=[7] * max_new_tokens) for _ in prompts]

    monkeypatch.setattr(batch, "generate_batch", fake_generate_batch)
    monkeypatch.setattr(bench, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    model = SimpleNamespace(config=SimpleNamespace(vocab_size=100))
    rows = bench.bench_batch(model, [1, 4], steps=16)
    for row, batch_size in zip(rows, [1, 4], strict=True):
        assert row["batch"] == batch_size and row["same_text"]
        assert row["ms_per_step"] == pytest.approx(2.0) and row["tokens_per_s"] == pytest.approx(batch_size / 0.002)
        assert row["queue_ms"] == pytest.approx(0.5) and row["wait_ms"] == pytest.approx(1.0)
