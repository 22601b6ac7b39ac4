"""configs/ladder_cpu.py, the size ladder of issue 37: a sweep file the sweep runs as it is."""

from tools import sweep


def test_the_ladder_is_standard_at_five_widths_on_the_replication_s_first_seeds():
    spec = sweep.load_sweep("configs/ladder_cpu.py")
    sweep.check_runs(spec)  # every width parses as train.py reads it
    replication = sweep.load_sweep("configs/replication_cpu.py")
    assert spec["seeds"] == replication["seeds"][:3] and spec["base"] == replication["base"]
    assert spec["variants"][spec["rung"]] == "" and len(spec["variants"]) == 5
    assert all(v in replication["variants"] for vs in spec["pairs"].values() for v in vs)
