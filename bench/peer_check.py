"""`llmchaos load` side by side with a peer benchmark client, GuideLLM 0.8.1, same traffic.

    .venv/bin/python bench/peer_check.py [--rates 20,100] [--duration-s 30]
                                         [--prompt-tokens 64] [--output-tokens 16]

Not a test: it prints a table. What it does:

1. Installs GuideLLM 0.8.1 from PyPI into its own venv, reports/peer/venv (never a project
   dependency; ~6 GB, it pulls torch; once), and writes a local tokenizer to reports/peer/tok:
   a word-level Hugging Face tokenizer over Faker's word list (GuideLLM writes its synthetic
   prompts with Faker), whitespace-split, so that one token is one word, which is how the
   embedded stack counts (`llmchaos.stack.tokens`). GuideLLM runs with HF_HUB_OFFLINE=1:
   no hub access.
2. Starts the embedded stack (default variant) and, for each rate, runs `llmchaos load` and
   `guidellm run` one after the other with the same shape: constant arrivals, every request
   streamed, a fixed prompt and a fixed output length (`ignore_eos`), `rate` requests/s for
   `duration` seconds. Then the same against the scripted reference server of the tests
   (tests/load/scripted_server.py: first content 80 ms after the request, then a token every
   12 ms), whose timings are known: the arbiter when the two disagree.
3. Prints TTFT, ITL, TPOT and e2e p50/p99 of both, and llmchaos / GuideLLM.

Definitions: llmchaos as llmchaos/load/README.md says (vLLM bench serve's). GuideLLM's TTFT and
request latency start when its request is sent (llmchaos: when it was scheduled; at a constant
rate the two are within the send lag); its "ITL" is (last token - first token) / (tokens - 1)
per request, which is vLLM's TPOT, so both the ITL and the TPOT rows compare against it
(llmchaos' ITL is every gap between chunks, pooled, as vLLM bench serve reports it).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from llmchaos.load import LoadConfig, LoadRun, Summary, TrafficSpec
from llmchaos.stack.config import StackConfig
from llmchaos.stack.stack import start_stack, stop_stack
from llmchaos.stack.tokendb import read_tokens_file
from llmchaos.stack.topology import Topology

REPO = Path(__file__).resolve().parents[1]
PEER = REPO / "reports" / "peer"
GUIDELLM = "guidellm==0.8.1"
SCRIPT_TTFT_MS, SCRIPT_ITL_MS = 80.0, 12.0
METRICS = ("ttft", "itl", "tpot", "e2e")
Figures = dict[str, tuple[float, float]]
"""metric -> (p50, p99) in ms."""
ENGINE_HISTOGRAMS = {
    "ttft": "vllm:time_to_first_token_seconds_bucket",
    "e2e": "vllm:e2e_request_latency_seconds_bucket",
}

_TOKENIZER = """
import sys
from faker.providers.lorem.en_US import Provider
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers
from transformers import PreTrainedTokenizerFast
from llmchaos_words import WORDS
words = sorted({w.lower() for w in Provider.word_list} | set(WORDS))
vocab = {"[UNK]": 0, **{w: i + 1 for i, w in enumerate(words)}}
tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
tok.normalizer = normalizers.Sequence(
    [normalizers.Lowercase(), normalizers.Replace(".", ""), normalizers.Replace(",", "")]
)
tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
tok.decoder = decoders.WordPiece(prefix="##")
PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(sys.argv[1])
"""


def ensure_guidellm() -> Path:
    """The guidellm executable of reports/peer/venv, installed there first if missing."""
    venv = PEER / "venv"
    guidellm = venv / "bin" / "guidellm"
    if not guidellm.exists():
        print(f"installing {GUIDELLM} into {venv} (once; several minutes)", file=sys.stderr)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(venv / "bin" / "pip"), "install", "-q", GUIDELLM], check=True)
    return guidellm


def make_tokenizer(python: Path) -> Path:
    """reports/peer/tok: a local word-level tokenizer (see the module docstring)."""
    folder = PEER / "tok"
    if (folder / "tokenizer.json").exists():
        return folder
    from llmchaos.stack import tokens

    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "llmchaos_words.py").write_text(f"WORDS = {sorted(set(tokens._WORDS))!r}\n")
        env = {**os.environ, "PYTHONPATH": tmp, "HF_HUB_OFFLINE": "1"}
        subprocess.run([str(python), "-c", _TOKENIZER, str(folder)], check=True, env=env)
    return folder


def run_llmchaos(
    url: str, tokens_file: str | None, args: argparse.Namespace, rate: float
) -> Figures:
    run_dir = PEER / "runs" / f"llmchaos-{time.strftime('%H%M%S')}-{rate:g}"
    config = LoadConfig(
        url=url,
        qps=rate,
        duration_s=args.duration_s,
        profile="constant",
        tokens_file=tokens_file,
        traffic=TrafficSpec(
            stream_share=1.0,
            context_tokens=0,
            prompt_tokens=str(args.prompt_tokens),
            output_tokens=str(args.output_tokens),
            ignore_eos=True,
        ),
        run_dir=str(run_dir),
    )
    with LoadRun.start(config) as run:
        summary: Summary = run.wait()
    if summary.ok != summary.scheduled:
        print(
            f"  llmchaos: {summary.scheduled - summary.ok} of {summary.scheduled} failed",
            file=sys.stderr,
        )
    quantiles = {
        "ttft": summary.ttft_ms,
        "itl": summary.itl_ms,
        "tpot": summary.tpot_ms,
        "e2e": summary.latency_ms,
    }
    return {m: (float(q["p50"] or 0.0), float(q["p99"] or 0.0)) for m, q in quantiles.items()}


def run_guidellm(
    guidellm: Path, tokenizer: Path, url: str, api_key: str, args: argparse.Namespace, rate: float
) -> Figures:
    out = PEER / "runs" / f"guidellm-{time.strftime('%H%M%S')}-{rate:g}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    cmd = [
        str(guidellm),
        "run",
        "--backend",
        f"kind=openai_http,target={url},model=llmchaos-7b,api_key={api_key}",
        "--tokenizer",
        f"kind=hf_auto,model={tokenizer}",
        "--data",
        f"kind=synthetic_text,prompt_tokens={args.prompt_tokens},output_tokens={args.output_tokens}",
        "--profile",
        f"kind=constant,rate={rate:g}",
        "--constraint",
        f"kind=max_duration,seconds={args.duration_s:g}",
        "--output",
        f"kind=json,path={out}",
        "--disable-console",
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    if args.guidellm_workers:
        env["GUIDELLM__MAX_WORKER_PROCESSES"] = str(args.guidellm_workers)
    subprocess.run(
        cmd, check=True, env=env, cwd=PEER, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    metrics = json.loads(out.read_text())["benchmarks"][0]["metrics"]

    def quantiles(name: str, scale: float = 1.0) -> tuple[float, float]:
        p = metrics[name]["successful"]["percentiles"]
        return p["p50"] * scale, p["p99"] * scale

    per_request_itl = quantiles("inter_token_latency_ms")
    return {
        "ttft": quantiles("time_to_first_token_ms"),
        "itl": per_request_itl,
        "tpot": per_request_itl,
        "e2e": quantiles("request_latency", 1000.0),
    }


def engine_buckets(topology: Topology) -> dict[str, Counter[float]]:
    """The workers' own TTFT and e2e histograms (vLLM's), summed: le (s) -> count."""
    totals: dict[str, Counter[float]] = {name: Counter() for name in ENGINE_HISTOGRAMS}
    for node in topology.nodes:
        for worker in node.workers:
            with urllib.request.urlopen(f"{worker.url}/metrics", timeout=5) as response:
                text = response.read().decode()
            for family in text_string_to_metric_families(text):
                for sample in family.samples:
                    for name, bucket in ENGINE_HISTOGRAMS.items():
                        if sample.name == bucket:
                            totals[name][float(sample.labels["le"])] += sample.value
    return totals


def engine_quantiles(before: dict[str, Counter[float]], after: dict[str, Counter[float]]) -> str:
    """Where p50 and p99 of what the workers saw between two scrapes fall: the bucket (ms)."""
    out = []
    for name in ENGINE_HISTOGRAMS:
        cumulative = sorted((le, after[name][le] - before[name][le]) for le in after[name])
        total = cumulative[-1][1] if cumulative else 0
        for q in (0.5, 0.99):
            lower = 0.0
            for le, count in cumulative:
                if count >= q * total:
                    out.append(f"{name} p{q * 100:g} in ({lower * 1000:g}, {le * 1000:g}] ms")
                    break
                lower = le
    return "; ".join(out)


def scripted_server(output_tokens: int) -> tuple[subprocess.Popen[bytes], str]:
    port_file = PEER / f"script-port-{os.getpid()}"
    port_file.unlink(missing_ok=True)
    process = subprocess.Popen(
        [
            *(sys.executable, "-m", "tests.load.scripted_server", "--port-file", str(port_file)),
            *("--ttft-ms", str(SCRIPT_TTFT_MS), "--itl-ms", str(SCRIPT_ITL_MS)),
            *("--tokens", str(output_tokens), "--max-lifetime-s", "900"),
        ],
        cwd=REPO,
    )
    deadline = time.monotonic() + 15
    while not port_file.exists():
        if process.poll() is not None or time.monotonic() > deadline:
            raise SystemExit("the scripted server did not start")
        time.sleep(0.05)
    port = port_file.read_text()
    port_file.unlink()
    return process, f"http://127.0.0.1:{port}"


def print_table(rows: list[tuple[str, float, Figures, Figures, Figures | None]]) -> None:
    head = ("target", "QPS", "metric", "q", "llmchaos", "GuideLLM", "ratio", "script")
    print("{:<16}{:>5}  {:<5}{:>4} {:>10} {:>10} {:>7} {:>8}".format(*head))
    for target, rate, ours, peer, script in rows:
        for metric in METRICS:
            for i, q in enumerate(("p50", "p99")):
                mine, theirs = ours[metric][i], peer[metric][i]
                ratio = f"{mine / theirs:7.3f}" if theirs else "      -"
                expected = f"{script[metric][i]:8.1f}" if script else ""
                print(
                    f"{target:<16}{rate:>5g}  {metric:<5}{q:>4} {mine:10.2f} {theirs:10.2f} "
                    f"{ratio} {expected}".rstrip()
                )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rates", default="20,100", help="constant QPS, comma-separated")
    parser.add_argument("--duration-s", type=float, default=30.0)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--output-tokens", type=int, default=16)
    parser.add_argument("--skip-script", action="store_true", help="no scripted-server runs")
    parser.add_argument(
        "--guidellm-workers",
        type=int,
        default=0,
        help="GuideLLM's worker processes (0: its default, 10)",
    )
    args = parser.parse_args()
    guidellm = ensure_guidellm()
    tokenizer = make_tokenizer(guidellm.parent / "python")
    rows: list[tuple[str, float, Figures, Figures, Figures | None]] = []
    witnesses: list[str] = []
    topology = start_stack(StackConfig(port=0), progress=True)
    try:
        token = next(t.token for t in read_tokens_file(topology.tokens_file) if not t.revoked)
        warm_up = argparse.Namespace(**{**vars(args), "duration_s": 5.0})
        run_llmchaos(topology.gateway_url, topology.tokens_file, warm_up, 20.0)  # token cache
        for rate in (float(r) for r in args.rates.split(",")):
            print(f"embedded stack at {rate:g} QPS ...", file=sys.stderr)
            before = engine_buckets(topology)
            ours = run_llmchaos(topology.gateway_url, topology.tokens_file, args, rate)
            middle = engine_buckets(topology)
            peer = run_guidellm(guidellm, tokenizer, topology.gateway_url, token, args, rate)
            after = engine_buckets(topology)
            rows.append(("embedded stack", rate, ours, peer, None))
            witnesses.append(
                f"{rate:g} QPS, the workers' own histograms: during llmchaos "
                f"{engine_quantiles(before, middle)}; during GuideLLM "
                f"{engine_quantiles(middle, after)}"
            )
    finally:
        stop_stack(topology)
    if not args.skip_script:
        process, url = scripted_server(args.output_tokens)
        try:
            e2e_ms = SCRIPT_TTFT_MS + (args.output_tokens - 1) * SCRIPT_ITL_MS
            expected = {"ttft": SCRIPT_TTFT_MS, "itl": SCRIPT_ITL_MS, "tpot": SCRIPT_ITL_MS}
            script = {m: (v, v) for m, v in {**expected, "e2e": e2e_ms}.items()}
            print("scripted server at 20 QPS ...", file=sys.stderr)
            ours = run_llmchaos(url, None, args, 20.0)
            peer = run_guidellm(guidellm, tokenizer, url, "unused", args, 20.0)
            rows.append(("scripted server", 20.0, ours, peer, script))
        finally:
            process.kill()
            process.wait()
    print_table(rows)
    print("\n".join(witnesses))


if __name__ == "__main__":
    main()
