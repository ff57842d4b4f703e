"""The gate's baseline: counted figures on every machine, timings per machine class."""

from dlmrt.bench import gate
from dlmrt.bench.machine import cpu_info, machine_class


def case(setting, ratio, ci, digest="d"):
    return {"setting": setting, "tokens_sha256": digest, "nfe": 4, "tpf": 2.0, "work": None, "speedup": ratio,
            "speedup_ci": ci, "seconds_runs": [1.0 / ratio] * 9}


def run(eager_ratio=1.8, eager_ci=(1.76, 1.84), digest="d"):
    return {"exact_match": None, "canary": None,
            "cases": [case("reference", 1.0, [1.0, 1.0]), case("torch:eager", eager_ratio, list(eager_ci), digest)]}


def baseline_on(machine, eager_ratio):
    """A baseline of scenario tiny whose timings were recorded on `machine`."""
    return gate.record("test", {"tiny": run(eager_ratio, (eager_ratio, eager_ratio))}, machine)


def test_a_scenario_s_margin_is_the_drop_its_ratios_may_show():
    """A ratio 10% under the baseline's, its interval 8-12% under: within 15%, beyond 5%."""
    baseline = baseline_on("A", 2.0)
    assert gate.check("tiny", run(), baseline, "A") == ([], [])
    changed, slowed = gate.check("tiny", run(), baseline, "A", margin=0.05)
    assert changed == [] and [str(f) for f in slowed] == [
        "scenario tiny, torch:eager: speed vs reference is 1.80x (1.76-1.84x), below the baseline's 2.00x by more "
        "than 5%"]


def test_timings_hold_only_on_the_machine_class_that_recorded_them():
    baseline = baseline_on("A", 4.0)
    assert len(gate.check("tiny", run(), baseline, "A")[1]) == 1  # 1.8x against 4.0x recorded here
    assert gate.check("tiny", run(), baseline, "B") == ([], [])  # no timings of class B
    changed, _ = gate.check("tiny", run(digest="e"), baseline, "B")  # counted figures hold everywhere
    assert [f.figure for f in changed] == ["tokens_sha256"]


def test_an_update_keeps_the_other_classes_timings_and_a_subset_keeps_the_other_scenarios():
    kept = gate.record("test", {"tiny": run(2.0, (2.0, 2.0)), "other": run(3.0, (3.0, 3.0))}, "A")
    on_b = gate.record("test", {"tiny": run(1.5, (1.5, 1.5), digest="e")}, "B")

    subset = gate.updated(kept, on_b, subset=True)
    assert set(subset["scenarios"]) == {"tiny", "other"}
    assert subset["scenarios"]["tiny"]["cases"]["torch:eager"]["tokens_sha256"] == "e"
    assert subset["timings"]["A"]["tiny"]["cases"]["torch:eager"]["ratio"] == 2.0
    assert subset["timings"]["B"]["tiny"]["cases"]["torch:eager"]["ratio"] == 1.5

    whole = gate.updated(kept, on_b, subset=False)  # a whole suite's run drops scenarios it no longer has
    assert set(whole["scenarios"]) == {"tiny"} and set(whole["timings"]["A"]) == {"tiny"}
    assert gate.updated(None, on_b, subset=False) == on_b


def test_the_machine_class_names_vendor_isa_and_amx(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nvendor_id\t: GenuineIntel\nmodel name\t: Intel(R) Xeon(R) Platinum\n"
                       "flags\t\t: fpu avx2 avx512f amx_tile amx_bf16\n\nprocessor\t: 1\nvendor_id\t: Other\n")
    info = cpu_info(cpuinfo)
    assert (info.vendor, info.model) == ("GenuineIntel", "Intel(R) Xeon(R) Platinum")
    assert machine_class(info).split()[1] == "GenuineIntel" and machine_class(info).endswith(" AMX")
    cpuinfo.write_text("vendor_id\t: AuthenticAMD\nflags\t\t: fpu avx2 avx512f\n")
    assert "AMX" not in machine_class(cpu_info(cpuinfo)).split()
    assert cpu_info(tmp_path / "absent").flags == frozenset()
