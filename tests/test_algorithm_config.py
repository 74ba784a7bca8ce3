"""Algorithm flags: combinations that would silently do nothing are errors naming the flag and the fix."""
from __future__ import annotations

import pytest

from engine.algorithms import LossSpec
from engine.config.cli import parse_args
from engine.doctor import ConfigError


@pytest.mark.parametrize("args, what, fix", [
    # grpo's advantage is the group-normalised reward: a KL reward shaping would be ignored
    (["--kl-coef", "0.1"], "--kl-coef 0.1", "--use-kl-loss --kl-loss-coef 0.1"),
    (["--advantage-estimator", "ppo", "--disable-grpo-std-normalization"], "--disable-grpo-std-normalization",
     "drop --disable-grpo-std-normalization"),
    (["--use-tis", "--tis-clip", "1.5", "--tis-clip-low", "2"], "--tis-clip-low 2.0", "below 1.5"),
    (["--eps-clip-c", "0.9"], "--eps-clip-c (field eps_clip_c) = 0.9", "--eps-clip-c"),
    # TIS bounds, stateless Adam's betas, a cosine's end, a filter's round size: each alone would do nothing
    (["--tis-clip", "1.5", "--tis-clip-low", "0.5"], "--tis-clip 1.5, --tis-clip-low 0.5 without --use-tis",
     "add --use-tis, or drop --tis-clip, --tis-clip-low"),
    (["--use-stateless-adam", "--adam-beta2", "0.95"], "--adam-beta2 0.95 with --use-stateless-adam",
     "drop --adam-beta2"),
    (["--min-lr", "1e-7"], "--min-lr 1e-07 is where the cosine schedule ends", "add --lr-decay-style cosine"),
    (["--over-sampling-batch-size", "64"], "--over-sampling-batch-size 64 sizes the sampling rounds",
     "add --dynamic-sampling-filter-path"),
    # a term the configuration does not compute: the critic, γ / λ, the KL loss, MIS, the health checks, pruning
    (["--critic-lr", "1e-05"], "--critic-lr 1e-05: only --advantage-estimator ppo has a critic (now grpo)",
     "--advantage-estimator ppo, or drop --critic-lr"),
    (["--value-clip", "0.3"], "--value-clip 0.3: only --advantage-estimator ppo", "drop --value-clip"),
    (["--gamma", "0.9", "--lambd", "0.8"], "--gamma 0.9, --lambd 0.8 with --advantage-estimator grpo",
     "drop --gamma, --lambd, or --advantage-estimator ppo"),
    (["--advantage-estimator", "reinforce_plus_plus", "--lambd", "0.8"],
     "--lambd 0.8 with --advantage-estimator reinforce_plus_plus", "drop --lambd, or --advantage-estimator ppo"),
    (["--kl-loss-coef", "0.1"], "--kl-loss-coef 0.1 without --use-kl-loss", "add --use-kl-loss"),
    (["--mis-high", "3"], "--mis-high 3.0 without --use-mis", "add --use-mis, or drop --mis-high"),
    # slime's MIS helper's settings (--tis-mode, --use-rs, …) without what they set
    (["--tis-mode", "mask"], "--tis-mode mask without --use-tis", "add --use-tis, or drop --tis-mode"),
    (["--use-tis", "--tis-mode", "truncate", "--tis-clip-low", "0.5"],
     "--tis-clip-low 0.5 with --tis-mode truncate would do nothing", "--tis-mode clip"),
    (["--rs-level", "geometric", "--rs-veto-threshold", "1e-4"],
     "--rs-level geometric, --rs-veto-threshold 0.0001 without --use-rs", "drop --rs-level, --rs-veto-threshold"),
    (["--use-rs", "--rs-lower-bound", "3"], "--use-rs's lower bound 3.0 is not below its upper bound 2.0",
     "--rs-lower-bound 0.5 --rs-upper-bound 2.0"),
    (["--tis-batch-normalize"], "--tis-batch-normalize without --use-tis", "add --use-tis"),
    (["--use-rs", "--use-rollout-logprobs"], "--use-rollout-logprobs with --use-rs", "drop --use-rollout-logprobs"),
    (["--use-rs", "--loss-type", "sft_loss"], "--loss-type sft_loss", "drop --use-rs"),
    (["--rollout-health-check-timeout", "5"], "--rollout-health-check-timeout 5.0 without --use-fault-tolerance",
     "add --use-fault-tolerance"),
    (["--keep-last-n", "2", "--save", ""], "--keep-last-n 2 with no --save", "drop --keep-last-n"),
    (["--save-hf", "--no-save-optim", "--wait-for-save-lock", "5", "--save", ""],
     "--save-hf, --no-save-optim, --wait-for-save-lock 5 with no --save: no checkpoint is written, so they would do "
     "nothing", "drop --save-hf, --no-save-optim, --wait-for-save-lock"),
])
def test_inconsistent_algorithm_flags_are_errors(args, what, fix):
    with pytest.raises(ConfigError) as e:
        parse_args(args)
    assert what in str(e.value) and fix in str(e.value)


def test_the_same_flags_where_they_act_are_accepted():
    assert parse_args(["--use-tis", "--tis-clip", "1.5", "--tis-clip-low", "0.5"]).tis_clip == 1.5
    assert parse_args(["--tis-clip", "1.5", "--get-mismatch-metrics", "--custom-tis-function-path",
                       "examples/hooks.py:icepop"]).tis_clip == 1.5  # the function reads args.tis_clip
    assert parse_args(["--adam-beta2", "0.95"]).adam_beta2 == 0.95
    assert parse_args(["--min-lr", "1e-7", "--lr-decay-style", "cosine"]).min_lr == 1e-7
    assert parse_args(["--over-sampling-batch-size", "64", "--dynamic-sampling-filter-path",
                       "engine.rollout.filters:check_reward_nonzero_std"]).over_sampling_batch_size == 64
    ppo = parse_args(["--advantage-estimator", "ppo", "--critic-lr", "1e-5", "--value-clip", "0.3", "--gamma", "0.9",
                      "--lambd", "0.8"])
    assert (ppo.critic_lr, ppo.value_clip, ppo.gamma, ppo.lambd) == (1e-5, 0.3, 0.9, 0.8)
    assert parse_args(["--advantage-estimator", "reinforce_plus_plus", "--gamma", "0.9"]).gamma == 0.9
    assert parse_args(["--gamma", "0.9", "--custom-advantage-function-path", "m:f"]).gamma == 0.9  # it may read γ
    assert parse_args(["--use-kl-loss", "--kl-loss-coef", "0.1"]).kl_loss_coef == 0.1
    assert parse_args(["--use-mis", "--mis-high", "3"]).mis_high == 3.0
    # slime's mis.yaml: truncate with a lower bound that --use-rs takes as its own; a function may read them all
    assert parse_args(["--use-tis", "--tis-mode", "truncate", "--tis-clip-low", "0.5", "--use-rs"]).rs_bounds == \
        (0.5, 2.0)
    assert parse_args(["--use-rs", "--rs-upper-bound", "4"]).rs_bounds == (0.5, 4.0)  # 1 / --tis-clip below, as slime
    assert parse_args(["--tis-mode", "mask", "--rs-veto-threshold", "1e-4", "--get-mismatch-metrics",
                       "--custom-tis-function-path", "examples/hooks.py:icepop"]).tis_mode == "mask"
    assert parse_args(["--use-fault-tolerance", "--rollout-health-check-timeout", "5"]).rollout_health_check_timeout \
        == 5.0
    assert parse_args(["--keep-last-n", "2", "--save", "ck"]).keep_last_n == 2


@pytest.mark.parametrize("args, what", [
    (["--tis-clip", "2.0"], "--tis-clip 2.0 without --use-tis"),
    (["--mis-low", "0.5"], "--mis-low 0.5 without --use-mis"),
    (["--value-clip", "0.2"], "--value-clip 0.2: only --advantage-estimator ppo"),
    (["--gamma", "1.0"], "--gamma 1.0 with --advantage-estimator grpo"),
    (["--use-stateless-adam", "--adam-beta1", "0.9"], "--adam-beta1 0.9 with --use-stateless-adam"),
    (["--opsm-delta", "1e-4"], "--opsm-delta 0.0001 without --use-opsm"),
    (["--opd-kl-coef", "1.0"], "--opd-kl-coef without --use-opd"),
    (["--profile-step-start", "10"], "--profile-step-start without --use-pytorch-profiler"),
])
def test_a_flag_typed_at_its_default_value_where_it_does_nothing_is_an_error(args, what):
    """A flag on the command line is a setting given, whatever its value: at the default's value it still does
    nothing without its switch."""
    with pytest.raises(ConfigError) as e:
        parse_args(args)
    assert what in str(e.value) and "would do nothing" in str(e.value)


def test_a_whole_config_dump_reads_back_as_a_yaml_config(tmp_path):
    """A YAML key at its default's value is not counted as given: the run's config.yaml (--dump-details, MLflow's
    artifact), every field in it, runs again as --config, and a typed flag at its default still counts."""
    import yaml

    cfg = parse_args(["--use-tis", "--tis-clip", "1.5", "--num-rollout", "3"])
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    again = parse_args(["--config", str(path)])
    assert again.model_dump() == cfg.model_dump()
    with pytest.raises(ConfigError, match="--mis-low 0.5 without --use-mis"):
        parse_args(["--config", str(path), "--mis-low", "0.5"])


def test_loss_spec_maps_the_estimator_to_its_policy_loss_once():
    cfg = parse_args(["--advantage-estimator", "gspo", "--eps-clip", "3e-4", "--eps-clip-high", "4e-4"])
    spec = LossSpec.of(cfg)
    assert (spec.policy_loss, spec.eps_clip, spec.eps_clip_high) == ("gspo", 3e-4, 4e-4)
    for est, kind in [("grpo", "ppo"), ("cispo", "cispo"), ("ppo", "ppo"), ("reinforce_plus_plus", "ppo")]:
        assert LossSpec.of(parse_args(["--advantage-estimator", est])).policy_loss == kind
    assert LossSpec.of(parse_args(["--calculate-per-token-loss"])).per_token_loss is True
