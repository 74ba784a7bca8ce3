"""SGLang's min_new_tokens on the built-in engine on a GPU (bf16, CUDA graphs on).

    PYTHONPATH=. python bench/gpu_min_new_tokens.py --out DIR

A batch that carries min_new_tokens runs on the eager path and keeps the stop tokens off until then; a batch
without it still replays the CUDA graphs (GraphDecoder.steps moves). Writes DIR/gpu_min_new_tokens.json and exits 1
when a check fails.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main() -> int:
    import torch

    from engine.config.data import BUNDLED_MODEL
    from engine.modeling import render_prompt
    from engine.rollout.generation import GenRequest
    from engine.rollout.server import EngineState

    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    a = p.parse_args()
    if not torch.cuda.is_available():
        print("needs CUDA")
        return 2
    state = EngineState(BUNDLED_MODEL, device="cuda", dtype="bfloat16", max_new_tokens=8)
    gen = state.generator
    ids = render_prompt(state.tokenizer, "37+48=", True)
    eos = set(gen.eos_ids)

    def run(n: int, hold: int) -> tuple[list, int]:
        before = gen.graphs.steps if gen.graphs is not None else 0
        reqs = [GenRequest(rid=f"r{i}", input_ids=list(ids), max_new_tokens=8, temperature=0.0,
                           min_new_tokens=hold if i % 2 == 0 else 0) for i in range(n)]
        out = gen.generate(reqs)
        return out, (gen.graphs.steps if gen.graphs is not None else 0) - before

    base, graph_steps_plain = run(4, 0)
    k = len(base[0].output_ids)
    held, graph_steps_held = run(4, k + 2)
    checks = {
        "graphs_present": gen.graphs is not None,
        "plain_batch_replays_graphs": graph_steps_plain > 0,
        "held_batch_runs_eager": graph_steps_held == 0,
        "base_ends_with_eos_early": k < 8 and base[0].output_ids[-1] in eos,
        "held_rows_run_past_eos": all(len(r.output_ids) >= k + 2 and not eos & set(r.output_ids[:k + 1])
                                      for r in held[0::2]),
        "held_rows_keep_the_prefix": all(r.output_ids[:k - 1] == base[0].output_ids[:k - 1] for r in held[0::2]),
        "logprobs_finite": all(all(lp <= 0 and lp == lp for lp in r.logprobs) for r in held),
    }
    # not a check: the unheld rows ran eager beside the held ones, the base on the graphs (bf16 numerics may differ)
    same_unheld = all(r.output_ids == base[0].output_ids for r in held[1::2])
    res = {"command": "PYTHONPATH=. python bench/gpu_min_new_tokens.py --out $OUT",
           "device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "when_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()), "k": k,
           "base": base[0].output_ids, "held": [r.output_ids for r in held], "graph_steps_plain": graph_steps_plain,
           "graph_steps_held": graph_steps_held, "unheld_rows_as_base": same_unheld, "checks": checks}
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "gpu_min_new_tokens.json").write_text(json.dumps(res, indent=1))
    print(json.dumps(res))
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
