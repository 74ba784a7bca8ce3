"""megatron-core's GPTModel, built by engine.train.megatron_model, against transformers on CPU (gloo).

Runs only where megatron-core is installed (`pip install --no-deps megatron-core==0.16.1` works on a CPU
machine). Each case is a fresh process group of 1 or 2 processes (TP = 1, 2), with RoPE either Megatron's
THD path or the packed attention's own. Megatron's RoPE moves its frequencies to
`torch.cuda.current_device()`; the child processes point that at the CPU — the only patch.
Checks, per family (Qwen2 tied / Qwen3 q-k norm / Llama GQA 6:2 / Mistral: a sliding window of 4 tokens / at TP = 1
the mixtures of experts: Qwen3-MoE's router and experts, Mixtral's (a window of 6), Qwen2-MoE's gated shared expert
and dense layer 0),
on one packed row of 3 samples:
log-probs and entropies equal the torch backend's per-sample ones; the gradients of Σ(log p + H) equal
transformers' gradients mapped and sharded the same way; gathering the shards gives back the HF weights.
With routing replay (the mixtures of experts), the same after both models' routers moved, each replaying the
routing it recorded before.
"""
from __future__ import annotations

import sys
import warnings
from contextlib import nullcontext
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

pytest.importorskip("megatron.core")
pytestmark = pytest.mark.slow

sys.path.insert(0, str(Path(__file__).parent))
from conftest import spawn_ranks  # noqa: E402


def _case(rank: int, world: int, init: str, families: list[str], rope_in_attention: bool, out: dict,
          replay: bool = False, ep: int = 1, dispatcher: str = "allgather") -> None:
    """ep > 1: TP = 1, each rank a data-parallel rank with its own micro-batch and num_experts / ep experts."""
    warnings.filterwarnings("ignore")
    torch.cuda.current_device = lambda: "cpu"  # see module docstring
    if dispatcher == "alltoall":
        _host_streams()
    if torch.cuda.is_available():  # on a GPU host megatron-core's compiled MoE helpers would ask dynamo about the
        from torch import _dynamo  # "cpu" CUDA device above: they run eagerly (the same math)

        _dynamo.config.disable = True
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)

    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region
    from megatron.core.transformer.transformer_config import TransformerConfig
    from test_megatron_mapping import hf_model

    from engine.train import megatron_model as mm
    from engine.train.megatron_mapping import hf_to_megatron, padded_vocab, shape_from_hf_config, tp_shard
    from engine.train.packed_logprobs import align_to_tokens, shift_targets, vocab_parallel_log_probs
    from engine.train.forward import packed_forward, use_varlen_attention
    from engine.weights.layout import checkpoint_state

    tp = world // ep
    parallel_state.initialize_model_parallel(tp, 1, expert_model_parallel_size=ep)
    r = parallel_state.get_tensor_model_parallel_rank()
    group = parallel_state.get_tensor_model_parallel_group()

    def reduce_max(x):
        dist.all_reduce(x, op=dist.ReduceOp.MAX, group=group)
        return x

    for family in families:
        hf = hf_model(family)
        with torch.no_grad():
            for p in hf.parameters():
                p.mul_(0.3)  # hf_model draws N(0, 1) weights; keep activations in a sane range
        s = shape_from_hf_config(hf.config.to_dict())
        vp = padded_vocab(s.vocab_size, tp)  # 101 → 102 at TP = 2: exercises the padding mask
        # Megatron's fused SwiGLU is torch.compile'd: minutes on a small CPU, so it is left to the GPU run.
        # The rope-in-attention case also uses the HF-order RMSNorm (layers, q/k norms, final norm).
        kernels = mm.Kernels(rope_in_attention=rope_in_attention, fused_swiglu=False, hf_rms_norm=rope_in_attention)
        cfg_kw, gpt_kw = mm.model_kwargs(s, tp=tp, pp=1, dtype=torch.float32, kernels=kernels, ep=ep)
        assert gpt_kw["position_embedding_type"] == ("none" if rope_in_attention else "rope")
        if s.num_experts and dispatcher == "allgather":  # the alltoall dispatcher the runs use makes a CUDA stream
            # (the EP case replaces it: _host_streams); the routing and the experts are the same with allgather
            cfg_kw.update(moe_token_dispatcher_type="allgather", variable_seq_lengths=False)
        if s.num_experts:
            cfg_kw.update(moe_enable_routing_replay=replay)
        config = TransformerConfig(**cfg_kw, use_cpu_initialization=True)
        if s.num_experts:
            mm.router_without_te()  # (build_model does this for the runs)
        model = GPTModel(config=config, transformer_layer_spec=mm.block_spec(s, config, kernels), vocab_size=vp,
                         **gpt_kw)
        assert isinstance(model.decoder.final_layernorm, mm.HFRMSNorm) == rope_in_attention
        hf_state = checkpoint_state(hf, hf.state_dict())  # the files' names (a MoE's experts one by one)
        mm.load_hf_into(model, config, hf_state, s, vocab_padded=vp)
        gathered = mm.gather_hf_state(model, config, s)

        # EP: data-parallel ranks, each its own row (rank 1's samples: other tokens, other lengths)
        mbs = [_row(s.vocab_size, j) for j in range(ep)]
        mb = mbs[rank] if ep > 1 else mbs[0]
        tokens, cu, pos, trained = mb.tokens, mb.cu_seqlens, mb.position_ids, mb.loss_mask
        longest = int((cu[1:] - cu[:-1]).max())
        psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=longest,
                              max_seqlen_kv=longest)
        use_varlen_attention(hf)
        state = (float(max((gathered[k] - v).abs().max() for k, v in hf_state.items()
                           if not (s.tie_embeddings and k == "lm_head.weight"))) if rank == 0 else 0.0)
        replaying, facts = nullcontext(), {}
        if replay:
            replaying, facts = _record_and_move_routers(model, hf, mb, dict(input_ids=tokens[None],
                                                        position_ids=pos[None], attention_mask=None,
                                                        packed_seq_params=psp))
        logits = model(input_ids=tokens[None], position_ids=pos[None], attention_mask=None, packed_seq_params=psp)
        lp, ent = vocab_parallel_log_probs(logits[0].float(), shift_targets(tokens), vocab_start=r * vp // tp,
                                           vocab_size=s.vocab_size, reduce_max=reduce_max,
                                           reduce_sum=reduce_from_tensor_model_parallel_region)
        lp, ent = align_to_tokens(lp, cu), align_to_tokens(ent, cu)
        (lp.sum() + ent.sum()).backward()

        with replaying:
            for j, other in enumerate(mbs):  # EP: transformers' gradients are those of every rank's row
                got = packed_forward(hf, other, temperature=1.0)  # the torch backend's forward
                (got[0].sum() + got[1].sum()).backward()
                if other is mb:
                    ref_lp, ref_ent = got
        hf_grads = {n: p.grad for n, p in hf.named_parameters()}
        if s.tie_embeddings:
            hf_grads["lm_head.weight"] = hf_grads["model.embed_tokens.weight"]
        hf_grads = checkpoint_state(hf, hf_grads)
        want = hf_to_megatron(hf_grads, s, vocab_padded=vp)
        grad_err = {}
        first_expert = mm.expert_offset(s)
        for name, p in model.named_parameters():
            g = p.grad
            if "q_layernorm" in name or "k_layernorm" in name:  # replicated, each rank sees its own heads:
                g = g.clone()                                    # Megatron's finalize sums them over TP
                dist.all_reduce(g, group=group)
            if ep > 1 and ".local_experts." not in name:  # replicated over the DP ranks: DDP sums them; an
                g = g.clone()                              # expert's already holds every rank's tokens
                dist.all_reduce(g)
            grad_err[mm._global_name(name, 0, first_expert)] = float(
                (g - tp_shard(name, want[mm._global_name(name, 0, first_expert)], r, tp)).abs().max())
        out[(family, world, rank)] = dict(
            lp=float(((lp - ref_lp) * trained).abs().max()), ent=float(((ent - ref_ent) * trained).abs().max()),
            grad=grad_err, state=state, experts=sorted({n.split("local_experts.")[1].split(".")[0]
                                                        for n in grad_err if "local_experts." in n}), **facts)
    dist.destroy_process_group()


def rendezvous(tmp_path: Path, name: str = "rendezvous") -> str:
    """The process group's meeting place: a file, not a port (a free port picked here can be taken by another
    test's server before the ranks bind it: EADDRINUSE, seen once in CI)."""
    return f"file://{tmp_path / name}"


def _row(vocab_size: int, j: int):
    """Packed row j: 3 samples (row 0: 7, 12 and 5 tokens, with token 0, the random models' pad token, inside)."""
    from engine.packing.microbatch import MicroBatch

    lens = [[7, 12, 5], [9, 4, 10]][j]
    tokens = torch.randint(0, vocab_size, (sum(lens),), generator=torch.Generator().manual_seed(1 + j))
    tokens[9] = 0  # token 0 in the row: the families' random models name it their pad token (see hf_model)
    cu = torch.tensor([0] + lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    pos = torch.cat([torch.arange(n) for n in lens])
    trained = (pos > 0).float()  # every token a sample predicts (its first token has no prediction)
    return MicroBatch(tokens=tokens, cu_seqlens=cu, position_ids=pos, loss_mask=trained,
                      advantages=torch.zeros(len(pos)), rollout_log_probs=torch.zeros(len(pos)), sample_ids=[0, 1, 2])


def _host_streams() -> None:
    """megatron-core's alltoall dispatcher copies its token counts to the host on a side CUDA stream (the all-to-all
    splits as numpy arrays) and waits for an event there: on the CPU the copies only convert, and these stand-ins
    make the stream calls no-ops."""
    class Event:
        def synchronize(self):
            pass

    class Stream:
        def wait_stream(self, other):
            pass

        def record_event(self):
            return Event()

    from megatron.core.transformer.moe import token_dispatcher
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    def to_host(tensor, as_numpy=False, record_stream=False):  # moe_utils' copies only CUDA tensors; the splits
        return tensor.numpy() if as_numpy and torch.is_tensor(tensor) else tensor  # must become numpy as there

    token_dispatcher.maybe_move_tensor_to_cpu = to_host
    stream = Stream()
    MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = stream  # (made once, when None)
    torch.cuda.current_stream = lambda *a, **k: stream
    torch.cuda.stream = lambda s: nullcontext()


def _record_and_move_routers(model, hf, mb, inputs: dict):
    """--use-routing-replay at the model level: megatron-core's RouterReplay records the routing of a no-grad
    forward, the torch backend's hooks (engine.train.routing) that of transformers' model; both models' routers
    then move by the same noise, far enough that routing afresh differs; Megatron is set to replay its record.
    Returns (the torch side's replaying context, facts)."""
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    from engine.train.forward import packed_forward
    from engine.train.routing import TorchRouters

    replays = [m.router_replay for m in model.modules() if getattr(m, "router_replay", None) is not None]
    for r in replays:
        r.set_router_replay_action(RouterReplayAction.RECORD)
    with torch.no_grad():
        model(**inputs)
    mg_idx = [r.get_recorded_indices() for r in replays]
    hooks = TorchRouters(hf)
    with torch.no_grad(), hooks.recording() as hf_idx:
        packed_forward(hf, mb, temperature=1.0)
    same = len(mg_idx) == len(hf_idx) > 0 and all(torch.equal(a.sort(-1).values, b.sort(-1).values)
                                                  for a, b in zip(mg_idx, hf_idx))
    mg_routers = [p for n, p in model.named_parameters() if n.endswith("mlp.router.weight")]
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for a, b in zip(mg_routers, [r.weight for r in hooks.routers], strict=True):
            noise = torch.randn(b.shape, generator=g) * 3 * b.std()
            a.add_(noise)
            b.add_(noise)
    with torch.no_grad(), hooks.recording() as fresh:
        packed_forward(hf, mb, temperature=1.0)
    for r, idx in zip(replays, mg_idx):
        r.clear_indices()
        r.set_target_indices(idx)
        r.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
    return hooks.replaying(hf_idx), dict(same_record=same,
                                         moved=any(not torch.equal(a, b) for a, b in zip(fresh, hf_idx)))


@pytest.mark.parametrize("rope_in_attention", [True, False],
                         ids=["rope-in-attention+hf-norm", "megatron-thd-rope+torch-norm"])
@pytest.mark.parametrize("world", [1, 2])
def test_megatron_model_matches_transformers_on_packed_rows(world, rope_in_attention, tmp_path):
    init = rendezvous(tmp_path)
    out = mp.Manager().dict()
    families = ["qwen2", "qwen3", "llama", "qwen3moe", "qwen3moe-norm", "mistral", "mixtral", "qwen2moe"] \
        if world == 1 else \
        ["qwen2", "qwen3", "mistral"]
    spawn_ranks(_case, args=(world, init, families, rope_in_attention, out), nprocs=world)
    for (family, w, rank), res in out.items():
        assert res["lp"] < 1e-5 and res["ent"] < 1e-5, (family, rank, res["lp"], res["ent"])
        bad = {n: e for n, e in res["grad"].items() if e > 1e-5}
        assert not bad, (family, w, rank, bad)
        assert res["state"] == 0.0, (family, res["state"])
    assert len(out) == len(families) * world


def test_megatron_expert_parallelism_matches_transformers(tmp_path):
    """--expert-model-parallel-size 2 at TP = 1: two data-parallel ranks, each with its own packed row, experts 0–1
    on rank 0 and 2–3 on rank 1 (megatron-core's placement, which load_hf_into follows). Each rank's log-probs and
    entropies equal transformers' on its row; each expert's gradient (its rank's: the tokens of both rows routed to
    it) and every replicated weight's gradient summed over the ranks equal transformers' gradient of both rows;
    gather_hf_state gives back the HF weights. The dispatcher is the runs' alltoall (the rows differ in length,
    which the allgather one would not take)."""
    init = rendezvous(tmp_path)
    out = mp.Manager().dict()
    families = ["qwen3moe", "mixtral", "qwen2moe"]
    spawn_ranks(_case, args=(2, init, families, True, out, False, 2, "alltoall"), nprocs=2)
    assert len(out) == 2 * len(families)
    for (family, _, rank), res in out.items():
        assert res["experts"] == [["0", "1"], ["2", "3"]][rank], (family, rank, res["experts"])
        assert res["lp"] < 1e-5 and res["ent"] < 1e-5, (family, rank, res["lp"], res["ent"])
        bad = {n: e for n, e in res["grad"].items() if e > 1e-5}
        assert not bad, (family, rank, bad)
        assert res["state"] == 0.0, (family, res["state"])


def test_megatron_replays_the_routing_as_the_torch_backend(tmp_path):
    """--use-routing-replay, the models: megatron-core's RouterReplay and the torch backend's router hooks record
    the same experts; after both models' routers moved (routing afresh picks other experts), the replayed forward's
    log-probs, entropies and every gradient (the routers' included) are equal."""
    init = rendezvous(tmp_path)
    out = mp.Manager().dict()
    families = ["qwen3moe", "qwen3moe-norm", "mixtral", "qwen2moe"]
    spawn_ranks(_case, args=(1, init, families, True, out, True), nprocs=1)
    assert len(out) == len(families)
    for (family, _, _), res in out.items():
        assert res["same_record"] and res["moved"], family
        assert res["lp"] < 1e-5 and res["ent"] < 1e-5, (family, res["lp"], res["ent"])
        bad = {n: e for n, e in res["grad"].items() if e > 1e-5}
        assert not bad, (family, bad)


def test_the_megatron_backend_counts_where_the_replayed_routing_differs():
    """train/routing_replay_diff on the megatron backend (--use-rollout-routing-replay): the wrapped RouterReplay
    still replays the target experts, and counts the rows the engine routed (rollflow_given) where megatron's own
    top k of the same logits differs."""
    from types import SimpleNamespace

    from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

    from engine.train.megatron_backend import MegatronBackend

    logits = torch.randn(6, 4, generator=torch.Generator().manual_seed(0))
    own = logits.topk(2).indices
    target = own.clone()
    rest = [[e for e in range(4) if e not in row] for row in own.tolist()]
    target[[1, 3, 5]] = torch.tensor([rest[1], rest[3], rest[5]])  # three rows routed elsewhere
    replay, backend = RouterReplay(), SimpleNamespace(_differing=[0, 0])
    MegatronBackend._count_differing(backend, replay)
    replay.rollflow_given = torch.tensor([True, True, True, True, True, False])  # the last: not the engine's
    replay.set_target_indices(target)
    replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
    _, routing_map = topk_routing_with_score_function(logits, 2, router_replay=replay)
    assert torch.equal(routing_map, torch.zeros(6, 4, dtype=torch.bool).scatter(1, target, True))
    assert [float(x) for x in backend._differing] == [2.0, 5.0]
    replay.set_router_replay_action(RouterReplayAction.RECORD)  # recording counts nothing
    topk_routing_with_score_function(logits, 2, router_replay=replay)
    assert [float(x) for x in backend._differing] == [2.0, 5.0]
