"""`megalite bench ckpt|train|dcp` run end to end at a tiny size and print their tables (timings are not checked)."""
from __future__ import annotations

import re
import shlex

import pytest

from helpers import cli, ok
from benchmarks import transcripts


def _run(*args, cwd) -> str:
    return ok(cli("bench", *args, cwd=cwd, timeout=600)).stdout


def _documented(session: str, tmp_path, *extra) -> tuple:
    """The bench as docs/performance.md and docs/parallelism.md show it, run once at the small size of
    transcripts.SMALL_ARGS: (its output, the shown lines whose shape it no longer prints)."""
    outs = []

    def runner(cmd):
        outs.append(_run(*shlex.split(cmd)[2:], *extra, cwd=tmp_path))
        return outs[-1]

    problems = transcripts.check(session, runner)
    assert len(outs) == 1
    return outs[0], problems


def test_bench_ckpt_prints_its_table(tmp_path):
    out, shown = _documented("bench-ckpt", tmp_path, "--dir", str(tmp_path))
    assert "--size-mb 8 --world 2 --repeats 1" in transcripts.small_command("bench-ckpt", "megalite bench ckpt")
    assert "operation" in out and "median s (min-max)" in out and "vs DCP" in out and "of disk" in out
    for op in ("disk write, 1 stream", "disk read, 2 streams", "megalite save", "megalite load",
               "megalite load, resharded", "megalite async save: blocked", "megalite async save: until commit",
               "DCP save", "DCP load", "DCP async_save: blocked", "gather + torch.save", "torch.load (rank 0)",
               "megalite async save, copied: blocked", "megalite async save, copied: until commit",
               "AdamW step, in place", "AdamW step, out of place (after async save)",
               "megalite convert", "dcp_to_torch_save"):
        assert f"\n{op} " in out, op
    assert "page cache:" in out
    # each measurement is printed as it is made, before the summary: one row per operation and repeat
    live, summary = out.split("median s (min-max)", 1)  # the first size's live rows, then the rest
    for op in ("megalite save", "megalite async save: blocked", "megalite load, resharded", "DCP load"):
        assert re.search(rf"\n{re.escape(op)} +1 +\d+\.\d{{3}} ", live), op
    assert len(re.findall(r"\nmegalite load, resharded +1 ", live)) == 2, "same-layout and resharded loads: ABBA"
    for probe in ("disk write, 1 stream", "disk write, 2 streams", "disk read, 1 stream", "disk read, 2 streams"):
        assert len(re.findall(rf"\n{probe} +1 ", live)) >= 2, f"{probe}: repeated until two of the repeat agree"
    assert re.search(r"async blocked / sync save: [\d.]+% \(ratio of medians", summary)
    assert re.search(r"async blocked with a staging copy / sync save: [\d.]+% \(ratio of medians", summary)
    # the cost row times the steps that run while the writer works, against as many plain steps side by side
    for op in ("AdamW steps while an async save writes", "AdamW steps, as many, no save"):
        assert f"\n{op} " in out, op
    assert re.search(r"what an async save costs the training loop: blocked [\d.]+ s \+ the [\d.]+ AdamW steps that "
                     r"ran while it wrote, over as many in-place steps without a save \([\d.]+ s against [\d.]+ s, "
                     r"the blocked time included\) = -?[\d.]+ s = -?[\d.]+% of the sync save", summary)
    assert re.search(r"CPU time the async save added to the 2 ranks' processes: -?[\d.]+ s \(median over repeats: "
                     r".*; where the loop keeps all \d+ cores busy that is -?[\d.]+ s of its time = -?[\d.]+% of the "
                     r"sync save", summary)
    assert re.search(r"resharded / same-layout load: [\d.]+x \(ratio of medians over 2 loads each", summary)
    # the waiting loop (steps asleep, as a host thread waits on its GPU): page cache and O_DIRECT, each repeat
    for op in ("megalite async save: waiting loop's cost", "megalite async, O_DIRECT: waiting loop's cost"):
        assert re.search(rf"\n{re.escape(op)} +1 +-?\d+\.\d{{3}} ", live), op
    assert re.search(r"what an async save costs a loop that waits \(50 ms asleep per step, .*\): through the page "
                     r"cache -?[\d.]+% \(.*\), with O_DIRECT -?[\d.]+% \(.*\) of the sync save", summary)
    assert "megalite async save: cost to the loop " in summary
    assert "disk probe: each repeat writes, then reads, the probe files" in summary
    # docs/performance.md runs it over sizes: one whole run per size, then the scaling table and the fits
    assert "--sizes 4,8 --world 2 --repeats 1" in transcripts.small_command(
        "bench-ckpt", "megalite bench ckpt --sizes 128,512,1024 --repeats 2")
    assert out.count("bench ckpt: GPT n_layer=") == 2 and "\nscaling over 4, 8 MiB: seconds per GiB" in out
    assert re.search(r"\nmegalite load \| DCP load +4 +[\d.]+ +[\d.]+ +[\d.]+x\n", out)
    assert re.search(r"\nmegalite save: -?[\d.]+ s fixed \+ -?[\d.]+ s/GiB \(least squares over 2 sizes\)", out)
    assert list(tmp_path.iterdir()) == [], "the benchmark leaves nothing behind"
    assert shown == [], "docs/performance.md shows lines the bench no longer prints"


def test_bench_train_prints_its_tables(tmp_path):
    out, shown = _documented("bench-train", tmp_path)
    assert "--steps 2 --nproc 2 --n-embd 32 --block-size 32 --rounds 1 --pairs 2 --bubble-wait-ms 2" in \
        transcripts.small_command("bench-train", "megalite bench train")
    assert shown == [], "docs/performance.md or docs/parallelism.md shows lines the bench no longer prints"
    assert re.search(r"megalite / plain tokens/s: [\d.]+ \(median of 2 pairs; range [\d.]+-[\d.]+\)", out), out
    assert re.search(r"\n1( +[\d.]+){6}\n2( +[\d.]+){6}\n", out), "one row per pair: wall and CPU ms, ratios"
    assert re.search(r"megalite / plain tokens/s by CPU time per step: [\d.]+ \(median of 2 pairs; range", out), out
    for header in ("tokens/s", "idle measured", "theory", "saved activations", "tp,pp,dp", "comm"):
        assert header in out, header
    for row in ("\nplain ", "\nmegalite ", "1f1b", "afab", "\n1,1,2 ", "\n1,2,1 ", "\n2,1,1 "):
        assert row in out, row
    # issue 13's tables: activation bytes per recompute x sp (measured = the adapted formula), the interleaved
    # bubble, exposed dp reduction with and without overlap, bf16 vs fp32
    for header in ("4. activation bytes", "measured/formula", "5. interleaved 1F1B", "6. exposed dp gradient",
                   "overlap_grad_reduce", "7. precision", "\nbf16 "):
        assert header in out, header
    # table 5: the real schedule with sleeping chunks ("wait") and the real model, V = 1 and 2, m = 4 and 8
    for kind in ("wait", "model"):
        for vpp, m in ((1, 4), (1, 8), (2, 4), (2, 8)):
            assert re.search(rf"\n{kind} +2 +{vpp} +{m} ", out), (kind, vpp, m)
    assert "t_f = 2.0 ms at pp 2 per stage forward" in out and "below 1F1B" in out
    for rc in ("none", "selective", "full"):
        for sp in ("off", "on"):
            assert re.search(rf"\n2 +{rc} +{sp} .* 1\.000 ", out), (rc, sp)
    # issue 22's table: cp = 1, 2 and tp = 2 at 2 ranks; one layer's saved bytes per rank equal the formula at
    # s/cp tokens, and cp = 2 saves half of cp = 1
    # (and the attention and MLP regions apart: each equal to its formula, each halved by cp = 2)
    assert "8. context parallelism at 2 ranks: 32-token sequences" in out
    rows = {m[1]: m for m in re.finditer(r"\n(\d,\d,\d,\d)" + r" +([\d.]+)" * 9 + " ", out)}
    assert set(rows) == {"1,1,2,1", "1,1,1,2", "2,1,1,1"}, rows.keys()
    for m in rows.values():  # measured == formula for the layer, attention and MLP; attention + MLP = layer
        assert m[2] == m[3] and m[5] == m[6] and m[8] == m[9], m[0]
        assert float(m[5]) + float(m[8]) == pytest.approx(float(m[2]), abs=0.1), m[0]
    assert [rows["1,1,1,2"][i] for i in (4, 7, 10)] == ["0.500"] * 3 and rows["1,1,2,1"][4] == "1.000"
    # at cp = 1 by hand (s = 32, h = 32, a = 4, fp32): attention 2sh + 2s + 4sh + sa = 6336 elements = 24.75 KiB,
    # MLP 2sh + 2s + 8sh = 10304 elements = 40.25 KiB
    assert rows["1,1,2,1"][6] == f"{6336 * 4 / 1024:.1f}" and rows["1,1,2,1"][9] == f"{10304 * 4 / 1024:.1f}"
    # issue 32's tables: the Llama pairs against transformers, and a Llama block's saved bytes = its formula at
    # tp 1, 2 (kv heads split) and cp 2
    assert re.search(r"megalite / transformers tokens/s \(Llama\): [\d.]+ \(median of 2 pairs; range", out), out
    # issue 41's table: zero 0..3 at dp 2, the bytes each rank holds and sends equal `bench plan --memory`'s
    zero = re.findall(r"\n2 +([0-3]) +[\d.]+ +([\d.]+) +([\d.]+) +([\d.]+) +([\d.]+)(?=\n)", out)
    assert [z[0] for z in zero] == ["0", "1", "2", "3"], out
    assert all(z[1] == z[2] and z[3] == z[4] for z in zero), zero
    llama = {m[1]: m for m in re.finditer(r"\n(\d,\d,\d,\d)" + r" +([\d.]+)" * 5 + r"(?=\n)", out)}
    assert set(llama) == {"1,1,2,1", "2,1,1,1", "1,1,1,2"}, llama.keys()
    for m in llama.values():
        assert m[2] == m[3] and m[4] == m[5], m[0]


def test_bench_dcp_prints_its_table(tmp_path):
    """Through the CLI's main() in this process (its 2-rank save reuses the warm run_parallel fork server; the
    conversions it measures still run in fresh interpreters)."""
    import contextlib
    import io
    from megalite.cli import main
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(["bench", "dcp", "--size-mb", "6", "--repeats", "1", "--dir", str(tmp_path)]) == 0
    out = buf.getvalue()
    assert "DCP checkpoint" in out and "as DTensor shards of 2 gloo ranks" in out
    for op in ("megalite convert", "dcp_to_torch_save"):
        assert re.search(rf"\n{op} +1 +\d+\.\d{{3}} ", out), op  # the live row
        assert re.search(rf"\n{op} +[\d.]+ MiB +\d+\.\d{{3}} \(", out), op  # the summary row
    assert re.search(r"megalite convert / dcp_to_torch_save: time [\d.]+x \(ratio of medians; [\d.]+-[\d.]+x in the "
                     r"pairs measured together\); peak RSS growth \d+ / \d+ MiB", out)
    assert list(tmp_path.iterdir()) == [], "the benchmark leaves nothing behind"


def test_bench_documents_prints_its_table(tmp_path, capsys):
    """`megalite bench documents` as docs/performance.md shows it, small (transcripts.SMALL_ARGS), in this process:
    every shown line's shape is printed, each setting once a round, the documents' rows hold several documents
    and not every target counts (padding, document starts), nothing is left behind."""
    from megalite.cli import main
    outs = []

    def runner(cmd):
        assert main([*shlex.split(cmd)[1:], "--dir", str(tmp_path)]) == 0
        outs.append(capsys.readouterr().out)
        return outs[-1]

    assert transcripts.check("bench-documents", runner) == []
    [out] = outs
    for setting in ("windows", "documents", "documents \\+ document_mask"):
        assert len(re.findall(rf"\n{setting} +[12] +[\d.]+ ", out)) == 2, setting
    docs = re.search(r"\ndocuments \+ document_mask +1 +[\d.]+ +[\d.]+ +([\d.]+) +([\d.]+)%", out)
    assert float(docs.group(1)) > 1 and float(docs.group(2)) < 100, out
    assert re.search(r"\ndocuments \+ document_mask / windows CPU ms per step: [\d.]+x \(median of 2 rounds; range", out)
    for setting in ("windows", "documents", "documents \\+ document_mask"):  # the loader outruns the step
        drawn, times, used = re.search(rf"\n{setting} loader: ([\d,]+) tokens/s drawn \(CPU\), ([\d,]+)x the ([\d,]+) "
                                       r"tokens/s a training step consumes", out).groups()
        drawn, times, used = (int(v.replace(",", "")) for v in (drawn, times, used))
        assert times > 1 and abs(drawn / used - times) <= 1, (setting, drawn, times, used)
    assert list(tmp_path.iterdir()) == []


def test_stream_table_prints_each_row_when_it_is_measured():
    """A long bench is not silent until the end: the header and each row reach the log as they come."""
    from megalite.bench import StreamTable, table
    lines = []
    t = StreamTable(["operation", "bytes", "s"], [10, 8, 6], log=lines.append)
    assert lines == []
    t.row(["save", "1 MiB", 0.5])
    assert len(lines) == 3 and lines[2].split() == ["save", "1", "MiB", "0.5"]
    t.row(["load", "1 MiB", None])
    assert len(lines) == 4 and lines[3].split() == ["load", "1", "MiB", "-"]
    assert t.text() == table(["operation", "bytes", "s"], [["save", "1 MiB", 0.5], ["load", "1 MiB", None]])
    with pytest.raises(ValueError, match="2 cells for 3 columns"):
        t.row(["x", "y"])


def test_the_scaling_table_gives_s_per_gib_ratios_and_a_fit():
    """`bench ckpt --sizes`: s/GiB per size for both sides, their ratio, and a least-squares fixed + per-GiB fit
    that recovers a line it was given (hand computation: t = 0.09 + 0.79 x, the issue's save)."""
    from megalite.bench.scaling import fit_line, scaling_lines
    G = 2**30
    runs = {mb: [{"op": "megalite save", "bytes": mb * 2**20, "median_s": 0.09 + 0.79 * mb / 1024},
                 {"op": "DCP save", "bytes": mb * 2**20, "median_s": 2 * (0.09 + 0.79 * mb / 1024)}]
            for mb in (128, 512, 1024)}
    a, b = fit_line([(r[0]["bytes"] / G, r[0]["median_s"]) for r in runs.values()])
    assert abs(a - 0.09) < 1e-9 and abs(b - 0.79) < 1e-9
    out = "\n".join(scaling_lines(runs, [("megalite save", "DCP save")], ["megalite save"]))
    rows = [ln.split()[5:] for ln in out.splitlines() if ln.startswith("megalite save | DCP save")]
    # at 128 MiB: (0.09 + 0.79 / 8) / (1 / 8) = 1.510 s/GiB; the peer twice that; ratio 0.50x at every size
    assert rows[0] == ["128", "1.510", "3.020", "0.50x"], rows
    assert [r[0] for r in rows] == ["128", "512", "1024"] and all(r[3] == "0.50x" for r in rows) and "megalite save: 0.090 s fixed + 0.790 s/GiB (least squares over 3 sizes)" in out


def test_bench_sizes_must_be_positive_numbers(capsys):
    from megalite.cli import main
    assert main(["bench", "ckpt", "--sizes", "128,x"]) != 0
    assert "--sizes '128,x': expected sizes in MiB separated by commas" in capsys.readouterr().err


def test_summary_memory_is_per_row_growth_and_of_disk_above_100_is_marked():
    """A row's memory is its own growth (a later row's higher absolute peak is not charged to it), and a read
    faster than the best probe is marked, not silently shown as >100%."""
    from megalite.bench.ckpt import _rows, format_rows, stable
    rec = {"disk read, 1 stream": [{"s": 1.0, "rss": 2000, "extra": 0}],
           "megalite load": [{"s": 0.8, "rss": 1700, "extra": 20}, {"s": 0.8, "rss": 1680, "extra": 2}],
           "torch.load (rank 0)": [{"s": 1.0, "rss": 2270, "extra": 500}]}
    rows = {r["op"]: r for r in _rows(rec, {k: 10**9 for k in rec})}
    assert rows["megalite load"]["growth_mib"] == (11, 2, 20)
    text = format_rows(list(rows.values()))
    assert "+11 (+20)" in text and "2270" not in text and "125%!" in text
    assert stable([{"s": 1.0}, {"s": 1.09}]) and not stable([{"s": 1.0}, {"s": 1.2}]) and not stable([{"s": 1.0}])


def test_the_scaling_fit_is_never_a_line_through_sizes_that_moved_the_same_bytes():
    """`bench ckpt --sizes 8,16 --world 2` builds one model for both sizes (its smallest): the bytes differ only
    by a manifest's few bytes, and a least-squares line through them was noise (-61870 s fixed + 5726436 s/GiB).
    `bench dcp --sizes 8,16` moved identical bytes and printed no fit and no reason. Both now say why."""
    from megalite.bench.scaling import scaling_lines
    runs = {8: [{"op": "megalite save", "bytes": 11_597_000, "median_s": 0.063},
                {"op": "DCP save", "bytes": 11_598_000, "median_s": 0.087}],
            16: [{"op": "megalite save", "bytes": 11_597_400, "median_s": 0.079},
                 {"op": "DCP save", "bytes": 11_598_400, "median_s": 0.116}]}
    out = "\n".join(scaling_lines(runs, [("megalite save", "DCP save")], ["megalite save"]))
    assert "s fixed +" not in out, out
    assert "megalite save: no fixed + per-GiB fit: every size moved about the same bytes (11.06, 11.06 MiB" in out
    assert re.search(r"\nmegalite save \| DCP save +8 +5\.833 +8\.054 +0\.72x\n", out), out  # the table stays
    same = {mb: [{"op": "megalite convert", "bytes": 29_392_000, "median_s": 0.08},
                 {"op": "dcp_to_torch_save", "bytes": 29_392_000, "median_s": 0.09}] for mb in (8, 16)}
    out = "\n".join(scaling_lines(same, [("megalite convert", "dcp_to_torch_save")], ["megalite convert"]))
    assert "megalite convert: no fixed + per-GiB fit: every size moved about the same bytes" in out, out


def test_the_disk_probe_is_repeated_within_each_repeat_until_stable():
    """PROBE_RULE: two timings of the same repeat must agree. The last read of the repeat before (of files
    written anew since) once counted, so a repeat could stop after a single read."""
    from megalite.bench.ckpt import PROBE_TRIES, probe_until_stable
    rows = ["disk read, 1 stream", "disk read, 2 streams"]
    rec = {r: [{"s": 1.0}] for r in rows}  # the repeat before's last probe of each
    feed = iter([1.0, 1.0, 1.02, 1.01])  # the first try agrees with the repeat before: not enough

    def once():
        for r in rows:
            rec[r].append({"s": next(feed)})

    assert probe_until_stable(once, rows, rec) == 2 and len(rec[rows[1]]) == 3
    rec = {r: [{"s": 1.0}] for r in rows[:1]}
    feed = iter([1.0, 1.05])
    assert probe_until_stable(lambda: rec[rows[0]].append({"s": next(feed)}), rows[:1], rec) == 2
    rec = {rows[0]: []}
    slow = iter([1.0, 2.0, 1.0, 2.0, 1.0])
    assert probe_until_stable(lambda: rec[rows[0]].append({"s": next(slow)}), rows[:1], rec) == PROBE_TRIES
    assert len(rec[rows[0]]) == PROBE_TRIES
    votes = []  # every rank decides alike: the collective vote is asked from the second try on, once per try
    rec = {rows[0]: []}
    steady = iter([1.0, 1.0])
    assert probe_until_stable(lambda: rec[rows[0]].append({"s": next(steady)}), rows[:1], rec,
                              lambda ok: votes.append(ok) or ok) == 2 and votes == [True]


@pytest.mark.skipif(not __import__("os").path.exists("/proc/self/status"), reason="needs Linux /proc")
@pytest.mark.parametrize("reset", [True, False], ids=["VmHWM reset", "no clear_refs: polled"])
def test_a_rows_memory_is_its_own_growth_even_where_the_peak_cannot_be_reset(monkeypatch, reset):
    """bench ckpt's rows and conversions: peak over the RSS at the row's start. Where VmHWM cannot be reset
    (no writable /proc/self/clear_refs) it still held an earlier row's 200 MiB peak, charged to the next row."""
    import numpy as np
    import megalite.bench as b
    if not reset:
        monkeypatch.setattr(b, "reset_peak_rss", lambda: False)
    before = np.ones(200 << 17)  # 200 MiB, touched: an earlier row's peak, freed before this row
    del before
    mem = b.track_rss(interval=0.001)
    row = np.ones(40 << 17)  # this row: 40 MiB, held until the row ends
    peak, growth = mem()
    del row
    assert 30 < growth < 80, (peak, growth)
    assert peak - growth == pytest.approx(b.rss_mib(), abs=20)


class _Stop(Exception):
    pass


def _fail(*_):
    raise _Stop("the first line printed fails (a closed pipe)")


def test_every_bench_removes_its_temp_folder_when_it_fails(tmp_path, monkeypatch):
    """bench ckpt and bench train made their folder before the `try` that removes it, and printed a line in
    between; `python -m benchmarks stress ckpt` (no --workdir) never removed its folder. Each fails here at
    its first step after making the folder; nothing is left behind."""
    import tempfile
    import benchmarks.stress as stress
    from megalite.bench.ckpt import bench_ckpt
    from megalite.bench.documents import bench_documents
    from megalite.bench.prepare import bench_prepare
    from megalite.bench.train import bench_train
    for name, run in (("ckpt", lambda d: bench_ckpt(size_mb=1, world=2, repeats=1, dir=d, log=_fail)),
                      ("train", lambda d: bench_train(workdir=d, log=_fail)),
                      ("prepare", lambda d: bench_prepare(size_mb=0.05, vocab_size=300, rounds=1, dir=d,
                                                          log=_fail)),
                      ("documents", lambda d: bench_documents(size_mb=0.05, vocab_size=300, n_layer=1, n_embd=32,
                                                              block_size=32, dir=d, log=_fail))):
        d = tmp_path / name
        d.mkdir()
        with pytest.raises(_Stop):
            run(str(d))
        assert list(d.iterdir()) == [], f"bench {name} left {list(d.iterdir())}"
    d = tmp_path / "stress"
    d.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(d))

    def no_torchrun(*a, **k):
        raise _Stop("torchrun could not start")
    monkeypatch.setattr(stress, "_torchrun", no_torchrun)
    with pytest.raises(_Stop):
        stress.stress_ckpt(trials=1, log=_fail)
    assert list(d.iterdir()) == [], f"stress ckpt left {list(d.iterdir())}"
