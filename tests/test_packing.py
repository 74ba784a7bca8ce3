"""Pack/balance: the DP schedule's invariants (one helper, every test), KK, FLOPs, micro-batches, RF03/RF06/RF07."""
from __future__ import annotations

import logging

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.doctor import ConfigError
from engine.packing.arithmetic import batch_plan, working_global_batch_sizes
from engine.packing.balance import karmarkar_karp, rebalance
from engine.packing.flops import ModelShape, flops_per_sample, sequence_flops
from engine.packing.microbatch import make_micro_batch
from engine.packing.schedule import Step, best_fit_decreasing, build_dp_schedule, schedule_stats
from engine.samples import Sample, Status

QWEN2_7B = ModelShape(num_layers=28, hidden_size=3584, num_heads=28, num_kv_heads=4, head_dim=128,
                      ffn_hidden_size=18944, vocab_size=152064)


# ---- the one invariant helper ----------------------------------------------------------------------------------
def assert_schedule(steps: list[Step], lengths: list[int], *, dp_size: int, global_batch_size: int,
                    cap: int | None = None, micro_batch_size: int | None = None,
                    rollout_ids: list[int] | None = None) -> None:
    """I1–I4 of engine/packing/schedule.py, plus: no empty micro-batch, every step has dp_size ranks."""
    rids = rollout_ids if rollout_ids is not None else list(range(len(lengths)))
    seen: list[int] = []
    step_of: dict[int, int] = {}
    for s, step in enumerate(steps):
        assert len(step.ranks) == dp_size
        counts = {len(rank) for rank in step.ranks}
        assert len(counts) == 1 and counts.pop() >= 1, f"I1: step {s} micro-batches per rank differ"
        for mb in step.micro_batches:
            assert mb, "an empty micro-batch"
            tokens = sum(lengths[i] for i in mb)
            if cap is not None:
                assert tokens <= cap or len(mb) == 1, f"I2: {tokens} tokens > cap {cap} in {len(mb)} samples"
            else:
                assert len(mb) <= micro_batch_size, f"I2: {len(mb)} samples > micro_batch_size {micro_batch_size}"
        for i in step.samples:
            if rids[i] in step_of:
                assert step_of[rids[i]] == s, f"I4: trajectory {rids[i]} spans steps {step_of[rids[i]]} and {s}"
            step_of[rids[i]] = s
        assert len({rids[i] for i in step.samples}) == global_batch_size, "I4: a step holds G trajectories"
        seen += step.samples
    assert sorted(seen) == list(range(len(lengths))), "I3: every sample exactly once"


def flops_of(lengths: list[int]) -> list[float]:
    return flops_per_sample(lengths, QWEN2_7B)


# ---- hand-computed cases ---------------------------------------------------------------------------------------
def test_best_fit_decreasing_by_hand():
    # lengths 5 4 3 3 2 2 1 (Σ = 20), cap 8, longest first into the fullest bin that fits:
    # 5 → new (room 3); 4 → new (room 4); 3 → room 3 (full); 3 → room 4 (left 1); 2 → new (room 6); 2 → (4);
    # 1 → room 1. Bins {5,3} {4,3,1} {2,2} = 3 = ⌈20/8⌉, the lower bound.
    lengths = [5, 4, 3, 3, 2, 2, 1]
    bins = best_fit_decreasing(list(range(7)), lengths, 8)
    assert sorted(sorted(lengths[i] for i in b) for b in bins) == [[1, 3, 4], [2, 2], [3, 5]]


def test_dynamic_split_to_a_multiple_of_dp_by_hand():
    # same 3 bins, DP = 2 → 4 micro-batches: the costliest multi-sample bin (8 tokens; {5,3} wins the tie as
    # the older bin) is halved by tokens into {5} and {3}. Strided: bins 0,2 → rank 0; 1,3 → rank 1.
    lengths = [5, 4, 3, 3, 2, 2, 1]
    steps = build_dp_schedule(lengths, dp_size=2, global_batch_size=7, max_tokens_per_gpu=8)
    assert_schedule(steps, lengths, dp_size=2, global_batch_size=7, cap=8)
    tok = [[sum(lengths[i] for i in mb) for mb in rank] for rank in steps[0].ranks]
    assert tok == [[5, 4], [8, 3]]  # bins in order: {5} {4,3,1} {2,2} {3}: 5, 8, 4, 3 tokens


def test_cp_multiplies_the_cap_and_an_oversize_sample_sits_alone():
    # cap = max_tokens_per_gpu · cp = 5·2 = 10; the 25-token sample is alone (I2's exception); 4+3+3 = 10 fits
    lengths = [25, 3, 3, 4]
    steps = build_dp_schedule(lengths, dp_size=2, global_batch_size=4, cp_size=2, max_tokens_per_gpu=5)
    assert_schedule(steps, lengths, dp_size=2, global_batch_size=4, cap=10)
    assert sorted(sorted(mb) for mb in steps[0].micro_batches) == [[0], [1, 2, 3]]


def test_static_mode_by_hand():
    # G = 8 samples, micro_batch_size 2 → 4 micro-batches in order; strided over DP = 2
    lengths = [10, 20, 30, 40, 50, 60, 70, 80]
    steps = build_dp_schedule(lengths, dp_size=2, global_batch_size=8, micro_batch_size=2)
    assert_schedule(steps, lengths, dp_size=2, global_batch_size=8, micro_batch_size=2)
    assert steps[0].ranks == [[[0, 1], [4, 5]], [[2, 3], [6, 7]]]


def test_steps_follow_trajectories():
    # 3 trajectories (ids 7, 7, 9, 8, 8, 8 by first appearance 7, 9, 8), G = 1 → 3 steps, one trajectory each
    lengths, rids = [3, 3, 4, 1, 1, 1], [7, 7, 9, 8, 8, 8]
    steps = build_dp_schedule(lengths, dp_size=1, global_batch_size=1, max_tokens_per_gpu=4, rollout_ids=rids)
    assert_schedule(steps, lengths, dp_size=1, global_batch_size=1, cap=4, rollout_ids=rids)
    assert [sorted(s.samples) for s in steps] == [[0, 1], [2], [3, 4, 5]]
    with pytest.raises(ValueError, match="3 trajectories .* not a multiple of global_batch_size = 2"):
        build_dp_schedule(lengths, dp_size=1, global_batch_size=2, max_tokens_per_gpu=4, rollout_ids=rids)


def test_a_step_too_small_for_dp_names_the_numbers():
    # one trajectory of 3 samples, DP = 4: 3 samples cannot fill 4 micro-batches
    with pytest.raises(ValueError, match="3 samples cannot fill 4 micro-batches"):
        build_dp_schedule([1, 1, 1], dp_size=4, global_batch_size=1, max_tokens_per_gpu=8, rollout_ids=[0, 0, 0])


def test_karmarkar_karp_by_hand():
    # module docstring: 8 7 6 5 4 into 2 → (8|7), (6|5), (11|8), then 11+5 | 8+6 = 16 | 14
    w = [8, 7, 6, 5, 4]
    parts = karmarkar_karp(w, 2, equal_size=False)
    assert parts == [[1, 3, 4], [0, 2]]
    # equal size, 1..8 into 2 of 4: runs (2|1) (4|3) (6|5) (8|7); (8|7)+(6|5) → 13|13, (4|3)+(2|1) → 5|5 → 18|18
    w = list(range(1, 9))
    parts = karmarkar_karp(w, 2, equal_size=True)
    assert [len(p) for p in parts] == [4, 4] and [sum(w[i] for i in p) for p in parts] == [18, 18]
    with pytest.raises(ValueError, match="got 5 items, k = 2"):
        karmarkar_karp([1] * 5, 2, equal_size=True)


def test_flops_closed_form():
    # L=2, h=4, a=2, g=1, d=2, f=8, V=10, one layer:
    # QKV 2·2·4·(2·2) + 4·2·4·(1·2) = 64 + 64; attention 2·2·2²·2 = 32; out 2·2·(2·2)·4 = 64; MLP 6·2·4·8 = 384;
    # head 2·2·4·10 = 160 → 128 + 32 + 64 + 384 + 160 = 768
    m = ModelShape(num_layers=1, hidden_size=4, num_heads=2, num_kv_heads=1, head_dim=2, ffn_hidden_size=8,
                   vocab_size=10)
    assert sequence_flops(2, m) == 768
    # the L² term: doubling L more than doubles the cost (attention), by exactly 2·a·d·(4L² − 2L²)·layers
    assert sequence_flops(4, m) - 2 * sequence_flops(2, m) == 2 * 2 * 2 * (16 - 2 * 4)


def test_model_shape_from_hf_config(tiny_model):
    m = ModelShape.from_hf_config(tiny_model)  # the bundled Qwen2: 4 layers, h 128, 4 heads, 2 kv heads
    assert (m.num_layers, m.hidden_size, m.num_heads, m.num_kv_heads, m.head_dim, m.ffn_hidden_size,
            m.vocab_size, m.num_moe_layers) == (4, 128, 4, 2, 32, 384, 259, 0)
    # Qwen3-MoE-like: 48 layers all MoE, top-8 of experts of width 768 → active MLP width 8·768 = 6144
    moe = ModelShape.from_hf_config({"num_hidden_layers": 48, "hidden_size": 2048, "num_attention_heads": 32,
                                     "num_key_value_heads": 4, "head_dim": 128, "vocab_size": 151936,
                                     "intermediate_size": 6144, "num_experts": 128, "num_experts_per_tok": 8,
                                     "moe_intermediate_size": 768})
    assert (moe.num_moe_layers, moe.moe_ffn_hidden_size, moe.head_dim) == (48, 6144, 128)
    # Mixtral-like: top-2 of 8 experts of width intermediate_size 14336 → 2·14336 = 28672, h / a = 4096/32 = 128
    mix = ModelShape.from_hf_config({"num_hidden_layers": 32, "hidden_size": 4096, "num_attention_heads": 32,
                                     "num_key_value_heads": 8, "vocab_size": 32000, "intermediate_size": 14336,
                                     "num_local_experts": 8, "num_experts_per_tok": 2})
    assert (mix.num_moe_layers, mix.moe_ffn_hidden_size, mix.head_dim) == (32, 28672, 128)
    with pytest.raises(ConfigError, match="lacks num_attention_heads, intermediate_size"):
        ModelShape.from_hf_config({"num_hidden_layers": 2, "hidden_size": 8, "vocab_size": 3})


def test_balance_data_evens_out_ranks_that_strided_leaves_unequal():
    # FLOPs = tokens here, so the arithmetic is exact. Σ = 2650, cap 1000. Best fit: {900,100} {400,350,250}
    # {300,200,150} (1000, 1000, 650); DP 2 needs 4 → {900,100} halves into {900} {100}.
    # strided: rank 0 = {900} + {300,200,150} = 1550, rank 1 = 1000 + 100 = 1100 → 1550 / 1325 = 1.170.
    # KK: runs (650|100), (1000|900) → 650+900 | 100+1000: the same 1550 | 1100. Then the best transfer for gap
    # 450 (δ closest to 225, bins ≤ 1000): move 200 into rank 1's {100} (δ = 200; the swap 300 ↔ 100 ties and a
    # move is preferred) → 1350 | 1300 → 1350 / 1325 = 1.019; the next gap, 50, is below any sample: stop.
    lengths = [900, 400, 350, 300, 250, 200, 150, 100]
    F = [float(x) for x in lengths]
    kw = dict(dp_size=2, global_batch_size=8, max_tokens_per_gpu=1000, flops=F)
    plain = build_dp_schedule(lengths, **kw)
    balanced = build_dp_schedule(lengths, balance_data=True, **kw)
    for s in (plain, balanced):
        assert_schedule(s, lengths, dp_size=2, global_batch_size=8, cap=1000)
    assert schedule_stats(plain, lengths, F, 1000)["dp_imbalance"] == pytest.approx(1550 / 1325)
    assert schedule_stats(balanced, lengths, F, 1000)["dp_imbalance"] == pytest.approx(1350 / 1325)
    assert sorted(sorted(lengths[i] for i in mb) for mb in balanced[0].ranks[1]) == [[100, 200], [250, 350, 400]]


def test_schedule_stats_by_hand():
    # 2 ranks, one step: rank 0 {0,1} (3+5 tokens), rank 1 {2} (8 tokens), cap 10:
    # efficiency = 16 / (2·10) = 0.8; FLOPs = tokens here: max 8 / mean 8 = 1.0
    steps = [Step(ranks=[[[0, 1]], [[2]]])]
    s = schedule_stats(steps, [3, 5, 8], [3.0, 5.0, 8.0], 10)
    assert (s["efficiency"], s["dp_imbalance"], s["micro_batches_per_rank"]) == (0.8, 1.0, 1.0)
    s = schedule_stats(steps, [3, 5, 8], [3.0, 1.0, 8.0], 10)  # FLOPs 4 vs 8 → max 8 / mean 6
    assert s["dp_imbalance"] == pytest.approx(8 / 6)


# ---- property tests (hypothesis), all through the invariant helper ---------------------------------------------
@st.composite
def schedules(draw):
    dp = draw(st.integers(1, 6))
    per_step = draw(st.integers(1, 4)) * dp  # G: a multiple of DP (RF06 guarantees it in dynamic mode)
    num_steps = draw(st.integers(1, 3))
    multi = draw(st.booleans())  # trajectories of several samples (multi-turn, compaction) or one each
    sizes = [draw(st.integers(1, 3)) if multi else 1 for _ in range(per_step * num_steps)]
    rids = [t for t, k in enumerate(sizes) for _ in range(k)]
    lengths = draw(st.lists(st.integers(1, 3000), min_size=len(rids), max_size=len(rids)))
    dynamic = draw(st.booleans())
    cap = draw(st.integers(50, 4000)) if dynamic else None
    return dict(lengths=lengths, rids=rids if multi else None, dp=dp, G=per_step, cap=cap,
                cp=draw(st.integers(1, 2)), mbs=draw(st.integers(1, 3)), balance_data=draw(st.booleans()),
                balance_by_flops=draw(st.booleans()))


@settings(max_examples=300, deadline=None)
@given(schedules())
def test_every_schedule_keeps_the_invariants(c):
    lengths, dp, G = c["lengths"], c["dp"], c["G"]
    dynamic = c["cap"] is not None
    if not dynamic and c["rids"] is None and G % (c["mbs"] * dp):
        c["mbs"] = 1  # static mode needs mbs·DP | G (RF06); trajectory steps are sized by splitting
    try:
        steps = build_dp_schedule(lengths, dp_size=dp, global_batch_size=G, cp_size=c["cp"],
                                  max_tokens_per_gpu=c["cap"], micro_batch_size=c["mbs"],
                                  balance_data=c["balance_data"], balance_by_flops=c["balance_by_flops"],
                                  flops=flops_of(lengths), rollout_ids=c["rids"])
    except ValueError as e:  # only legal when a step has fewer samples than the DP-multiple it must fill
        assert c["rids"] is not None and "cannot fill" in str(e)
        return
    cap = c["cap"] * c["cp"] if dynamic else None
    assert_schedule(steps, lengths, dp_size=dp, global_batch_size=G, cap=cap, micro_batch_size=c["mbs"],
                    rollout_ids=c["rids"])
    if dynamic and c["rids"] is None and not c["balance_by_flops"]:
        # best fit leaves at most one bin half empty, so K ≤ oversize + 2·⌈Σ_fit/cap⌉ + 1, then < DP splits
        for step in steps:
            fit = [lengths[i] for i in step.samples if lengths[i] <= cap]
            over = sum(1 for i in step.samples if lengths[i] > cap)
            k = len(step.micro_batches)
            assert k <= over + 2 * -(-sum(fit) // cap) + 1 + dp - 1 or k == len(step.samples)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 10_000), min_size=1, max_size=60), st.integers(1, 8), st.booleans())
def test_karmarkar_karp_partitions_exactly(weights, k, equal_size):
    if equal_size:
        weights = weights[: len(weights) - len(weights) % k] or [1] * k
    parts = karmarkar_karp(weights, k, equal_size)
    assert len(parts) == k and sorted(i for p in parts for i in p) == list(range(len(weights)))
    if equal_size:
        assert {len(p) for p in parts} == {len(weights) // k}
    sums = [sum(weights[i] for i in p) for p in parts]
    assert sums == sorted(sums, reverse=True)
    if not equal_size:  # differencing never leaves a gap larger than the largest item
        assert sums[0] - sums[-1] <= max(weights)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 500), min_size=4, max_size=40), st.integers(2, 4), st.booleans())
def test_rebalance_only_lowers_the_heaviest_rank_and_keeps_bins_legal(lengths, groups, moves):
    F = flops_of(lengths)
    cap = max(lengths) * 2
    bins = best_fit_decreasing(list(range(len(lengths))), lengths, cap)
    ranks = [bins[r::groups] for r in range(groups)]
    out = rebalance(ranks, lengths, F, cap, moves=moves)
    load = lambda rs: max(sum(F[i] for b in g for i in b) for g in rs)  # noqa: E731
    assert load(out) <= load(ranks)
    assert [len(g) for g in out] == [len(g) for g in ranks]
    assert all(b and sum(lengths[i] for i in b) <= cap for g in out for b in g)
    if not moves:  # swaps only: every bin keeps its sample count (static mode)
        assert [[len(b) for b in g] for g in out] == [[len(b) for b in g] for g in ranks]
    assert sorted(i for g in out for b in g for i in b) == list(range(len(lengths)))


# ---- micro-batch materialisation -------------------------------------------------------------------------------
def _sample(index, prompt, response, lps, status=Status.COMPLETED):
    return Sample(index=index, group_index=0, rollout_id=0, prompt="p", tokens=prompt + response,
                  response_length=len(response), loss_mask=[1] * len(response), rollout_log_probs=lps,
                  status=status)


def test_micro_batch_is_flat_with_restarting_positions_and_aligned_fields():
    a = _sample(3, [11, 12], [13, 14, 15], [-0.1, -0.2, -0.3])  # P=2, R=3
    b = _sample(5, [21], [22], [-0.5])  # P=1, R=1
    mb = make_micro_batch([a, b], [2.0, -1.0], pad_to_multiple=4)  # 5 + 2 = 7 tokens → 1 pad token to 8
    assert mb.tokens.tolist() == [11, 12, 13, 14, 15, 21, 22, 0]
    assert mb.cu_seqlens.tolist() == [0, 5, 7, 8]
    assert mb.position_ids.tolist() == [0, 1, 2, 3, 4, 0, 1, 0]
    assert mb.loss_mask.tolist() == [0, 0, 1, 1, 1, 0, 1, 0]
    assert mb.advantages.tolist() == [0, 0, 2, 2, 2, 0, -1, 0]
    assert mb.rollout_log_probs.tolist() == pytest.approx([0, 0, -0.1, -0.2, -0.3, 0, -0.5, 0])
    assert mb.sample_ids == [3, 5] and mb.num_samples == 2 and mb.num_tokens == 8


def test_micro_batch_masks_failed_samples_and_rejects_misaligned_ones():
    failed = _sample(0, [1], [2, 3], [], status=Status.FAILED)  # no log-probs: fine, it is never trained
    mb = make_micro_batch([failed], [1.0])
    assert mb.loss_mask.sum() == 0 and mb.rollout_log_probs.abs().sum() == 0
    bad = _sample(1, [1], [2, 3], [-0.1])  # 2 response tokens, 1 log-prob
    with pytest.raises(ValueError, match="sample 1: response_length 2 but 2 loss-mask entries and 1 rollout"):
        make_micro_batch([bad], [1.0])


# ---- batch arithmetic (RF06) -----------------------------------------------------------------------------------
@settings(max_examples=200, deadline=None)
@given(st.integers(1, 24), st.integers(1, 16), st.integers(1, 4), st.integers(1, 8), st.booleans())
def test_working_global_batch_sizes_are_exactly_those_batch_plan_accepts(B, n, mbs, dp, dynamic):
    good = working_global_batch_sizes(B * n, micro_batch_size=mbs, dp_size=dp, use_dynamic_batch_size=dynamic)
    for g in range(1, B * n + 1):
        kw = dict(rollout_batch_size=B, n_samples_per_prompt=n, num_rollout=3, global_batch_size=g,
                  num_steps_per_rollout=None, micro_batch_size=mbs, dp_size=dp, use_dynamic_batch_size=dynamic)
        if g in good:
            plan = batch_plan(**kw)
            assert plan.num_steps_per_rollout * g == B * n and plan.train_iters == 3 * B * n // g
        else:
            with pytest.raises(ConfigError) as e:
                batch_plan(**kw)
            assert e.value.codes == ["RF06"] and str(g) in str(e.value)


@pytest.mark.parametrize("kw, what, fix", [
    # k = 4 → G = B·n/k = 8·8/4 = 16 ≠ 32
    (dict(num_steps_per_rollout=4, global_batch_size=32), "G = B·n/k = 64/4 = 16", "--global-batch-size 16"),
    # dynamic: G = 64 over DP = 3 cannot give every rank the same count; working G: 3 | G | 64 → none
    (dict(global_batch_size=None, dp_size=3, use_dynamic_batch_size=True), "G = 64 is not a multiple of DP = 3",
     "--rollout-batch-size 3 (B·n = 24)"),
    # static: G = 64, mbs 4 × DP 4 = 16 | 64 fine; mbs 3 × DP 4 = 12 ∤ 64 → mbs one of divisors(64/4 = 16)
    (dict(global_batch_size=None, micro_batch_size=3, dp_size=4), "micro_batch_size × DP = 3 × 4 = 12",
     "--micro-batch-size one of [1, 2, 4, 8, 16]"),
])
def test_rf06_messages_show_the_numbers_and_the_fix(kw, what, fix):
    base = dict(rollout_batch_size=8, n_samples_per_prompt=8, num_rollout=1, global_batch_size=None,
                num_steps_per_rollout=None, micro_batch_size=1, dp_size=1)
    with pytest.raises(ConfigError) as e:
        batch_plan(**{**base, **kw})
    assert e.value.codes == ["RF06"] and what in str(e.value) and fix in str(e.value), str(e.value)


# ---- config: RF03, CP, RF07 ------------------------------------------------------------------------------------
def test_rf03_dynamic_batch_needs_a_cap_and_suggests_response_len_over_cp():
    from engine.config import RunConfig
    from engine.doctor.checks import Environment, dynamic_batch_needs_cap

    env = Environment()
    # no cap: error; safe start = rollout_max_response_len / cp = 8192 / 2 = 4096
    cfg = RunConfig(use_dynamic_batch_size=True, rollout_max_response_len=8192, context_parallel_size=2,
                    actor_num_gpus_per_node=2)
    (d,) = dynamic_batch_needs_cap(cfg, env)
    assert (d.code, d.severity) == ("RF03", "error") and "--max-tokens-per-gpu 4096" in d.fix
    # a cap without dynamic batching does nothing: warned
    (d,) = dynamic_batch_needs_cap(RunConfig(max_tokens_per_gpu=4096), env)
    assert d.severity == "warning" and "no effect without --use-dynamic-batch-size" in d.what
    # one response (8192) > cap·cp = 2048·2 = 4096: warned, fix CP = ⌈8192/2048⌉ = 4
    cfg = RunConfig(use_dynamic_batch_size=True, max_tokens_per_gpu=2048, rollout_max_response_len=8192,
                    context_parallel_size=2, actor_num_gpus_per_node=2)
    (d,) = dynamic_batch_needs_cap(cfg, env)
    assert d.severity == "warning" and "2048·2 = 4096" in d.what and "--max-tokens-per-gpu 4096" in d.fix
    assert "--context-parallel-size 4" in d.fix  # slime's remedy, named with the note that it is not run here
    cfg = RunConfig(use_dynamic_batch_size=True, max_tokens_per_gpu=8192, rollout_max_response_len=8192)
    assert dynamic_batch_needs_cap(cfg, env) == []


def test_context_parallel_divides_dp_and_is_not_run_by_any_backend():
    from engine.config import RunConfig
    from engine.doctor.checks import Environment, parallel_layout

    cfg = RunConfig(actor_num_nodes=2, actor_num_gpus_per_node=4, context_parallel_size=2, train_backend="megatron",
                    rollout_batch_size=4, n_samples_per_prompt=4)
    assert cfg.dp_size == 4  # 2·4 GPUs / CP 2
    (d,) = parallel_layout(cfg, Environment())
    assert d.severity == "error" and "--context-parallel-size 2" in d.what and "--context-parallel-size 1" in d.fix
    tp = cfg.model_copy(update={"context_parallel_size": 1, "tensor_model_parallel_size": 3})
    (d,) = parallel_layout(tp, Environment())
    assert "8 train GPUs" in d.what and "TP·PP·CP = 3·1·1 = 3" in d.what


def test_moe_allgather_dispatcher_is_switched_to_alltoall_with_a_log_line(caplog):
    from engine.config import RunConfig

    with caplog.at_level(logging.WARNING, logger="rollflow.packing"):
        cfg = RunConfig(moe_token_dispatcher_type="allgather")
    assert cfg.moe_token_dispatcher_type == "alltoall"
    assert any("[RF07]" in r.message and "switched to alltoall" in r.message for r in caplog.records)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="rollflow.packing"):
        assert RunConfig(moe_token_dispatcher_type="flex").moe_token_dispatcher_type == "flex"
    assert not caplog.records


def test_varlen_packing_has_no_off_switch():
    from engine.config import RunConfig

    # slime forces variable_seq_lengths = True; here no flag may exist to turn packing (THD / varlen) off
    names = set(RunConfig.model_fields)
    assert not {n for n in names if any(w in n for w in ("varlen", "variable_seq", "qkv_format", "no_pack",
                                                         "packing"))}


# ---- the pack stage, without Ray or Prefect --------------------------------------------------------------------
def test_pack_stage_builds_equal_micro_batch_counts_and_logs_the_metrics(tmp_path, tiny_model):
    from engine.config import RunConfig
    from engine.run import Run
    from engine.stages import RolloutBatch, pack

    # B·n = 4·4 = 16 samples, k = 2 → G = 8, DP = 2, dynamic cap 40 tokens
    cfg = RunConfig(hf_checkpoint=tiny_model, rollout_batch_size=4, n_samples_per_prompt=4, num_steps_per_rollout=2,
                    actor_num_gpus_per_node=2, use_dynamic_batch_size=True, max_tokens_per_gpu=40,
                    balance_data=True, work_dir=str(tmp_path))
    groups = [[_sample(g * 4 + j, [1] * (3 + g), [2] * (5 + 3 * j), [-0.1] * (5 + 3 * j)) for j in range(4)]
              for g in range(4)]
    for g in groups:
        for j, s in enumerate(g):
            s.reward = float(j % 2)
    packed = pack(Run(cfg), RolloutBatch(0, groups, {}))
    lengths = [len(s.tokens) for g in groups for s in g]
    steps = [Step(ranks=[[mb.sample_ids for mb in packed.per_rank_steps[r][k]] for r in range(2)])
             for k in range(2)]
    assert_schedule(steps, lengths, dp_size=2, global_batch_size=8, cap=40)
    m = packed.metrics
    assert m["pack/micro_batches"] == sum(len(s.micro_batches) for s in steps)
    assert m["pack/micro_batches_per_rank"] == m["pack/micro_batches"] / 2
    assert m["pack/tokens"] == sum(lengths) and 0 < m["pack/efficiency"] <= 1
    assert 1.0 <= m["pack/dp_imbalance"] <= 1.1
    # the rewards travel with the packed rollout (the train workers compute advantages from them), by Sample.index
    assert packed.rewards == [float(j % 2) for _ in range(4) for j in range(4)]
    mb = next(mb for r in packed.per_rank_steps for st_ in r for mb in st_ if 1 in mb.sample_ids)
    j = mb.sample_ids.index(1)
    lo, hi = mb.cu_seqlens[j].item(), mb.cu_seqlens[j + 1].item()
    assert torch.equal(mb.position_ids[lo:hi], torch.arange(hi - lo))
