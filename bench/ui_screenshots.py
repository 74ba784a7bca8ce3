"""What an RL engineer sees first: a real `prefect server` (with its UI) and `mlflow server` on loopback, a training
run against both, then Debian's Chromium (driven by Playwright) opens the two pages rollflow links to.

    python bench/ui_screenshots.py --out bench/results/ui [--num-rollout 40] [--eval-interval 10]

Writes mlflow_run.png, prefect_flow_run.png, prefect_artifacts.png, prefect_summary.png and ui.json (what was read
off each page: the MLflow layout, its chart sections in order and the first chart; the Prefect task runs and artifact cards) under
--out. tests/test_ui_browser.py runs the same functions on 3 rollouts. Needs /usr/bin/chromium (Debian's
`chromium`, installed by `make test`) and the `playwright` Python package (the dev extra; no browser download).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from engine.rollout.ports import free_loopback_port

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM = "/usr/bin/chromium"
# as root, on a machine without internet: no sandbox, and no background connections (refused by the closed network)
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]


free_port = free_loopback_port  # engine/rollout/ports.py


class Servers:
    """`prefect server start` (UI on) and `mlflow server`, each in its own process group, stopped by pid."""

    def __init__(self, work: Path):
        self.work, self.procs = work, []
        work.mkdir(parents=True, exist_ok=True)
        self.prefect_port, self.mlflow_port = free_port(), free_port()
        self.prefect_api = f"http://127.0.0.1:{self.prefect_port}/api"
        self.mlflow_uri = f"http://127.0.0.1:{self.mlflow_port}"
        home = work / "prefect-home"
        home.mkdir(exist_ok=True)
        self.env = {**os.environ, "PREFECT_HOME": str(home), "PREFECT_API_URL": self.prefect_api,
                    "PREFECT_UI_API_URL": self.prefect_api, "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
                    "PREFECT_API_DATABASE_CONNECTION_URL": f"sqlite+aiosqlite:///{work / 'prefect.db'}"}
        self.env.pop("MLFLOW_TRACKING_URI", None)
        self.env.pop("PREFECT_PROFILES_PATH", None)

    def _start(self, name: str, args: list[str]) -> None:
        log = open(self.work / f"{name}.log", "w")
        self.procs.append(subprocess.Popen(args, cwd=ROOT, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                           start_new_session=True))

    def start(self, deadline_s: float = 180) -> "Servers":
        bin_dir = Path(sys.executable).parent
        self._start("prefect", [str(bin_dir / "prefect"), "server", "start", "--host", "127.0.0.1", "--port",
                                str(self.prefect_port), "--no-scheduler", "--no-late-runs"])
        self._start("mlflow", [str(bin_dir / "mlflow"), "server", "--backend-store-uri",
                               f"sqlite:///{self.work / 'mlflow.db'}", "--artifacts-destination",
                               str(self.work / "mlartifacts"), "--host", "127.0.0.1", "--port", str(self.mlflow_port),
                               "--workers", "1"])
        t0 = time.monotonic()
        for url in (f"{self.prefect_api}/health", f"{self.mlflow_uri}/health"):
            while True:
                for p, name in zip(self.procs, ("prefect", "mlflow")):
                    if p.poll() is not None:
                        raise RuntimeError(f"{name} server exited: {(self.work / f'{name}.log').read_text()[-2000:]}")
                try:
                    if httpx.get(url, timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() - t0 > deadline_s:
                    raise TimeoutError(f"{url} not healthy after {deadline_s} s")
                time.sleep(0.5)
        return self

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)


def train(servers: Servers, *flags: str, timeout_s: float = 900) -> dict:
    """`rollflow train --config examples/demo.yaml FLAGS` against both servers; its summary JSON."""
    summary = servers.work / "summary.json"
    cmd = [sys.executable, "-m", "flows.cli", "train", "--config", "examples/demo.yaml", "--no-progress",
           "--mlflow-tracking-uri", servers.mlflow_uri, "--work-dir", str(servers.work / "run"),
           "--save", str(servers.work / "ckpt"), "--summary-json", str(summary), *flags]
    r = subprocess.run(cmd, cwd=ROOT, env=servers.env, capture_output=True, text=True, timeout=timeout_s)
    if r.returncode != 0:
        raise RuntimeError(f"rollflow train exited {r.returncode}:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    return json.loads(summary.read_text())


def _lines(page) -> list[str]:
    return [x.strip() for x in page.inner_text("body").splitlines() if x.strip()]


def read_mlflow(page, url: str, shot: Path) -> dict:
    """The run page rollflow links to: its layout, its chart sections in order and the first chart's title."""
    page.goto(url)
    page.wait_for_selector("text=Add chart", timeout=60_000)
    close = page.get_by_role("button", name="Close")  # MLflow's assistant opens once per browser: out of the way
    if close.count():
        close.first.click()
    page.wait_for_timeout(2000)
    lines = _lines(page)
    sections = [lines[i - 1] for i, x in enumerate(lines)
                if re.fullmatch(r"\(\d+\)", x) and i + 1 < len(lines) and lines[i + 1] == "Add chart"]
    first_chart = lines[lines.index("Add chart") + 1]
    page.screenshot(path=str(shot))
    return {"url": url, "layout": "model training" if "Model registry" in lines and "Evaluation runs" not in lines
            else "genai", "sections": sections, "first_chart": first_chart, "screenshot": shot.name, "lines": lines}


def read_prefect(page, url: str, shot: Path, artifacts_shot: Path) -> dict:
    """The flow run page: its name and state, its task runs, then its Artifacts tab."""
    page.goto(url)
    page.wait_for_selector("text=Task Runs", timeout=60_000)
    page.wait_for_timeout(3000)
    head = _lines(page)
    page.screenshot(path=str(shot))
    page.get_by_text("Task Runs", exact=True).first.click()
    page.wait_for_timeout(3000)
    tasks = sorted({x for x in _lines(page) if re.fullmatch(r"(preflight|place|convert|(eval|rollout|pack|train|save|"
                                                            r"sync)-\d+)", x)})
    page.get_by_text("Artifacts", exact=True).first.click()
    page.wait_for_timeout(3000)
    cards = sorted({x for x in _lines(page) if re.fullmatch(r"[a-z0-9-]+-[0-9a-f]{8}", x)})
    page.screenshot(path=str(artifacts_shot))
    summary = next((c for c in cards if c.startswith("summary-")), None)
    if summary:  # the summary card's own page: the run so far and the last rollout
        page.get_by_text(summary, exact=True).first.click()
        page.wait_for_timeout(3000)
        page.screenshot(path=str(artifacts_shot.with_name("prefect_summary.png")))
    return {"url": url, "lines": head, "state": "Completed" if "Completed" in head else "?", "tasks": tasks,
            "artifacts": cards,
            "screenshot": shot.name, "artifacts_screenshot": artifacts_shot.name}


def shoot(summary: dict, out: Path) -> dict:
    from playwright.sync_api import sync_playwright

    out.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            facts = {"mlflow": read_mlflow(page, summary["mlflow_run_url"], out / "mlflow_run.png"),
                     "prefect": read_prefect(page, summary["flow_run_url"], out / "prefect_flow_run.png",
                                             out / "prefect_artifacts.png")}
        finally:
            browser.close()
    # the run's one name, as MLflow stores it, on both pages
    from mlflow.tracking import MlflowClient

    name = MlflowClient(summary["mlflow_tracking_uri"]).get_run(summary["mlflow_run_id"]).info.run_name
    facts["run_name"] = name
    for side in ("mlflow", "prefect"):
        facts[side]["shows_run_name"] = any(x.startswith(name) for x in facts[side].pop("lines"))
    return facts


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "ui"))
    ap.add_argument("--num-rollout", type=int, default=40)
    ap.add_argument("--eval-interval", type=int, default=10)
    ap.add_argument("--work", default="/tmp/rollflow-ui")
    a = ap.parse_args()
    servers = Servers(Path(a.work)).start()
    try:
        summary = train(servers, "--num-rollout", str(a.num_rollout), "--eval-interval", str(a.eval_interval))
        facts = shoot(summary, Path(a.out))
    finally:
        servers.stop()
    facts.update(command="python bench/ui_screenshots.py " + " ".join(sys.argv[1:]),
                 date=time.strftime("%Y-%m-%d %H:%M:%S"), accuracy=[summary["test_accuracy_before"],
                                                                   summary["test_accuracy_after"]])
    (Path(a.out) / "ui.json").write_text(json.dumps(facts, indent=1) + "\n")
    print(json.dumps(facts, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
