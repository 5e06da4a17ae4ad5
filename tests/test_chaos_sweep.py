"""The chaos invariants over many fault schedules, at a pace the machine holds and at one it cannot.

Slow (about a minute a run): `./dev test -m slow tests/test_chaos_sweep.py`. Every run must end with no version
regression, no lost accepted update, no unloadable checkpoint and no learner that died on its own, whatever
the seed; a saturated fleet (4 learners asked for a step every 20 ms on 2 cores) keeps them too. A version whose
every holder was down when another of its number appeared (`lost_with_every_holder_down`, node/goodput.py) is
not a defect of the protocol, which never waits for dead peers; it is reported with the other figures.
"""

import pytest

from diloco.node.chaos_run import ChaosOptions, run_chaos

SEEDS = range(10)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("saturated", [False, True], ids=["paced", "saturated"])
@pytest.mark.parametrize("seed", SEEDS)
def test_no_schedule_breaks_an_invariant(tmp_path, seed, saturated):
    opts = ChaosOptions(peers=4, minutes=0.75, mtbf_s=20.0, downtime_s=1.5, seed=seed, out=tmp_path,
                        calibrate_s=12.0, checkpoint_every=40, eval_every=1000, no_failure=False, mode="decoupled",
                        owner_every=2, pace_s=0.02 if saturated else 0.12)
    mode = run_chaos(opts, say=lambda _: None)["decoupled"]
    assert mode["failures"] >= 2, "the schedule killed fewer than two learners"
    found = {k: mode[k] for k in ("version_regressions", "lost_accepted_updates", "unloadable_checkpoints",
                                  "unexpected_exits")}
    assert found == dict.fromkeys(found, 0), \
        f"seed {seed}: {found}, every holder down: {mode['lost_with_every_holder_down']}, restart {mode['restart_s']} s"
