"""Accuracy with a real harness: lm-evaluation-harness against radixlm's
server (`--model local-completions` for log-likelihoods,
`local-chat-completions` for chat generation) and against HF transformers
(`--model hf`, the peer) on the same offline tasks (benchmarks/lm_eval/), in
one run. Prints each command, then one table: radixlm's score, HF's, the
difference, and how far the two agree sample by sample (the largest
log-likelihood difference; identical greedy answers).

    python benchmarks/lm_eval_accuracy.py                 # the embedded SmolLM2-135M
    python benchmarks/lm_eval_accuracy.py --limit 50      # a quicker subset
    python benchmarks/lm_eval_accuracy.py --model-path /path/to/hf-checkpoint
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[1]
TASKS = REPO / "benchmarks" / "lm_eval"
LOGLIKELIHOOD_TASKS = "radixlm_hellaswag,radixlm_arithmetic_2da"
CHAT_TASKS = "radixlm_arithmetic_2da_chat"
OFFLINE = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def start_server(args: argparse.Namespace, port: int) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "radixlm.launch_server", "--port", str(port),
           "--dtype", "float32", *(["--model-path", args.model_path] if args.model_path else [])]
    log = open(Path(tempfile.gettempdir()) / "radixlm-lm-eval-server.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode}; see {log.name}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(1)
    proc.kill()
    raise SystemExit("the server did not become ready")


def lm_eval(model: str, model_args: str, tasks: str, out: Path, args: argparse.Namespace,
            chat: bool) -> dict[str, Any]:
    cmd = ["lm_eval", "--model", model, "--model_args", model_args, "--tasks", tasks,
           "--include_path", str(TASKS), "--output_path", str(out), "--seed", "1234",
           "--log_samples"]
    if chat:
        cmd.append("--apply_chat_template")
    if model == "hf":
        cmd += ["--device", "cpu", "--batch_size", str(args.hf_batch_size)]
    if args.limit:
        cmd += ["--limit", str(args.limit)]
    print("$", " ".join(cmd), flush=True)
    t0 = time.monotonic()
    subprocess.run(cmd, check=True, env={**os.environ, **OFFLINE}, stdout=subprocess.DEVNULL)
    print(f"  ({time.monotonic() - t0:.0f} s)", flush=True)
    (result,) = sorted(out.rglob("results_*.json"))[-1:]
    results = json.loads(result.read_text())["results"]
    for task in results:
        (path,) = sorted(out.rglob(f"samples_{task}_*.jsonl"))[-1:]
        samples = [json.loads(line) for line in path.read_text().splitlines()]
        results[task]["samples"] = {s["doc_id"]: s["resps"] for s in samples}
    return results


def agreement(ours: dict[str, Any], peer: dict[str, Any]) -> str:
    """Log-likelihood tasks: the largest absolute difference over every scored
    continuation; generation: how many greedy answers are the same text."""
    a, b = ours["samples"], peer["samples"]
    if not isinstance(a[0][0], list) or not isinstance(a[0][0][0], list):  # generations
        same = sum(a[d][0][0].strip() == b[d][0][0].strip() for d in a)
        return f"{same}/{len(a)} answers identical"
    # The sample files hold (loglikelihood, is_greedy) pairs as strings.
    worst = max(abs(float(x[0][0]) - float(y[0][0])) for d in a for x, y in zip(a[d], b[d]))
    return f"log-likelihoods within {worst:.1e} ({sum(len(v) for v in a.values())})"


def scores(results: dict[str, Any]) -> dict[tuple[str, str], float]:
    out = {}
    for task, metrics in results.items():
        for key, value in metrics.items():
            if key == "samples":
                continue
            if isinstance(value, float) and "stderr" not in key:
                out[(task, key.split(",")[0])] = value
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", default=None, help="default: the embedded SmolLM2-135M")
    p.add_argument("--limit", type=int, default=None, help="examples per task (default: all)")
    p.add_argument("--port", type=int, default=30017)
    p.add_argument("--num-concurrent", type=int, default=4)
    p.add_argument("--hf-batch-size", type=int, default=8)
    args = p.parse_args()
    from radixlm.models.loader import prepare_model_dir

    model_dir = prepare_model_dir(args.model_path)
    name = "SmolLM2-135M-Instruct" if args.model_path is None else \
        Path(args.model_path.rstrip("/")).name
    base = f"http://127.0.0.1:{args.port}/v1"
    server = start_server(args, args.port)
    work = Path(tempfile.mkdtemp(prefix="radixlm-lm-eval-"))
    try:
        ours = {**lm_eval("local-completions",
                          f"model={name},base_url={base}/completions,tokenizer={model_dir},"
                          f"tokenizer_backend=huggingface,num_concurrent={args.num_concurrent},"
                          "max_retries=1", LOGLIKELIHOOD_TASKS, work / "ours-ll", args, False),
                **lm_eval("local-chat-completions",
                          f"model={name},base_url={base}/chat/completions,"
                          f"num_concurrent={args.num_concurrent},max_retries=1",
                          CHAT_TASKS, work / "ours-chat", args, True)}
    finally:
        server.terminate()
        server.wait(60)
    hf_args = f"pretrained={model_dir},dtype=float32"
    peer = {**lm_eval("hf", hf_args, LOGLIKELIHOOD_TASKS, work / "hf-ll", args, False),
            **lm_eval("hf", hf_args, CHAT_TASKS, work / "hf-chat", args, True)}
    a, b = scores(ours), scores(peer)
    print("\n| task | metric | radixlm | HF transformers | difference | per sample |\n"
          "|---|---|---:|---:|---:|---|")
    for key in sorted(a):
        if key in b:
            print(f"| {key[0]} | {key[1]} | {a[key]:.4f} | {b[key]:.4f} | "
                  f"{a[key] - b[key]:+.4f} | {agreement(ours[key[0]], peer[key[0]])} |")


if __name__ == "__main__":
    main()
