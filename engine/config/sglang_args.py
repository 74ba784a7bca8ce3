"""The flags SGLang's `launch_server` accepts, to check `--sglang-*` pass-through flags (a typo is caught, not sent).

`sglang_server_args.txt` beside this file lists them, one per line without the leading `--`, read from SGLang's
own source (its first line names the version). Regenerate it from a wheel (no install, nothing imported):

    pip download sglang==<version> --no-deps -d /tmp/sgl
    python -m engine.config.sglang_args --from-wheel /tmp/sgl/sglang-<version>-….whl

The reader takes every field of the ServerArgs namespaces (`sglang/srt/arg_groups/fields/*.py`: `name: A[T, …]`,
the CLI name `--name-with-dashes`, `cli_name=` and `aliases=` of its `Arg`, fields with `no_cli=True` left out)
and every `parser.add_argument("--…")` of `sglang/srt/server_args.py` (flags with dynamic choices, deprecated
aliases). rollflow's own launcher flags (`--model-path`, `--port`, …) are SGLang's too and are in the list.
"""
from __future__ import annotations

import ast
import difflib
import sys
from pathlib import Path

LIST = Path(__file__).with_name("sglang_server_args.txt")

#: the `--sglang-*` flags the built-in engine of a run reads (engine/rollout/engines.py `engine_spec`); an SGLang
#: engine gets them all on its command line. Any other one would do nothing with the built-in engine: refused.
BUILTIN_READS = ("api-key", "max-running-requests", "max-total-tokens", "enable-deterministic-inference",
                 "disable-cuda-graph", "enable-torch-compile")
#: Flags rollflow sets itself; passing them as --sglang-* would contradict the placement or the port allocator.
OWNED = {"model-path": "--hf-checkpoint", "host": None, "port": None, "tp-size": "--rollout-num-gpus-per-engine",
         "tp": "--rollout-num-gpus-per-engine", "tensor-parallel-size": "--rollout-num-gpus-per-engine",
         "base-gpu-id": None, "nccl-port": None, "dist-init-addr": None, "nnodes": None, "node-rank": None}
#: rollflow's own flag for what an SGLang flag the built-in engine does not read sets
ROLLFLOW_FLAG_FOR = {"dtype": "--rollout-dtype", "model-impl": "--model-impl",
                     **{k: v for k, v in OWNED.items() if v}}


def known_flags() -> tuple[str, set[str]]:
    """(the SGLang version the list was read from, the flag names without `--`)."""
    lines = LIST.read_text().splitlines()
    version = lines[0].removeprefix("# sglang ").split()[0] if lines and lines[0].startswith("#") else "?"
    return version, {ln.strip() for ln in lines if ln.strip() and not ln.startswith("#")}


def unknown_flags(names: list[str]) -> list[tuple[str, list[str]]]:
    """The pass-through names (without `--sglang-`) that SGLang does not accept, each with its nearest flags."""
    _, known = known_flags()
    return [(n, difflib.get_close_matches(n, known, n=3, cutoff=0.75)) for n in names if n not in known]


# ---- reading SGLang's source -----------------------------------------------------------------------------------
def _strings(node: ast.AST | None) -> list[str]:
    return [e.value for e in getattr(node, "elts", []) if isinstance(e, ast.Constant) and isinstance(e.value, str)]


def flags_of_fields(source: str) -> set[str]:
    """CLI flags of the annotated fields `name: A[T, "help"]` / `A[T, Arg(...)]` in one fields module."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        ann = node.annotation
        if not (isinstance(ann, ast.Subscript) and getattr(ann.value, "id", None) == "A"):
            continue
        elts = getattr(ann.slice, "elts", [])
        meta = elts[1] if len(elts) > 1 else None
        kw = {k.arg: k.value for k in meta.keywords} if isinstance(meta, ast.Call) else {}
        if isinstance(kw.get("no_cli"), ast.Constant) and kw["no_cli"].value is True:
            continue
        if not (isinstance(meta, ast.Call) or (isinstance(meta, ast.Constant) and isinstance(meta.value, str))):
            continue
        cli = kw["cli_name"].value if isinstance(kw.get("cli_name"), ast.Constant) else "--" + node.target.id.replace(
            "_", "-")
        out |= {cli, *_strings(kw.get("aliases"))}
    return {f.removeprefix("--") for f in out if f.startswith("--")}


def flags_of_add_argument(source: str) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument":
            out |= {a.value.removeprefix("--") for a in node.args
                    if isinstance(a, ast.Constant) and isinstance(a.value, str) and a.value.startswith("--")}
    return out


def read_wheel(path: str) -> tuple[str, set[str]]:
    import zipfile

    with zipfile.ZipFile(path) as z:
        names = z.namelist()
        meta = next(n for n in names if n.endswith(".dist-info/METADATA"))
        version = meta.split("/")[0].removesuffix(".dist-info").split("-", 1)[1]
        flags = flags_of_add_argument(z.read("sglang/srt/server_args.py").decode())
        for n in names:
            if n.startswith("sglang/srt/arg_groups/fields/") and n.endswith(".py"):
                flags |= flags_of_fields(z.read(n).decode())
    return version, flags


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] != "--from-wheel":
        sys.exit("usage: python -m engine.config.sglang_args --from-wheel sglang-<version>-….whl")
    version, flags = read_wheel(sys.argv[2])
    LIST.write_text(f"# sglang {version} launch_server flags, read by engine/config/sglang_args.py from "
                    f"{Path(sys.argv[2]).name}\n" + "".join(f"{f}\n" for f in sorted(flags)))
    print(f"{len(flags)} flags of sglang {version} → {LIST}")
