"""The error contract under the documented launcher, a real 2-process torchrun: a user error seen by one rank
only is reported once, by rank 0, as one line; no rank prints a traceback; every rank exits 2; nothing is
left behind. And what SIGTERM to the torchrun agent itself does (README, Reliability)."""
from __future__ import annotations

import json
import re
import signal
import subprocess

from pathlib import Path

from helpers import (CKPT, TORCHRUN, resign, TORCHRUN_TIMEOUT, env, kill_tree, metrics, run, train_cmd, train_in_process,
                     wait_for)
from megalite.checkpoint.layout import read_latest
from megalite.checkpoint.verify import verify


def _matrix(tmp_path, token_file) -> list:
    """(argv, fragments of rank 0's one stderr line, paths that must not exist afterwards) per case."""
    from megalite.convert import reshard
    toml = CKPT.toml(tmp_path / "tiny.toml", token_file, model={"n_layer": 2})
    train_in_process(CKPT.config(token_file, tmp_path / "run1", **{"model.n_layer": 2, "train.steps": 1,
                                                                    "checkpoint.dir": str(tmp_path / "ck1")}))
    src = reshard(tmp_path / "ck1", tmp_path / "ck2", 1, 1, 2, quiet=True)  # a dp=2 checkpoint
    state = src / "tp00-pp00-dp01" / "state.json"  # rank 1's coordinate only: a broken RNG state
    s = json.loads(state.read_text())
    s["rng"] = {"python": "garbage"}
    state.write_text(json.dumps(s))
    resign(src, "tp00-pp00-dp01/state.json")  # checksums made to agree: what is tested is the 'rng' check
    (tmp_path / "ck3").mkdir()
    (tmp_path / "ck3" / "lock").symlink_to(tmp_path / "tiny.toml")

    def train(i, *extra):
        out, ck = tmp_path / f"out{i}", tmp_path / f"newck{i}"
        return ["train", "--config", str(toml), "--parallel.dp=2", f"--train.out_dir={out}",
                f"--checkpoint.dir={ck}", *extra], [out, ck]

    cases = [
        (*train(0, "--train.lr=nan"), ["train.lr = nan"]),
        (*train(1, "--model.vocab_size=64"), ["token id", "model.vocab_size = 64"]),
        (*train(2, f"--checkpoint.resume={tmp_path / 'nope'}"), ["nope", "does not exist"]),
        (*train(3, f"--checkpoint.dir={tmp_path / 'ck3'}", "--checkpoint.resume=auto"), ["lock", "symlink"]),
        (*train(4, "--train.lr=1e5", "--train.min_lr=0", "--train.grad_clip=0", "--train.warmup_steps=0"),
         ["step 2: loss", "not finite"]),
        (*train(5, f"--checkpoint.resume={tmp_path / 'ck2'}"), ["tp00-pp00-dp01/state.json", "'rng'"]),
    ]
    cases[3] = (cases[3][0], [tmp_path / "out3"], cases[3][2])  # ck3 is the crafted input itself
    cases[4] = (cases[4][0], [], cases[4][2])  # trains a step and saves nothing: its out_dir stays (metrics)
    return cases


def test_the_bad_input_matrix_under_a_2_process_torchrun(tmp_path, token_file):
    """One launch, six bad inputs on both ranks (a config number, data vs model, a missing resume path, a
    symlinked lock, a NaN loss mid-run, a resume error only rank 1 sees): each is one line from rank 0,
    nothing from rank 1, no traceback, exit 2 on both ranks, nothing left behind."""
    cases = _matrix(tmp_path, token_file)
    (tmp_path / "cases.json").write_text(json.dumps([argv for argv, _, _ in cases]))
    res, logs = tmp_path / "results", tmp_path / "logs"
    res.mkdir()
    cmd = [*TORCHRUN, "--log-dir", str(logs), "--redirects", "3", "--standalone", "--nproc-per-node=2",
           str(Path(__file__).parent / "torchrun_matrix.py"), str(tmp_path / "cases.json"), str(res)]
    p = run(cmd, timeout=TORCHRUN_TIMEOUT)
    last = {int(f.parent.name): f.read_text() for f in logs.rglob("stderr.log")}
    stdout = {int(f.parent.name): f.read_text() for f in logs.rglob("stdout.log")}
    shown = f"exit {p.returncode}\n{p.stderr[-3000:]}\n{last}\n{stdout}"
    assert sorted(last) == [0, 1] and (res / "rank0.json").exists() and (res / "rank1.json").exists(), shown
    ranks = [json.loads((res / f"rank{r}.json").read_text()) + [{"rc": 2, "stderr": last[r], "stdout": stdout[r]}]
             for r in (0, 1)]
    for (argv, leftovers, fragments), r0, r1 in zip(cases, *ranks):
        case = f"{argv[4:]}: rank 0 {r0}, rank 1 {r1}"
        assert r0["rc"] == 2 and r1["rc"] == 2, case
        assert "Traceback" not in r0["stderr"] + r1["stderr"] + r0["stdout"] + r1["stdout"], case
        lines = r0["stderr"].splitlines()
        assert len(lines) == 1 and lines[0].startswith("megalite train: error: "), case
        assert all(f in lines[0] for f in fragments), (fragments, case)
        assert r1["stderr"] == "", case
        assert not any(Path(x).exists() for x in leftovers), (leftovers, case)
    # the last case ended the workers: torchrun saw exit code 2 from both, then exits 1 (its ChildFailedError)
    assert sorted(map(int, re.findall(r"rank\s*: (\d) \(local_rank", p.stderr))) == [0, 1], shown
    assert p.stderr.count("exitcode  : 2") == 2 and p.returncode == 1, shown
    assert (tmp_path / "tiny.toml").read_text().startswith("[model]")  # the symlinked lock's target untouched


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
