"""Issue 35, item 1: a refusal names the constraint that rules out every plan, with its numbers.

Each kind of refusal is driven through ``graphpipe plan`` (in this process,
through :func:`graphpipe.cli.main`, the console script's boundary) and its
one line is checked for the reason and the figures, not only for exit 2.
The oracle for "the reason is right" is the model itself: twobranch:small
needs a few MB, so a refusal blaming 16 GB of memory is wrong by
construction; the fixes a message proposes are then run and must plan.
"""

from __future__ import annotations

import os

import pytest

from graphpipe.cli import main
from graphpipe.errors import DeviceMemoryError, InfeasibleError, InputError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
H100_PROFILE = os.path.join(ROOT, "evals", "results", "device", "mmt_h100_fp32.profile.json")


def plan(capsys, *argv: str) -> tuple[int, str]:
    """``graphpipe plan ARGV``: (exit code, the one stderr line of a refusal or "")."""
    try:
        code = main(["plan", *argv, "--tp", "1", "--shard", "none"])  # the partitioners' own refusals
    except SystemExit as exc:
        code = exc.code
    _, err = capsys.readouterr()
    lines = err.strip().splitlines()
    if code == 2:
        assert len(lines) == 1 and lines[0].startswith("graphpipe: error: "), err
        return code, lines[0]
    return code, ""


@pytest.mark.parametrize("model,devices", [("twobranch:small", "4"), ("twobranch:small", "3"),
                                           ("candle-uno:small", "4")])
def test_pipedream_replicas_vs_micro_batches_is_not_blamed_on_memory(capsys, model, devices):
    """The issue's command: PipeDream's DP puts the whole model on every device (data parallel), but batch 8 at
    micro-batch 4 is 2 micro-batches for 3-4 round-robin replicas. The line says so, with the share B/N."""
    code, line = plan(capsys, model, "--devices", devices, "--batch-size", "8", "--strategy", "pipedream",
                      "--micro-batch-size", "4")
    assert code == 2
    assert "GB" not in line and "memory" not in line, line
    assert f"one stage replicated on {devices} devices (data parallelism)" in line, line
    assert "--batch-size 8 at micro-batch 4 makes only 2 micro-batches" in line, line
    assert f"--micro-batch-size 2 (the data-parallel share 8 / {devices} devices" in line, line
    assert f"--batch-size {4 * int(devices)} or more" in line and "--devices 2" in line, line
    # every fix it proposes plans
    for fix in (["--micro-batch-size", "2"], ["--micro-batch-size", "4", "--batch-size", str(4 * int(devices))],
                ["--micro-batch-size", "4", "--devices", "2"]):
        args = {"--devices": devices, "--batch-size": "8", "--micro-batch-size": "4"}
        args.update(dict(zip(fix[::2], fix[1::2])))
        code, line = plan(capsys, model, "--strategy", "pipedream", *[x for kv in args.items() for x in kv])
        assert code == 0, (fix, line)


def test_memory_refusal_names_the_preset_and_the_profiles_device(capsys):
    """The issue's H100 profile planned on the default V100 cluster: the largest need against the device's 16 GB,
    that the 16 GB is the default V100 preset's, and that the profile is an H100's (with the flag to use)."""
    code, line = plan(capsys, "mmt", "--profile", H100_PROFILE, "--devices", "1", "--batch-size", "4096",
                      "--micro-batch-size", "4096", "--strategy", "pipedream")
    assert code == 2
    assert "pipedream: no plan of 'mmt' fits in 16 GB per device on 1 device: at micro-batch 4096" in line, line
    assert "PipeDream's layout needs 2,208 GB on its fullest device, device 0 (stage 0: 34 ops)" in line, line
    assert "16 GB is a V100-16GB's, from --cluster v100 (the default)" in line, line
    assert "was measured on cuda (NVIDIA H100 80GB HBM3): add --cluster h100 to plan for it" in line, line


def test_memory_refusal_of_a_sequential_strategy_gives_a_true_lower_bound(capsys):
    """gpipe on 0.5 GB devices: the bound it states (model state over the devices) really exceeds 0.5 GB and is
    not above what a plan then needs: with that much memory per device gpipe plans."""
    code, line = plan(capsys, "mmt:small", "--devices", "2", "--batch-size", "8", "--strategy", "gpipe",
                      "--memory-gb", "0.0001")
    assert code == 2
    assert "gpipe: no plan of 'mmt:small' fits in 0.0001 GB per device on 2 devices: at micro-batch 1" in line, line
    assert "some device needs at least" in line and "(0.0001 GB is --memory-gb 0.0001)" in line, line
    need_gb = float(line.split("needs at least ")[1].split(" GB")[0])
    assert need_gb > 0.0001
    code, _ = plan(capsys, "mmt:small", "--devices", "2", "--batch-size", "8", "--strategy", "gpipe",
                   "--memory-gb", str(need_gb * 0.999))
    assert code == 2  # a lower bound: just under it nothing fits


def test_micro_batch_divisibility_lists_the_sizes_that_divide(capsys):
    for strategy in ("gpp", "pipedream", "gpipe"):
        code, line = plan(capsys, "twobranch:small", "-n", "2", "-b", "12", "--micro-batch-size", "5",
                          "--strategy", strategy)
        assert code == 2
        assert line.endswith("--micro-batch-size 5 does not divide the batch size 12: a mini-batch is cut into "
                             "equal micro-batches; use one of 1, 2, 3, 4, 6, 12"), line


def test_device_count_pipedream_cannot_place(capsys):
    code, line = plan(capsys, "twobranch:small", "-n", "6", "-b", "12", "--strategy", "pipedream")
    assert code == 2
    assert ("pipedream: the cluster's levels (4 devices per node, then nodes) cannot hold 6 devices; use a multiple "
            "of 4 devices (or at most 4)") in line, line


def test_refusal_kinds_are_typed():
    """Library callers tell the kinds apart by class: memory is a DeviceMemoryError, the others are not."""
    from graphpipe.cluster import preset
    from graphpipe.search import pipedream
    from graphpipe.search.common import SearchOptions
    from conftest import chain_graph
    from graphpipe.graph import Affine, Op, OpGraph

    with pytest.raises(DeviceMemoryError):
        pipedream.partition(chain_graph(4), preset("v100", 2).with_memory(1e3), 8, SearchOptions())
    no_weights = OpGraph.build("free", [Op(f"l{i}", "x", Affine(0, 1e-3), Affine(0, 2e-3), 0, 1e3, 1e3) for i in range(3)],
                               [("l0", "l1", 1e3), ("l1", "l2", 1e3)])  # replicating is free: data parallel
    with pytest.raises(InfeasibleError) as info:
        pipedream.partition(no_weights, preset("v100", 4), 4, SearchOptions(micro_batch_size=2))
    assert "replicated on" in str(info.value) and not isinstance(info.value, DeviceMemoryError)
    with pytest.raises(InputError, match="does not divide"):
        pipedream.partition(chain_graph(4), preset("v100", 2), 8, SearchOptions(micro_batch_size=3))


def test_pipedreams_loose_memory_bound_is_not_blamed_on_the_device(capsys):
    """PipeDream's DP counts a replica as holding one micro-batch more than the devices after its stage; with
    replicated later stages that bound rejects layouts that fit. When its unconstrained layout simulates within
    the device, the line says the bound is the cause (with the simulated peak below the capacity) and offers
    a fix that plans."""
    args = ["mmt:small", "--devices", "64", "--batch-size", "1024", "--memory-gb", "0.001"]
    code, line = plan(capsys, *args, "--strategy", "pipedream")
    assert code == 2
    assert "PipeDream's memory model finds no layout" in line and "a bound" in line, line
    simulated = float(line.split("simulates to ")[1].split(" GB")[0])
    assert simulated <= 0.001, line
    assert "use --strategy gpp" in line, line
    assert plan(capsys, *args, "--strategy", "gpp")[0] == 0


def test_gpipe_in_flight_refusal_asks_for_a_smaller_batch_not_more_devices(capsys):
    """GPipe holds every micro-batch of the batch in flight and never replicates: on 32 devices (more than
    twobranch:small's 7 ops) 8,192 micro-batches overflow 10 MB devices. The message says so and offers a
    smaller batch and gpp, not more devices; each offered fix plans, and more devices would not have."""
    args = ["twobranch:small", "--strategy", "gpipe", "--memory-gb", "0.01"]
    code, line = plan(capsys, *args, "-n", "32", "-b", "8192")
    assert code == 2
    assert "GPipe holds all 8,192 micro-batches of the batch in flight" in line, line
    assert "use a smaller --batch-size, more memory per device, or --strategy gpp (it replicates stages)" in line
    assert "more devices" not in line
    assert plan(capsys, *args, "-n", "32", "-b", "512")[0] == 0
    assert plan(capsys, "twobranch:small", "--strategy", "gpp", "--memory-gb", "0.01", "-n", "32", "-b", "8192")[0] == 0
    assert plan(capsys, *args, "-n", "64", "-b", "8192")[0] == 2
