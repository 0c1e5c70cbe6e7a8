"""launch/gpu-check.sh --dry-run: the GPU check's steps on the CPU with a tiny model, and its failure exit."""
from pathlib import Path


from helpers import run

SCRIPT = Path(__file__).resolve().parents[1] / "launch" / "gpu-check.sh"


def test_gpu_check_dry_run_passes(tmp_path):
    p = run(["bash", SCRIPT, "--dry-run", "--window", "0.5", "--dir", tmp_path], timeout=240)
    assert p.returncode == 0, p.stdout + p.stderr
    out = p.stdout
    lines = out.splitlines()
    for phase, result in (("measuring the bf16 matmul rate", "1. bf16 matmul:"), ("measuring training", "2. train"),
                          ("measuring sync and async saves", "3. checkpoint")):  # said before it runs, result after
        said = [i for i, line in enumerate(lines) if phase in line]
        done = [i for i, line in enumerate(lines) if line.startswith(result)]
        assert len(said) == 1 and len(done) == 1 and said[0] < done[0], (phase, out)
    for line in ("DRY RUN", "1. bf16 matmul:", "TFLOP/s", "2. train 2x64 bf16 (1,1,1)", "tokens/s", "MFU",
                 "3. checkpoint from cpu memory: sync save", "async save stall", "verify ok",
                 "4. gpu-check: all checks passed"):
        assert line in out, (line, out)


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
