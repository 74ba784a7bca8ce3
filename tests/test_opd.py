"""--use-opd (on-policy distillation, slime's flags): the teacher scores the student's own samples and each trained
token's advantage gets −opd_kl_coef × (log π_old − log π_teacher)."""
from __future__ import annotations

import pytest
import torch
from train_fakes import fake_samples, pack

from engine.config import RunConfig
from engine.config.data import BUNDLED_MODEL
from engine.diagnosis import ConfigError, DiagnosisError

OPD = dict(use_opd=True, opd_type="megatron")


def _teacher(path, noise: float = 0.05, vocab: int | None = None) -> str:
    """The bundled model with every weight moved (a teacher that disagrees with the student), as an HF directory."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(BUNDLED_MODEL, torch_dtype=torch.float32)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(noise * torch.randn(p.shape, generator=g))
    if vocab is not None:
        model.resize_token_embeddings(vocab)
    model.save_pretrained(path)
    return str(path)


def _worker(**over):
    from engine.train.worker import TrainWorker

    cfg = RunConfig(hf_checkpoint=BUNDLED_MODEL, rollout_batch_size=4, n_samples_per_prompt=2, global_batch_size=8,
                    micro_batch_size=4, **over)
    return TrainWorker(cfg.model_dump(), rank=0, world_size=1, master=None, train_iters=2, threads=1)


def _batch():
    samples = fake_samples([(5, 3), (4, 2), (6, 4), (3, 3), (5, 1), (4, 4), (2, 3), (5, 2)], n=2, seed=0,
                           rewards=[1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 1.0])
    samples[2].loss_mask = [1, 0, 1, 1]  # a masked token (a tool's) is not penalised
    return samples, [pack(samples, [[0, 1, 2, 3], [4, 5, 6, 7]])]


def _advantages(**over):
    samples, steps = _batch()
    w = _worker(**over)
    facts = w.set_rollout(steps, [s.scalar_reward for s in samples], need_ref=False)
    return samples, steps, torch.cat([mb.advantages for mb in steps[0]]), facts


def _response_logprobs(path: str, sample) -> torch.Tensor:
    """log π(token) of the sample's response tokens under the model at `path`, by transformers, unpacked."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([sample.tokens])).logits[0].float()
    lp = torch.log_softmax(logits[:-1], -1).gather(-1, torch.tensor(sample.tokens[1:])[:, None]).squeeze(-1)
    return lp[-sample.response_length:]


def test_the_penalty_is_the_reverse_kl_to_the_teacher_on_every_trained_token(tmp_path):
    teacher = _teacher(tmp_path / "teacher")
    samples, steps, base, _ = _advantages()
    _, opd_steps, adv, facts = _advantages(use_opd=True, opd_type="megatron", opd_teacher_load=teacher,
                                           opd_kl_coef=0.5)
    expected, kls = [], []
    for mb in steps[0]:  # the micro-batches' layout: each sample's prompt, then its response
        for i in mb.sample_ids:
            s = samples[i]
            rkl = (_response_logprobs(BUNDLED_MODEL, s) - _response_logprobs(teacher, s)) * torch.tensor(
                s.loss_mask, dtype=torch.float32)
            expected.append(torch.cat([torch.zeros(len(s.tokens) - s.response_length), -0.5 * rkl]))
            kls += [float(x) for x, m in zip(rkl, s.loss_mask) if m]
    delta = adv - base
    assert delta.abs().sum() > 0.1
    assert torch.allclose(delta, torch.cat(expected), atol=1e-5)
    assert facts["opd_reverse_kl_sum"] / facts["opd_reverse_kl_count"] == pytest.approx(sum(kls) / len(kls),
                                                                                       abs=1e-5)
    assert facts["opd_reverse_kl_count"] == sum(sum(s.loss_mask) for s in samples)


def test_a_teacher_from_a_checkpoint_iteration_and_the_errors_that_name_it(tmp_path):
    from engine import checkpoint
    from engine.weights import load_weights_dir, save_weights_dir

    teacher = _teacher(tmp_path / "teacher")
    _, _, from_hf, _ = _advantages(**OPD, opd_teacher_load=teacher)
    save = tmp_path / "save"  # a --save directory holding iteration 3 (no marker needed with a step)
    save_weights_dir(load_weights_dir(teacher), checkpoint.iter_dir(save, 3) / "model")
    _, _, from_ckpt, _ = _advantages(**OPD, opd_teacher_load=str(save), opd_teacher_ckpt_step=3)
    assert torch.equal(from_hf, from_ckpt)
    with pytest.raises(DiagnosisError, match="--opd-teacher-ckpt-step 5: it has no iteration 5"):
        _advantages(**OPD, opd_teacher_load=str(save), opd_teacher_ckpt_step=5)
    with pytest.raises(DiagnosisError, match="neither a Hugging Face directory .* nor a checkpoint directory"):
        _advantages(**OPD, opd_teacher_load=str(tmp_path / "save"))  # no marker: which iteration is unknown
    with pytest.raises(DiagnosisError, match="vocabulary of 320 tokens and the student"):
        _advantages(**OPD, opd_teacher_load=_teacher(tmp_path / "other", vocab=320))


@pytest.mark.parametrize("over, named", [
    (dict(use_opd=True), "--use-opd needs --opd-type"),
    (dict(opd_kl_coef=0.5), "--opd-kl-coef without --use-opd would do nothing"),
    (dict(opd_teacher_load="t"), "--opd-teacher-load without --use-opd"),
    (dict(**OPD), "--opd-type megatron needs --opd-teacher-load"),
    (dict(use_opd=True, opd_type="sglang"), "--opd-type sglang needs --opd-teacher-url"),
    (dict(use_opd=True, opd_type="sglang", opd_teacher_url="h:1", opd_teacher_load="t"), "which --opd-type sglang"),
    (dict(**OPD, opd_teacher_load="t", opd_teacher_url="h:1"), "--opd-teacher-url is read only with --opd-type"),
    (dict(opd_teacher_url="h:1"), "--opd-teacher-url without --use-opd"),
    (dict(use_opd=True, opd_type="sglang", opd_teacher_url="h"), "--opd-teacher-url: 'h' is not host:port"),
    (dict(**OPD, opd_teacher_load="t", loss_type="sft_loss"), "--loss-type sft_loss does not read"),
])
def test_opd_flags_that_could_not_work_are_refused(over, named):
    with pytest.raises(ConfigError, match=named):
        RunConfig(**over)


def test_the_teacher_server_scores_each_response_as_the_teacher_model_does(tmp_path):
    """--opd-type sglang: teacher_scores asks the server for a prefill of every trained sample and keeps the
    response's log-probs: equal to transformers' on the teacher model; a failed sample is not scored."""
    from types import SimpleNamespace

    from conftest import served_engine

    from engine.rollout.client import EngineError
    from engine.samples import Status
    from engine.stages import teacher_scores

    teacher = _teacher(tmp_path / "teacher")
    samples, _ = _batch()
    samples[5].status = Status.FAILED
    with served_engine(teacher, api_key="k") as (_, url):
        cfg = RunConfig(use_opd=True, opd_type="sglang", opd_teacher_url=url, opd_teacher_api_key="k",
                        rollout_temperature=1.0)
        metrics = teacher_scores(SimpleNamespace(cfg=cfg), samples, batch=3)
        assert metrics["rollout/opd_teacher_seconds"] > 0
        for s in samples:
            if s.status == Status.FAILED:
                assert s.teacher_log_probs is None
            else:
                assert torch.allclose(torch.tensor(s.teacher_log_probs), _response_logprobs(teacher, s), atol=1e-4)
        wrong = RunConfig(use_opd=True, opd_type="sglang", opd_teacher_url=url, opd_teacher_api_key="nope")
        with pytest.raises(EngineError, match="did not score the rollout's samples: .*HTTP 401"):
            teacher_scores(SimpleNamespace(cfg=wrong), samples)


def _answer_kl(student: dict | None, teacher: str, k: int = 32) -> float:
    """The exact KL(π_student ‖ π_teacher) over the vocabulary at the first answer token of k test prompts, by
    transformers (student: a state dict over the bundled model, None for the bundled model itself)."""
    from transformers import AutoModelForCausalLM

    from engine.config.data import BUNDLED_TEST
    from engine.data import load_prompts
    from engine.modeling import load_tokenizer, render_prompt

    tok = load_tokenizer(BUNDLED_MODEL)
    rows = load_prompts(BUNDLED_TEST, input_key="prompt", label_key="label")[:k]
    models = []
    for path, state in ((BUNDLED_MODEL, student), (teacher, None)):
        m = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
        if state is not None:
            m.load_state_dict(state, strict=False)
        models.append(m)
    total = 0.0
    with torch.no_grad():
        for row in rows:
            ids = torch.tensor([render_prompt(tok, row.prompt, True)])
            ls, lt = (torch.log_softmax(m(ids).logits[0, -1].float(), -1) for m in models)
            total += float((ls.exp() * (ls - lt)).sum())
    return total / len(rows)


@pytest.mark.slow
@pytest.mark.parametrize("opd_type", ["megatron", "sglang"])
def test_pure_distillation_moves_the_student_toward_the_teacher(prefect_harness, shared_ray, small_cfg, tmp_path,
                                                               opd_type):
    """Every reward 0 (GRPO's advantages all 0): the teacher's penalty is the only signal, the teacher loaded into
    the trainer (megatron) or served (sglang: a built-in engine of the teacher, with a key). The exact KL from the
    student to the teacher at the first answer token of 32 test prompts (measured apart from the run) falls, and
    the run logs the sampled estimate every rollout."""
    from contextlib import nullcontext

    from conftest import served_engine
    from safetensors.torch import load_file

    from engine import checkpoint
    from flows.train import rl_train

    teacher = _teacher(tmp_path / "teacher")
    save = tmp_path / "ckpt"
    server = served_engine(teacher, api_key="teacher-key") if opd_type == "sglang" else nullcontext()
    with server as served:
        where = dict(opd_teacher_url=served[1], opd_teacher_api_key="teacher-key") if served else \
            dict(opd_teacher_load=teacher)
        out = rl_train(small_cfg(num_rollout=8, eval_prompt_data=[], save=str(save), lr=3e-4, use_opd=True,
                                 opd_type=opd_type, custom_rm_path="examples/hooks.py:no_reward", **where))
    assert set(out["history"]["rollout/reward_mean"].values()) == {0.0}
    if opd_type == "sglang":
        assert all(v > 0 for v in out["history"]["rollout/opd_teacher_seconds"].values())
    assert sorted(out["history"]["train/opd_reverse_kl"], key=int) == [str(i) for i in range(8)]
    trained = load_file(str(checkpoint.iter_dir(str(save), 7) / "model" / "model.safetensors"))
    before, after = _answer_kl(None, teacher), _answer_kl(trained, teacher)
    assert after < 0.7 * before, (before, after)


def test_the_doctor_finds_a_teacher_that_cannot_load_before_anything_starts(tmp_path):
    from engine.doctor.checks import Environment, opd_teacher_usable

    def found(**over):
        cfg = RunConfig(hf_checkpoint=BUNDLED_MODEL, use_opd=True, opd_type="megatron", **over)
        return [d.what for d in opd_teacher_usable(cfg, Environment()) if d.severity == "error"]

    assert found(opd_teacher_load=_teacher(tmp_path / "teacher")) == []
    assert "neither a Hugging Face directory" in found(opd_teacher_load=str(tmp_path / "nowhere"))[0]
    assert "no iteration 4" in found(opd_teacher_load=str(tmp_path), opd_teacher_ckpt_step=4)[0]
    assert "vocabulary of 320 tokens" in found(opd_teacher_load=_teacher(tmp_path / "other", vocab=320))[0]
    # a wider teacher with the student's vocabulary: the torch backend loads it as a model of its own; the megatron
    # backend loads a teacher into the student's model (as slime's), so there it is refused before anything starts
    from transformers import AutoConfig, AutoModelForCausalLM

    wider = AutoConfig.from_pretrained(BUNDLED_MODEL)
    wider.intermediate_size *= 2
    AutoModelForCausalLM.from_config(wider).save_pretrained(tmp_path / "wider")
    assert found(opd_teacher_load=str(tmp_path / "wider")) == []
    (what,) = found(opd_teacher_load=str(tmp_path / "wider"), train_backend="megatron")
    assert "not the student's architecture" in what and f"ffn_hidden_size={wider.intermediate_size}" in what, what
    assert found(opd_teacher_load=_teacher(tmp_path / "teacher"), train_backend="megatron") == []


def test_served_teacher_log_probs_reach_the_penalty_and_a_batch_without_trained_samples_needs_none():
    """--opd-type sglang: the penalty takes the samples' teacher_log_probs; a micro-batch whose samples all failed
    (nothing trained, so nothing scored) gets no penalty instead of an error."""
    from engine.samples import Status

    samples, steps = _batch()
    for s in samples[:4]:
        s.teacher_log_probs = [lp - 0.25 for lp in s.rollout_log_probs]
    for s in samples[4:]:
        s.status = Status.FAILED
    steps = [pack(samples, [[0, 1, 2, 3], [4, 5, 6, 7]])]
    w = _worker(use_opd=True, opd_type="sglang", opd_teacher_url="127.0.0.1:1", use_rollout_logprobs=True)
    facts = w.set_rollout(steps, [s.scalar_reward for s in samples], need_ref=False, old_from="rollout")
    # old = the engine's log-probs, teacher = old − 0.25: a reverse KL of 0.25 on every trained token
    assert facts["opd_reverse_kl_sum"] / facts["opd_reverse_kl_count"] == pytest.approx(0.25)
    assert not steps[0][1].advantages.any()
