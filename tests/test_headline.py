"""scripts/headline's parts (flexoffload/bench/headline.py): runs interleaved and written as they end, paired ratios
and ties, the README's table between its markers, Token Recycling's table reset and the user's put back, and the two
runners (ours and llama-completion) on a tiny synthetic model."""

import csv
import dataclasses

import pytest

from flexoffload import FlexoffloadError
from flexoffload.bench import headline as hl
from flexoffload.bench.headline import Case, Outcome, Record, Row, System
from flexoffload.memory.budgets import MiB

# it streams or profiles the real model: what it records of the disk is its own (conftest.module_cache)
pytestmark = pytest.mark.usefixtures("module_cache")


def record(row, rep, prompt, system, value, side="upstream", ok=True):
    return Record(row=row, rep=rep, prompt=prompt, system=system, side=side, value=value, ok=ok, decode_tok_s=value,
                  ttft_s=0.0, n_prompt=1, n_gen=1, tokens_per_pass=0.0, acceptance_rate=0.0, peak_mb=0.0,
                  limit_mb=0.0, wall_s=0.0, same_text="", error="" if ok else "boom", at="")


def test_ratios_are_paired_and_a_gap_inside_the_spread_is_a_tie():
    ours = [10.0, 11.0, 12.0]
    records = [record("r", i, "p", "ours", v, side="ours") for i, v in enumerate(ours)]
    records += [record("r", i, "p", "slow", v / 2) for i, v in enumerate(ours)]
    records += [record("r", i, "p", "close", v) for i, v in enumerate([11.0, 10.0, 12.5])]
    first, slow, close = hl.summarize(records, "decode_tok_s")
    assert (first.median, first.low, first.high, first.ratio) == (11.0, 10.0, 12.0, 0.0)
    assert slow.ratio == pytest.approx(2.0) and slow.verdict == "2.00x"
    assert close.ratio_low < 1 < close.ratio_high and close.verdict == "tie"
    assert first.passes == 0 and "a pass" not in hl._value(first, "decode_tok_s")
    spec = [dataclasses.replace(r, tokens_per_pass=t) for r, t in zip(records[:3], (1.2, 1.5, 2.0))]
    assert "1.50 tokens a pass" in hl._value(hl.summarize(spec, "decode_tok_s")[0], "decode_tok_s")
    # lower is better for the time to the first token: half the time is twice as good
    first, slow, _ = hl.summarize(records, "ttft_s")
    assert slow.ratio == pytest.approx(0.5)


def test_a_failed_run_is_counted_and_not_paired():
    records = [record("r", 0, "p", "ours", 4.0, side="ours"), record("r", 1, "p", "ours", 6.0, side="ours"),
               record("r", 0, "p", "up", 0.0, ok=False), record("r", 1, "p", "up", 3.0)]
    _, up = hl.summarize(records, "decode_tok_s")
    assert (up.runs, up.failed, up.median, up.ratio) == (2, 1, 3.0, 2.0)
    row = Row("r", "cap", "m (real)", "0.5x", "decode_tok_s", (), lambda: [])
    line = hl.table([row], records).splitlines()[-1]
    assert "1 of 2 failed" in line and "**2.00x**" in line and "1 prompts x 2" in line


def test_runs_interleave_are_written_as_they_end_and_a_row_run_again_replaces_its_runs(tmp_path):
    calls, before = [], [1]  # the lines on disk before this measure's first run: the header, then what was kept

    def system(label, value):
        def run(case):
            calls.append((case.prompt, label))
            assert len(list(csv.reader(out.open()))) == before[0] + len(calls) - 1  # earlier runs are on disk
            return Outcome(ok=True, decode_tok_s=value, text="same" if label != "c" else "other")
        return System(label, "ours" if label == "a" else "upstream", run)

    def cases():
        return [(p, Case(model=tmp_path, limit=MiB, mem=None, prompt=p, n_predict=1, n_ctx=8, timeout=1))
                for p in ("p1", "p2")]

    out = tmp_path / "h.csv"
    one = Row("one", "cap", "m", "s", "decode_tok_s", (system("a", 2.0), system("b", 1.0), system("c", 1.0)), cases)
    two = Row("two", "cap", "m", "s", "decode_tok_s", (system("a", 2.0), system("b", 4.0)), cases)
    hl.measure([one, two], 2, out)
    assert calls[:6] == [("p1", "a"), ("p1", "b"), ("p1", "c"), ("p2", "a"), ("p2", "b"), ("p2", "c")]
    records = hl.read_csv(out)
    assert len(records) == 2 * 2 * 3 + 2 * 2 * 2
    assert {r.same_text for r in records if r.system == "b"} == {"True"}
    assert {r.same_text for r in records if r.system == "c"} == {"False"}
    assert hl.agree("same text", "same") and hl.agree("same", "same text") and not hl.agree("", "same")
    assert not hl.agree("same text", "some text")
    calls.clear()
    before[0] = 1 + 12
    hl.measure([two], 1, out)  # row two again: its earlier runs go, row one's stay
    records = hl.read_csv(out)
    assert sum(r.row == "one" for r in records) == 12 and sum(r.row == "two" for r in records) == 4
    assert "| cap | m | s; 2 prompts x 1 |" in hl.table([one, two], records)
    with pytest.raises(FlexoffloadError, match="-r"):
        hl.measure([one], 0, out)


def test_the_table_goes_between_the_markers_only():
    text = f"intro\n{hl.BEGIN}\nold table\n{hl.END}\nrest\n"
    assert hl.replace_between(text, "new") == f"intro\n{hl.BEGIN}\nnew\n{hl.END}\nrest\n"
    with pytest.raises(FlexoffloadError, match="markers"):
        hl.replace_between("no markers here", "new")


def test_a_row_names_the_builds_that_made_it():
    old = [record("r", 0, "p", "ours", 1.0)]
    new = [dataclasses.replace(r, commit="4d51e44cd0123", native="5d1a22ae7d45b4ec") for r in old]
    assert hl.build(old) == "not recorded (before patches 0022-0030)"
    assert hl.build(new + old) == "4d51e44cd, native 5d1a22ae; not recorded"


def test_the_readme_s_table_is_what_scripts_headline_table_makes_of_the_csv(tmp_path):
    """`scripts/headline --table results/headline.csv` writes the README's block as it stands: every number in the
    table comes from the CSV, none edited by hand."""
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    readme = shutil.copy(root / "README.md", tmp_path / "README.md")
    subprocess.run([sys.executable, str(root / "scripts" / "headline"), "--table", str(root / "results" /
                    "headline.csv"), "-o", str(tmp_path / "headline"), "--readme", str(readme)],
                   check=True, capture_output=True, timeout=300)
    assert Path(readme).read_text() == (root / "README.md").read_text()
    assert (tmp_path / "headline.md").read_text().strip() in Path(readme).read_text()


def test_the_recycling_table_is_reset_before_each_run_and_the_users_is_put_back(tmp_path):
    store, warm = tmp_path / "table.npz", tmp_path / "warm.npz"
    store.write_text("the user's")
    warm.write_text("warmed")
    with hl.Reset(store=store, warm=warm) as reset:
        assert not store.exists()  # set aside
        store.write_text("left by a run")
        reset()
        assert store.read_text() == "warmed"
    assert store.read_text() == "the user's"
    store.unlink()
    with hl.Reset(store=store, warm=tmp_path / "none.npz") as reset:
        store.write_text("left by a run")
        reset()
        assert not store.exists()  # no warm copy: each run starts with no table
    assert not store.exists()


def test_ours_and_llama_completion_run_in_the_same_cgroup_and_agree(tiny_model):
    case = Case(model=tiny_model, limit=512 * MiB, mem=None, prompt="Once upon a time\n", n_predict=12, n_ctx=128,
                timeout=300)  # a final newline, which llama-completion's -f would drop
    ours = hl.flexoffload(spec_type="none")(case)
    upstream = hl.completion("--no-repack")(case)
    assert ours.ok and upstream.ok, (ours.error, upstream.error)
    assert ours.decode_tok_s > 0 and upstream.decode_tok_s > 0 and upstream.ttft_s > 0
    assert 0 < ours.peak_mb <= 512 and 0 < upstream.peak_mb <= 512
    assert upstream.n_gen == ours.n_gen == 12
    assert upstream.text == ours.text
    starved = hl.completion()(Case(model=tiny_model, limit=MiB, mem=None, prompt="x", n_predict=4, n_ctx=64,
                                   timeout=120))
    assert not starved.ok and starved.error
