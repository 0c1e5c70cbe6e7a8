"""launch/gpu-check.sh --dry-run: the GPU check's steps on the CPU with a tiny model, and its failure exit."""
import re
import shlex
from pathlib import Path

import pytest
import torch

from helpers import run
from benchmarks import transcripts

SCRIPT = Path(__file__).resolve().parents[1] / "launch" / "gpu-check.sh"


def _script(cmd: str, tmp_path) -> str:
    """A documented `bash launch/gpu-check.sh ...` command (small), run as it is shown, in `tmp_path`."""
    p = run(["bash", SCRIPT, *shlex.split(cmd)[2:], "--dir", tmp_path], timeout=240)
    assert p.returncode == 0, p.stdout + p.stderr
    return p.stdout


def test_gpu_check_dry_run_passes(tmp_path):
    outs = []
    shown = transcripts.check("gpu-dry", lambda cmd: outs.append(_script(cmd, tmp_path)) or outs[-1])
    (out,) = outs
    assert "--window 0.5" in transcripts.small_command("gpu-dry", "bash launch/gpu-check.sh --dry-run")
    for line in ("DRY RUN", "\ngpu-check: datasheet dense bf16 peak: unknown for 'CPU'", "\ncheck  ",
                 "\n1. bf16 matmul (256x256) ", " TFLOP/s\n", "\n2. eager: warm-up (1 step) ",
                 "\n2. eager: train 2x64 V256 bf16 (1,1,1), ", " tokens/s/GPU\n",
                 "\n2. eager: MFU vs datasheet peak (6N + 12LhT flops/token) ", " unknown chip\n",
                 "\n2. eager: MFU vs step 1's measured matmul ", "\n3. sync save from cpu memory ",
                 "\n3. async buffers, allocated once at start-up ", "\n3. async save stall (held, no copy) ", " ms\n", "\n3. load (async checkpoint) ",
                 "\n3. verify both; load, fp32 and bf16 files vs live ", " ok\n", "\ngpu-check: all checks passed"):
        assert line in out, (line, out)
    assert shown == [], "docs/parallelism.md's dry run shows lines the script no longer prints"
    assert "compiled" not in out, "the dry run trains eager only (compiling would cost a minute here)"


def test_gpu_check_runs_eager_and_compiled_by_default(monkeypatch):
    """The prepared GPU command (no --compile) trains an eager window and a compiled one, in that order, on
    GPT-2's padded vocab; --dry-run and --compile off/on pick one."""
    from megalite.bench import gpu_check
    seen = []
    monkeypatch.setattr(gpu_check, "run", lambda dry, config, window, out, compile_modes, micro_batch: seen.append(
        (dry, window, compile_modes, micro_batch)) or 0)
    for argv in ([], ["--dry-run"], ["--compile", "on"], ["--dry-run", "--compile", "both"],
                 ["--micro-batch-size", "64", "--compile", "on"]):
        assert gpu_check.main(argv) == 0
    assert seen == [(False, 60.0, ("off", "on"), None), (True, 2.0, ("off",), None), (False, 60.0, ("on",), None),
                    (True, 2.0, ("off", "on"), None), (False, 60.0, ("on",), 64)]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: the prepared eager + compiled command")
def test_gpu_check_on_a_gpu_trains_eager_and_compiled(tmp_path):
    """The prepared command trains GPT-2-124M (vocab 50304) eager and compiled and prints MFU against the
    datasheet (or says the chip is unknown); any `gpu` transcript in the docs shows what it prints."""
    out = _script("bash launch/gpu-check.sh --window 5", tmp_path)
    for label in ("eager", "compiled"):
        assert f"\n2. {label}: train 12x768 V50304 bf16 (1,1,1), " in out, out
        assert re.search(rf"\n2\. {label}: MFU vs datasheet peak .*( \d+\.\d%| unknown chip)\n", out), out
        assert re.search(rf"\n2\. {label}: MFU vs step 1's measured matmul +\d+\.\d%\n", out), out
    assert out.index("2. eager: ") < out.index("2. compiled: ")
    assert transcripts.check("gpu", lambda cmd: _script(cmd, tmp_path)) == []


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: the real run would start")
def test_gpu_check_without_a_gpu_refuses_the_real_run():
    p = run(["bash", SCRIPT, "--window", "0"], timeout=120)
    assert p.returncode == 2 and "no CUDA device" in p.stdout, p.stdout + p.stderr


def test_gpu_check_exits_1_on_a_mismatch(tmp_path, monkeypatch):
    """A load that returns other weights than were saved must fail the check (exit code 1, named tensor)."""
    import torch
    import megalite.checkpoint as ckpt
    from megalite.bench import gpu_check
    real = ckpt.load_checkpoint

    def corrupting(path, model, optimizer, grid, **kw):
        info = real(path, model, optimizer, grid, **kw)
        with torch.no_grad():
            dict(model.global_parameters())["ln_f.weight"].add_(1.0)
        return info

    monkeypatch.setattr(ckpt, "load_checkpoint", corrupting)
    lines = []
    assert gpu_check.run(True, str(gpu_check.Path(SCRIPT).parents[1] / "configs" / "gpt2-124m.toml"), 0.2,
                         tmp_path, log=lines.append) == 1
    assert any("load: ln_f.weight differs" in line for line in lines), lines
