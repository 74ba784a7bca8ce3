"""Pure pieces of the rollout stage: protocol mapping, SGLang command, log scanning, ports, placement, buckets."""
from __future__ import annotations

import socket

import pytest
import torch

from engine.doctor import ConfigError
from engine.rollout.protocol import ProtocolError, to_requests, to_response


def _tok(text: str) -> list[int]:
    return [ord(c) for c in text]


# ---- protocol ----------------------------------------------------------------------------------------------------
def test_single_and_batched_requests_map_sglang_fields():
    reqs, batched = to_requests({"input_ids": [1, 2, 3], "sampling_params": {
        "temperature": 0.7, "top_p": 0.9, "top_k": 5, "max_new_tokens": 4, "stop": "\n", "stop_token_ids": [9],
        "no_stop_trim": True, "sampling_seed": 11}, "rid": "a"}, _tok, 128)
    assert not batched and len(reqs) == 1
    r = reqs[0]
    assert (r.rid, r.input_ids, r.temperature, r.top_p, r.top_k, r.max_new_tokens) == ("a", [1, 2, 3], 0.7, 0.9, 5, 4)
    assert (r.stop, r.stop_token_ids, r.no_stop_trim, r.seed) == (["\n"], [9], True, 11)

    reqs, batched = to_requests({"text": ["ab", "c"], "sampling_params": [{"temperature": 0}, {}],
                                 "rid": ["x", "y"], "logprob_start_len": 0}, _tok, 16)
    assert batched and [r.input_ids for r in reqs] == [[97, 98], [99]]
    assert [r.temperature for r in reqs] == [0.0, 1.0] and [r.max_new_tokens for r in reqs] == [16, 16]
    assert [r.logprob_start_len for r in reqs] == [0, 0]


@pytest.mark.parametrize("body, words", [
    ({"sampling_params": {}}, "either `text` or `input_ids`"),
    ({"input_ids": [1], "sampling_params": {"temprature": 1.0}}, "unknown sampling param 'temprature'"),
    ({"input_ids": [1], "sampling_params": {"repetition_penalty": 1.2}}, "repetition_penalty=1.2 is not supported"),
    ({"input_ids": [1], "sampling_params": {"top_p": 0}}, "top_p=0.0"),
    ({"input_ids": [[1], [2]], "sampling_params": [{}]}, "`sampling_params` has 1 entries for 2 inputs"),
    ({"input_ids": [[1], [2]], "rid": ["a", "a"]}, "must be unique"),
    ({"input_ids": [1], "stream": True}, "`stream` is not supported"),
])
def test_bad_requests_name_the_field(body, words):
    with pytest.raises(ProtocolError, match=words.replace("(", r"\(").replace(")", r"\)").replace("`", ".")):
        to_requests(body, _tok, 8)


def test_neutral_values_of_unimplemented_params_are_accepted():
    (r,), _ = to_requests({"input_ids": [1], "sampling_params": {"min_p": 0.0, "n": 1, "repetition_penalty": 1.0}},
                          _tok, 8)
    assert r.max_new_tokens == 8


def test_response_has_sglang_meta_info():
    from engine.rollout.generation import GenResult

    res = GenResult("r1", [5, 6], [-0.5, -1.5], {"type": "length", "length": 2}, "xy", 3, [None, -2.0], 1, [7, 8, 9])
    out = to_response(res, True, "4", 0.25)
    meta = out["meta_info"]
    assert out["output_ids"] == [5, 6] and out["text"] == "xy"
    assert meta["output_token_logprobs"] == [[-0.5, 5, None], [-1.5, 6, None]]
    assert meta["input_token_logprobs"] == [[None, 8, None], [-2.0, 9, None]]  # from logprob_start_len = 1
    assert (meta["prompt_tokens"], meta["completion_tokens"], meta["weight_version"]) == (3, 2, "4")
    assert "output_token_logprobs" not in to_response(res, False, "4", 0.25)["meta_info"]


def test_compact_logprobs_round_trip_bit_for_bit_and_read_like_triples():
    import math

    from engine.rollout.generation import GenResult
    from engine.rollout.protocol import output_logprobs

    lps = [-0.1, -1e-300, -123.456789012345678, math.nextafter(-2.0, 0.0), -0.0]
    res = GenResult("r1", [5, 6, 7, 8, 9], lps, {"type": "length", "length": 5}, "x", 3)
    compact = to_response(res, True, "4", 0.25, compact=True)
    assert "output_token_logprobs" not in compact["meta_info"]
    ids, got = output_logprobs(compact)
    assert ids == [5, 6, 7, 8, 9] and [x.hex() for x in got] == [x.hex() for x in lps]
    assert output_logprobs(to_response(res, True, "4", 0.25)) == (ids, got)  # SGLang's triples read the same
    assert output_logprobs(to_response(res, False, "4", 0.25)) == (ids, [])
    compact["output_ids"] = [5, 6]
    with pytest.raises(ValueError, match="5 log-probs for 2 output_ids"):
        output_logprobs(compact)


# ---- the SGLang command and its log ----------------------------------------------------------------------------
def test_sglang_command_passes_every_flag_through():
    from engine.config.cli import parse_args
    from engine.rollout.sglang import sglang_command

    cfg = parse_args(["--sglang-mem-fraction-static", "0.7", "--sglang-cuda-graph-bs", "1", "2", "4",
                      "--sglang-enable-deterministic-inference", "--sglang-context-length=4096",
                      "--rollout-engine", "sglang", "--weight-sync-method", "disk"])
    assert cfg.sglang_args["cuda-graph-bs"] == ["1", "2", "4"]
    cmd = sglang_command(python="/envs/sglang/bin/python", model_path="/m", host="10.0.0.2", port=30001, tp_size=2,
                         base_gpu_id=4, nccl_port=30002, dist_init_addr="10.0.0.2:30003",
                         sglang_args=cfg.sglang_args, colocate=True)
    assert cmd[:3] == ["/envs/sglang/bin/python", "-m", "sglang.launch_server"]
    pairs = {cmd[i]: cmd[i + 1] for i in range(3, len(cmd) - 1) if cmd[i].startswith("--")}
    assert pairs["--model-path"] == "/m" and pairs["--port"] == "30001" and pairs["--tp-size"] == "2"
    assert pairs["--base-gpu-id"] == "4" and pairs["--nccl-port"] == "30002"
    assert pairs["--dist-init-addr"] == "10.0.0.2:30003" and pairs["--mem-fraction-static"] == "0.7"
    assert pairs["--context-length"] == "4096"
    i = cmd.index("--cuda-graph-bs")
    assert cmd[i + 1:i + 4] == ["1", "2", "4"]
    assert "--enable-deterministic-inference" in cmd and "--enable-memory-saver" in cmd  # colocated


def test_sglang_flags_owned_by_rollflow_are_refused():
    from engine.rollout.sglang import sglang_command

    with pytest.raises(ConfigError, match="--sglang-tp-size is set by rollflow.*--rollout-num-gpus-per-engine"):
        sglang_command(python="p", model_path="m", host="h", port=1, tp_size=1, base_gpu_id=0, nccl_port=2,
                       dist_init_addr="h:3", sglang_args={"tp-size": "2"})


def test_tensor_sync_with_sglang_is_a_config_error():
    from engine.config import RunConfig

    with pytest.raises(ConfigError, match="--weight-sync-method disk"):
        RunConfig(rollout_engine="sglang")


def test_illegal_memory_access_is_rf11_with_the_current_fraction():
    from engine.rollout.diagnose import scan_engine_log

    log = "loading...\n[2026] RuntimeError: CUDA error: an illegal memory access was encountered\n  at ..."
    (d,) = scan_engine_log(log, mem_fraction_static=0.85)
    assert d.code == "RF11" and "0.85" in d.what and "--sglang-mem-fraction-static 0.75" in d.fix
    (d,) = scan_engine_log("torch.OutOfMemoryError: CUDA out of memory.", mem_fraction_static=None)
    assert d.code == "RF11" and "SGLang's default" in d.what
    (d,) = scan_engine_log("OSError: [Errno 98] Address already in use", mem_fraction_static=None, ports=[30001])
    assert d.code == "RF08" and "30001" in d.what
    assert scan_engine_log("all good\nserver started", mem_fraction_static=0.8) == []


def test_truncation_share_above_threshold_is_rf10():
    from engine.rollout.diagnose import truncation_diagnosis

    # 60 of 64 truncated = 94% > 90%
    d = truncation_diagnosis(60, 64, max_response_len=8, stop_token_ids=[258], stop=[], threshold=0.9)
    assert d.code == "RF10" and "60 of 64" in d.what and "[258]" in d.what and "--rollout-stop-token-ids" in d.fix
    assert truncation_diagnosis(57, 64, max_response_len=8, stop_token_ids=[], stop=[], threshold=0.9) is None
    assert truncation_diagnosis(64, 64, max_response_len=8, stop_token_ids=[], stop=[], threshold=1.0) is None


# ---- ports -------------------------------------------------------------------------------------------------------
def test_registry_never_hands_a_port_twice_per_node():
    from engine.rollout.ports import LocalKV, PortRegistry, allocate_ports

    reg = PortRegistry(start=41000, end=41100, kv=LocalKV())
    a = allocate_ports(reg.reserve, "n1", 3)
    b = allocate_ports(reg.reserve, "n1", 3)
    c = allocate_ports(reg.reserve, "n2", 3)
    assert len(set(a + b)) == 6  # one node: all distinct
    assert set(c) & set(a)  # another node may reuse numbers


def test_registries_sharing_one_store_never_collide_and_wrap_only_after_the_whole_range():
    """Two processes' registries on one store (as two runs on one Ray cluster share its key-value store): every
    port once, in order; a new round only when the range is used up; a request larger than the range is refused."""
    from engine.rollout.ports import LocalKV, PortRegistry

    kv = LocalKV()
    a, b = PortRegistry(41000, 41006, kv=kv), PortRegistry(41000, 41006, kv=kv)
    got = a.reserve("n", 2) + b.reserve("n", 2) + a.reserve("n", 1)
    assert got == [41000, 41001, 41002, 41003, 41004]
    kv.put("next/n", "41000")  # a stale cursor (another process reserved meanwhile): the taken keys are skipped
    assert b.reserve("n", 1) == [41005]
    assert a.handed_out() == {"n": list(range(41000, 41006))}
    assert a.reserve("n", 2) == [41000, 41001]  # all six were handed out: the round starts again
    assert a.handed_out() == {"n": [41000, 41001]}
    with pytest.raises(ValueError, match="7 ports asked of a registry of 6"):
        a.reserve("n", 7)
    c = PortRegistry(41000, 41006, kv=LocalKV(), first=41004)  # a cluster's registry begins at a random port
    assert c.reserve("n", 3) == [41004, 41005, 41000] and c.reserve("n", 1) == [41001]
    with pytest.raises(ValueError, match="first port 42000 is outside the range"):
        PortRegistry(41000, 41006, first=42000)


def test_taken_port_is_skipped_and_its_holder_named():
    from engine.rollout.ports import LocalKV, PortRegistry, allocate_ports, port_holder, port_holder_pid, port_in_use

    with socket.socket() as s:
        s.bind(("0.0.0.0", 0))
        s.listen()
        taken = s.getsockname()[1]
        reg = PortRegistry(start=taken, end=taken + 50, kv=LocalKV())
        got = allocate_ports(reg.reserve, "n", 2)
        assert taken not in got and len(got) == 2
        import os

        holder = port_holder_pid(taken)
        assert holder is not None and holder[0] == os.getpid()
        assert port_holder(taken).startswith(f"pid {os.getpid()} (")
        d = port_in_use(taken, "0.0.0.0", "test engine")
        assert d.code == "RF08" and f"pid {os.getpid()}" in d.what and d.facts["holder_pid"] == os.getpid()


def test_proc_net_tcp_parsing():
    from engine.rollout.ports import socket_inodes

    table = ("  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n"
             "   0: 0100007F:7531 00000000:0000 0A 00000000:00000000 00:00000000 00000000  1000        0 4242 1\n"
             "   1: 00000000:1F90 00000000:0000 0A 00000000:00000000 00:00000000 00000000  1000        0 777 1\n"
             "   2: 0100007F:1F90 0100007F:A3C2 01 00000000:00000000 00:00000000 00000000  1000        0 778 1\n")
    assert socket_inodes(table, 0x7531) == {"4242"} and socket_inodes(table, 8080) == {"777", "778"}
    assert socket_inodes(table, 8080, listening=True) == {"777"}  # the connection (state 01) is not a listener
    assert socket_inodes(table, 9) == set()


# ---- placement ---------------------------------------------------------------------------------------------------
def test_colocated_engines_share_the_train_bundles():
    from engine.cluster.placement import rollout_layout

    # T = 8 train GPUs, g = 2 → 4 engines on bundles 0, 2, 4, 6; trainer keeps 1 - 0.2 = 0.8 of each GPU
    lay = rollout_layout(cluster_gpus=8, train_gpus=8, colocate=True, rollout_num_gpus=None, gpus_per_engine=2,
                         num_engines=1)
    assert len(lay.bundles) == 8 and lay.engine_bundles == [0, 2, 4, 6] and lay.train_bundles == list(range(8))
    assert (lay.engine_gpu_fraction, lay.train_gpu_fraction) == (0.2, 0.8)


def test_decoupled_engines_follow_the_train_bundles():
    from engine.cluster.placement import rollout_layout

    # T = 4, R = 4, g = 1 → bundles 0..7, engines on 4..7
    lay = rollout_layout(cluster_gpus=8, train_gpus=4, colocate=False, rollout_num_gpus=4, gpus_per_engine=1,
                         num_engines=1)
    assert len(lay.bundles) == 8 and lay.engine_bundles == [4, 5, 6, 7] and lay.train_gpu_fraction == 1.0
    with pytest.raises(ConfigError, match="--rollout-num-gpus-per-engine one of \\[1, 2, 4\\]"):
        rollout_layout(cluster_gpus=8, train_gpus=4, colocate=False, rollout_num_gpus=4, gpus_per_engine=3,
                       num_engines=1)


def test_decoupled_without_rollout_gpus_counts_engines_times_tp():
    from engine.cluster.placement import rollout_layout

    # R = --rollout-num-engines × g = 2 × 2 = 4 (the doctor's RF02 arithmetic) → bundles 0..5, engines on 2 and 4
    lay = rollout_layout(cluster_gpus=8, train_gpus=2, colocate=False, rollout_num_gpus=None, gpus_per_engine=2,
                         num_engines=2)
    assert len(lay.bundles) == 6 and lay.engine_bundles == [2, 4]
    cpu = rollout_layout(cluster_gpus=8, train_gpus=2, colocate=False, rollout_num_gpus=0, gpus_per_engine=1,
                         num_engines=2)
    assert cpu.gpus_per_engine == 0 and all("GPU" not in b for b in cpu.bundles)


def test_cpu_cluster_gets_cpu_engines():
    from engine.cluster.placement import rollout_layout

    lay = rollout_layout(cluster_gpus=0, train_gpus=1, colocate=True, rollout_num_gpus=None, gpus_per_engine=1,
                         num_engines=3)
    assert lay.engine_bundles == [0, 1, 2] and all("GPU" not in b for b in lay.bundles) and not lay.train_bundles


# ---- weights -----------------------------------------------------------------------------------------------------
def test_buckets_respect_the_size_and_send_tied_tensors_once():
    from engine.weights import buckets, decode_tensors, encode_tensors

    emb = torch.randn(4, 256)  # 4 KiB
    sd = {"embed.weight": emb, "a": torch.randn(256), "b": torch.randn(256), "lm_head.weight": emb}
    parts = buckets(sd, max_bytes=4096)
    # [emb 4096] [a 1024 + b 1024]; the tied lm_head is the same tensor → left out
    assert [list(p) for p in parts] == [["embed.weight"], ["a", "b"]]
    back = decode_tensors(encode_tensors(parts[1]))
    assert torch.equal(back["a"], sd["a"]) and torch.equal(back["b"], sd["b"])


def test_a_bad_bucket_changes_nothing():
    from engine.diagnosis import DiagnosisError
    from engine.weights import check_and_copy

    model = torch.nn.Linear(3, 2)
    before = model.weight.detach().clone()
    with pytest.raises(DiagnosisError, match="RF14.*1 shapes that differ: bias: sent \\(5,\\), served \\(2,\\)"):
        check_and_copy(model, {"weight": torch.ones(2, 3), "bias": torch.ones(5)}, full=False)
    assert torch.equal(model.weight, before)  # checked before copying
    with pytest.raises(DiagnosisError, match="1 served parameters not sent: bias"):
        check_and_copy(model, {"weight": torch.ones(2, 3)}, full=True)
    with pytest.raises(DiagnosisError, match="1 names the engine does not serve: layers.0.weight"):
        check_and_copy(model, {"weight": torch.ones(2, 3), "bias": torch.ones(2), "layers.0.weight": torch.ones(1)},
                       full=True)
    assert check_and_copy(model, {"weight": torch.ones(2, 3)}, full=False) == 6 * 4
    assert torch.equal(model.weight, torch.ones(2, 3))


def test_an_untied_lm_head_must_be_sent_a_tied_one_is_the_embedding():
    from engine.diagnosis import DiagnosisError
    from engine.weights import check_and_copy, unique_tensors

    class LM(torch.nn.Module):
        def __init__(self, tied: bool):
            super().__init__()
            self.embed = torch.nn.Embedding(5, 3)
            self.lm_head = torch.nn.Linear(3, 5, bias=False)
            if tied:
                self.lm_head.weight = self.embed.weight

    sent = unique_tensors(LM(tied=True).state_dict())
    assert list(sent) == ["embed.weight"]  # the tied head is one tensor, sent once
    assert check_and_copy(LM(tied=True), sent, full=True) == 15 * 4
    with pytest.raises(DiagnosisError, match="served parameters not sent: lm_head.weight"):
        check_and_copy(LM(tied=False), sent, full=True)  # an untied head left out would be a partial load


def test_bf16_weights_reach_a_float32_engine_by_value_not_by_bit_pattern():
    # A bf16 trainer (Megatron) → the object store → a float32 engine: the int16 bit patterns that carry bf16 must
    # be read back as bf16 (the first GPU flow's engine served garbage after the first sync without this).
    from engine.weights import check_and_copy, numpy_state

    src = torch.nn.Linear(4, 3)
    sent = numpy_state({k: v.to(torch.bfloat16) for k, v in src.state_dict().items()})
    assert sent.dtypes == {"weight": "bfloat16", "bias": "bfloat16"}
    engine = torch.nn.Linear(4, 3)
    check_and_copy(engine, sent.tensors(), full=True)
    assert torch.equal(engine.weight, src.weight.detach().to(torch.bfloat16).float())
    f32 = numpy_state(src.state_dict())
    assert f32.dtypes["weight"] == "float32" and torch.equal(f32.tensors()["weight"], src.weight.detach())


# ---- filters -----------------------------------------------------------------------------------------------------
def test_builtin_filter_drops_groups_whose_rewards_agree():
    from engine.rollout.filters import BUILTIN_NONZERO_STD, load_filter
    from engine.samples import Sample, Status

    def group(rewards, failed=()):
        return [Sample(index=i, group_index=0, rollout_id=0, prompt="p", reward=r,
                       status=Status.FAILED if i in failed else Status.COMPLETED) for i, r in enumerate(rewards)]

    keep = load_filter(BUILTIN_NONZERO_STD)
    assert keep(group([0.0, 1.0, 0.0])) and not keep(group([1.0, 1.0])) and not keep(group([0.0, 0.0]))
    assert not keep(group([1.0, 0.0], failed=(1,)))  # one live sample: nothing to compare


# ---- the Sample contract -----------------------------------------------------------------------------------------
def test_sample_from_dict_keeps_keys_it_does_not_know():
    # slime's Sample.from_dict sets unknown keys as attributes; custom rollouts carry their own data that way
    from engine.samples import Sample, Status

    s = Sample.from_dict({"index": 3, "group_index": 1, "rollout_id": 0, "prompt": "p", "status": "truncated",
                          "turns": [{"role": "tool", "content": "42"}], "env_id": "sandbox-7"})
    assert s.status is Status.TRUNCATED and s.turns[0]["content"] == "42" and s.env_id == "sandbox-7"
    d = s.to_dict()
    assert d["turns"] == s.turns and d["status"] == "truncated"
    assert Sample.from_dict(d).env_id == "sandbox-7"  # and they survive a round trip


def test_an_unknown_finish_reason_fails_the_sample_with_the_reason():
    from engine.data import PromptRow
    from engine.rollout.loop import Partial, Prompt, SamplingParams, _Round
    from engine.samples import Status

    rnd = _Round([Prompt(PromptRow(prompt="1+1=", label="2", metadata={}, row=0), [5, 6])], first_draw=0, needed=1,
                 rollout_id=0, nonce="x", n=3, params=SamplingParams(max_new_tokens=4), seed=0, engines=None,
                 reward_model=None, keep=None, concurrency=2)
    out = {"text": "2", "output_ids": [7], "meta_info": {"output_token_logprobs": [[-0.1, 7, None]]}}
    rows = [Partial() for _ in range(3)]
    for row, reason in zip(rows, ("stop", "preempted", "abort")):
        rnd._extend(row, {**out, "meta_info": {**out["meta_info"], "finish_reason": {"type": reason}}})
    ok, odd, aborted = rnd._samples(0, rows)
    assert ok.status is Status.COMPLETED and "failure" not in ok.metadata and ok.tokens == [5, 6, 7]
    assert odd.status is Status.FAILED and "preempted" in odd.metadata["failure"]
    assert aborted.status is Status.ABORTED  # without --partial-rollout an abort ends the sample


def test_eval_metrics_mean_and_pass_at_k_in_closed_form():
    from engine.stages import eval_metrics

    greedy = eval_metrics("test", [[1.0], [0.0], [1.0], [0.0]])
    assert greedy == {"eval/test_accuracy": 0.5}  # one sample per prompt: no @k metrics
    k3 = eval_metrics("aime", [[1.0, 0.0, 0.0], [0.0, 0.0, 0.0], [1.0, 1.0, 0.5]])
    assert k3["eval/aime_mean_at_k"] == k3["eval/aime_accuracy"] == pytest.approx(3.5 / 9)
    assert k3["eval/aime_pass_at_k"] == pytest.approx((1.0 + 0.0 + 1.0) / 3)


def test_eval_sets_are_one_path_or_named_pairs():
    from pydantic import ValidationError

    from engine.config import RunConfig
    from engine.config.cli import parse_args
    from engine.stages import eval_accuracy_key

    assert RunConfig(eval_prompt_data="t.jsonl").eval_sets == [("test", "t.jsonl")]  # a YAML string, as before
    assert RunConfig(eval_prompt_data="").eval_sets == [] and RunConfig(eval_prompt_data=None).eval_sets == []
    cfg = parse_args(["--eval-prompt-data", "aime", "a.jsonl", "gsm8k", "g.jsonl"])  # slime's NAME PATH pairs
    assert cfg.eval_sets == [("aime", "a.jsonl"), ("gsm8k", "g.jsonl")]
    assert eval_accuracy_key(cfg) == "eval/aime_accuracy"
    with pytest.raises(ValidationError, match="NAME PATH pairs"):
        RunConfig(eval_prompt_data=["aime", "a.jsonl", "gsm8k"])
    with pytest.raises(ValidationError, match="distinct word"):
        RunConfig(eval_prompt_data=["a b", "a.jsonl", "c", "c.jsonl"])


def test_eval_interval_evaluates_between_rollouts_but_not_after_the_last():
    from engine.config import RunConfig
    from engine.stages import should_eval

    cfg = RunConfig(num_rollout=6, eval_interval=2)
    assert [r for r in range(6) if should_eval(cfg, r)] == [1, 3]  # after 2 and 4 rollouts; 6 is the final eval
    assert not any(should_eval(RunConfig(num_rollout=6), r) for r in range(6))


def test_pooled_connections_expire_before_the_engine_server_closes_them():
    """The run keeps one HTTP pool (engine/rollout/client.py); a pooled connection idle as long as the server's
    keep-alive is closed by the server just as a request may go out on it (a ReadError on /generate). The pools drop
    idle connections well before uvicorn's keep-alive, the server the built-in engine (and SGLang) runs."""
    import asyncio

    import uvicorn

    from engine.rollout.client import KEEPALIVE_S, run_on_rollout_loop, shared_http

    server_keepalive = uvicorn.Config(app=None).timeout_keep_alive
    assert KEEPALIVE_S < server_keepalive
    assert shared_http()._transport._pool._keepalive_expiry == KEEPALIVE_S

    async def expiry(client):
        await asyncio.sleep(0)
        return client._transport._pool._keepalive_expiry

    assert run_on_rollout_loop(expiry, None) == KEEPALIVE_S


# ---- the engine's batching of a burst the client announces ---------------------------------------------------
class _FakeGenerator:
    """What BatchingScheduler needs of a Generator: abort bookkeeping and a batch call (echoes the rids)."""

    def __init__(self):
        from engine.rollout.generation import AbortBook

        self.aborts = AbortBook()

    def generate(self, reqs):
        return [r.rid for r in reqs]


def _spread(burst, spacing_s: float, count: int = 6, gap_s: float = 0.01, hold: bool = True,
            window_s: float = 0.05):
    """`count` one-row requests sent `spacing_s` apart to a scheduler; returns its batch sizes."""
    import asyncio

    from engine.rollout.generation import GenRequest
    from engine.rollout.server import BatchingScheduler

    async def main():
        sched = BatchingScheduler(_FakeGenerator(), window_s=window_s, max_batch=64, gap_s=gap_s, hold_bursts=hold)
        sched.start()

        async def one(i):
            await asyncio.sleep(i * spacing_s)
            return await sched.submit([GenRequest(rid=f"r{i}", input_ids=[1], max_new_tokens=1)], burst)

        out = await asyncio.gather(*(one(i) for i in range(count)))
        assert [o[0] for o in out] == [f"r{i}" for i in range(count)]  # every request got its own answer
        return sched.batch_sizes

    return asyncio.run(main())


def test_an_announced_burst_is_one_batch_however_spread_its_arrivals():
    """Requests 30 ms apart (more than the 10 ms gap that ends an unannounced burst): without the header they run
    as separate batches, with `X-Rollflow-Burst: <id> 6` as one when the engine holds bursts (on a GPU)."""
    from engine.rollout.server import parse_burst

    assert len(_spread(None, 0.03)) > 1
    assert _spread(("rf1-abc-d0", 6), 0.03) == [6]
    assert len(_spread(("rf1-abc-d0", 6), 0.03, hold=False)) > 1  # a CPU engine does not hold a burst
    assert parse_burst("rf1-abc-d0 6") == ("rf1-abc-d0", 6)
    assert parse_burst("junk") is None and parse_burst("a -3") is None and parse_burst("a 0") is None


def test_a_complete_burst_runs_without_linger_even_when_not_held():
    """All 6 arrive at once: the batch starts on the 6th, not gap_s (here 2 s) after it, held or not; an
    unannounced burst waits the gap out."""
    import time

    for hold in (True, False):
        t = time.perf_counter()
        assert _spread(("b", 6), 0.0, gap_s=2.0, window_s=4.0, hold=hold) == [6]
        assert time.perf_counter() - t < 1.5
    t = time.perf_counter()
    assert _spread(None, 0.0, gap_s=2.0, window_s=4.0) == [6]
    assert time.perf_counter() - t >= 2.0
    # a call that is a whole batch by itself (EngineClient.generate: the RF14 probe, a score) does not linger
    from engine.rollout.client import BURST_HEADER, alone
    from engine.rollout.server import parse_burst

    one = parse_burst(alone()[BURST_HEADER])
    assert one is not None and one[1] == 1 and one != parse_burst(alone()[BURST_HEADER])
    t = time.perf_counter()
    assert _spread(one, 0.0, count=1, gap_s=2.0, window_s=4.0, hold=False) == [1]
    assert time.perf_counter() - t < 1.5


def test_a_burst_that_never_completes_closes_after_its_gap():
    """Announced as 10 but only 4 come (the rest went to another engine): the batch closes burst_gap_s after the
    last one instead of waiting for the rest."""
    assert _spread(("b", 10), 0.0, count=4) == [4]


def test_only_built_in_cpu_engines_take_a_rounds_groups_in_one_request():
    """EngineGroup.join_rows: the built-in engine on a CPU answers a batch once every row is done, so a round's
    groups go to it joined (at most its batch's rows); SGLang and GPU engines answer each request as it finishes
    (rewards scored meanwhile, a filtered round cut early) and keep one request per group."""
    from types import SimpleNamespace

    from engine.rollout.actor import EngineSpec
    from engine.rollout.engines import EngineGroup

    def group(kind: str, gpus: int) -> EngineGroup:
        spec = EngineSpec(kind=kind, model_path="m", log_dir="l", max_batch=96)
        return EngineGroup(spec, SimpleNamespace(layout=SimpleNamespace(engine_bundles=[0], gpus_per_engine=gpus)),
                           registry=None)

    assert group("builtin", 0).join_rows == 96
    assert group("builtin", 1).join_rows == 0 and group("sglang", 1).join_rows == 0
