"""Issue 42's attack classes, each held at its cause by one test (the message and the exit code a user sees):

    flags typed and ranged before use    0 is a value, refused like -1 (never read as "not given"); a head
                                         width a Llama cannot rotate; on the torchtitan and Megatron paths
    values of an unexpected type/size    a float field written as the JSON integer 10**400; an index's
                                         weight_map naming a number or a list
    --check without transformers         one line, nothing written
    a cast that overflows                --dtype fp16 of a weight of 1e6 refused, never written as inf
    every file through base/fs           a weight_map naming a FIFO refused at once (no hang), a symlink refused
    a dtype megalite does not know       refused by the one dtype table, never called float32
    megalite torchrun                    --nproc-per-node abc/0 one line; a failed worker's exit code; the
                                         survivor of a SIGKILLed worker one line (gloo's traceback before);
                                         a dead peer in NCCL's words and c10d's types (unit: no GPU here)
    W&B inside the run's folder          in tests/test_wandb.py's offline run (one W&B run serves both)

Each test plants nothing of its own: the input is the attack; the commit that added a test says which fix,
reverted, makes it fail."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from helpers import TORCHRUN_TIMEOUT, cli, cli_in_process, run
from megalite.base.errors import ConfigError
from megalite.config import ModelConfig, model_from
from megalite.convert import hints as hn

transformers = pytest.importorskip("transformers")


def one_line(rc: int, out: str, err: str, pattern: str) -> str:
    """A CLI failure as the contract says: exit 2, one error line on stderr matching `pattern`, no traceback
    (convert's informational lines, `convert: ...`, aside)."""
    lines = [line for line in err.strip().splitlines() if not line.startswith("convert: ")]
    assert rc == 2 and "Traceback" not in out + err and len(lines) == 1, (rc, out, err)
    assert pattern in err, err
    return err


def hf_llama(folder: Path, shard: str | None = None) -> Path:
    """A tiny transformers Llama folder (2 layers, width 32), sharded with an index when `shard` is given."""
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                   tie_word_embeddings=False)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(folder, **({"max_shard_size": shard} if shard else {}))
    return folder


# ---------------------------------------------------------------- flags: typed and ranged before use
@pytest.mark.parametrize("told, pattern", [
    (dict(rope_theta=0), "--rope-theta = 0, expected a finite positive number"),
    (dict(norm_eps=0.0), "--norm-eps = 0.0, expected a finite positive number"),
    (dict(rope_theta=-1.0), "--rope-theta = -1.0, expected a finite positive number"),
    (dict(norm_eps=float("nan")), "--norm-eps = nan"),
    (dict(num_heads=0), "--num-heads = 0, expected an integer in [1, "),
    (dict(num_heads=-4), "--num-heads = -4, expected an integer in [1, "),
    (dict(num_kv_heads=True), "--num-kv-heads = True"),
    (dict(vocab_size=0), "--vocab-size = 0"),
])
def test_a_hint_of_zero_or_below_is_refused_like_minus_one(told, pattern):
    with pytest.raises(hn.ConvertError, match=pattern.replace("[", r"\[").replace("(", r"\(")):
        hn.Hints(**told)


def test_the_torchtitan_path_refuses_zero_a_negative_head_count_and_an_odd_head_width(ttref, tmp_path):
    base = ["convert", ttref / "step-10", "--from", "dcp", "--arch", "llama", "--no-check",
            "--out", tmp_path / "o.safetensors"]
    for flags, pattern in ((["--num-heads", "4", "--rope-theta", "0"], "--rope-theta = 0.0, expected a finite "
                                                                          "positive number"),
                           (["--num-heads", "4", "--norm-eps", "0"], "--norm-eps = 0.0"),
                           (["--num-heads", "-4"], "--num-heads = -4"),
                           (["--num-heads", "64"], "--num-heads 64 gives a head width of 1, expected an even width")):
        one_line(*cli_in_process(*base, *flags), pattern)
        assert not (tmp_path / "o.safetensors").exists()


def test_megatrons_vocab_size_zero_is_refused_not_taken_as_padded(mref, tmp_path):
    rc, out, err = cli_in_process("convert", mref / "untied_tp2_noargs", "--num-heads", "4", "--vocab-size", "0",
                                  "--no-check", "--out", tmp_path / "o.safetensors")
    one_line(rc, out, err, "--vocab-size 0: expected 1 to the checkpoint's padded vocabulary")


def test_bench_flags_of_zero_are_one_line():
    p = cli("bench", "train", "--steps", "0")  # argparse's own error: a subprocess (it exits)
    one_line(p.returncode, p.stdout, p.stderr, "argument --steps: expected a positive integer, got '0'")


# ---------------------------------------------------------------- values of an unexpected type or size
@pytest.mark.parametrize("field", ["rope_theta", "layer_norm_eps", "n_embd"])
def test_a_model_field_of_10_to_the_400_is_one_line(field):
    m = dict(vars(ModelConfig(arch="llama", n_layer=2, n_head=4, n_kv_head=2, n_embd=32, vocab_size=64,
                              block_size=32, intermediate_size=64)))
    with pytest.raises(ConfigError, match=f"model.{field} = an integer of 1,329 bits"):
        model_from(json.loads(json.dumps({**m, field: 10**400})), "m.safetensors")


def test_a_config_float_of_10_to_the_400_is_one_line(tmp_path):
    cfg = tmp_path / "config.json"
    for digits, said in ((400, "rope_theta = an integer of 1,329 bits, expected a positive number"),
                         (5000, "is not valid JSON .Exceeds the limit .4300 digits.")):  # json's own refusal
        cfg.write_text('{"model_type": "llama", "hidden_act": "silu", "rope_theta": 1' + "0" * digits + "}")
        with pytest.raises(hn.ConvertError, match=r"--config .*config.json:? " + said):
            hn.merge_config(hn.Hints(), cfg)


@pytest.mark.parametrize("named", [7, ["model-00001-of-00002.safetensors"], None])
def test_a_weight_map_naming_a_number_or_a_list_is_one_line(tmp_path, named):
    folder = hf_llama(tmp_path / "hf", shard="20KB")
    index = folder / "model.safetensors.index.json"
    d = json.loads(index.read_text())
    d["weight_map"]["lm_head.weight"] = named
    index.write_text(json.dumps(d))
    one_line(*cli_in_process("convert", folder, "--no-check", "--out", tmp_path / "o.safetensors"),
             "weight_map names file")


# ---------------------------------------------------------------- --check without transformers
def test_check_without_transformers_is_one_line_and_writes_nothing(tmp_path, monkeypatch):
    folder = hf_llama(tmp_path / "hf")
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers -> ImportError
    one_line(*cli_in_process("convert", folder, "--check", "--out", tmp_path / "o.safetensors"),
             "--check needs the `transformers` package")
    assert not (tmp_path / "o.safetensors").exists()


# ---------------------------------------------------------------- a cast that overflows
@pytest.mark.parametrize("fmt", ["megalite", "hf"])
def test_dtype_fp16_of_a_weight_of_1e6_is_refused_not_written_as_inf(tmp_path, fmt):
    folder = hf_llama(tmp_path / "hf")
    from safetensors.torch import load_file
    state = load_file(folder / "model.safetensors")
    state["model.layers.1.mlp.up_proj.weight"][3, 5] = 1e6
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    out = tmp_path / ("o.safetensors" if fmt == "megalite" else "o")
    one_line(*cli_in_process("convert", folder, "--dtype", "fp16", "--format", fmt, "--no-check", "--out", out),
             "holds 1e+06, beyond torch.float16's largest finite value 65504; convert to bf16 or fp32")
    assert not out.exists()
    rc, _, err = cli_in_process("convert", folder, "--dtype", "bf16", "--no-check", "--out", tmp_path / "b.st")
    assert rc == 0, err  # bf16 holds 1e6 (as 999424: its rounding, not an overflow)


# ---------------------------------------------------------------- every file through base/fs
def test_a_weight_map_naming_a_fifo_or_a_symlink_is_refused_at_once(tmp_path):
    folder = hf_llama(tmp_path / "hf", shard="20KB")
    shard = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]["lm_head.weight"]
    real = tmp_path / "elsewhere.safetensors"
    (folder / shard).rename(real)
    os.mkfifo(folder / shard)
    p = cli("convert", folder, "--no-check", "--out", tmp_path / "o.st", timeout=60)  # a hang: TimeoutExpired
    one_line(p.returncode, p.stdout, p.stderr, "is a named pipe (FIFO), not a regular file")
    (folder / shard).unlink()
    os.mkfifo(tmp_path / "fifo")
    (folder / shard).symlink_to(tmp_path / "fifo")  # a link to a FIFO: refused at open as well, no hang
    p = cli("convert", folder, "--no-check", "--out", tmp_path / "o.st", timeout=60)
    one_line(p.returncode, p.stdout, p.stderr, "is a named pipe (FIFO), not a regular file")
    assert not (tmp_path / "o.st").exists()
    (folder / shard).unlink()
    (folder / shard).symlink_to(real)  # a link to a regular file: the Hugging Face cache's snapshot layout
    for name in ("config.json", "model.safetensors.index.json"):  # the cache links these to blobs as well
        (folder / name).rename(tmp_path / f"blob-{name}")
        (folder / name).symlink_to(tmp_path / f"blob-{name}")
    rc, _, err = cli_in_process("convert", folder, "--no-check", "--out", tmp_path / "o.st")
    assert rc == 0, err


# ---------------------------------------------------------------- one dtype table
def test_a_dtype_outside_the_table_is_refused_not_called_float32(tmp_path):
    folder = hf_llama(tmp_path / "hf")
    from safetensors.torch import load_file
    state = load_file(folder / "model.safetensors")
    state["model.norm.weight"] = state["model.norm.weight"].to(torch.float8_e4m3fn)
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    one_line(*cli_in_process("convert", folder, "--no-check", "--out", tmp_path / "o.safetensors"),
             "tensor 'model.norm.weight': dtype 'F8_E4M3', expected one of F32, BF16")


# ---------------------------------------------------------------- megalite torchrun: one line, the worker's code
@pytest.mark.parametrize("n", ["abc", "0", "-1"])
def test_torchrun_refuses_a_number_of_processes_it_cannot_start_in_one_line(n):
    p = cli("torchrun", "--standalone", "--nproc-per-node", n, "-m", "megalite", "config")
    one_line(p.returncode, p.stdout, p.stderr, f"megalite torchrun: error: --nproc-per-node {n}: expected a "
                                               f"positive number of processes")


def test_torchrun_gives_a_failed_workers_exit_code():
    p = cli("torchrun", "--standalone", "--nproc-per-node", "2", "--no-python", "sh", "-c", "exit 13")
    assert p.returncode == 13 and "Traceback" not in p.stderr, p.stderr
    assert "megalite torchrun: rank 0 exited with code 13, rank 1 exited with code 13" in p.stderr, p.stderr


def test_the_survivor_of_a_sigkilled_worker_says_one_line(tiny_toml, tmp_path):
    """Rank 1 SIGKILLed as it finishes writing its part of the step-2 save (faults.kill_point): rank 0, waiting
    for its report, fails on a closed gloo connection and says so in one line (was a 37-line gloo traceback);
    the launcher gives 128 + 9."""
    p = run([sys.executable, "-m", "megalite", "torchrun", "--standalone",
             "--nproc-per-node", "2", "-m", "megalite", "train", "--config", tiny_toml, "--train.steps=3",
             "--parallel.dp=2", "--checkpoint.interval=2", f"--checkpoint.dir={tmp_path / 'ckpt'}",
             f"--train.out_dir={tmp_path / 'run'}"], timeout=TORCHRUN_TIMEOUT,
            extra_env={"MEGALITE_KILL_POINT": "slices_written", "MEGALITE_KILL_RANK": "1"})
    ours = [line for line in p.stderr.splitlines() if line.startswith("megalite train:")]
    assert "Traceback" not in p.stdout + p.stderr and len(ours) == 1, p.stderr[-3000:]
    assert ours[0].startswith("megalite train: error: another rank of the job is gone (gloo: "), ours
    assert p.returncode == 128 + 9 and "rank 1 was killed by SIGKILL" in p.stderr, (p.returncode, p.stderr[-2000:])



# ---------------------------------------------------------------- a dead peer in NCCL's words, and c10d's types
# NCCL's texts as torch and NCCL print them: ProcessGroupNCCL's error for ncclRemoteError (ncclGetErrorString's
# "remote process exited or there was a network error"), its watchdog's timeout and abort, its socket transport
NCCL_REMOTE = ("NCCL error in: ../torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:1970, remote process exited or "
               "there was a network error, NCCL version 2.21.5\nncclRemoteError: A call failed possibly due to a "
               "network error or a remote process exiting prematurely.\nLast error:\nNET/IB : Got completion from "
               "peer 10.5.0.34<33956> with error 5")
NCCL_WATCHDOG = ("[Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=64, OpType=ALLREDUCE, "
                 "NumelIn=1, NumelOut=1, Timeout(ms)=600000) ran for 600081 milliseconds before timing out.")
NCCL_ABORTED = "NCCL communicator was aborted on rank 1."
NCCL_SOCKET = ("NCCL error in: ProcessGroupNCCL.cpp:1970, unhandled system error (run with NCCL_DEBUG=INFO for "
               "details), NCCL version 2.21.5\nLast error:\nnet.cc:747 NCCL WARN Net : Connection closed by peer")
GLOO_CLOSED = ("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Read error [127.0.0.1]:29500: Connection "
               "closed by peer")


@pytest.mark.parametrize("kind, text, said", [
    ("RuntimeError", GLOO_CLOSED, "gloo: Connection closed by peer"),
    ("RuntimeError", "[gloo/transport/tcp/pair.cc:598] Connection reset by peer", "gloo: Connection reset by peer"),
    ("DistBackendError", NCCL_REMOTE, "NCCL: ncclRemoteError"),
    ("RuntimeError", NCCL_REMOTE.replace("ncclRemoteError: ", ""),
     "NCCL: remote process exited or there was a network error"),
    ("DistBackendError", NCCL_WATCHDOG, "NCCL: Watchdog caught collective operation timeout"),
    ("DistBackendError", NCCL_ABORTED, "NCCL: NCCL communicator was aborted"),
    ("DistBackendError", NCCL_SOCKET, "NCCL: Connection closed by peer"),
    ("DistBackendError", "[c10d] Connection reset by peer", "c10d: Connection reset by peer"),
    ("DistNetworkError", "Connection reset by peer\nException raised from recvBytes at TCPStoreLibUvBackend.cpp",
     "c10d: Connection reset by peer"),
    ("DistNetworkError", "failed to recv, got 0 bytes", "c10d network error: failed to recv, got 0 bytes"),
    # an error of this rank's own keeps its traceback: a bug, a CUDA fault inside NCCL, a local socket word alone
    ("DistBackendError", "NCCL error in: ProcessGroupNCCL.cpp:1970, unhandled cuda error (run with NCCL_DEBUG=INFO "
                         "for details), NCCL version 2.21.5", None),
    ("DistBackendError", "NCCL error in: ProcessGroupNCCL.cpp:1970, invalid usage, NCCL version 2.21.5", None),
    ("RuntimeError", "Connection reset by peer", None),  # not a collective's error (an HTTP client's, say)
    ("RuntimeError", "shape mismatch in NCCL test harness", None),
    ("ValueError", GLOO_CLOSED, None),
])
def test_a_dead_peer_is_recognised_in_gloos_and_nccls_words_and_c10ds_types(kind, text, said):
    import torch.distributed as dist
    from megalite.parallel.process_group import peer_lost
    cls = {"RuntimeError": RuntimeError, "ValueError": ValueError}.get(kind) or getattr(dist, kind)
    got = peer_lost(cls(text))
    assert got == said, (kind, got)
    assert got is None or "\n" not in got  # one line, whatever the backend printed
