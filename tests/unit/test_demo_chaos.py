"""The --chaos plan (node/tools/demo_chaos.py): deterministic for a seed, and it never takes
every replica of a stage down unless asked."""

from __future__ import annotations

import pytest
from wanswarm.node.tools.demo_chaos import ChaosConfig, ChaosEvent, chaos_schedule


def _down_intervals(
    events: list[ChaosEvent], rejoin_s: float
) -> dict[int, list[tuple[float, float]]]:
    """daemon -> (killed at, counted up again at) for each kill of the plan."""
    kills = [e for e in events if e.action == "kill"]
    restarts = [e for e in events if e.action == "restart"]
    out: dict[int, list[tuple[float, float]]] = {}
    for kill in kills:
        restart = min(r.at_s for r in restarts if r.daemon == kill.daemon and r.at_s > kill.at_s)
        out.setdefault(kill.daemon, []).append((kill.at_s, restart + rejoin_s))
    return out


def test_same_seed_same_plan_other_seed_other_plan() -> None:
    a = chaos_schedule(3, 2, 900.0, seed=7)
    assert a == chaos_schedule(3, 2, 900.0, seed=7)
    assert a != chaos_schedule(3, 2, 900.0, seed=8)
    assert a == sorted(a)
    kills = [e for e in a if e.action == "kill"]
    # first kill at first_kill_s, then every 30-90 s: 900 s hold 10 to 29 of them
    assert kills[0].at_s == ChaosConfig().first_kill_s
    assert 10 <= len(kills) <= 29
    assert all(e.at_s < 900.0 for e in kills)


@pytest.mark.parametrize("seed", range(40))
@pytest.mark.parametrize(("n_stages", "replicas"), [(3, 2), (3, 3), (2, 2), (4, 2)])
def test_a_stage_always_keeps_a_replica(seed: int, n_stages: int, replicas: int) -> None:
    config = ChaosConfig(period_s=20.0, down_s=25.0, first_kill_s=5.0, rejoin_s=15.0)
    events = chaos_schedule(n_stages, replicas, 600.0, seed, config)
    assert any(e.action == "kill" for e in events)
    down = _down_intervals(events, config.rejoin_s)
    for event in events:
        assert event.stage == event.daemon % n_stages
        assert 0 <= event.daemon < n_stages * replicas
        if event.action != "kill":
            continue
        t = event.at_s
        replicas_up = [
            d
            for d in range(event.stage, n_stages * replicas, n_stages)
            if not any(start <= t < end for start, end in down.get(d, []))
        ]
        # the victim is counted down from t on: another replica of its stage must be up
        assert event.daemon not in replicas_up
        assert replicas_up, f"seed {seed}: kill at {t} left stage {event.stage} empty"
    # each kill is followed by its restart down_s later
    for kill in (e for e in events if e.action == "kill"):
        assert any(
            e.action == "restart"
            and (e.daemon, e.stage) == (kill.daemon, kill.stage)
            and e.at_s == pytest.approx(kill.at_s + config.down_s, abs=0.01)
            for e in events
        )


def test_one_replica_per_stage_is_never_killed_unless_asked() -> None:
    assert chaos_schedule(3, 1, 900.0, seed=1) == []
    anyway = chaos_schedule(3, 1, 900.0, seed=1, config=ChaosConfig(allow_empty=True))
    assert any(e.action == "kill" for e in anyway)


def test_a_killed_daemon_is_not_killed_again_while_down() -> None:
    config = ChaosConfig(period_s=2.0, down_s=30.0, first_kill_s=0.0, rejoin_s=30.0)
    events = chaos_schedule(3, 2, 300.0, seed=3, config=config)
    for daemon, intervals in _down_intervals(events, config.rejoin_s).items():
        for (s0, e0), (s1, _) in zip(intervals, intervals[1:], strict=False):
            assert s1 >= e0, f"daemon {daemon} killed at {s1} while down since {s0}"


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="period"):
        ChaosConfig(period_s=0)
    with pytest.raises(ValueError, match="stage"):
        chaos_schedule(0, 2, 10.0, seed=0)


def test_the_cli_refuses_bad_chaos_settings_and_builds_the_plan(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from wanswarm.node import cli
    from wanswarm.node.tools import demo

    assert cli.main(["demo", "--chaos", "--chaos-period", "0"]) == 2
    assert "--chaos-period" in capsys.readouterr().err
    seen: list[demo.DemoOptions] = []
    monkeypatch.setattr(demo, "run_demo", lambda options: seen.append(options) or 0)
    argv = ["demo", "--chaos", "--chaos-seed", "5", "--chaos-period", "40", "--no-loss-curve"]
    assert cli.main(argv) == 0
    (options,) = seen
    assert options.chaos == ChaosConfig(period_s=40.0, down_s=20.0, first_kill_s=20.0)
    assert options.chaos_seed == 5 and options.loss_curve is None
    assert options.tokens == demo.DEMO_TOKENS
    assert cli.main(["demo", "--loss-curve", "x.png"]) == 0
    assert seen[1].chaos is None and seen[1].loss_curve is not None
    assert seen[1].loss_curve.name == "x.png"
