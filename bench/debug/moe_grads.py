"""Which gradients differ between the Megatron backend's Qwen3-MoE and the torch backend's (GPU, fp32), with the
alltoall and the allgather dispatcher: the check behind test_gpu_megatron_moe_steps_equal_torch_steps_in_fp32
(session 36). `python bench/debug/moe_grads.py OUT_DIR` on a GPU host with megatron-core."""
import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, "tests")
torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False


def run(dispatcher: str, model_dir: str, work: str) -> dict:
    from test_megatron_backend import _micro_batches

    from engine.config import RunConfig
    from engine.train import megatron_model as mm
    from engine.train.megatron_backend import MegatronBackend
    from engine.train.megatron_mapping import megatron_to_hf
    from engine.train.torch_backend import TorchBackend
    from engine.weights.layout import checkpoint_state

    orig = mm.model_kwargs

    def kwargs(*a, **k):
        cfg, gpt = orig(*a, **k)
        if dispatcher == "allgather":
            cfg.update(moe_token_dispatcher_type="allgather", variable_seq_lengths=False)
        return cfg, gpt

    mm.model_kwargs = kwargs
    cfg = RunConfig(hf_checkpoint=model_dir, train_backend="megatron", lr=1e-3, micro_batch_size=4,
                    rollout_batch_size=4, n_samples_per_prompt=4, work_dir=work, save="", progress=False)
    mbs = _micro_batches()
    mg = MegatronBackend(cfg, params_dtype="float32")
    tb = TorchBackend(cfg)
    got = {}
    step = mg._optimizer_step

    def capture(local_loss, mbs_):
        got["mg"] = {n: p.main_grad.detach().clone().cpu() for n, p in mg.gpt.named_parameters()}
        return step(local_loss, mbs_)

    mg._optimizer_step = capture
    tstep = tb.optimizer.step

    def tcapture(*a, **k):
        got["tb"] = {n: p.grad.detach().clone().cpu() for n, p in tb.model.named_parameters()}
        return tstep(*a, **k)

    tb.optimizer.step = tcapture
    eager = TorchBackend(cfg)  # transformers' experts one by one (its default on CUDA is grouped_mm)
    impl = getattr(eager.model.config, "_experts_implementation", None)
    eager.model.set_experts_implementation("eager")
    estep = eager.optimizer.step

    def ecapture(*a, **k):
        got["eager"] = {n: p.grad.detach().clone().cpu() for n, p in eager.model.named_parameters()}
        return estep(*a, **k)

    eager.optimizer.step = ecapture
    old, t_old = mg.compute_log_probs(mbs), tb.compute_log_probs(mbs)
    e_old = eager.compute_log_probs(mbs)
    m, t = mg.train_step(mbs, old, old, 8), tb.train_step(mbs, t_old, t_old, 8)
    e = eager.train_step(mbs, e_old, e_old, 8)
    mine = megatron_to_hf(got["mg"], mg.shape)
    theirs = checkpoint_state(tb.model, got["tb"])
    ref = checkpoint_state(eager.model, got["eager"])
    diff = {k: float((mine[k] - theirs[k]).abs().max()) for k in theirs if k in mine}
    norms = {k: float(theirs[k].norm()) for k in theirs}
    mm.model_kwargs = orig
    return {"dispatcher": dispatcher, "torch_experts_impl": impl, "loss": [m["loss_total"], t["loss_total"]],
            "grad_norm": [m["grad_norm"], t["grad_norm"]], "grad_norm_eager_experts": e["grad_norm"],
            "max_diff_megatron_vs_eager": max(float((mine[k] - ref[k]).abs().max()) for k in ref),
            "max_diff_default_vs_eager": max(float((theirs[k] - ref[k]).abs().max()) for k in ref),
            "sum_sq_torch": sum(v ** 2 for v in norms.values()),
            "sum_sq_megatron": sum(float(v.norm()) ** 2 for v in mine.values()),
            "missing": sorted(set(theirs) - set(mine)),
            "worst": sorted(diff.items(), key=lambda kv: -kv[1])[:8],
            "norms_of_worst": {k: norms[k] for k, _ in sorted(diff.items(), key=lambda kv: -kv[1])[:8]}}


def main() -> None:
    from model_families import random_model

    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp())
    model = random_model("qwen3moe", 128)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    model.save_pretrained(tmp / "hf")
    res = [run(d, str(tmp / "hf"), str(tmp / "work")) for d in sys.argv[2:] or ["alltoall"]]
    (out / "moe_grads.json").write_text(json.dumps(res, indent=1))
    for r in res:
        print(json.dumps(r)[:1500])


if __name__ == "__main__":
    main()
