"""Stopping in time: a stop signal (Ctrl-C, SIGTERM, a preemption) is followed by a SIGKILL after the launcher's
grace period (torchrun's shutdown timeout). The launch scripts give a generous one, the trainer reads the one it
has and says once, in one line, when a step + a save would not fit in it. The real torchrun case (a SIGTERM in
the middle of a slow step still commits a checkpoint) is in test_error_contract_torchrun.py."""
from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest

from helpers import CKPT, train_in_process
from megalite.checkpoint.tree import read_latest
from megalite.run.ckpt_policy import DEFAULT_SHUTDOWN_TIMEOUT_S, signal_grace
from megalite.config import Config

REPO = Path(__file__).resolve().parents[1]


def _fake_tools(folder: Path) -> Path:
    """A PATH folder whose `torchrun` prints the grace it was given, an `srun` that runs its command and a
    `scontrol` that names one host: enough to run the launch scripts without launching anything."""
    folder.mkdir()
    tools = {"torchrun": 'echo "grace=${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-unset}"',
             "srun": 'while [ "${1#-}" != "$1" ]; do shift; done; exec "$@"',
             "scontrol": "echo node0",  # python3 -m megalite torchrun: as torchrun; demo.sh's later steps: stop
             "python3": 'case " $* " in *" torchrun "*) echo "grace=${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-unset}";; '
                        '*) exit 3;; esac'}
    for name, body in tools.items():
        (folder / name).write_text(f"#!/bin/sh\n{body}\n")
        (folder / name).chmod(0o755)
    return folder


@pytest.mark.parametrize("own", [None, "77"])
def test_every_launch_script_gives_the_workers_a_generous_grace(tmp_path, own):  # ~0.1 s each
    """local.sh, multinode.sh, slurm.sbatch (via multinode.sh) and demo.sh export TORCH_ELASTIC_SHUTDOWN_TIMEOUT
    (read by torchrun and by the workers) = 120 s unless the user set it; a value of the user's is kept."""
    tools = _fake_tools(tmp_path / "bin")
    base = {k: v for k, v in os.environ.items() if k != "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"}
    base.update(PATH=f"{tools}:{os.environ['PATH']}", **({"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": own} if own else {}))
    scripts = {"local.sh": {}, "multinode.sh": {"NNODES": "2", "RDZV_ENDPOINT": "node0:29500"},
               "slurm.sbatch": {"SLURM_SUBMIT_DIR": str(REPO), "SLURM_JOB_NODELIST": "node0", "SLURM_JOB_ID": "1",
                                "SLURM_NNODES": "1", "SLURM_NODEID": "0"},
               "demo.sh": {"RUN": str(tmp_path / "demo")}}
    for script, extra in scripts.items():
        p = subprocess.run(["bash", str(REPO / "launch" / script)], env={**base, **extra}, capture_output=True,
                           text=True, timeout=60, cwd=tmp_path)
        assert p.stdout.splitlines()[:1] == [f"grace={own or DEFAULT_SHUTDOWN_TIMEOUT_S}"], (script, p.stdout,
                                                                                             p.stderr)


def test_the_grace_the_trainer_reads(monkeypatch):
    cfg = Config()
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    monkeypatch.delenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", raising=False)
    assert signal_grace(cfg)[0] is None  # no launcher known: nothing to compare with
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    assert signal_grace(cfg)[0] == 30.0  # torchrun's own default
    monkeypatch.setenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "120")
    assert signal_grace(cfg) == (120.0, "TORCH_ELASTIC_SHUTDOWN_TIMEOUT=120")
    cfg.checkpoint.signal_grace_s = 7.5  # stated by the user (e.g. torchrun --shutdown-timeout 7.5, SLURM KillWait)
    assert signal_grace(cfg) == (7.5, "checkpoint.signal_grace_s")


def test_a_step_longer_than_the_grace_is_said_once_and_again_when_the_signal_comes(tmp_path, token_file, capfd,
                                                                                   monkeypatch):
    """Steps made slow (0.6 s from step 2) against checkpoint.signal_grace_s = 0.5: one WARNING line, once,
    naming the setting; a SIGTERM that then arrives mid-run is answered at once on stderr (before the SIGKILL
    could come) and the run still stops with its checkpoint and the resume line."""
    monkeypatch.setenv("MEGALITE_SLOW_STEP_S", "0.6")
    monkeypatch.setenv("MEGALITE_SLOW_FROM_STEP", "2")
    logs = []

    def log(line):
        logs.append(line)
        if line.startswith("step     4/"):
            os.kill(os.getpid(), signal.SIGTERM)  # the handler runs here, in the main thread, during step 4's log

    root = tmp_path / "ck"
    cfg = CKPT.config(token_file, tmp_path / "out", **{"model.n_layer": 2, "train.steps": 8, "train.log_interval": 1,
                                                        "checkpoint.dir": str(root), "checkpoint.interval": 2,
                                                        "checkpoint.signal_grace_s": 0.5})
    tr = train_in_process(cfg, log=log)
    warnings = [line for line in logs if line.startswith("WARNING")]
    assert len(warnings) == 1, logs
    assert "more than the 0.5 s" in warnings[0] and "checkpoint.signal_grace_s" in warnings[0], warnings
    assert "\n" not in warnings[0]
    err = capfd.readouterr().err
    assert "megalite: got SIGTERM: the checkpoint after this step needs ~" in err and "0.5 s before SIGKILL" in err, err
    assert tr.stopped_by == "SIGTERM" and tr.step == 4 and read_latest(root) == "step_00000004"
    assert logs[-1] == (f"megalite: stopped by SIGTERM at step 4/8; checkpoint {root / 'step_00000004'}; to resume, "
                        f"run the same command again"), logs


def test_the_stop_line_says_how_to_resume():
    from megalite.run.runlog import resume_hint as _resume_hint
    cfg = Config()
    cfg.checkpoint.dir = "runs/x/ck"
    assert _resume_hint(cfg, 7) == "; checkpoint runs/x/ck/step_00000007; to resume, run the same command again"
    cfg.checkpoint.resume = "runs/other/ck"  # rerunning this would load the other checkpoint again
    assert _resume_hint(cfg, 7).endswith("run the same command with --checkpoint.resume=auto instead of "
                                         "'runs/other/ck'")
    assert _resume_hint(cfg, 0) == "; no checkpoint was saved in runs/x/ck"
    cfg.checkpoint.dir = ""
    assert "checkpoints are off" in _resume_hint(cfg, 0)


def test_a_stop_at_step_launch_times_its_eta_to_that_step_and_says_the_rerun_goes_on(tmp_path, token_file):
    """train.stop_at_step = 3 of train.steps = 6: the step lines before it time the ETA to step 3 (this launch
    ends there), step 3's line shows none, and the stop line says that the rerun trains on to step 6."""
    logs = []
    root = tmp_path / "ck"
    cfg = CKPT.config(token_file, tmp_path / "out", **{"model.n_layer": 2, "train.steps": 6, "train.stop_at_step": 3,
                                                        "train.log_interval": 100, "checkpoint.dir": str(root)})
    tr = train_in_process(cfg, log=logs.append)
    steps = [line for line in logs if line.startswith("step ")]
    assert [line.split("|")[0].strip() for line in steps] == ["step     1/6", "step     3/6"], logs
    assert steps[0].endswith("| ETA after step 2") and steps[1].endswith("| stops here (train.stop_at_step)"), steps
    assert logs[-1] == (f"megalite: stopped by train.stop_at_step at step 3/6; checkpoint {root / 'step_00000003'}; "
                        f"to resume, run the same command again (it trains on to step 6, train.steps; "
                        f"train.stop_at_step=3 is then behind it)"), logs
    assert tr.step == 3 and read_latest(root) == "step_00000003"


def test_the_eta_of_a_launch_that_stops_early_is_to_its_stop_step():
    from megalite.run.runlog import step_line
    rec = {"step": 11, "loss": 5.0, "lr": 1e-3, "grad_norm": 1.0, "tokens_per_s": 100.0, "ms_per_step": 2000.0}
    assert step_line(rec, 1000, 20.0, 10).endswith("| ETA 32m58s")  # 989 steps left at 2 s
    assert step_line(rec, 1000, 20.0, 10, stop_at=500).endswith("| ETA 16m18s to step 500")  # 489 left
    rec["step"] = 500
    assert step_line(rec, 1000, 998.0, 499, stop_at=500).endswith("| stops here (train.stop_at_step)")
    rec["step"] = 1000
    assert step_line(rec, 1000, 998.0, 499, stop_at=0).endswith("| ETA 0m00s")
