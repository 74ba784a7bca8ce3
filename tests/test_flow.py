"""The whole rl-train flow under the Prefect test harness: real Ray, the built-in engine, MLflow on SQLite."""
from __future__ import annotations

import time

import pytest

pytestmark = pytest.mark.slow


def test_two_rollouts_end_to_end(prefect_harness, shared_ray, small_cfg, tmp_path):
    import asyncio

    from mlflow.tracking import MlflowClient
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    from engine import checkpoint
    from flows.train import rl_train

    from engine.config.data import BUNDLED_TEST

    # evals after 0, 1 and 2 rollouts, 2 samples each, on two named sets (the second: 8 rows of the same file);
    # rollout 1's training profiled (--use-pytorch-profiler: the train worker, in Ray, writes under <work_dir>)
    cfg = small_cfg(eval_interval=1, n_samples_per_eval_prompt=2,
                    eval_prompt_data=["arith", BUNDLED_TEST, "arith8", f"{BUNDLED_TEST}@[0:8]"],
                    use_pytorch_profiler=True, profile_step_start=1, profile_step_end=2)
    result = rl_train(cfg)
    assert [p.name for p in (tmp_path / "work" / "profile").iterdir()] == [
        "train_overall_rollout1_rank0.pt.trace.json.gz"]

    assert result["rollouts"] == 2
    assert 0.0 <= result["reward_first"] <= 1.0 and result["test_accuracy_after"] is not None
    # a one-node CPU run with one engine and one train rank: the engine serves from the train worker's process
    # (--rollout-engine-process auto) and takes its weights by an in-process copy
    (eng,), (rank0,) = result["placement"]["engines"], result["placement"]["train"]
    assert result["placement"]["engine_in_trainer"] and eng["pid"] == rank0["pid"], result["placement"]
    assert result["weight_sync"] == "in_process"

    # the checkpoint: marker written last, naming the last rollout, whose iteration dir exists
    assert checkpoint.read_marker(cfg.save) == 1
    assert (checkpoint.iter_dir(cfg.save, 1) / "manifest.json").is_file()
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text() == "1\n"

    # Prefect: the flow run completed, one task run per stage per rollout id
    async def read():
        async with get_client() as client:
            fr = await client.read_flow_run(result["flow_run_id"])
            trs = await client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[fr.id])))
            arts = await client.read_artifacts(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[fr.id])))
            return fr, trs, arts

    # task runs reach the API through its event pipeline, a moment after the flow returns
    expected = ["preflight", "place", "convert", "eval-0", "eval-1", "eval-2"] + [
        f"{stage}-{i}" for i in range(2) for stage in ("rollout", "pack", "train", "sync")] + ["save-1"]
    deadline = time.monotonic() + 30
    while True:
        fr, trs, arts = asyncio.run(read())
        if (len(trs) == len(expected) and all(t.state.is_final() for t in trs)) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert fr.state.is_completed()
    names = sorted(t.name for t in trs)
    assert names == sorted(expected)
    assert all(t.state.is_completed() for t in trs)
    # the graph draws the iteration's data: rollout → pack → train, and no edge from `place` to every task
    name_of = {t.id: t.name for t in trs}
    upstream = {t.name: sorted(name_of[x.id] for xs in t.task_inputs.values() for x in xs if x.input_type == "task_run")
                for t in trs}
    assert upstream["pack-1"] == ["rollout-1"] and upstream["train-1"] == ["pack-1"], upstream
    assert upstream["rollout-1"] == upstream["sync-1"] == upstream["eval-2"] == [], upstream

    # what the UI shows, each card once and updated in place, keys scoped to this run: progress at 100%, the
    # summary (the run so far and the last rollout), the last rollout's samples, the MLflow run and the checkpoint
    # (the rollflow.checkpoint.committed event and its trigger: tests/test_deployment.py)
    from plumbing.ui import artifact_key

    by_key = {}
    for a in arts:
        by_key.setdefault(a.key, []).append(a)
    for name in ("progress", "summary", "samples", "mlflow-run", "checkpoint", "checkpoint-link"):
        assert len(by_key.get(artifact_key(cfg, name), [])) == 1, (name, sorted(by_key))
    suffix = artifact_key(cfg, "x")[1:]  # -<experiment>-<8 hex of --save>
    assert all(k.endswith(suffix) for k in by_key), sorted(by_key)
    assert by_key[artifact_key(cfg, "progress")][0].data == 100.0
    summary = by_key[artifact_key(cfg, "summary")][0].data
    assert "finished, 2 of 2 rollouts" in summary and "#### rollout 1 of 2" in summary and "eval accuracy" in summary
    assert "samples of rollout 1" == by_key[artifact_key(cfg, "samples")][0].description
    assert by_key[artifact_key(cfg, "checkpoint-link")][0].data.endswith("/ckpt/iter_0000001)")

    # MLflow: params are the config, one metric point per rollout
    client = MlflowClient(tracking_uri=result["mlflow_tracking_uri"])
    run = client.get_run(result["mlflow_run_id"])
    assert run.data.params["rollout_batch_size"] == "4" and run.data.params["lr"] == "0.0001"
    assert run.data.tags["prefect.flow_run_id"] == str(fr.id)
    assert run.info.run_name == fr.name and fr.name.startswith("tests-")  # one name in both UIs
    assert [m.step for m in client.get_metric_history(run.info.run_id, "train/kl")] == [0]  # RF01's step only
    for key in ("rollout/reward_mean", "rollout/response_len_mean", "train/loss", "train/grad_norm",
                "rollout/seconds", "train/seconds", "sync/seconds", "pack/efficiency", "pack/dp_imbalance",
                "pack/micro_batches_per_rank"):
        hist = client.get_metric_history(run.info.run_id, key)
        assert sorted(m.step for m in hist) == [0, 1], key
    # RF14 after both syncs: the first samples the probe answers over HTTP, the second scores them in the sync
    # call itself (the engine in the train worker's process); fp32 on both sides
    probe = client.get_metric_history(run.info.run_id, "sync/probe_mismatch")
    assert sorted(m.step for m in probe) == [0, 1] and all(m.value < 1e-4 for m in probe), probe
    assert run.info.status == "FINISHED"

    # the eval curves: every --eval-interval and per named set, with mean@k and pass@k of k samples per prompt
    for name in ("arith", "arith8"):
        curve = {m.step: m.value for m in client.get_metric_history(run.info.run_id, f"eval/{name}_accuracy")}
        assert sorted(curve) == [0, 1, 2], name
        mean = {m.step: m.value for m in client.get_metric_history(run.info.run_id, f"eval/{name}_mean_at_k")}
        best = {m.step: m.value for m in client.get_metric_history(run.info.run_id, f"eval/{name}_pass_at_k")}
        assert mean == curve and all(best[s] >= mean[s] for s in curve), name
    first = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "eval/arith_accuracy")}
    assert first[2] == result["test_accuracy_after"]  # the first set is the run's headline accuracy


def test_a_runtime_failure_fails_the_task_with_the_diagnosis(prefect_harness, shared_ray, small_cfg, tmp_path):
    """A NaN reward makes the loss NaN: train-0 fails with RF13 in its state message and a doctor-report artifact."""
    import asyncio

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId, FlowRunFilterName

    from engine.doctor import DiagnosisError
    from flows.train import rl_train

    rm = tmp_path / "nan_reward.py"
    rm.write_text("def score(sample):\n    return float('nan')\n")
    cfg = small_cfg(custom_rm_path=f"{rm}:score", num_rollout=1, eval_prompt_data=None,
                    run_name="nan-run")
    with pytest.raises(DiagnosisError) as e:
        rl_train(cfg)
    assert e.value.codes == ["RF13"]

    async def read():
        async with get_client() as client:
            frs = await client.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=["nan-run"])))
            fr = frs[-1]
            trs = await client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[fr.id])))
            # this run's artifacts only: unfiltered, the API returns its default page (200) of every artifact of the
            # session's database, in id order, which need not hold this run's
            arts = await client.read_artifacts(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[fr.id])))
            return fr, trs, arts

    fr, trs, arts = asyncio.run(read())
    assert fr.state.is_failed()
    train = next(t for t in trs if t.name == "train-0")
    assert train.state.is_failed() and "RF13" in train.state.message
    from plumbing.ui import artifact_key

    assert any(a.key == artifact_key(cfg, "doctor-report") and "RF13" in (a.data or "") for a in arts)
