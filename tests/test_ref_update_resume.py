"""--ref-update-interval across a resume: the checkpoint carries the moved reference, so 2 rollouts then a resume
to 3 end with the weights of 3 uninterrupted rollouts, bit for bit."""
from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow


def test_a_resume_continues_with_the_moved_reference(prefect_harness, shared_ray, small_cfg, tmp_path):
    from safetensors.torch import load_file

    from engine import checkpoint
    from flows.train import rl_train

    over = dict(use_kl_loss=True, kl_loss_coef=1.0, ref_update_interval=1, lr=1e-3, eval_prompt_data=[],
                save_interval=1)
    whole = rl_train(small_cfg(num_rollout=3, save=str(tmp_path / "whole"), work_dir=str(tmp_path / "w1"), **over))
    assert whole["history"]["train/ref_updated"] == {"0": 1.0, "1": 1.0, "2": 1.0}
    rl_train(small_cfg(num_rollout=2, save=str(tmp_path / "cut"), work_dir=str(tmp_path / "w2"), **over))
    assert (checkpoint.iter_dir(str(tmp_path / "cut"), 1) / "ref" / "model" / "model.safetensors").is_file()
    resumed = rl_train(small_cfg(num_rollout=3, save=str(tmp_path / "cut"), work_dir=str(tmp_path / "w2"), **over))
    assert resumed["history"]["train/kl"]["2"] == whole["history"]["train/kl"]["2"]

    def weights(save):
        return load_file(str(checkpoint.iter_dir(save, 2) / "model" / "model.safetensors"))

    a, b = weights(str(tmp_path / "whole")), weights(str(tmp_path / "cut"))
    assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)
