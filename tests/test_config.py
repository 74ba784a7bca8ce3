"""RunConfig: flags, YAML, errors that name the field and the fix, derived batch numbers (RF06)."""
from __future__ import annotations

from pathlib import Path

import pytest

from engine.config import RunConfig
from engine.config.cli import build_parser, flag, parse_args
from engine.doctor import ConfigError
from conftest import BUNDLED_TRAIN

REPO = Path(__file__).resolve().parent.parent


def test_flags_map_to_fields_and_override_yaml(tmp_path):
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text("rollout-batch-size: 16\nn_samples_per_prompt: 4\nlr: 3.0e-4\nrollout_stop: [\"\\n\\n\"]\n")
    cfg = parse_args(["--config", str(cfg_file), "--rollout-batch-size", "8", "--colocate"])
    assert cfg.rollout_batch_size == 8  # the flag beats the file
    assert cfg.n_samples_per_prompt == 4 and cfg.lr == 3e-4 and cfg.rollout_stop == ["\n\n"]
    assert cfg.colocate is True


def test_boolean_negation_and_lists():
    cfg = parse_args(["--no-check-for-nan-in-loss-and-grad", "--rollout-stop-token-ids", "7", "9"])
    assert cfg.check_for_nan_in_loss_and_grad is False
    assert cfg.rollout_stop_token_ids == [7, 9]


def test_sglang_flags_are_kept_verbatim(tmp_path):
    cfg = parse_args(["--rollout-engine", "sglang", "--weight-sync-method", "disk", "--sglang-mem-fraction-static",
                      "0.7", "--sglang-enable-dp-attention", "--sglang-context-length=4096", "--num-rollout", "3"])
    assert cfg.sglang_args == {"mem-fraction-static": "0.7", "enable-dp-attention": True,
                               "context-length": "4096"}
    assert cfg.num_rollout == 3


def test_eval_interval_needs_an_eval_set():
    with pytest.raises(ConfigError) as e:
        RunConfig(eval_interval=5, eval_prompt_data=[])
    d = e.value.diagnoses[0]
    assert "--eval-interval 5 with no eval sets" in d.what and d.facts["field"] == "eval_interval"
    assert RunConfig(eval_interval=5).eval_interval == 5  # the bundled test set by default


def test_ray_code_needs_a_joined_cluster():
    with pytest.raises(ConfigError, match="--ray-code image without --ray-address"):
        RunConfig(ray_code="image")
    assert RunConfig(ray_code="image", ray_address="auto").ray_code == "image"


def test_unknown_flag_suggests_the_nearest():
    with pytest.raises(ConfigError) as e:
        parse_args(["--rollout-bach-size", "4"])
    assert "unknown flag --rollout-bach-size" in str(e.value)
    assert "did you mean --rollout-batch-size?" in str(e.value)


def test_unknown_yaml_key_suggests_the_nearest(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("n_sample_per_prompt: 4\n")
    with pytest.raises(ConfigError) as e:
        parse_args(["--config", str(f)])
    assert "n_sample_per_prompt" in str(e.value) and "n_samples_per_prompt" in str(e.value)


#: slime's scripts/run-qwen3-30B-A3B.sh (THUDM/slime), its flags as they are, and MODEL_ARGS of the kind its
#: scripts/models/*.sh hold (Megatron-LM's architecture flags)
SLIME_QWEN3_30B_A3B = """
--num-layers 48 --hidden-size 2048 --ffn-hidden-size 6144 --swiglu --disable-bias-linear --qk-layernorm
--group-query-attention --num-attention-heads 32 --num-query-groups 4 --kv-channels 128 --normalization RMSNorm
--norm-epsilon 1e-6 --position-embedding-type rope --rotary-percent 1.0 --rotary-base 1000000 --vocab-size 151936
--untie-embeddings-and-output-weights --num-experts 128 --moe-ffn-hidden-size 768 --moe-router-topk 8
--moe-grouped-gemm --moe-token-dispatcher-type alltoall --moe-router-score-function softmax --moe-aux-loss-coeff 0
--hf-checkpoint HF --ref-load /root/Qwen3-30B-A3B_torch_dist
--prompt-data DATA --input-key prompt --label-key label --apply-chat-template --rollout-shuffle --rm-type deepscaler
--num-rollout 3000 --rollout-batch-size 8 --n-samples-per-prompt 4 --rollout-max-response-len 8192
--rollout-temperature 0.8 --global-batch-size 32 --balance-data
--eval-prompt-data aime DATA --n-samples-per-eval-prompt 16 --eval-max-response-len 16384 --eval-top-p 0.7
--tensor-model-parallel-size 4 --sequence-parallel --pipeline-model-parallel-size 1 --context-parallel-size 1
--expert-model-parallel-size 8 --expert-tensor-parallel-size 1
--recompute-granularity full --recompute-method uniform --recompute-num-layers 1
--use-dynamic-batch-size --max-tokens-per-gpu 20480
--advantage-estimator grpo --use-kl-loss --kl-loss-coef 0.00 --kl-loss-type low_var_kl --entropy-coef 0.00
--eps-clip 0.2 --eps-clip-high 0.28 --use-tis --tis-level geometric
--optimizer adam --lr 1e-6 --lr-decay-style constant --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.98
--optimizer-cpu-offload --overlap-cpu-optimizer-d2h-h2d --use-precision-aware-optimizer
--rollout-num-gpus-per-engine 8 --sglang-mem-fraction-static 0.7 --sglang-cuda-graph-bs 1 2 4 8 16 24 32
--attention-dropout 0.0 --hidden-dropout 0.0 --accumulate-allreduce-grads-in-fp32 --attention-softmax-in-fp32
--attention-backend flash --actor-num-nodes 1 --actor-num-gpus-per-node 8 --colocate --train-backend megatron
"""


def test_a_slime_moe_script_ported_as_it_is_gets_a_reason_and_a_fix_for_every_flag_rollflow_lacks(tiny_model):
    """slime's canonical Qwen3-30B-A3B script, its Megatron-LM flags included: no flag is merely "unknown"; each
    one rollflow lacks is named with why and what to do (its architecture flags: config.json), and the script with
    those dropped parses with SGLang engines (--rm-type deepscaler, --sequence-parallel and the rest are
    rollflow's)."""
    from engine.config.slime_flags import not_taken

    argv = SLIME_QWEN3_30B_A3B.replace("HF", tiny_model).replace("DATA", BUNDLED_TRAIN).split()
    with pytest.raises(ConfigError) as e:
        parse_args(argv)
    what = [d.what for d in e.value.diagnoses]
    assert not [w for w in what if w.startswith("unknown flag")], what
    named = [w.split(" is slime's flag")[0] for w in what]
    assert "--num-layers" in named and "--optimizer" in named
    assert "--recompute-granularity" not in named and "--tis-level" not in named  # (rollflow's flags)
    assert all(d.fix for d in e.value.diagnoses)
    kept, skip = [], False
    for a in argv:  # the script less every flag rollflow names (and their values)
        if a.startswith("--"):
            skip = not_taken(a) is not None
        if not skip:
            kept.append(a)
    # (on this CPU machine: SGLang on GPUs of its own, synced over NCCL, slime's other layout)
    cfg = parse_args([a for a in kept if a != "--colocate"] + ["--rollout-engine", "sglang", "--weight-sync-method",
                                                               "distributed"])
    assert (cfg.rm_type, cfg.sequence_parallel, cfg.tensor_model_parallel_size, cfg.tis_level, cfg.recompute) == \
        ("deepscaler", True, 4, "geometric", ("full", "uniform", 1))


def test_slimes_mis_example_ported_runs_on_rollflows_built_in_rollout_correction(tiny_model, tmp_path):
    """slime's examples/train_infer_mismatch_helper/run-qwen3-4b-mis.sh: its mis.yaml (examples/mis.yaml) sets
    rollflow's flags (tis_lower_bound / tis_upper_bound → --tis-clip-low / --tis-clip, kept as arguments too);
    slime's helper itself needs slime's context-parallel module, and the error says what replaces it; a key given
    twice with two values is an error naming both."""
    from engine.algorithms import LossSpec
    from engine.rewards import load_function

    argv = ["--hf-checkpoint", tiny_model, "--prompt-data", BUNDLED_TRAIN, "--rm-type", "deepscaler",
            "--advantage-estimator", "grpo", "--use-kl-loss", "--kl-loss-coef", "0.00", "--eps-clip-high", "0.28",
            "--use-tis", "--custom-config-path", str(REPO / "examples" / "mis.yaml")]  # slime's file, as it is
    cfg = parse_args(argv)
    assert (cfg.use_tis, cfg.tis_mode, cfg.tis_clip_low, cfg.tis_clip, cfg.use_rs, cfg.rs_level, cfg.rs_bounds,
            cfg.rs_veto_threshold, cfg.tis_batch_normalize) == \
        (True, "truncate", 0.5, 2.0, True, "token", (0.5, 2.0), 1e-4, True)
    assert cfg.custom_config == {"tis_lower_bound": 0.5, "tis_upper_bound": 2.0} and cfg.tis_upper_bound == 2.0
    spec = LossSpec.of(cfg)
    assert (spec.tis_mode, spec.use_rs, spec.rs_low, spec.rs_high, spec.rs_veto) == ("truncate", True, 0.5, 2.0, 1e-4)
    spec = LossSpec.of(parse_args(["--use-rs", "--rs-level", "geometric", "--rs-lower-bound", "0.3",
                                   "--rs-upper-bound", "3"]))
    assert (spec.rs_level, spec.rs_low, spec.rs_high) == ("geometric", 0.3, 3.0)
    with pytest.raises(ConfigError) as e:
        parse_args(argv + ["--tis-clip", "3"])
    assert "sets tis_upper_bound: 2.0, and --tis-clip is also given as 3.0" in e.value.diagnoses[0].what
    # slime's helper as the script names it: its module imports fine, the call needs slime's CP utilities
    helper = tmp_path / "examples" / "train_infer_mismatch_helper"
    helper.mkdir(parents=True)
    (helper / "mis.py").write_text("def compute_mis_weights_with_cp(args, **kwargs):\n"
                                   "    from slime.backends.megatron_utils.cp_utils import all_gather_with_cp\n")
    path = f"{helper / 'mis.py'}:compute_mis_weights_with_cp"
    fn = load_function(path, "--custom-tis-function-path")
    from engine.rollout.hooks import HookError, call_hook

    with pytest.raises(HookError) as e:
        call_hook("--custom-tis-function-path", path, fn, cfg)
    assert "No module named 'slime'" in e.value.diagnoses[0].what
    assert e.value.diagnoses[0].fix.startswith("slime's MIS helper") and "drop --custom-tis-function-path" in \
        e.value.diagnoses[0].fix


def test_slimes_own_sglang_flags_are_not_passed_to_sglang():
    """slime's --sglang-router-ip / -port / -request-timeout-secs, --sglang-server-concurrency and --sglang-config
    are slime's (its sglang_utils/arguments.py), not SGLang's launch flags: passed on they would fail SGLang's
    launch or, --sglang-config, be read as SGLang's own --config file. Each is named, with any engine."""
    for engine in ([], ["--rollout-engine", "sglang", "--weight-sync-method", "distributed"]):
        with pytest.raises(ConfigError) as e:
            parse_args([*engine, "--sglang-router-ip", "10.0.0.1", "--sglang-server-concurrency", "64",
                        "--sglang-config", "groups.yaml"])
        got = {d.facts["value"]: d for d in e.value.diagnoses}
        assert sorted(got) == ["config", "router-ip", "server-concurrency"]
        assert got["server-concurrency"].fix == "--rollout-concurrency N"
        assert got["config"].what.startswith("--sglang-config is slime's flag, which rollflow does not take")
    assert parse_args(["--rollout-engine", "sglang", "--weight-sync-method", "distributed",
                       "--sglang-mem-fraction-static", "0.7"]).sglang_args == {"mem-fraction-static": "0.7"}


def test_slimes_flags_that_rollflow_does_not_take_are_named_with_the_reason_and_the_replacement(tmp_path):
    """A slime script ported as it is stops on the first slime flag rollflow lacks, on the command line, in a
    --config file and in a dict of values, with why and what to use (not a near-miss suggestion)."""
    from engine.config.slime_flags import NOT_TAKEN

    with pytest.raises(ConfigError) as e:
        parse_args(["--num-rollout", "2", "--ci-test"])
    (d,) = e.value.diagnoses
    assert d.what.startswith("--ci-test is slime's flag, which rollflow does not take: ") and "RF14" in d.what
    assert d.fix == "drop it (the checks are always on)" and d.facts["field"] == "ci_test"
    with pytest.raises(ConfigError, match="--ci-train-rollout-logprob-abs-diff-threshold is slime's flag") as e:
        parse_args(["--ci-train-rollout-logprob-abs-diff-threshold=0.2"])
    assert e.value.diagnoses[0].fix == "--logprob-mismatch-threshold X"
    f = tmp_path / "c.yaml"
    f.write_text("num_rollout: 2\nstart-rollout-id: 3\n")
    with pytest.raises(ConfigError, match=r"c.yaml: --start-rollout-id is slime's flag") as e:
        parse_args(["--config", str(f)])
    assert "--ckpt-step" in e.value.diagnoses[0].fix
    from engine.config.cli import make_config

    with pytest.raises(ConfigError, match="--offload-rollout is slime's flag"):  # a dict of values (flows' API)
        make_config({"offload_rollout": True})
    # every unknown flag or key at once, in order: a ported script is fixed in one pass
    with pytest.raises(ConfigError) as e:
        parse_args(["--ci-test", "--rollout-bach-size", "4", "--offload", "--ci-disable-kl-checker"])
    assert [d.what.split(" is slime's")[0] for d in e.value.diagnoses] == \
        ["--ci-test", "unknown flag --rollout-bach-size", "--offload", "--ci-disable-kl-checker"]
    f.write_text("num_rollout: 2\nstart_rollout_id: 3\nn_sample_per_prompt: 4\n")
    with pytest.raises(ConfigError) as e:
        parse_args(["--config", str(f)])
    assert len(e.value.diagnoses) == 2 and "n_samples_per_prompt" in e.value.diagnoses[1].fix
    # none of them is a rollflow flag, and every rollflow flag still parses as before
    fields = {f.replace("_", "-") for f in RunConfig.model_fields}
    assert not fields & set(NOT_TAKEN)
    with pytest.raises(ConfigError, match="unknown flag --rollout-bach-size"):
        parse_args(["--rollout-bach-size", "4"])


def test_negative_batch_size_names_field_value_and_fix():
    with pytest.raises(ConfigError) as e:
        parse_args(["--rollout-batch-size", "-4"])
    msg = str(e.value)
    assert "--rollout-batch-size" in msg and "rollout_batch_size" in msg and "-4" in msg
    assert "greater than or equal to 1" in msg


def test_bad_choice_is_rejected():
    with pytest.raises(SystemExit):
        parse_args(["--train-backend", "jax"])


def test_help_lists_every_flag_with_help_and_default(capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for name, field in RunConfig.model_fields.items():
        if name == "sglang_args":
            assert "--sglang-" in out
            continue
        assert flag(name) in out, name
        assert field.description, f"{name} has no help text"
    assert "(default: 8)" in out  # rollout_batch_size's default is shown


def test_every_field_has_a_flag():
    parser = build_parser()
    dests = {a.dest for a in parser._actions}
    assert set(RunConfig.model_fields) - dests == {"sglang_args"}


@pytest.mark.parametrize("args, fix", [
    # B·n = 8·8 = 64; k = 3 does not divide 64
    (["--num-steps-per-rollout", "3"], "--num-steps-per-rollout one of [1, 2, 4, 8, 16, 32, 64]"),
    # G = 48 does not divide 64 samples (G counts samples, not prompts)
    (["--global-batch-size", "48"], "--global-batch-size one of"),
    # k = 2 → G = 64/2 = 32 ≠ 16
    (["--num-steps-per-rollout", "2", "--global-batch-size", "16"], "--global-batch-size 32"),
    # G = 64 is not divisible by micro_batch_size × DP = 3 × 1
    (["--micro-batch-size", "3"], "--micro-batch-size one of [1, 2, 4, 8, 16, 32, 64]"),
])
def test_inconsistent_batch_sizes_are_rf06_with_working_values(args, fix):
    with pytest.raises(ConfigError) as e:
        parse_args(args)
    assert e.value.codes == ["RF06"]
    assert fix in str(e.value)


def test_derived_numbers_are_computed_once():
    # B·n = 32·8 = 256 samples; k = 4 → G = 64; train_iters = num_rollout·k = 10·4 = 40
    cfg = RunConfig(rollout_batch_size=32, n_samples_per_prompt=8, num_steps_per_rollout=4, num_rollout=10)
    b = cfg.batch
    assert (b.samples_per_rollout, b.global_batch_size, b.num_steps_per_rollout, b.train_iters) == (256, 64, 4, 40)


def test_config_hash_ignores_paths_but_not_hyperparameters():
    a = RunConfig(work_dir="/a", lr=1e-5)
    assert a.config_hash() == RunConfig(work_dir="/b", lr=1e-5).config_hash()
    assert a.config_hash() != RunConfig(work_dir="/a", lr=2e-5).config_hash()


def test_readme_flag_reference_matches_the_code():
    from pathlib import Path

    from engine.config.docs import END, START, flags_markdown

    readme = (Path(__file__).parent.parent / "docs" / "flags.md").read_text()
    block = readme.split(START, 1)[1].split(END, 1)[0]
    assert block.strip() == flags_markdown().strip(), "run: python -m engine.config.docs --write docs/flags.md"


def test_num_epoch_makes_num_rollout_from_the_rows_of_the_data(tmp_path):
    """slime's --num-epoch: --num-rollout = epochs × (rows // --rollout-batch-size), through the command line and
    a YAML config; a dumped config reads back; a contradicting --num-rollout, a data source, too few rows are
    CONFIG errors."""
    import json

    from engine.config.cli import parse_args

    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}+1=", "label": str(i + 1)}) + "\n" for i in range(10)))
    cfg = RunConfig(prompt_data=str(data), rollout_batch_size=4, num_epoch=3)
    assert cfg.num_rollout == 6 and cfg.batch.train_iters == 6  # 10 // 4 = 2 a pass: the lr schedule's length too
    assert RunConfig(**cfg.model_dump()).num_rollout == 6
    # a train worker on another node reads the dump without the data file (nothing assumed shared)
    assert RunConfig.from_dump({**cfg.model_dump(), "prompt_data": str(tmp_path / "not-here.jsonl")}).num_rollout == 6
    assert RunConfig(prompt_data=f"{data}@[0:8]", rollout_batch_size=4, num_epoch=1).num_rollout == 2
    assert parse_args(["--prompt-data", str(data), "--rollout-batch-size", "2", "--num-epoch", "2"]).num_rollout == 10
    conf = tmp_path / "run.yaml"
    conf.write_text(f"prompt_data: {data}\nrollout_batch_size: 5\nnum_epoch: 1\n")
    assert parse_args(["--config", str(conf)]).num_rollout == 2
    for over, msg in ((dict(num_rollout=5), "makes --num-rollout 6 .10 rows // --rollout-batch-size 4 × 3., but "
                                            "--num-rollout 5 is set too"),
                      (dict(data_source_path="m:Source"), "a data source has no number of rows"),
                      (dict(rollout_batch_size=16), "has 10 rows, fewer than one rollout's --rollout-batch-size 16")):
        with pytest.raises(ConfigError, match=msg):
            RunConfig(**{**dict(prompt_data=str(data), rollout_batch_size=4, num_epoch=3), **over})


def test_train_env_vars_take_json_and_refuse_what_is_not_an_environment():
    from engine.config.cli import parse_args

    cfg = parse_args(["--train-env-vars", '{"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", "NCCL_DEBUG": 1}'])
    assert cfg.train_env_vars == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", "NCCL_DEBUG": "1"}
    for bad, why in (('{"OMP_NUM_THREADS": 4}', "--train-threads"), ('{"1BAD": "x"}', "not an environment variable"),
                     ("[1]", "JSON object"), ("{x", "not JSON"), ('{"A": {"b": 1}}', "text or a number")):
        with pytest.raises(ConfigError, match="train.env.vars") as e:
            parse_args(["--train-env-vars", bad])
        assert why in str(e.value), (bad, str(e.value))
    # not part of what is trained: the config hash and a resume ignore it
    assert parse_args([]).config_hash() == cfg.config_hash()


def test_async_save_needs_a_save_to_commit():
    with pytest.raises(ConfigError, match="--async-save with no --save") as e:
        parse_args(["--async-save"])
    assert "--save DIR" in str(e.value) and e.value.diagnoses[0].facts["field"] == "async_save"
    assert parse_args(["--async-save", "--save", "/tmp/x"]).async_save is True
