"""The cluster recipes (docs/cluster.md), kept working without a cluster:

- KubeRay: deployments/kuberay/raycluster.yaml against Kubernetes' published schemas (kubernetes-validate, strict:
  unknown fields fail) for the core objects and every pod template, and against KubeRay's RayCluster v1 fields
  (RAYCLUSTER below, transcribed from KubeRay's API types: headGroupSpec / workerGroupSpecs / rayStartParams);
  plus what the recipe relies on (the Prefect sidecar shares the head's /tmp/ray, secrets only by reference).
- Slurm: deployments/slurm/rollflow.sbatch run by bash with a fake `srun` and `scontrol` on PATH that record the
  commands they receive.
- Prefect: deployments/prefect/cluster.yaml read by Prefect's own prefect.yaml model, its job variables by the
  process worker's job configuration, its parameters by rl-train's.
"""
from __future__ import annotations

import json
import os
import stat
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
KUBERAY = ROOT / "deployments" / "kuberay" / "raycluster.yaml"
SBATCH = ROOT / "deployments" / "slurm" / "rollflow.sbatch"
CLUSTER_DEPLOYMENTS = ROOT / "deployments" / "prefect" / "cluster.yaml"

_STR_MAP = {"type": "object", "additionalProperties": {"type": "string"}}
_GROUP = {"rayStartParams": _STR_MAP, "template": {"type": "object"}, "serviceType": {"type": "string"},
          "headService": {"type": "object"}, "enableIngress": {"type": "boolean"}}
#: RayCluster (ray.io/v1) as KubeRay's Go types declare it (ray-operator/apis/ray/v1/raycluster_types.go): the
#: fields a manifest may set, which are required, and their types. Pod templates are checked by Kubernetes' schema.
RAYCLUSTER = {
    "type": "object", "required": ["apiVersion", "kind", "metadata", "spec"], "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "ray.io/v1"}, "kind": {"const": "RayCluster"}, "metadata": {"type": "object"},
        "spec": {
            "type": "object", "required": ["headGroupSpec"], "additionalProperties": False,
            "properties": {
                "rayVersion": {"type": "string"}, "enableInTreeAutoscaling": {"type": "boolean"},
                "autoscalerOptions": {"type": "object"}, "headServiceAnnotations": _STR_MAP,
                "suspend": {"type": "boolean"}, "managedBy": {"type": "string"},
                "gcsFaultToleranceOptions": {"type": "object"}, "upgradeStrategy": {"type": "object"},
                "headGroupSpec": {"type": "object", "required": ["template"], "additionalProperties": False,
                                  "properties": _GROUP},
                "workerGroupSpecs": {"type": "array", "items": {
                    "type": "object", "required": ["groupName", "template"], "additionalProperties": False,
                    "properties": {**_GROUP, "groupName": {"type": "string", "minLength": 1},
                                   "replicas": {"type": "integer", "minimum": 0},
                                   "minReplicas": {"type": "integer", "minimum": 0},
                                   "maxReplicas": {"type": "integer", "minimum": 0},
                                   "numOfHosts": {"type": "integer", "minimum": 1},
                                   "idleTimeoutSeconds": {"type": "integer"}, "suspend": {"type": "boolean"},
                                   "scaleStrategy": {"type": "object"}}}},
            }},
        "status": {"type": "object"}}}


def _docs() -> list[dict]:
    return [d for d in yaml.safe_load_all(KUBERAY.read_text()) if d]


def validate_manifest(docs: list[dict]) -> list[str]:
    """Every object of the manifest checked; returns what is wrong (empty: valid)."""
    import jsonschema
    import kubernetes_validate as kv

    version, errors = kv.latest_version(), []

    def k8s(obj: dict, what: str) -> None:
        try:
            kv.validate(obj, version, strict=True)
        except kv.ValidationError as e:
            errors.append(f"{what}: {e.message} at {'.'.join(map(str, e.path))}")

    for d in docs:
        if d.get("kind") != "RayCluster":
            k8s(d, f"{d.get('kind')} {d.get('metadata', {}).get('name')}")
            continue
        for e in jsonschema.Draft7Validator(RAYCLUSTER).iter_errors(d):
            errors.append(f"RayCluster: {e.message} at {'.'.join(map(str, e.path))}")
        spec = d.get("spec", {})
        groups = [("head", spec.get("headGroupSpec", {}))] + \
            [(g.get("groupName", "?"), g) for g in spec.get("workerGroupSpecs", [])]
        for name, g in groups:  # a pod template is a core PodTemplate's `template`
            k8s({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": f"rollflow-{name}"},
                 "template": g.get("template", {})}, f"RayCluster group {name} pod template")
    return errors


def test_kuberay_manifest_is_valid():
    docs = _docs()
    assert [d["kind"] for d in docs] == ["PersistentVolumeClaim", "RayCluster"]
    assert validate_manifest(docs) == []


@pytest.mark.parametrize("break_it", [
    lambda d: d["spec"].update(workerGroupSpec=d["spec"].pop("workerGroupSpecs")),  # a typo in KubeRay's field
    lambda d: d["spec"]["headGroupSpec"]["rayStartParams"].update({"num-cpus": 0}),  # params are strings
    lambda d: d["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0].update(volumeMount=[]),  # k8s typo
    lambda d: d["spec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0].pop("name"),  # k8s required
])
def test_the_manifest_validator_catches_mistakes(break_it):
    docs = _docs()
    break_it(docs[1])
    assert validate_manifest(docs), "a broken manifest passed"


def test_kuberay_recipe_wiring():
    pvc, rc = _docs()
    head = rc["spec"]["headGroupSpec"]["template"]["spec"]
    by_name = {c["name"]: c for c in head["containers"]}
    ray_head, worker = by_name["ray-head"], by_name["prefect-worker"]
    mounts = lambda c: {m["mountPath"]: m["name"] for m in c.get("volumeMounts", [])}  # noqa: E731
    # the flow runs (the worker's subprocesses) find the head's session: `--ray-address auto` reads /tmp/ray
    assert mounts(worker)["/tmp/ray"] == mounts(ray_head)["/tmp/ray"] == "ray-tmp"
    assert worker["image"] == ray_head["image"]
    pool = worker["command"][worker["command"].index("--pool") + 1]
    deps = {d["name"]: d for d in yaml.safe_load(CLUSTER_DEPLOYMENTS.read_text())["deployments"]}
    assert deps["rl-train-kuberay"]["work_pool"]["name"] == pool
    # every pod reads the model from the same claim at the same path
    for g in [rc["spec"]["headGroupSpec"]] + rc["spec"]["workerGroupSpecs"]:
        spec = g["template"]["spec"]
        claims = {v["name"]: v["persistentVolumeClaim"]["claimName"] for v in spec["volumes"]
                  if "persistentVolumeClaim" in v}
        assert claims == {"models": pvc["metadata"]["name"]}
        for c in spec["containers"]:
            assert mounts(c).get("/models") == "models", c["name"]
            for e in c.get("env", []):  # credentials only by reference to a secret
                if "KEY" in e["name"]:
                    assert "value" not in e and "secretKeyRef" in e["valueFrom"], e
    gpu = rc["spec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert gpu["nvidia.com/gpu"] == "8"


# ---- Slurm ------------------------------------------------------------------------------------------------------
FAKE_SRUN = r"""#!/usr/bin/env python3
import json, os, sys, time
argv = sys.argv[1:]
with open(os.environ["FAKE_LOG"], "a") as f:
    f.write(json.dumps({"tool": "srun", "argv": argv, "auth_mode": os.environ.get("RAY_AUTH_MODE"),
                        "auth_token": os.environ.get("RAY_AUTH_TOKEN")}) + "\n")
cmd = argv[argv.index("-w") + 2:]
if cmd[:2] == ["hostname", "--ip-address"]:
    print("10.1.2.3 fe80::1")
elif cmd[-2:] == ["get-auth-token", "--generate"]:  # Ray's: the token on stdout, no newline; a note on stderr
    print("Generating new authentication token...", file=sys.stderr)
    print(os.environ["FAKE_HEAD_TOKEN"], end="")
elif "--block" in cmd:
    time.sleep(0.2)  # a real `ray start --block` runs until `ray stop`
elif "flows.cli" in cmd or "prefect.engine" in cmd:
    sys.exit(int(os.environ.get("FAKE_RUN_RC", "0")))
"""
FAKE_SCONTROL = r"""#!/usr/bin/env python3
import json, os, sys
with open(os.environ["FAKE_LOG"], "a") as f:
    f.write(json.dumps({"tool": "scontrol", "argv": sys.argv[1:]}) + "\n")
assert sys.argv[1:] == ["show", "hostnames", "gpu[01-03]"], sys.argv
print("gpu01\ngpu02\ngpu03")
"""


def _sbatch(tmp_path: Path, *args: str, **env: str) -> tuple[int, list[dict], str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755 | stat.S_IXUSR)
    log = tmp_path / "calls.jsonl"
    log.unlink(missing_ok=True)
    full = {**{k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "PREFECT__FLOW", "RAY_AUTH_"))},
            "PATH": f"{bin_dir}:{os.environ['PATH']}", "FAKE_LOG": str(log), "SLURM_JOB_NODELIST": "gpu[01-03]",
            "FAKE_HEAD_TOKEN": HEAD_TOKEN,
            "SLURM_GPUS_PER_NODE": "h100:8", "SLURM_CPUS_PER_TASK": "32", "SLURM_JOB_ID": "4242", **env}
    p = subprocess.run(["bash", str(SBATCH), *args], env=full, capture_output=True, text=True, timeout=60,
                       cwd=tmp_path)
    calls = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    return p.returncode, calls, p.stdout + p.stderr


HEAD_TOKEN = "3f9a0c51d2e84b7f9a6e1c0d5b2a4e87"  # what the fake `ray get-auth-token` on the head prints


def _cmds(calls: list[dict]) -> list[tuple[str, list[str]]]:
    """(host, command) of every srun call."""
    out = []
    for c in calls:
        if c["tool"] == "srun":
            a = c["argv"]
            assert a[:4] == ["--nodes=1", "--ntasks=1", "--overlap", "-w"], a
            out.append((a[4], a[5:]))
    return out


def test_sbatch_starts_ray_across_the_allocation_then_runs_the_flow(tmp_path):
    rc, calls, out = _sbatch(tmp_path, "--config", "deployments/demo.yaml", "--actor-num-nodes", "2")
    assert rc == 0, out
    cmds = _cmds(calls)
    ray = lambda c: c[1:4] == ["-m", "ray.scripts.scripts", "start"]  # noqa: E731
    heads = [(h, c) for h, c in cmds if ray(c) and "--head" in c]
    joins = [(h, c) for h, c in cmds if ray(c) and "--head" not in c]
    assert [h for h, _ in heads] == ["gpu01"]
    assert {"--node-ip-address=10.1.2.3", "--port=6379", "--num-gpus=8", "--num-cpus=32", "--block"} <= set(heads[0][1])
    assert sorted(h for h, _ in joins) == ["gpu02", "gpu03"]
    assert all("--address=10.1.2.3:6379" in c and "--num-gpus=8" in c for _, c in joins)
    waits = [(h, c) for h, c in cmds if "engine.cluster.wait" in c]
    assert waits == [("gpu01", ["python", "-m", "engine.cluster.wait", "--address", "10.1.2.3:6379", "--nodes", "3",
                                "--timeout", "300"])]
    (run,) = [(h, c) for h, c in cmds if "flows.cli" in c]
    assert run == ("gpu01", ["python", "-m", "flows.cli", "train", "--ray-address", "10.1.2.3:6379", "--config",
                             "deployments/demo.yaml", "--actor-num-nodes", "2"])
    order = [c for _, c in cmds]
    assert order.index(waits[0][1]) < order.index(run[1])  # the flow starts once every node has joined
    stops = [h for h, c in cmds if c[-1] == "stop"]
    assert sorted(stops) == ["gpu01", "gpu02", "gpu03"] and order.index(run[1]) < len(order) - 3


def _ray_steps(calls: list[dict]) -> list[dict]:
    """The srun calls that join Ray: `ray start` (head and workers), the wait, the flow."""
    return [c for c in calls if c["tool"] == "srun" and any(x in c["argv"] for x in
                                                            ("start", "engine.cluster.wait", "flows.cli"))]


def test_sbatch_runs_every_ray_step_with_the_heads_token(tmp_path):
    """Ray turns token authentication on for `ray start` wherever ~/.ray/auth_token exists, and refuses a node or
    driver joining by address without RAY_AUTH_MODE=token (engine.cluster.check_token_auth): every step gets token
    mode and the one token the head prints, and the token is never in the job's output."""
    rc, calls, out = _sbatch(tmp_path, "--config", "deployments/demo.yaml")
    assert rc == 0, out
    (gen,) = [c for c in calls if c["tool"] == "srun" and "get-auth-token" in c["argv"]]
    assert gen["argv"][4] == "gpu01" and gen["argv"][5:] == ["python", "-m", "ray.scripts.scripts", "get-auth-token",
                                                             "--generate"]
    steps = _ray_steps(calls)
    assert len(steps) == 5  # head, two workers, the wait, the flow
    assert all(c["auth_mode"] == "token" and c["auth_token"] == HEAD_TOKEN for c in steps), steps
    assert calls.index(gen) < calls.index(steps[0])
    assert HEAD_TOKEN not in out


def test_sbatch_keeps_the_users_ray_auth_choice(tmp_path):
    rc, calls, out = _sbatch(tmp_path, RAY_AUTH_MODE="disabled")
    assert rc == 0, out
    assert not [c for c in calls if "get-auth-token" in c.get("argv", [])]
    assert all(c["auth_mode"] == "disabled" and c["auth_token"] is None for c in _ray_steps(calls))
    rc, calls, out = _sbatch(tmp_path, RAY_AUTH_TOKEN_PATH="/shared/ray/token")  # a token the user provides
    assert rc == 0, out
    assert not [c for c in calls if "get-auth-token" in c.get("argv", [])]
    assert all(c["auth_mode"] == "token" and c["auth_token"] is None for c in _ray_steps(calls))


def test_sbatch_under_a_prefect_worker_runs_that_flow_run_and_passes_its_failure_on(tmp_path):
    rc, calls, out = _sbatch(tmp_path, PREFECT__FLOW_RUN_ID="5c0ffee0-0000-4000-8000-000000000001",
                             FAKE_RUN_RC="3", ROLLFLOW_PYTHON="/opt/venv/bin/python")
    assert rc == 3, out  # `sbatch --wait` hands the job's code to the Prefect worker
    cmds = _cmds(calls)
    assert ("gpu01", ["/opt/venv/bin/python", "-m", "prefect.engine"]) in cmds
    assert not [c for _, c in cmds if "flows.cli" in c]
    assert sorted(h for h, c in cmds if c[-1] == "stop") == ["gpu01", "gpu02", "gpu03"]  # cleaned up on failure


def test_sbatch_directives_and_syntax():
    text = SBATCH.read_text()
    subprocess.run(["bash", "-n", str(SBATCH)], check=True)
    directives = dict(line.removeprefix("#SBATCH --").partition("=")[::2] for line in text.splitlines()
                      if line.startswith("#SBATCH --"))
    assert directives["ntasks-per-node"] == "1" and int(directives["nodes"]) >= 2 and "exclusive" in directives
    assert text.startswith("#!/bin/bash\n") and "set -euo pipefail" in text and "trap cleanup EXIT" in text


# ---- Prefect ----------------------------------------------------------------------------------------------------
def test_cluster_deployments_are_what_prefect_and_rl_train_accept():
    from prefect.cli.deploy._models import PrefectYamlModel
    from prefect.workers.process import ProcessJobConfiguration

    from flows.params import run_config

    raw = yaml.safe_load(CLUSTER_DEPLOYMENTS.read_text())
    model = PrefectYamlModel.model_validate(raw)
    by_name = {d.name: d for d in model.deployments}
    assert set(by_name) == {"rl-train-kuberay", "rl-train-slurm"}
    for d in by_name.values():
        path, _, fn = d.entrypoint.partition(":")
        assert (ROOT / path).is_file() and "rl_train = " in (ROOT / path).read_text() and fn == "rl_train"
        assert set(d.work_pool.job_variables) <= set(ProcessJobConfiguration.model_fields), d.work_pool.job_variables
        cfg = run_config(d.parameters["cfg"], str(ROOT / d.parameters["config"]))
        assert cfg.ray_address == "auto"
    assert by_name["rl-train-kuberay"].parameters["cfg"]["ray_code"] == "image"
    command = by_name["rl-train-slurm"].work_pool.job_variables["command"].split()
    assert command[:2] == ["sbatch", "--wait"] and (ROOT / command[2]) == SBATCH
