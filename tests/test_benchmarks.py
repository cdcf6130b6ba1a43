"""The throughput benchmarks' CPU script checks: each script runs end to end at a tiny size (gloo for the
multi-process ones) and writes rows without errors, so a change to the code they share breaks a test, not the next
GPU run. The numbers themselves mean nothing on a CPU; the byte formula of FSDP2's all-gathers is checked exactly.
Also: the benchmarks import nothing from the test suite.
"""

import ast
import gzip
import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BENCHMARKS = REPO / "benchmarks"
# On PYTHONPATH, its sitecustomize.py installs the CPU shim of megatron-core's CUDA calls in every process.
MEGATRON_CPU_SITE = REPO / "tests" / "megatron" / "cpu_site"


def _run(script: str, *args: str, out: Path, pythonpath: Path | None = None) -> list[dict]:
    return _launch(script, *args, out=out, pythonpath=pythonpath)[0]


def _launch(
    script: str, *args: str, out: Path, pythonpath: Path | None = None, allow_failed: bool = False
) -> tuple[list[dict], str]:
    """The rows of the script's JSON (none failed, unless ``allow_failed``) and its stdout."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if pythonpath is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(pythonpath), env.get("PYTHONPATH")]))
    cmd = [sys.executable, str(BENCHMARKS / script), "--device", "cpu", *args, "--out", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())["results"]
    failed = [r for r in rows if "error" in r]
    assert allow_failed or not failed, failed
    return rows, proc.stdout


# A freshly initialised model on random tokens of the debug vocabulary (256) starts near ln(256).
FIRST_LOSS = math.log(256)


def test_llm_throughput_script_trains_both_sides(tmp_path):
    args = ["--shape", "debug", "--seq", "64", "--batch", "2", "--steps", "2", "--warmup", "1"]
    paths = ["forge", "forge-fp8-full", "forge-fp8-attn", "hf-eager"]  # FP8 paths: torchao / emulated on CPU
    rows = _run("llm_throughput.py", *args, "--paths", *paths, out=tmp_path / "llm.json")
    assert [r["path"] for r in rows] == paths
    for r in rows:
        assert r["tokens_per_s"] > 0
        assert abs(r["final_loss"] - FIRST_LOSS) < 0.2, r  # 3 steps at lr 1e-4 stay near the start


def test_fsdp_throughput_script_counts_gather_bytes_and_profiles(tmp_path):
    """Two gloo ranks; the debug model's 2 blocks hold 73,984 parameters, the root (embedding, head, norm) 32,832:
    a rank sends half of each all-gather, blocks gathered twice per step unless kept from forward to backward, the
    root once; gradients are reduce-scattered in fp32."""
    args = ["--gpus", "2", "--shape", "debug", "--seq", "64", "--batch", "2", "--warmup", "2", "--steps", "2"]
    args += ["--profile", "1", "--paths", "forge-fsdp2", "forge-fsdp2-keep"]
    rows = {r["path"]: r for r in _run("fsdp_throughput.py", *args, out=tmp_path / "fsdp.json")}
    blocks, root = 73_984, 32_832
    assert rows["forge-fsdp2"]["param_bytes_per_step"] == 0.5 * 2 * (2 * blocks + root)
    assert rows["forge-fsdp2-keep"]["param_bytes_per_step"] == 0.5 * 2 * (blocks + root)
    assert rows["forge-fsdp2"]["grad_bytes_per_step"] == 0.5 * 4 * (blocks + root)
    profile = rows["forge-fsdp2"]["profile"]
    assert profile["steps"] == 1 and profile["top_kernels"], profile


def test_megatron_throughput_script_trains_its_megatron_and_fsdp2_paths(tmp_path):
    args = ["--model", "debug", "--seq", "64", "--batch", "2", "--warmup", "2", "--steps", "2"]
    args += ["--paths", "forge-megatron", "forge-fsdp2"]
    rows = _run("megatron_throughput.py", *args, out=tmp_path / "megatron.json", pythonpath=MEGATRON_CPU_SITE)
    assert [r["path"] for r in rows] == ["forge-megatron", "forge-fsdp2"]
    for r in rows:
        assert r["tokens_per_s"] > 0
        assert abs(r["first_loss"] - FIRST_LOSS) < 0.2 and abs(r["last_loss"] - FIRST_LOSS) < 0.2, r


def test_vlm_throughput_script_trains_transformers_our_packed_rows_and_forge_fit(tmp_path):
    """The tiny Qwen2.5-VL shape: transformers and ours train the same samples (same digest, real tokens and
    samples per step), ours in packed rows of 512 tokens with its own row option (selective checkpointing); the
    product-path row runs ``forge fit`` of the Qwen2.5-VL recipe; the table is printed last with a row per path."""
    args = ["--tiny", "--steps", "2", "--warmup", "1", "--samples-per-step", "2", "--seq-length", "512"]
    args += [
        "--rows",
        "transformers",
        "ours-packed:ac=selective",
        "forge-fit",
        "--work-dir",
        str(tmp_path / "work"),
    ]
    rows, stdout = _launch("vlm_throughput.py", *args, out=tmp_path / "vlm.json")
    assert [r["row"] for r in rows] == ["transformers", "ours-packed:ac=selective", "forge-fit"]
    hf, ours, fit = rows
    assert hf["layout"] == "padded" and ours["layout"] == "packed" and not hf["liger"]
    assert "AC selective" in ours["setting"]
    assert hf["data_digest"] == ours["data_digest"] and hf["params"] == ours["params"]
    assert hf["real_tokens_per_step"] == ours["real_tokens_per_step"] > 0
    assert all(shape[1] == 512 for shape in ours["batch_shapes"])
    assert all(shape[0] == 2 for shape in hf["batch_shapes"])  # two samples, padded to the longer
    for r in (hf, ours):
        assert r["tokens_per_s"] > 0 and r["samples_per_s"] > 0 and r["tflops"] > 0 and r["timed_steps"] == 2
        assert abs(r["first_loss"] - math.log(512)) < 0.3 and abs(r["last_loss"] - math.log(512)) < 0.3, r
    assert fit["setting"].startswith("forge fit configs/vlm/qwen2.5-vl-3b/sft_fsdp2.yaml: 1 device")
    assert fit["tokens_per_s"] > 0 and fit["tflops"] > 0 and fit["timed_steps"] == 5
    assert abs(fit["first_loss"] - math.log(512)) < 0.5, fit
    lines = stdout.strip().splitlines()
    assert lines[-5].startswith("| row | setting | attention | real tokens/s | samples/s | TFLOP/s | MFU |")
    assert "| vs transformers | first loss | last loss |" in lines[-5]
    assert lines[-2].startswith("| ours-packed:ac=selective |") and "LLM packed sdpa" in lines[-2]
    assert lines[-1].startswith("| forge-fit |")
    assert json.loads((tmp_path / "vlm.json").read_text())["meta"]["same_data"] is True


def test_diffusion_throughput_script_runs_every_row_kind(tmp_path):
    """The debug Wan shape, 2 timed steps: both diffusers baselines and ours (the first block checkpointed, SDPA's
    math backend only) start from the same weights (ours and the fp32 baseline's checksums equal) and train on the
    same inputs (equal first losses: the zero-initialised output projection predicts 0 against the same targets);
    an attention kernel the performance section does not know fails its row with the config's error and the run
    goes on; the forge-fit row trains the 1.3B recipe from a synthetic feature cache; ``--profile`` writes a Chrome
    trace of the first row; the table is printed last."""
    names = ["diffusers:diffsynth", "diffusers:bf16", "ours:ac=1,eager,attn=math", "ours:eager,attn=bogus"]
    names.append("forge-fit:ac=none")
    args = [
        "--tiny",
        "--steps",
        "2",
        "--warmup",
        "1",
        "--row-timeout",
        "300",
        "--work-dir",
        str(tmp_path / "work"),
    ]
    args += ["--profile", str(tmp_path / "profile"), "--rows", *names]
    rows, stdout = _launch(
        "diffusion_throughput.py", *args, out=tmp_path / "diffusion.json", allow_failed=True
    )
    assert [r["row"] for r in rows] == names
    diffsynth, bf16, ours, bogus, fit = rows
    assert "attn=bogus" in bogus["error"] and "performance" in bogus["error"]
    for r in (diffsynth, bf16, ours):
        assert "error" not in r, r
        assert r["latents"] == [1, 4, 2, 4, 4] and r["tokens_per_video"] == 8 and r["timed_steps"] == 2
        assert r["samples_per_s"] > 0 and r["tflops"] > 0 and r["flops_per_step"] == ours["flops_per_step"]
        assert r["first_loss"] == pytest.approx(ours["first_loss"], abs=1e-6)
    assert diffsynth["init_checksum"] == pytest.approx(ours["init_checksum"], rel=1e-9)
    assert bf16["init_checksum"] == pytest.approx(
        ours["init_checksum"], rel=1e-3
    )  # the weights rounded to bf16
    assert "gradient checkpointing" in diffsynth["setting"] and "bf16 weights" in bf16["setting"]
    assert "AC first 1 blocks full" in ours["setting"] and "SDPA order math" in ours["attention"]
    assert fit["setting"].startswith(
        "forge fit configs/diffusion/wan2.1-t2v-1.3b/sft_fsdp2.yaml: 1 device, AC none"
    )
    assert fit["samples_per_s"] > 0 and fit["tflops"] > 0 and fit["timed_steps"] == 5
    assert Path(diffsynth["profile"]["trace"]).name == "diffusers_diffsynth.json.gz"
    trace = json.loads(gzip.decompress(Path(diffsynth["profile"]["trace"]).read_bytes()))
    assert trace["traceEvents"] and diffsynth["profile"]["top_kernels"]
    lines = stdout.strip().splitlines()
    assert lines[-7] == (
        "| row | setting | s/step | samples/s | TFLOP/s | MFU | peak GB | vs diffusers:diffsynth | vs diffusers:bf16 |"
    )
    assert lines[-5].startswith("| diffusers:diffsynth |") and "| 1.00x |" in lines[-5]
    assert lines[-2].startswith("| ours:eager,attn=bogus | failed: ValueError: attn=bogus")


@pytest.fixture
def diffusion_script(monkeypatch):
    """``benchmarks/diffusion_throughput.py`` imported (its folder on the path, as when it runs)."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    spec = importlib.util.spec_from_file_location(
        "diffusion_throughput", BENCHMARKS / "diffusion_throughput.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_diffusion_throughput_shapes_rows_and_loss_table(diffusion_script):
    """The real shapes' latents and token counts (480x832x81: Wan 2.1 32,760 tokens, Wan 2.2 8,190; 704x1280x121:
    27,280), the row options refused by name, and the loss table against the reference's last-20 mean."""
    bench = diffusion_script
    args = bench.parse_args(["--rows", "ours"])
    config = bench.dit_config(args)
    assert bench.latent_shape(args, config) == (16, 21, 60, 104)
    assert bench.tokens_per_video(config, bench.latent_shape(args, config)) == 32760
    args = bench.parse_args(["--shape", "wan2.2-5b", "--rows", "ours"])
    config = bench.dit_config(args)
    assert bench.latent_shape(args, config) == (48, 21, 30, 52)
    assert bench.tokens_per_video(config, bench.latent_shape(args, config)) == 8190
    args = bench.parse_args(["--shape", "wan2.2-5b", "--frames", "121", "--height", "704", "--width", "1280"])
    assert bench.tokens_per_video(config, bench.latent_shape(args, config)) == 27280
    with pytest.raises(SystemExit, match="a width divisible by 32"):
        bench.latent_shape(bench.parse_args(["--shape", "wan2.2-5b", "--width", "840"]), config)
    with pytest.raises(SystemExit, match="name the variant, diffusers:diffsynth or diffusers:bf16"):
        bench.parse_args(["--rows", "diffusers"])
    with pytest.raises(SystemExit, match="unknown option 'ac=some'; ours takes ac=none"):
        bench.parse_args(["--rows", "ours:ac=some"])
    with pytest.raises(SystemExit, match="the forge-fit row draws its own noise"):
        bench.parse_args(["--loss-steps", "10", "--rows", "forge-fit"])
    rows = [
        {"row": "diffusers:diffsynth", "setting": "a", "first_loss": 2.0, "losses": [2.0] * 10 + [1.0] * 20},
        {"row": "ours:ac=selective", "setting": "b", "first_loss": 2.0, "losses": [2.0] * 10 + [1.01] * 20},
        {"row": "ours:attn=fa4", "error": "ValueError: attn=fa4 refused"},
    ]
    lines = bench.table(rows, loss=True).splitlines()
    assert lines[0] == "| row | setting | first loss | last-20 loss | loss vs ref (%) |"
    assert lines[2:] == [
        "| diffusers:diffsynth | a | 2.0000 | 1.0000 | ref |",
        "| ours:ac=selective | b | 2.0000 | 1.0100 | +1.00% |",
        "| ours:attn=fa4 | failed: ValueError: attn=fa4 refused |",
    ]


@pytest.fixture(scope="module")
def quickstart_dir(tmp_path_factory) -> Path:
    """Where the scripts that train the quick-start model find its data: the first one builds it there."""
    return tmp_path_factory.mktemp("quickstart") / "data"


def test_run_endings_script_times_each_stage_of_a_forge_fit_ending(tmp_path, quickstart_dir):
    args = ["--runs", "single", "megatron", "--steps", "2", "--data", str(quickstart_dir)]
    rows = _run(
        "run_endings.py",
        *args,
        "--work",
        str(tmp_path / "w"),
        out=tmp_path / "re.json",
        pythonpath=MEGATRON_CPU_SITE,
    )
    assert [r["run"] for r in rows] == ["single", "megatron"]
    for r in rows:
        assert r["returncode"] == 0 and not r["hung"], r
        stages = r["stages_s"]
        assert len(stages) == 5 and all(v >= 0 for v in stages.values()), r
        assert abs(sum(stages.values()) - r["total_s"]) < 0.5, r  # the stages cover the whole ending
        assert r["checkpoint_gb"] > 0, r  # the recipe's save_last checkpoint was written (then removed)
    assert not (tmp_path / "w" / "megatron").exists()


def test_async_checkpoint_script_times_the_save_in_both_modes(tmp_path, quickstart_dir):
    args = ["--steps", "5", "--save-at", "3", "--data", str(quickstart_dir), "--work", str(tmp_path / "w")]
    rows = _run("async_checkpoint.py", *args, out=tmp_path / "ac.json")
    assert [r["mode"] for r in rows] == ["sync", "async"]
    for r in rows:
        assert r["returncode"] == 0 and r["checkpoint_gb"] > 0, r
        assert r["save_step_s"] > 0 and r["last_step_to_exit_s"] > 0, r


def _imports_of_tests(path: Path) -> list[str]:
    """The places in a benchmark script that import from ``tests/`` or put a ``tests/`` path on ``sys.path``."""
    test_modules = {p.stem for p in (REPO / "tests").rglob("*.py")} - {"__init__"}
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = [node.module or ""] if node.level == 0 else []
        elif isinstance(node, ast.Call) and "sys.path" in ast.unparse(node.func):
            strings = [n.value for n in ast.walk(node) if isinstance(n, ast.Constant)]
            found += [(node.lineno, f"sys.path gets {s!r}") for s in strings if "tests" in str(s)]
            continue
        else:
            continue
        for name in names:
            top = name.split(".")[0]
            if top == "tests" or top in test_modules:
                found.append((node.lineno, f"imports {name}"))
    return [f"{path.name}:{line} {what}" for line, what in sorted(found)]


def test_benchmarks_import_nothing_from_tests():
    scripts = sorted(BENCHMARKS.glob("*.py"))
    assert {"harness.py", "megatron_throughput.py"} <= {p.name for p in scripts}
    assert [place for script in scripts for place in _imports_of_tests(script)] == []


def test_the_import_guard_sees_the_old_shim_import(tmp_path):
    """What megatron_throughput.py did before the shim moved to the test side."""
    script = tmp_path / "old.py"
    script.write_text(
        "import sys\nfrom pathlib import Path\n"
        "sys.path.insert(0, str(Path(__file__).resolve().parents[1] / 'tests' / 'megatron'))\n"
        "import cuda_shim\nfrom tests.megatron import conftest\n"
    )
    assert [place.split(" ", 1)[1] for place in _imports_of_tests(script)] == [
        "sys.path gets 'tests'",
        "imports cuda_shim",
        "imports tests.megatron",
    ]
