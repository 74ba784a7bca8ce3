"""Train workers: one Ray actor per train rank in one torch.distributed group (gloo on CPU, NCCL on GPU).

Per rollout (`set_rollout`), before any update: old log-probs, reference log-probs and (PPO) the critic's values
for every micro-batch of every step, the train–inference mismatch against the engine's log-probs (RF14 is judged
on it by the driver before the first update), then the advantages — computed here, once per rollout, because PPO
and REINFORCE++ need the log-probs and values — written into each micro-batch. Forwards the configuration makes
unnecessary are skipped (issue 18): the reference without a KL term (except on the run's first step, RF01), and
the old log-probs when the rollout's only step can take them from its own forward (`old_from="train"`) or from
the engine (`--use-rollout-logprobs`); the mismatch then comes with step 0 and is judged right after it. Every
rank receives the rewards of the whole rollout, so a GRPO group split over ranks is normalised identically
everywhere. Then `train_step(k)`
runs optimizer step k (policy, then critic).

A worker trains on the GPU Ray assigned it (Ray narrows CUDA_VISIBLE_DEVICES to it: `cuda:0`), else on the CPU.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch is imported where it is used: the driver defines this actor class without it
    import torch

    from engine.packing.microbatch import MicroBatch


def worker_device() -> str:
    """`cuda` when Ray gave this process a GPU (and CUDA works here), else `cpu`."""
    import ray
    import torch

    gpus = ray.get_gpu_ids() if ray.is_initialized() else []
    return "cuda" if gpus and torch.cuda.is_available() else "cpu"


#: --deterministic-mode's environment: cuBLAS's reproducible workspace (read when cuBLAS starts) and one NCCL
#: all-reduce algorithm (read when a communicator starts), each where the environment does not set it already
DETERMINISTIC_ENV = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8", "NCCL_ALGO": "Ring"}


def deterministic_mode() -> dict[str, str]:
    """--deterministic-mode in this train process, before it starts CUDA (Megatron-LM's and slime's settings):
    deterministic algorithms only (a nondeterministic op raises), cuDNN without autotuning, DETERMINISTIC_ENV where
    unset. Returns the environment values in force."""
    import os

    import torch

    for k, v in DETERMINISTIC_ENV.items():
        os.environ.setdefault(k, v)
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    return {k: os.environ[k] for k in DETERMINISTIC_ENV}


class TrainWorker:
    """Holds a backend (and PPO's critic) and the current rollout's micro-batches with their log-probs."""

    def __init__(self, cfg_dict: dict[str, Any], *, rank: int, world_size: int, master: str | None,
                 train_iters: int, threads: int, lazy: bool = False):
        """Build the backend now (master: the rank-0 rendezvous `host:port`), or with `lazy` only when `setup` is
        called: a group learns its master address from rank 0's node (`rendezvous`) after the actors exist."""
        from engine.config import RunConfig
        from engine.train.torch_backend import configure_threads

        configure_threads(threads)
        self.cfg = RunConfig.from_dump(cfg_dict)  # on its node: the run's data files may not be there
        self.rank, self.world_size, self.train_iters = rank, world_size, train_iters
        if self.cfg.deterministic_mode:
            deterministic_mode()
        self.device = worker_device()
        if self.device == "cuda":
            import torch

            torch.cuda.set_device(0)
        self.backend = None
        self.critic = None
        self.steps: list[list[MicroBatch]] = []
        self.old: list[list[torch.Tensor]] = []
        self.ref: list[list[torch.Tensor]] | None = None
        self.values: list[list[torch.Tensor]] = []
        self.returns: list[list[torch.Tensor]] = []
        self.step_tokens: list[float] = []
        self._ipc = None  # the IPC buckets of a sync in progress (engine/weights/ipc.py)
        self._engine = None  # the built-in engine served from this process (--rollout-engine-process trainer)
        self._sender = None  # rank 0's weight-update group with the engines (--weight-sync-method distributed)
        self.custom_advantages = None  # --custom-advantage-function-path's function
        self.data_postprocess = None  # --rollout-data-postprocess-path's function
        self.rollout_id = -1  # the rollout set_rollout was given (the Megatron before-train-step hook's argument)
        self.entropy: list[list[torch.Tensor]] | None = None  # --use-rollout-entropy: the old policy's, per step / mb
        self.old_actors: dict[int, Any] = {}  # --keep-old-actor: weight version → the backend's host copy
        self.profiler = None  # --use-pytorch-profiler / --record-memory-history (engine/train/profiling.py)
        if not lazy:
            self.setup(master)

    def setup(self, master: str | None) -> dict[str, Any]:
        """Join the process group at `master` (world > 1), build the backend (and PPO's critic), load the model.
        Returns where this rank runs (`where`). The end of this actor's start-up: the collector, off since the
        process started (engine/startgc.py), comes back on with start-up's objects frozen, also on a failure."""
        from engine import startgc

        try:
            return self._setup(master)
        finally:
            startgc.ready()

    def _setup(self, master: str | None) -> dict[str, Any]:
        from engine.cluster.nodes import require_model
        from engine.train.backend import create_backend

        if self.cfg.hf_checkpoint.startswith("s3://"):  # this node's cached copy; the backends read files
            self.cfg = self.cfg.model_copy(update={"hf_checkpoint": self.cfg.model_dir})
        require_model(self.cfg.hf_checkpoint, who=f"train rank {self.rank}")
        self.backend = create_backend(self.cfg, rank=self.rank, world_size=self.world_size, master=master,
                                      train_iters=self.train_iters, device=self.device)
        if self.cfg.custom_advantage_function_path:
            from engine.rewards import load_function

            self.custom_advantages = load_function(self.cfg.custom_advantage_function_path,
                                                   "--custom-advantage-function-path")
        if self.cfg.rollout_data_postprocess_path:
            from engine.rewards import load_function

            self.data_postprocess = load_function(self.cfg.rollout_data_postprocess_path,
                                                  "--rollout-data-postprocess-path")
        if self.cfg.advantage_estimator == "ppo":  # preflight: the critic runs on the torch backend only
            from engine.train.critic import TorchCritic

            self.critic = TorchCritic(self.cfg, rank=self.rank, world_size=self.world_size,
                                      train_iters=self.train_iters, device=self.device)
        out = {**self.where(), "model_impl": getattr(self.backend, "model_impl", None)}
        if self.cfg.train_env_vars:  # what this process sees of --train-env-vars (the summary's placement.train)
            import os

            from engine.tracking.secrets import redact

            out["env"] = redact({k: os.environ.get(k) for k in self.cfg.train_env_vars})
        return out

    @staticmethod
    def where() -> dict[str, Any]:
        """This process's Ray node (id and IP; None outside Ray), pid and scheduling priority (`nice`: 0 on a local
        cluster rollflow started, Ray's `worker_niceness` elsewhere; engine/cluster/__init__.py)."""
        import os

        import ray

        nice = os.getpriority(os.PRIO_PROCESS, 0) if hasattr(os, "getpriority") else None
        if not ray.is_initialized():
            return {"node_ip": None, "node_id": None, "pid": os.getpid(), "nice": nice}
        return {"node_ip": ray.util.get_node_ip_address(), "node_id": ray.get_runtime_context().get_node_id(),
                "pid": os.getpid(), "nice": nice}

    def rendezvous(self, registry) -> str:
        """Rank 0: `host:port` of the process group's store on THIS node (its IP, a port the cluster's registry
        handed out for this node and that is free here). The store listens from now on, held by this process
        until `setup` builds the group on it (engine/train/rendezvous.py: a port bound only later could be taken
        in between); every rank connects to it, from whichever node."""
        import ray

        from engine.rollout.ports import allocate_ports
        from engine.train.rendezvous import host_group

        node = ray.util.get_node_ip_address()
        return host_group(node, self.world_size, lambda: allocate_ports(registry.reserve, node, 1)[0],
                          self.cfg.distributed_timeout_minutes)

    @property
    def reports(self) -> bool:
        """Whether this rank's sums count (TP / earlier PP peers of a Megatron replica would count twice)."""
        return self.backend.reports_metrics

    def _all_reduce(self, x: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """Σ (or max) over the data-parallel ranks: the whole world for torch, the DP group for megatron."""
        return self.backend.dp_all_reduce(x, op)

    def _old_actor(self, rollout_id: int, old_version: int | None) -> Any:
        """--keep-old-actor: keep these weights as version `rollout_id` (the trainer's weights before it trains
        rollout r are what a sync after rollout r − 1 handed the engines: version r), forget versions no rollout can
        come from any more, and return the copy of `old_version`, the weights that generated this rollout (None:
        the current ones)."""
        if not self.cfg.keep_old_actor or rollout_id < 0:
            return None
        self.old_actors.setdefault(rollout_id, self.backend.snapshot_weights())
        oldest = rollout_id - self.cfg.staleness_bound
        for v in [v for v in self.old_actors if v < oldest]:
            del self.old_actors[v]
        if old_version is None or old_version == rollout_id:
            return None
        if old_version not in self.old_actors:
            raise ValueError(f"--keep-old-actor: rollout {rollout_id} was generated by weight version {old_version}, "
                             f"which this train rank never held (it keeps {sorted(self.old_actors)}); a resumed run "
                             "keeps only the versions it trained itself")
        return self.old_actors[old_version]

    def set_rollout(self, steps: list[list[MicroBatch]], rewards: list[float], need_ref: bool,
                    normalized: bool = False, old_from: str = "forward", rollout_id: int = -1,
                    old_version: int | None = None) -> dict[str, float]:
        """Store this rank's micro-batches (per step); compute log-probs, values and advantages before any update.

        rewards: [N] the scalar reward of every sample of the rollout, indexed by Sample.index; `normalized`: they
        are --custom-reward-post-process-path's, used as they are (no GRPO group normalisation).
        old_from: where the old log-probs come from — "forward" (a no-grad forward now), "rollout" (the engine's,
        --use-rollout-logprobs: no forward) or "train" (the rollout's only optimizer step runs on these very
        weights, so its own forward, detached, is the old log-probs: no extra forward, same numbers; the mismatch
        facts then come with train_step(0)) or "none" (--loss-type sft_loss: no old log-probs, reference, mismatch
        or advantages at all; the loss reads only the trained tokens' log-probs).
        old_version (--keep-old-actor): the weight version that generated the rollout; its kept copy computes the
        old log-probs ("forward") when it is older than the trainer's.
        Returns facts for the driver: `ref_logp_maxdiff` (max |log π_old − log π_ref| on trained tokens, RF01),
        the train–inference mismatch |log π_engine − log π_old| on trained tokens as `mismatch_sum` /
        `mismatch_count` / `mismatch_max` (RF14), the tokens --use-mis masked (`mis_masked`; their loss mask is 0
        from here on, so advantages, token counts and the loss leave them out), and this rank's token count.
        """
        import torch

        from engine.algorithms import compute_advantages, kl, masked_whiten, whiten_stats

        cfg = self.cfg
        self.rollout_id = rollout_id
        if self.profiler is not None:
            self.profiler.begin(rollout_id)
        if old_from == "train" and (self.data_postprocess is not None or cfg.use_rollout_entropy):
            raise ValueError("--rollout-data-postprocess-path and --use-rollout-entropy need the old policy's forward "
                             "before the step: old_from 'train' has none")
        self.backend_onload()
        if cfg.reset_optimizer_states:  # before this rollout's first step (slime resets at the start of train)
            from engine.train.optim import reset_state

            self.backend.reset_optimizer()
            if self.critic:
                reset_state(self.critic.optimizer)
        self.steps = steps
        if old_from not in ("forward", "rollout", "train", "none"):
            raise ValueError(f"old_from {old_from!r}: forward, rollout, train or none")
        if old_from == "none":  # supervised: nothing to compute before the steps
            if cfg.loss_type != "sft_loss" and not cfg.disable_compute_advantages_and_returns:
                raise ValueError("old_from 'none' is for --loss-type sft_loss (or "
                                 "--disable-compute-advantages-and-returns)")
            return self._set_supervised(steps)
        if old_from == "train" and (len(steps) != 1 or cfg.use_mis or cfg.kl_coef > 0 or cfg.tis_batch_normalize
                                    or cfg.custom_advantage_function_path):
            raise ValueError("old log-probs from the train step need one optimizer step per rollout, no --use-mis, "
                             "no --tis-batch-normalize, --kl-coef 0 and no --custom-advantage-function-path (they "
                             "are used before the step)")
        self.old_from = old_from
        # a backend that keeps its train step's log-probs (torch) reports the mismatch from step 0's forward;
        # others (Megatron) still run the forward for it under --use-rollout-logprobs
        records = hasattr(self.backend, "last_log_probs")
        if old_from == "train" and not records:
            raise ValueError(f"old_from 'train' needs a backend that keeps its train-step log-probs "
                             f"({type(self.backend).__name__} does not)")
        # the policy's no-grad forward: the old log-probs, or (--use-rollout-logprobs) only for the mismatch on a
        # backend that does not keep its step's log-probs, or for --use-rollout-entropy's entropies
        # (--use-routing-replay: the forward records the routing the steps replay)
        policy_forward = old_from == "forward" or (old_from == "rollout" and (not records or cfg.use_rollout_entropy
                                                                              or cfg.use_routing_replay))
        replay = {"record_routing": True} if cfg.use_routing_replay else {}
        if cfg.use_routing_replay:
            self.backend.routes.clear()  # the last rollout's; "train" records nothing: its step routes as the old
        need_ref = need_ref or cfg.use_kl_loss or cfg.kl_coef > 0
        kept = self._old_actor(rollout_id, old_version)
        if kept is not None and old_from != "forward":
            raise ValueError(f"--keep-old-actor: a stale rollout's old log-probs come from a forward with the kept "
                             f"weights, not old_from {old_from!r}")
        weights = {"weights": kept} if kept is not None else {}
        # the no-grad forwards before the steps, where any runs (--profile-target train_log_probs)
        with self._profiled("train_log_probs", f"rollout{rollout_id}",
                            when=policy_forward or need_ref or self.critic is not None):
            forward, self.entropy = None, None
            if policy_forward:
                if cfg.use_rollout_entropy:
                    pairs = [self._forward_only(lambda m: self.backend.compute_log_probs(m, with_entropy=True,
                                                                                         **weights, **replay), mbs)
                             for mbs in steps]
                    forward, self.entropy = [p[0] for p in pairs], [p[1] for p in pairs]
                else:
                    forward = [self._forward_only(lambda m: self.backend.compute_log_probs(m, **weights, **replay),
                                                  mbs) for mbs in steps]
            if old_from == "forward":
                self.old = forward
            elif old_from == "rollout":
                self.old = [[mb.rollout_log_probs * (mb.loss_mask > 0) for mb in mbs] for mbs in steps]
            else:
                self.old = None
            # over every trained token, before MIS drops any; when the old log-probs are not this trainer's own
            # forward, train_step(0) reports it from its forward (the same weights, before the update)
            self.mismatch_deferred = old_from != "forward" and records
            if old_from == "rollout" and not records:
                mismatch = self._mismatch(steps, forward)
            else:
                mismatch = {} if self.mismatch_deferred else self._mismatch(steps, self.old)
            mis_masked = 0.0
            if cfg.use_mis:  # masked importance sampling: tokens too far off the behaviour policy leave the loss
                from engine.algorithms.losses import mis_mask

                for k, mbs in enumerate(steps):
                    for j, mb in enumerate(mbs):
                        kept = mis_mask(self.old[k][j], mb.rollout_log_probs, low=cfg.mis_low, high=cfg.mis_high)
                        mis_masked += float((mb.loss_mask * (1 - kept)).sum())
                        mb.loss_mask = mb.loss_mask * kept
            if cfg.tis_batch_normalize and not cfg.custom_tis_function_path:
                self._tis_scales(steps)
            self.ref = [self._forward_only(lambda m: self.backend.compute_log_probs(m, ref=True), mbs)
                        for mbs in steps] if need_ref else None
            self.values = [self._forward_only(self.critic.compute_values, mbs) for mbs in steps] if self.critic else []
        reward_t = torch.tensor(rewards, dtype=torch.float32)  # [N]
        self.returns = []
        for k, mbs in enumerate(steps):
            rets = []
            for j, mb in enumerate(mbs):
                kl_t = kl(self.old[k][j], self.ref[k][j], cfg.kl_loss_type) if self.ref and self.old \
                    else torch.zeros(mb.num_tokens)
                if self.custom_advantages is not None:
                    adv, ret = self._custom_advantages(mb, reward_t, self.old[k][j],
                                                       self.ref[k][j] if self.ref else None,
                                                       self.values[k][j] if self.critic else None, kl_t,
                                                       self.entropy[k][j] if self.entropy else None)
                    mb.advantages = adv
                    rets.append(ret)
                    continue
                adv, ret = compute_advantages(
                    cfg.advantage_estimator, rewards=reward_t, n_samples_per_prompt=cfg.n_samples_per_prompt,
                    sample_ids=mb.sample_ids, cu_seqlens=mb.cu_seqlens, loss_mask=mb.loss_mask, kl=kl_t,
                    values=self.values[k][j] if self.critic else None, gamma=cfg.gamma, lambd=cfg.lambd,
                    kl_coef=cfg.kl_coef, std_normalization=not cfg.disable_grpo_std_normalization,
                    rewards_normalized=normalized or cfg.disable_rewards_normalization)
                mb.advantages = adv
                rets.append(ret)
            self.returns.append(rets)
        opd = self._distill(steps) if cfg.use_opd else {}
        if cfg.normalize_advantages:  # whiten over the trained tokens of the whole rollout, all ranks
            stats = self._all_reduce(sum((whiten_stats(mb.advantages, mb.loss_mask) for mbs in steps for mb in mbs),
                                         torch.zeros(3, dtype=torch.float64)))
            for mb in (mb for mbs in steps for mb in mbs):
                mb.advantages = masked_whiten(mb.advantages, stats) * mb.loss_mask
        post = self._data_postprocess(steps, reward_t, rollout_id) if self.data_postprocess is not None else {}
        local_tokens = torch.tensor([float(sum(mb.loss_mask.sum() for mb in mbs)) for mbs in steps],
                                    dtype=torch.float64)
        self.step_tokens = self._all_reduce(local_tokens).tolist()
        maxdiff = 0.0
        if self.ref and self.old is not None:
            for k, mbs in enumerate(steps):
                for j, mb in enumerate(mbs):
                    d = ((self.old[k][j] - self.ref[k][j]).abs() * mb.loss_mask).max() if mb.num_tokens else 0.0
                    maxdiff = max(maxdiff, float(d))
        facts = {"ref_logp_maxdiff": maxdiff, **mismatch} if self.ref else dict(mismatch)
        if cfg.use_mis:  # a share of the trained tokens, over all ranks (reduce_metrics: Σ / Σ)
            facts.update(mis_masked_share_sum=mis_masked if self.reports else 0.0,
                         mis_masked_share_count=mismatch["mismatch_count"])
        facts["tokens"] = float(sum(mb.num_tokens for mbs in steps for mb in mbs)) if self.reports else 0.0
        facts.update(opd)
        facts.update(post)
        return facts

    def _tis_scales(self, steps: list[list[MicroBatch]]) -> None:
        """--tis-batch-normalize: each step's mean bounded TIS weight, over its trained tokens (--tis-level token)
        or its samples with a trained token (sequence, geometric: one weight each), all DP ranks; set on the step's
        micro-batches (`tis_scale`), which the objective divides the weights by. A mean ≤ 1e-8 leaves them (slime)."""
        import torch

        from engine.algorithms.losses import rollout_correction, tis_mean_parts

        cfg = self.cfg
        sums = torch.zeros(len(steps), 2, dtype=torch.float64)  # [K, (Σ w, count)]
        for k, mbs in enumerate(steps):
            for j, mb in enumerate(mbs):
                w, _, _ = rollout_correction(self.old[k][j], mb.rollout_log_probs, mb.loss_mask, mb.cu_seqlens,
                                             mode=cfg.tis_mode, level=cfg.tis_level, low=cfg.tis_clip_low,
                                             high=cfg.tis_clip)
                sums[k] += torch.tensor(tis_mean_parts(w, mb.loss_mask, mb.cu_seqlens, cfg.tis_level),
                                        dtype=torch.float64)
        sums = self._all_reduce(sums)
        for k, mbs in enumerate(steps):
            mean = float(sums[k, 0] / sums[k, 1]) if sums[k, 1] > 0 else 0.0
            for mb in mbs:
                mb.tis_scale = mean if mean > 1e-8 else 1.0

    def _forward_only(self, compute, mbs: list[MicroBatch]):
        """compute(micro-batches) → one per-token [T] result per micro-batch (or a tuple of such lists), run over
        `mbs` — or, with --log-probs-max-tokens-per-gpu, over their samples re-packed under that cap (slime's flag:
        a no-grad forward keeps no activations, so it can take larger micro-batches than the step) and given back per
        micro-batch of `mbs`."""
        cap = self.cfg.log_probs_max_tokens_per_gpu
        if cap is None or not mbs:
            return compute(mbs)
        from engine.packing.microbatch import regroup, split_like

        out = compute(regroup(mbs, cap * self.cfg.context_parallel_size))
        return tuple(split_like(o, mbs) for o in out) if isinstance(out, tuple) else split_like(out, mbs)

    def _profiled(self, target: str, name: str, when: bool = True):
        """--use-pytorch-profiler: the block recorded as `target`'s profile `name` (when due), else nothing."""
        import contextlib

        return self.profiler.region(target, self.rollout_id, name) if self.profiler is not None and when \
            else contextlib.nullcontext()

    def profile_setup(self, directory: str, memory_dir: str) -> None:
        """--use-pytorch-profiler / --record-memory-history: this rank's profiler, its traces under `directory`
        and its memory snapshots under `memory_dir` (absolute paths the driver resolved); the allocator's history
        starts recording now."""
        from engine.train.profiling import TrainProfiler

        self.profiler = TrainProfiler(self.cfg, rank=self.rank, device=self.device, directory=directory,
                                      memory_dir=memory_dir)

    def profile_end(self, rollout_id: int) -> list[str]:
        """After the rollout's last step: the files its profiles (and a due memory snapshot) wrote."""
        return self.profiler.end(rollout_id) if self.profiler is not None else []

    def _distill(self, steps: list[list[MicroBatch]]) -> dict[str, float]:
        """--use-opd: each trained token's advantage −= opd_kl_coef × (log π_old − log π_teacher), the teacher's
        log-probs of the very tokens sampled (slime's apply_opd_kl_to_advantages); after the estimator (and a custom
        advantage function), before --normalize-advantages. Returns the reverse KL's partial sums (token mean)."""
        import torch

        if self.old is None:
            raise ValueError("--use-opd needs the old log-probs before the update (old_from 'forward' or 'rollout')")
        total, count = 0.0, 0.0
        for k, mbs in enumerate(steps):
            if self.cfg.opd_type == "sglang":  # scored by the teacher server after the rollout
                if any(mb.teacher_log_probs is None and mb.loss_mask.any() for mb in mbs):
                    raise ValueError("--opd-type sglang: a micro-batch carries no teacher log-probs (the rollout "
                                     "scores them; a replayed rollout must have been saved with them)")
                # a micro-batch without a trained sample (all failed, or DP padding) has none to carry
                teacher = [torch.zeros(mb.num_tokens) if mb.teacher_log_probs is None else mb.teacher_log_probs
                           for mb in mbs]
            else:
                teacher = self._forward_only(lambda m: self.backend.compute_log_probs(m, teacher=True), mbs)
            for j, mb in enumerate(mbs):
                reverse_kl = (self.old[k][j] - teacher[j]) * mb.loss_mask
                mb.advantages = mb.advantages - self.cfg.opd_kl_coef * reverse_kl
                total += float(reverse_kl.sum())
                count += float(mb.loss_mask.sum())
        return {"opd_reverse_kl_sum": total if self.reports else 0.0, "opd_reverse_kl_count": count
                if self.reports else 0.0}

    def _custom_advantages(self, mb: MicroBatch, rewards: torch.Tensor, old: torch.Tensor, ref: torch.Tensor | None,
                           values: torch.Tensor | None, kl_t: torch.Tensor, entropy: torch.Tensor | None = None
                           ) -> tuple[torch.Tensor, torch.Tensor]:
        """--custom-advantage-function-path on one micro-batch: slime's per-sample `rollout_data` in, its
        "advantages" / "returns" (one value per response token) back into flat [T] tensors (0 off the loss mask)."""
        from engine.rollout.hooks import call_hook

        flag, path = "--custom-advantage-function-path", self.cfg.custom_advantage_function_path
        spans, lens, totals = _response_spans(mb)

        def per_sample(x: torch.Tensor | None):
            return None if x is None else [x[a:b].clone() for a, b in spans]

        data = {"log_probs": per_sample(old), "ref_log_probs": per_sample(ref), "values": per_sample(values),
                "kl": per_sample(kl_t), "rollout_log_probs": per_sample(mb.rollout_log_probs),
                "entropy": per_sample(entropy),
                "loss_masks": per_sample(mb.loss_mask), "rewards": [float(rewards[i]) for i in mb.sample_ids],
                "response_lengths": list(lens), "total_lengths": totals,
                "sample_ids": list(mb.sample_ids), "all_rewards": rewards.tolist()}
        call_hook(flag, path, self.custom_advantages, self.cfg, data)
        return tuple(_flat_from_hook(flag, path, data, key, [(mb, spans, lens)])[0] * mb.loss_mask
                     for key in ("advantages", "returns"))

    def _data_postprocess(self, steps: list[list[MicroBatch]], rewards: torch.Tensor,
                          rollout_id: int) -> dict[str, float]:
        """--rollout-data-postprocess-path (slime's flag and contract): `fn(args, rollout_id, rollout_data)` once per
        rank and rollout, after the log-probs, advantages (and --normalize-advantages), before the first update.
        rollout_data holds this rank's samples (all its steps, in order) as per-sample lists of their response
        tokens; the function may rewrite "loss_masks" (only lower: 0 takes a token out of the loss, and of the
        token counts) and "advantages" (and "returns", read by PPO's critic), which are read back. Returns the
        share of the trained tokens it took out (partial sums over ranks)."""
        from engine.rollout.hooks import HookError, call_hook

        flag, path = "--rollout-data-postprocess-path", self.cfg.rollout_data_postprocess_path
        views = [_response_spans(mb) for mbs in steps for mb in mbs]
        where = [(mb, spans, lens) for mb, (spans, lens, _) in zip((mb for mbs in steps for mb in mbs), views)]
        flat = [(k, j) for k, mbs in enumerate(steps) for j in range(len(mbs))]

        def per_sample(get) -> list | None:
            out = []
            for (k, j), (mb, spans, _) in zip(flat, where):
                x = get(k, j, mb)
                if x is None:
                    return None
                out += [x[a:b].clone() for a, b in spans]
            return out

        data = {
            "sample_ids": [i for mb, _, _ in where for i in mb.sample_ids],
            "rewards": [float(rewards[i]) for mb, _, _ in where for i in mb.sample_ids],
            "response_lengths": [r for _, _, lens in where for r in lens],
            "total_lengths": [t for _, _, totals in views for t in totals],
            "tokens": [mb.tokens[a:b].clone() for mb, _, _ in where for a, b in zip(
                mb.cu_seqlens[:mb.num_samples].tolist(), mb.cu_seqlens[1:mb.num_samples + 1].tolist())],
            "loss_masks": per_sample(lambda k, j, mb: mb.loss_mask),
            "log_probs": per_sample(lambda k, j, mb: self.old[k][j] if self.old is not None else None),
            "ref_log_probs": per_sample(lambda k, j, mb: self.ref[k][j] if self.ref else None),
            "rollout_log_probs": per_sample(lambda k, j, mb: mb.rollout_log_probs),
            "entropy": per_sample(lambda k, j, mb: self.entropy[k][j] if self.entropy else None),
            "advantages": per_sample(lambda k, j, mb: mb.advantages),
            "returns": per_sample(lambda k, j, mb: self.returns[k][j]),
            "values": per_sample(lambda k, j, mb: self.values[k][j] if self.critic else None),
        }
        before = sum(float(mb.loss_mask.sum()) for mb, _, _ in where)
        call_hook(flag, path, self.data_postprocess, self.cfg, rollout_id, data)
        masks = _flat_from_hook(flag, path, data, "loss_masks", where)
        for mb, m in zip((w[0] for w in where), masks):
            if ((m < 0) | (m > mb.loss_mask)).any():
                raise HookError.of(flag, path, "set a loss mask above the sample's own or below 0: a mask can "
                                               "only take tokens out of the loss (0) or weigh them less, never "
                                               "train a token the rollout left out (its log-probs are not kept)")
        advantages = _flat_from_hook(flag, path, data, "advantages", where)
        returns = _flat_from_hook(flag, path, data, "returns", where)
        for (k, j), (mb, _, _), m, a, r in zip(flat, where, masks, advantages, returns):
            mb.loss_mask = m
            mb.advantages = a * (m > 0)
            self.returns[k][j] = r * (m > 0)
        after = sum(float(mb.loss_mask.sum()) for mb, _, _ in where)
        return {"postprocess_masked_share_sum": before - after if self.reports else 0.0,
                "postprocess_masked_share_count": before if self.reports else 0.0}

    def _set_supervised(self, steps: list[list[MicroBatch]]) -> dict[str, float]:
        """set_rollout for --loss-type sft_loss (and --disable-compute-advantages-and-returns): the micro-batches
        and the steps' token counts only."""
        import torch

        self.old_from, self.old, self.ref, self.values, self.returns = "none", None, None, [], []
        self.mismatch_deferred = False
        for mb in (mb for mbs in steps for mb in mbs):
            mb.advantages = torch.zeros(mb.num_tokens)  # read by no loss term
        local_tokens = torch.tensor([float(sum(mb.loss_mask.sum() for mb in mbs)) for mbs in steps],
                                    dtype=torch.float64)
        self.step_tokens = self._all_reduce(local_tokens).tolist()
        return {"tokens": float(sum(mb.num_tokens for mbs in steps for mb in mbs)) if self.reports else 0.0}

    def set_rollout_and_step(self, steps: list[list[MicroBatch]], rewards: list[float], need_ref: bool,
                             normalized: bool, old_from: str, global_batch_size: int, rollout_id: int = -1
                             ) -> tuple[dict[str, float], dict[str, Any] | None]:
        """`set_rollout`, then `train_step(0)` in the same call when nothing is judged between the two: the
        mismatch comes with the step's own forward (old_from "train", or "rollout" on a backend that keeps its
        step's log-probs), so the driver's RF14 check follows the step either way. One round trip fewer per
        rollout. Returns (facts, step 0's metrics); the metrics are None when the mismatch was computed here, and
        the driver then judges it before it asks for the step."""
        facts = self.set_rollout(steps, rewards, need_ref, normalized, old_from, rollout_id)
        return facts, self.train_step(0, global_batch_size) if self.mismatch_deferred else None

    def _mismatch(self, steps: list[list[MicroBatch]], old: list[list[torch.Tensor]]) -> dict[str, float]:
        """Σ, count and max of |log π_engine − log π_trainer| over trained tokens (trainer = the weights before the
        update, the ones the engine should serve)."""
        total, count, worst = 0.0, 0.0, 0.0
        if self.reports:
            for k, mbs in enumerate(steps):
                for j, mb in enumerate(mbs):
                    m = mb.loss_mask > 0  # [T]
                    if m.any():
                        d = (mb.rollout_log_probs[m] - old[k][j][m]).abs().double()  # [K]
                        total, count, worst = total + float(d.sum()), count + float(m.sum()), max(worst, float(d.max()))
        return {"mismatch_sum": total, "mismatch_count": count, "mismatch_max": worst}

    def train_step(self, k: int, global_batch_size: int, policy: bool = True) -> dict[str, Any]:
        """Optimizer step k of the rollout: the policy's, then PPO's critic's; policy=False (--num-critic-only-steps)
        the critic's only."""
        if not policy:
            return self.critic.train_step(self.steps[k], self.values[k], self.returns[k], global_batch_size,
                                          global_tokens=self.step_tokens[k])
        deferred = self.old is None  # old_from "train" (the step's own forward gives them) or "none" (not needed)
        if hasattr(self.backend, "before_train_step"):  # the megatron backend's --custom-megatron-before-train-step
            self.backend.before_train_step(self.rollout_id, k)
        with self._profiled("train_actor", f"rollout{self.rollout_id}_step{k}"):
            out = self.backend.train_step(self.steps[k], None if deferred else self.old[k],
                                          self.ref[k] if self.ref else None, global_batch_size,
                                          global_tokens=self.step_tokens[k])
            if self.critic:
                out.update(self.critic.train_step(self.steps[k], self.values[k], self.returns[k],
                                                  global_batch_size, global_tokens=self.step_tokens[k]))
        if deferred and self.old_from == "train":
            self.old = [self.backend.last_log_probs]
        if k == 0 and self.mismatch_deferred:
            out.update(self._mismatch(self.steps[:1], [self.backend.last_log_probs]))
        return out

    def save_train_data(self, pattern: str, rollout_id: int) -> str:
        """--save-debug-train-data: what this rank trained on in the rollout just trained, per sample over its
        response tokens (see the flag's help), to `pattern` with {rollout_id} and {rank} filled in."""
        from pathlib import Path

        import torch

        from engine.config.rollout import fill_pattern

        out: dict[str, list] = {k: [] for k in ("sample_ids", "response_lengths", "tokens", "loss_masks",
                                                "advantages", "returns", "log_probs", "ref_log_probs",
                                                "rollout_log_probs", "values")}
        for k, mbs in enumerate(self.steps):
            for j, mb in enumerate(mbs):
                cu = mb.cu_seqlens.long().tolist()
                lens = (mb.response_lengths or [])[:mb.num_samples]
                spans = [(e - r, e) for e, r in zip(cu[1:mb.num_samples + 1], lens)]

                def cut(x):
                    return None if x is None else [x[a:b].clone() for a, b in spans]

                out["sample_ids"] += list(mb.sample_ids)
                out["response_lengths"] += list(lens)
                for key, x in (("tokens", mb.tokens), ("loss_masks", mb.loss_mask), ("advantages", mb.advantages),
                               ("returns", self.returns[k][j] if self.returns else None),
                               ("log_probs", self.old[k][j] if self.old else None),
                               ("ref_log_probs", self.ref[k][j] if self.ref else None),
                               ("rollout_log_probs", mb.rollout_log_probs),
                               ("values", self.values[k][j] if self.values else None)):
                    got = cut(x)
                    out[key] += got if got is not None else [None] * len(spans)
        path = fill_pattern(pattern, rollout_id, rank=self.rank)
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        torch.save(out, path)
        return path

    def update_ref(self) -> None:
        """--ref-update-interval: the reference becomes the current policy."""
        self.backend_onload()
        self.backend.update_ref()

    def score(self, mb: MicroBatch) -> tuple[torch.Tensor, bool]:
        """(log-probs [T] of one micro-batch under the policy, whether this rank's answer counts) — a collective
        for sharded backends; used to check the engine after a weight sync (RF14)."""
        self.backend_onload()
        return self.backend.compute_log_probs([mb])[0], self.reports

    # ---- memory (colocated runs) -------------------------------------------------------------------------------
    def backend_onload(self) -> None:
        self.backend.onload()

    def offload(self) -> None:
        """--offload-train: the trainer's state to host memory until the next train call."""
        self.backend.offload()

    def memory(self) -> dict[str, float]:
        from engine.gpu import gpu_memory

        return gpu_memory()

    # ---- state -------------------------------------------------------------------------------------------------
    def save(self, path: str, save_optim: bool = True) -> list[str]:
        if self.rank != 0 and not self.backend.collective:
            return []
        self.backend_onload()
        files = self.backend.save(path, save_optim=save_optim)
        if self.critic and self.rank == 0:
            files += [f"critic/{f}" for f in self.critic.save(f"{path}/critic")]
        return files

    def load(self, path: str, load_optim: bool = True) -> None:
        self.backend.load(path, load_optim=load_optim)
        if self.critic:
            self.critic.load(f"{path}/critic", load_optim=load_optim)

    def load_weights(self, path: str, ref: bool = False) -> None:
        self.backend.load_weights(path, ref=ref)

    # ---- the same, on a node that does not see the driver's directory (engine/cluster/nodes.py) ------------------
    @staticmethod
    def sees(file: str, token: str) -> bool:
        from engine.cluster.nodes import sees

        return sees(file, token)

    def save_to(self, ship: bool, path: str, save_optim: bool = True) -> dict[str, Any]:
        """`save` into `path`, or with `ship` into a node-local directory whose files are returned ("blobs")."""
        from engine.cluster.nodes import written

        if not ship:
            return {"files": self.save(path, save_optim), "blobs": None}
        files, blobs = written(lambda d: self.save(d, save_optim))
        return {"files": files, "blobs": blobs}

    def export_hf_to(self, ship: bool, path: str) -> dict[str, bytes] | None:
        from engine.cluster.nodes import written

        if not ship:
            self.export_hf(path)
            return None
        return written(self.export_hf)[1]

    def load_from(self, files: dict[str, bytes] | None, path: str, load_optim: bool = True) -> None:
        """`load(path)`, or from a node-local copy of `files` (the directory's files, from the object store)."""
        from engine.cluster.nodes import local_copy

        if files is None:
            return self.load(path, load_optim)
        local_copy(files, lambda d: self.load(d, load_optim))

    def load_weights_from(self, files: dict[str, bytes] | None, path: str, ref: bool = False) -> None:
        from engine.cluster.nodes import local_copy

        if files is None:
            return self.load_weights(path, ref)
        local_copy(files, lambda d: self.load_weights(d, ref))

    def _state(self) -> dict[str, torch.Tensor]:
        """The policy's full weights on rank 0 under the checkpoint's names, as engines load them ({} elsewhere);
        every rank joins when the backend is collective."""
        self.backend_onload()
        if self.rank == 0 or self.backend.collective:
            state = self.backend.engine_state()
            return state if self.rank == 0 else {}
        return {}

    def save_weights(self, path: str, engines: list[str] | None = None) -> str:
        """Rank 0 writes the policy's weights to `path`; with `engines` (a disk sync's URLs) it then calls
        --custom-update-weight-post-write-path's function, before any engine reads them."""
        from engine.weights import save_weights_dir

        state = self._state()
        if self.rank == 0:
            save_weights_dir(state, path)
            if engines is not None and self.cfg.custom_update_weight_post_write_path:
                from engine.rewards import load_function
                from engine.rollout.hooks import call_hook

                flag, where = "--custom-update-weight-post-write-path", self.cfg.custom_update_weight_post_write_path
                call_hook(flag, where, load_function(where, flag), self.cfg, path, list(engines))
        return path

    def numpy_state(self) -> tuple[Any, float]:
        """(the policy's weights as HostWeights, their MB) on rank 0 (None elsewhere): returned into Ray's object
        store for the engines."""
        from engine.weights import numpy_state

        state = self._state()
        if self.rank != 0:
            return None, 0.0
        host = numpy_state(state)
        return host, host.nbytes / 2**20

    # ---- the built-in engine in this process (--rollout-engine-process trainer) ----------------------------------
    def engine_start(self, spec, index: int, registry) -> dict[str, Any]:
        """Serve rollout engine `index` from threads of this process (engine/rollout/actor.py: the same server as
        an engine actor's); a second call replaces the first engine (a restart). Returns the engine's info."""
        from engine.rollout.actor import EngineActor

        if self._engine is not None:
            self._engine.stop()
        self._engine = EngineActor(spec, index, registry)
        return self._engine.start()

    def engine_call(self, name: str, *args) -> Any:
        """`EngineActor.<name>(*args)` of the engine this process serves (engine/rollout/engines.py:HostedEngine)."""
        if self._engine is None:
            raise RuntimeError(f"train rank {self.rank} serves no rollout engine")
        return getattr(self._engine, name)(*args)

    def engine_take_weights(self, version: str, probe: tuple | None = None) -> tuple[str, int, tuple | None]:
        """The engine in this process copies this rank's current weights as `version`: one in-memory copy (the
        engine keeps its own model), no object store. `probe` (the RF14 probe's stored sequences: a MicroBatch,
        the temperature and the token lists): then both sides score them here, right after the copy — this rank's
        log-probs of the answers, and the engine's of every token through its own request parser and generator
        (EngineState.score_local), the numbers its HTTP /generate would answer; no Ray or HTTP round trip.
        Returns (the version the engine serves now, bytes copied, None or (trainer log-probs [K], engine log-probs
        per sequence, the weight_version the engine scored under))."""
        from engine.weights import unique_tensors

        if self._engine is None or self._engine.state is None:
            raise RuntimeError(f"train rank {self.rank} serves no rollout engine")
        state = self._engine.state
        copied = state.update_from_named(unique_tensors(self._state()), version)
        scored = None
        if probe is not None:
            mb, temperature, seqs = probe
            scored = (self.score(mb)[0][mb.loss_mask > 0], *state.score_local(seqs, temperature))
        return str(state.weight_version), copied, scored

    # ---- weights by broadcast to the engines (--weight-sync-method distributed) ---------------------------------
    def group_open(self, engines: list[tuple[str, int]], api_key: str | None, backend: str, timeout_s: float) -> str:
        """Rank 0: open a weight-update group (SGLang's /init_weights_update_group) with the engines, each given
        as (url, its ranks), hosted at this node's address on a free port; closes the one open before. Returns
        "address:port". Other ranks do nothing."""
        from datetime import timedelta

        import ray

        from engine.rollout.client import EngineClient
        from engine.rollout.ports import free_port
        from engine.train.rendezvous import listen_store
        from engine.weights.distributed import DEFAULT_GROUP, DistributedSender

        self.group_close()
        if self.rank != 0:
            return ""
        address = ray.util.get_node_ip_address()
        # listening before any engine is told the port (a port picked free and bound later can be taken)
        store, port = listen_store(address, 1 + sum(n for _, n in engines), timedelta(seconds=timeout_s), free_port)
        clients = [EngineClient(url, timeout_s=timeout_s, api_key=api_key) for url, _ in engines]
        for c in clients:  # a group an earlier run left (killed before it could close it) would refuse this one
            try:
                c.destroy_weights_update_group(DEFAULT_GROUP)
            except Exception:  # noqa: BLE001 — none to leave: the usual case
                pass
        self._sender = DistributedSender(clients, address, port, backend=backend, timeout_s=timeout_s,
                                         ranks=[n for _, n in engines], store=store)
        self._sender_backend = backend
        return f"{address}:{port}"

    def group_push(self, version: int) -> tuple[list[dict], int]:
        """The policy's weights broadcast to the group's engines as `version` (tied tensors once, on the device
        the backend needs: CUDA for NCCL, CPU for gloo); every rank joins the gather of sharded weights. Returns
        the engines' answers and the bytes sent (rank 0; ([], 0) elsewhere)."""
        state = self._state()
        if self.rank != 0:
            return [], 0
        if self._sender is None:
            raise RuntimeError("no weight-update group is open: group_open first")
        from engine.weights import unique_tensors

        named = unique_tensors(state, "cuda" if self._sender_backend == "nccl" else "cpu")
        answers = self._sender.push(named, version=version)
        return answers, sum(t.numel() * t.element_size() for t in named.values())

    def group_close(self) -> None:
        if self._sender is not None:
            self._sender.close()
            self._sender = None

    def ipc_export(self, export: bool, dtype: str, bucket_bytes: int) -> list:
        """This rank's weights as CUDA IPC buckets in `dtype` when `export` (the rank shares its GPU with an
        engine), kept alive until `ipc_release`. Every rank joins: gathering sharded weights is a collective."""
        self.backend_onload()
        self._ipc = self.backend.ipc_export(dtype, bucket_bytes, export=export)
        return self._ipc.buckets if self._ipc is not None else []

    def ipc_release(self) -> None:
        import torch

        self._ipc = None
        torch.cuda.ipc_collect()  # blocks the engines held: freed now that they have copied out of them

    def export_hf(self, path: str) -> None:
        if self.rank == 0 or self.backend.collective:
            self.backend_onload()
            self.backend.export_hf(path)

    def parameters(self) -> dict[str, torch.Tensor]:
        """The policy's full parameters by name on the CPU (tests compare DP layouts with it); a collective when
        the backend shards them."""
        return self.backend.named_parameters_full()


def _response_spans(mb: MicroBatch) -> tuple[list[tuple[int, int]], list[int], list[int]]:
    """Each sample's response tokens in the micro-batch's flat row: (start, end) spans, response lengths, total
    lengths (slime's per-sample views)."""
    from engine.algorithms.packed import response_spans

    cu = mb.cu_seqlens.long().tolist()
    lens = list(mb.response_lengths[:mb.num_samples])
    return response_spans(mb.cu_seqlens, lens), lens, [e - s for s, e in zip(cu, cu[1:mb.num_samples + 1])]


def _flat_from_hook(flag: str, path: str, data: dict, key: str, where: list) -> list[torch.Tensor]:
    """A hook's per-sample list data[key] (one tensor of each sample's response length, the samples of `where`'s
    micro-batches in order) back into one flat [T] tensor per micro-batch (0 off the responses); a wrong shape,
    NaN or Inf is a HookError naming the key."""
    import torch

    from engine.rollout.hooks import HookError

    lens = [r for _, _, ls in where for r in ls]
    got = data.get(key)
    if not isinstance(got, (list, tuple)) or len(got) != len(lens) or not all(
            torch.is_tensor(v) and v.numel() == r for v, r in zip(got, lens)):
        shape = [tuple(v.shape) if torch.is_tensor(v) else type(v).__name__ for v in got][:8] \
            if isinstance(got, (list, tuple)) else type(got).__name__
        raise HookError.of(flag, path, f"set rollout_data[{key!r}] to {shape}; expected a list of {len(lens)} "
                                       f"tensors of the response lengths {lens[:8]}")
    out, i = [], 0
    for mb, spans, _ in where:
        flat = torch.zeros(mb.num_tokens)
        for a, b in spans:
            flat[a:b] = got[i].detach().float().reshape(-1).cpu()
            i += 1
        if not torch.isfinite(flat).all():
            raise HookError.of(flag, path, f"set rollout_data[{key!r}] with a NaN or Inf")
        out.append(flat)
    return out
