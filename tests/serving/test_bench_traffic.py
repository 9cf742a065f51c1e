"""scripts/bench_traffic.py's summary: ratios, acceptance and NVML's J/token per (temperature, category, mode)."""
from scripts.bench_traffic import summarise, to_markdown


def record(mode: str, tokens: int, wall: float, energy: float | None, drafted: int = 0, accepted: int = 0) -> dict:
    return dict(temperature=0.0, category="code", mode=mode, tokens=tokens, wall_s=wall, zero_draft_steps=0,
                stats=dict(steps=10, draft_tokens=drafted, accepted_tokens=accepted, energy_j=energy))


def test_summary_reports_joules_per_token_only_when_every_request_was_measured():
    recs = [record("target", 64, 2.0, 6.4), record("target", 64, 2.0, 6.4),
            record("default", 64, 1.0, 3.2, drafted=40, accepted=30), record("default", 64, 1.0, None, 40, 30)]
    rows, gm = summarise(recs, [0.0], ["code"], ["default", "target"])
    by = {r["mode"]: r for r in rows}
    assert by["target"]["j_per_token"] == 0.1                   # 12.8 J over 128 tokens
    assert by["default"]["j_per_token"] is None                 # one request without a reading: no figure
    assert by["default"]["ratio_to_target"] == 2.0 and by["default"]["acceptance"] == 0.75
    assert gm["0.0"]["default"] == 2.0
    md = to_markdown("setup", rows, gm, [0.0], ["default", "target"])
    assert "J/token" in md and "| 0.100 |" in md


def test_summary_has_no_energy_column_on_the_cpu():
    recs = [record("target", 64, 2.0, None), record("default", 64, 1.0, None, drafted=8, accepted=4)]
    rows, gm = summarise(recs, [0.0], ["code"], ["default", "target"])
    assert all(r["j_per_token"] is None for r in rows)
    assert "J/token" not in to_markdown("setup", rows, gm, [0.0], ["default", "target"])


def test_repeats_use_each_prompts_median_time_per_token_and_keep_the_plain_sums():
    def rep(mode, prompt, repeat, wall):
        return dict(record(mode, 64, wall, None), prompt_index=prompt, repeat=repeat)
    # prompt 0: the target's second of three runs was slowed 3x by other load; the median ignores it
    recs = [rep("target", 0, 0, 2.0), rep("target", 0, 1, 6.0), rep("target", 0, 2, 2.2),
            rep("default", 0, 0, 2.1), rep("default", 0, 1, 2.1), rep("default", 0, 2, 2.0)]
    rows, gm = summarise(recs, [0.0], ["code"], ["default", "target"])
    by = {r["mode"]: r for r in rows}
    assert by["target"]["prompts"] == 1 and by["target"]["repeats"] == 3
    assert by["target"]["tokens_per_s"] == round(64 / 2.2, 3)        # the median run, not the 6 s one
    assert by["default"]["ratio_to_target"] == round(2.2 / 2.1, 3)
    assert by["default"]["ratio_all_runs"] == round(10.2 / 6.2, 3)   # all runs: the slow one counts
    assert gm["0.0"]["default"] == round(2.2 / 2.1, 3)
    md = to_markdown("setup", rows, gm, [0.0], ["default", "target"])
    assert "vs target (all runs)" in md and "median seconds per token" in md


def test_an_even_number_of_repeats_averages_the_two_middle_runs():
    from scripts.bench_traffic import repeat_medians

    recs = [dict(prompt_index=0, tokens=10, wall_s=1.0), dict(prompt_index=0, tokens=10, wall_s=3.0),
            dict(prompt_index=1, tokens=20, wall_s=2.0)]
    tokens, wall = repeat_medians(recs)
    assert tokens == 30 and abs(wall - (2.0 + 2.0)) < 1e-9


def test_row_variants_set_one_knob_of_the_heads_tree():
    import argparse

    import pytest

    from scripts.bench_traffic import make_spec

    args = argparse.Namespace(medusa_heads="h", eagle_head=None, gamma=3, beams=4, tau=0.1)
    assert make_spec("default+lookup=0", args).extra["lookup_ngram"] == 0
    spec = make_spec("default+floor=0.2", args)
    assert spec.mode == "medusa" and spec.extra["node_floor"] == 0.2 and spec.extra["rule"] == "mjsd"
    assert make_spec("medusa+typical", args).extra["rule"] == "typical"
    with pytest.raises(ValueError, match="lookup= takes an integer"):
        make_spec("default+lookup=two", args)
    with pytest.raises(ValueError, match="lookup_ngram must be an integer in"):
        make_spec("default+lookup=-1", args)
    # engine knobs leave the request's spec as the plain mode's
    assert make_spec("mjsd+nostore", args) == make_spec("mjsd", args)
