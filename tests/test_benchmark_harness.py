"""benchmarks/harness.py: the step timer, peak memory, throughput arithmetic, table cells, the results JSON and the
child-process helpers, with exact expected values (the CPU paths; the GPU ones run in the GPU benchmarks)."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def harness():
    spec = importlib.util.spec_from_file_location("benchmark_harness", REPO / "benchmarks" / "harness.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


def test_step_timer_excludes_the_warmup_and_reports_mean_median_and_rate(harness, monkeypatch):
    clock = iter([10.0, 11.0, 14.0, 15.0])  # perf_counter at: warm-up done, then the end of each timed step
    monkeypatch.setattr(harness.time, "perf_counter", lambda: next(clock))
    timer = harness.StepTimer(warmup=2, steps=3, cuda=False)
    for done in range(6):  # 0 before the first step, then after each of the 2 + 3
        timer.after_step(done)
    assert timer.elapsed_s == 5.0
    assert timer.step_times_s == [1.0, 3.0, 1.0]
    assert timer.step_s == 5.0 / 3 and timer.median_step_s == 1.0
    assert timer.rate(8 * 4096) == 8 * 4096 * 3 / 5.0  # tokens/s of 8 x 4096 tokens per step
    timer.after_step(6)  # steps after the timed ones (e.g. profiled) change nothing
    assert timer.elapsed_s == 5.0


def test_step_timer_starts_before_the_first_step_without_warmup(harness):
    calls = []
    timer = harness.run_steps(calls.append, ["a", "b"], warmup=0, cuda=False)
    assert calls == ["a", "b"] and timer.steps == 2 and len(timer.step_times_s) == 2


def test_step_timer_refuses_numbers_before_its_last_step(harness):
    timer = harness.StepTimer(warmup=1, steps=2, cuda=False)
    timer.after_step(1)
    timer.after_step(2)
    with pytest.raises(RuntimeError, match=r"1 of 2 timed steps \(after 1 warm-up steps\) ran"):
        _ = timer.step_s


def test_cpu_peak_memory_is_the_resident_peak_in_bytes(harness, monkeypatch):
    import resource

    usage = type("Usage", (), {"ru_maxrss": 2_000_000})()  # KiB on Linux
    monkeypatch.setattr(resource, "getrusage", lambda who: usage)
    monkeypatch.setattr(harness.sys, "platform", "linux")
    assert harness.peak_memory_bytes(cuda=False) == 2_048_000_000.0
    assert harness.peak_memory_gb(cuda=False) == 2.048
    monkeypatch.setattr(harness.sys, "platform", "darwin")  # bytes there
    assert harness.peak_memory_bytes(cuda=False) == 2_000_000.0


def test_tflops_and_mfu_against_989(harness):
    assert harness.PEAK_TFLOPS == 989.0
    # 100,000 tokens/s x 9.89 GFLOP per token = 989 TFLOP/s: the whole H200.
    assert harness.tflops(100_000 * 9.89e9) == 989.0
    assert harness.mfu(989.0) == 1.0
    assert harness.mfu(harness.tflops(50_000 * 9.89e9)) == 0.5


def test_ratio_and_change_against_a_reference_row(harness):
    rows = [
        {"path": "hf", "error": "OOM"},
        {"path": "ours", "tokens_per_s": 3000.0},
        {"path": "hf", "tokens_per_s": 2000.0},
    ]
    ref = harness.reference_row(rows, lambda r: r["path"] == "hf")
    assert ref is rows[2]  # the failed one is skipped
    assert harness.ratio(rows[1]["tokens_per_s"], ref["tokens_per_s"]) == "1.50x"
    assert harness.ratio(3000.0, None) == harness.ratio(None, 2000.0) == harness.ratio(1.0, 0) == "-"
    assert harness.change(2.02, 2.0) == "+1.00%" and harness.change(1.98, 2.0) == "-1.00%"
    assert harness.change(2.0, None) == "-"
    assert harness.best(rows, "tokens_per_s", lambda r: True) == 3000.0
    assert harness.best(rows, "tokens_per_s", lambda r: r["path"] == "none") is None


def test_markdown_table(harness):
    table = harness.markdown_table(
        ["path", "tokens/s", "vs hf"], [["ours", "3.0k", "1.50x"], ["hf", harness.failed("x" * 150)]]
    )
    assert table.splitlines() == [
        "| path | tokens/s | vs hf |",
        "|---|---|---|",
        "| ours | 3.0k | 1.50x |",
        "| hf | failed: " + "x" * 100 + " |",
    ]
    assert harness.markdown_table(["n"], [[1]]) == "| n |\n|---|\n| 1 |"


def test_results_json_has_the_command_that_made_it(harness, tmp_path):
    script = REPO / "benchmarks" / "llm_throughput.py"
    argv = ["--paths", "forge", "hf-eager", "--batches", "hf eager=4"]
    meta = harness.run_meta(script, argv)
    expected = "python benchmarks/llm_throughput.py --paths forge hf-eager --batches 'hf eager=4'"
    assert meta["command"] == expected
    assert meta["argv"] == argv
    assert meta["torch"] == pytest.importorskip("torch").__version__
    assert harness.machine(cuda=False) == "cpu"
    out = harness.write_json(tmp_path / "results" / "x.json", {"meta": meta, "results": [{"path": "forge"}]})
    assert json.loads(out.read_text()) == {"meta": meta, "results": [{"path": "forge"}]}
    assert out.read_text().endswith("}\n") and list(out.parent.iterdir()) == [out]


def test_torchrun_command(harness):
    assert harness.torchrun(2, "b.py", ["--child", "x"]) == [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "b.py", "--child", "x",
    ]  # fmt: skip


def _python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def test_child_result_line_is_found_anywhere_in_a_line(harness):
    run = harness.run_child(_python("print('noise'); print('rank 1 half a line' + 'RESULT {\"a\": 1}')"))
    assert run.returncode == 0 and run.result() == {"a": 1} and run.seconds > 0


def test_child_failure_is_its_first_error_line_else_its_last_line(harness, capsys):
    code = (
        "import sys\n"
        "sys.path.insert(0, sys.argv[1])\n"
        "import harness\n"
        "with harness.errors_reported():\n"
        "    raise ValueError('bad shape\\nsecond line')\n"
    )
    run = harness.run_child([*_python(code), str(REPO / "benchmarks")])
    assert run.result() is None and run.returncode == 1
    assert run.failure() == "ValueError: bad shape"
    assert "Traceback" in capsys.readouterr().err  # the tail is shown
    assert harness.run_child(_python("raise SystemExit('no luck')")).failure() == "no luck"
    assert harness.run_child(_python("raise SystemExit(3)")).failure() == "exit 3"


def test_child_past_its_timeout_is_stopped(harness):
    sleeper = _python("import time; time.sleep(60)")
    run = harness.run_child(sleeper, timeout=0.5, timeout_message="gone after {:.1f} s")
    assert run.seconds < 30 and run.returncode != 0
    assert run.failure() == "gone after 0.5 s"
