"""The error contract under the documented launcher, a real 2-process torchrun: a user error seen by one rank
only is reported once, by rank 0, as one line; no rank prints a traceback; every rank exits 2; nothing is
left behind. And what SIGTERM to the torchrun agent itself does (README, Reliability)."""
from __future__ import annotations

import json
import re
import signal
import subprocess

from helpers import CKPT, TORCHRUN_TIMEOUT, env, kill_tree, metrics, run, torchrun_cmd, train_cmd, wait_for
from megalite.checkpoint.layout import read_latest
from megalite.checkpoint.verify import verify


def test_an_error_on_rank_1_only_is_one_line_from_rank_0_and_every_rank_exits_2(tmp_path, token_file):
    from megalite.convert import reshard
    toml = CKPT.toml(tmp_path / "tiny.toml", token_file, model={"n_layer": 2})
    from helpers import train_in_process
    train_in_process(CKPT.config(token_file, tmp_path / "run1", **{"model.n_layer": 2, "train.steps": 1,
                                                                    "checkpoint.dir": str(tmp_path / "ck1")}))
    src = reshard(tmp_path / "ck1", tmp_path / "ck2", 1, 1, 2, quiet=True)  # a dp=2 checkpoint
    state = src / "tp00-pp00-dp01" / "state.json"  # rank 1's coordinate only: a broken RNG state
    s = json.loads(state.read_text())
    s["rng"] = {"python": "garbage"}
    state.write_text(json.dumps(s))
    logs, out, ck = tmp_path / "logs", tmp_path / "out", tmp_path / "newck"
    cmd = torchrun_cmd(2, "train", "--config", toml, "--parallel.dp=2", f"--checkpoint.resume={tmp_path / 'ck2'}",
                       f"--train.out_dir={out}", f"--checkpoint.dir={ck}")
    cmd[cmd.index("--standalone"):cmd.index("--standalone")] = ["--log-dir", str(logs), "--redirects", "3"]
    p = run(cmd, timeout=TORCHRUN_TIMEOUT)
    per_rank = {int(f.parent.name): f.read_text() for f in logs.rglob("stderr.log")}
    stdout = {int(f.parent.name): f.read_text() for f in logs.rglob("stdout.log")}
    shown = f"exit {p.returncode}\n{p.stderr[-3000:]}\n{per_rank}\n{stdout}"
    assert sorted(per_rank) == [0, 1], shown
    lines = per_rank[0].splitlines()
    assert len(lines) == 1 and lines[0].startswith("megalite train: error: "), shown
    assert "tp00-pp00-dp01/state.json" in lines[0] and "'rng'" in lines[0], shown
    assert per_rank[1] == "" and "Traceback" not in "".join(per_rank.values()) + "".join(stdout.values()), shown
    # torchrun's own report: both workers exited with 2; torchrun itself then exits 1 (its ChildFailedError)
    assert sorted(map(int, re.findall(r"rank\s*: (\d) \(local_rank", p.stderr))) == [0, 1], shown
    assert p.stderr.count("exitcode  : 2") == 2 and p.returncode == 1, shown
    assert not out.exists() and not ck.exists(), "a failed start left something behind"


def test_sigterm_to_the_torchrun_agent_commits_a_checkpoint(tmp_path, token_file):
    """torchrun 2.13 forwards SIGTERM to every worker, waits for them (TORCH_ELASTIC_SHUTDOWN_TIMEOUT, 30 s),
    then re-raises the signal as SignalException: the job exits 1 with torchrun's traceback. The workers
    commit a checkpoint at the next step boundary and exit 0 before that; resuming from it is exact (as from
    any checkpoint, tests/test_checkpoint_resume.py)."""
    toml = CKPT.toml(tmp_path / "tiny.toml", token_file, model={"n_layer": 2})
    root, out = tmp_path / "ck", tmp_path / "out"
    proc = subprocess.Popen(train_cmd(toml, "--parallel.dp=2", "--train.steps=400", f"--checkpoint.dir={root}",
                                      f"--train.out_dir={out}", nproc=2), env=env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        assert wait_for(lambda: (out / "metrics.jsonl").exists() and len(metrics(out)) >= 2, 150, 0.05)
        proc.send_signal(signal.SIGTERM)  # the agent, not the workers
        text, _ = proc.communicate(timeout=150)
    finally:
        kill_tree(proc)
    m = re.search(r"stopped by SIGTERM at step (\d+)/400", text)
    assert m, text[-3000:]
    k = int(m[1])
    assert read_latest(root) == f"step_{k:08d}" and verify(root)[1] == [], text[-3000:]
    assert [r["step"] for r in metrics(out)][-1] == k
    assert proc.returncode == 1 and "SignalException" in text, (proc.returncode, text[-3000:])
