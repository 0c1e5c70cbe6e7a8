"""`megalite bench plan` on a small shape: the numbers it prints are checked against hand counts (GPT-2's
parameter formula, slices per tensor), a resume at another layout reads exactly each rank's own share, and
the manifest checks it runs do catch a broken manifest."""
import math

import pytest

import helpers as H
from megalite.bench.plan import bench_plan, bench_plan_cli, plan_layout, stage_tensors, validate
from megalite.cli import build_parser
from megalite.config import ConfigError

L, C, NH, V, T = 4, 64, 4, 256, 32
MODEL = {"n_layer": L, "n_head": NH, "n_embd": C, "block_size": T, "vocab_size": V, "dropout": 0.0}
# GPT-2: wte + wpe + per layer (qkv 3C^2+3C, proj C^2+C, fc 4C^2+4C, proj 4C^2+C, two LayerNorms 4C) + ln_f 2C
N_PARAMS = V * C + T * C + L * (12 * C * C + 13 * C) + 2 * C


def _quiet(**kw):
    return bench_plan(L, C, NH, V, block_size=T, log=lambda *a: None, **kw)


@pytest.mark.parametrize("zero1", [False, True])
def test_counts_match_hand_computation(zero1):
    rows = _quiet(tp=2, pp=2, dp=[1, 2, 4], zero1=zero1)["rows"]
    assert [r.ranks for r in rows] == [4, 8, 16]
    # slices: 25 tensors split over tp (wte + 6 per layer), 27 replicated (wpe, ln_f x2, 6 per layer); each
    # written as a weight and two moments. dp cuts each (stage, tp rank)'s flat space in dp ranges: each of
    # the dp - 1 cuts splits at most one tensor in two, so at most 3 (pp tp (dp - 1)) more slices, with or
    # without ZeRO-1 (its moments are cut the same way), not dp times the tensors
    base = 3 * (2 * (1 + 6 * L) + 3 + 6 * L)
    for r, dp in zip(rows, [1, 2, 4]):
        assert r.problems == 0
        assert r.files == 3 * r.ranks  # model, optimizer and state.json per coordinate
        assert r.write_mean * r.ranks == pytest.approx(12 * N_PARAMS)  # fp32 weights + two AdamW moments, once
        assert r.gather_msgs == 2 * dp - 1 + 1  # rank 0: the other tp x dp ranks of stage 0, stage 1's leader
        assert base <= r.slices <= base + 3 * 2 * 2 * (dp - 1), (dp, r.slices, base)
    assert rows[0].slices == base


def test_every_dp_rank_of_a_stage_writes_the_same_bytes():
    # one stage (no pipeline imbalance): every rank writes 1/8 of the model and moments, but for the
    # replicated tensors (3,712 of 218,496 parameters), written by one tp rank each, and the last range's rounding
    row = _quiet(tp=2, pp=1, dp=[4])["rows"][0]
    assert row.write_mean == pytest.approx(12 * N_PARAMS / 8)
    assert row.write_max / row.write_mean < 1.02, (row.write_max, row.write_mean)


def test_resume_elsewhere_reads_only_its_share():
    cases = [(False, (2, 2, 2), (1, 4, 2)),  # tp 2 -> 1: whole source slices
             (True, (2, 2, 2), (2, 1, 4)), (True, (2, 2, 4), (2, 4, 1))]  # same tp: only the overlapping ranges
    for zero1, src, dst in cases:
        out = _quiet(tp=src[0], pp=src[1], dp=[src[2]], zero1=zero1, reshard_to=dst)
        r = out["reshard"]
        assert r["ranks"] == math.prod(dst)
        assert r["read_over_needed_max"] == 1.0, (zero1, src, dst, r)
        assert 0 < r["files_max"] <= out["rows"][0].files
    # tp 2 -> 4: a column half of a row-parallel weight (attn.proj C x C, mlp.proj C x 4C, split on dim 1;
    # 8 and 32 fp32 of a row) is read as the span of the source slice (read_ranges, as read_stored: rows are
    # not read 32 bytes at a time), i.e. twice those tensors' bytes: 5 C^2 of a layer's 12 C^2 parameters
    # read twice, 1 + 5/12 = 1.42 on the layers; more, but under 1.5, on the ranks that hold few other bytes
    r = _quiet(tp=2, pp=2, dp=[2], reshard_to=(4, 1, 2))["reshard"]
    assert 1.0 < r["read_over_needed_max"] < 1.5, r


def test_zero1_resume_across_a_tp_change_reads_only_the_rows_it_needs():
    # Before: a ZeRO-1 piece of a tp-split tensor whose tp box changed was cut from the whole source boxes
    # (12 bytes per parameter instead of 4 + 8 / dp: 1.5x here). Now each source piece is read only over
    # the rows of the destination piece: at most a partial row more at each end of a piece.
    r = _quiet(tp=2, pp=2, dp=[4], zero1=True, reshard_to=(1, 2, 2))["reshard"]
    assert 1.0 <= r["read_over_needed_max"] < 1.05, r


def test_validation_names_a_broken_manifest():
    from megalite.checkpoint import manifest as mf
    row, man = plan_layout(MODEL, 2, 2, 2)
    assert row.problems == 0
    d = man.to_json()
    assert validate(d) == []
    sl = d["model"]["blocks.0.attn.qkv.weight"]["slices"]
    sl[1]["box"] = sl[0]["box"]  # two slices of the same region, none of the other half
    assert validate(d) and "was edited" in validate(d)[0]
    assert any("overlap" in p for p in validate(mf.sign(d)))
    del d["files"]["tp01-pp01-dp01/state.json"]
    # a coordinate without state.json: the layout is checked against the listed state.json files first
    assert any("has 8 coordinates but 'files' lists 7 state.json" in p for p in validate(mf.sign(d)))


def test_interleaved_stages_hold_every_pp_th_chunk():
    stages = stage_tensors(MODEL, 1, 2, vpp=2)
    layers = [sorted({int(p.placement.split(".")[1]) for _, p in s if p.placement.startswith("layer.")})
              for s in stages]
    assert layers == [[0, 2], [1, 3]]


def test_cli_prints_the_table_and_refuses_bad_flags():  # errors: main() prints them as one line, exit 2
    r = H.ok(H.cli("bench", "plan", "--n-layer", L, "--n-embd", C, "--n-head", NH, "--vocab-size", V,
                   "--block-size", T, "--tp", 2, "--pp", 2, "--dp", "1,2", "--zero1", "--reshard-to", "2,1,4"))
    lines = r.stdout.splitlines()
    assert lines[0].startswith("bench plan:") and f"{N_PARAMS:,} parameters" in lines[0]
    assert lines[1].split()[:5] == ["tp,pp,dp", "ranks", "files", "slices", "manifest"]
    assert [ln.split()[0] for ln in lines[3:5]] == ["2,2,1", "2,2,2"]
    assert "read / the rank's own weights + moments: max 1.00x" in r.stdout
    for flags, match in ([["--n-head", "4", "--tp", "3"], "--tp 3 does not divide --n-head 4"],
                         [["--reshard-to", "8,8"], "--reshard-to '8,8': expected 3"], [["--dp", "0"], "--dp '0'"],
                         [["--pp", "64", "--vpp", "2"], "--pp 64 x --vpp 2 is larger than --n-layer 96"]):
        with pytest.raises(ConfigError, match=match):
            bench_plan_cli(build_parser().parse_args(["bench", "plan", *flags]))


def test_the_documented_tables_still_have_their_shape(tmp_path):
    """docs/performance.md's two `megalite bench plan` tables (175B shape, 16,384 ranks), run small
    (transcripts.SMALL_ARGS) in this process: every shown line is still a line the bench prints."""
    from benchmarks import transcripts

    def runner(cmd):
        rc, out = transcripts.run_command(cmd, tmp_path)
        assert rc == 0, out
        return out

    assert transcripts.check("bench-plan", runner) == []
