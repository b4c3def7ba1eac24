#!/usr/bin/env python3
"""Measures an OpenAI-compatible engine's step costs from outside, for engines without
pdserve's step profiler (real vLLM): the sweeps of Dynamo's SLA profiler, written as the
`step` events `pdserve worker --profile-dir` writes, so scripts/fit-sim-profile.py fits
them the same way.

- Prefill: one request at a time, prompts of random token ids (no prefix-cache hits) of
  each length in --prefill-lengths, max_tokens 1, not streamed. Each request's latency is
  one step that computed N prompt tokens (N(N+1)/2 attention pairs), plus the request's
  own overhead (HTTP, tokenization), which the fit's overhead term takes.
- Decode: C streamed requests at once (each length in --decode-contexts, 64 tokens out,
  EOS ignored), for each C in --decode-batches. Once every request has its first token,
  the engine steps all C together: the mean gap between one request's chunks in that
  window is one step of C decode tokens over the C sequences' context.

    scripts/measure-engine-steps.py --url http://127.0.0.1:8000 --model NAME --out steps.json

Pure Python 3, no packages.
"""

import argparse
import json
import random
import statistics
import sys
import threading
import time
import urllib.request

VOCAB_LOW, VOCAB_HIGH = 1000, 40000
DECODE_TOKENS = 64


def prompt(rng, n):
    return [rng.randint(VOCAB_LOW, VOCAB_HIGH) for _ in range(n)]


def post(url, body, timeout=600):
    req = urllib.request.Request(
        url + "/v1/completions",
        data=json.dumps(body).encode(),
        headers={"content-type": "application/json"},
    )
    return urllib.request.urlopen(req, timeout=timeout)


def prefill_once(args, rng, n):
    body = {"model": args.model, "prompt": prompt(rng, n), "max_tokens": 1, "temperature": 0}
    began = time.perf_counter()
    with post(args.url, body) as r:
        reply = json.load(r)
    took = time.perf_counter() - began
    got = reply.get("usage", {}).get("prompt_tokens")
    if got != n:
        sys.exit(f"prefill of {n} tokens: the engine counted {got} prompt tokens")
    return took


def stream_times(args, tokens, out, at):
    """Streams one completion, storing the arrival time of each token's chunk in out[at]."""
    body = {
        "model": args.model, "prompt": tokens, "max_tokens": DECODE_TOKENS, "temperature": 0,
        "stream": True, "ignore_eos": True,
    }
    times = []
    with post(args.url, body) as r:
        for line in r:
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                break
            chunk = json.loads(data)
            if chunk.get("choices") and chunk["choices"][0].get("text") is not None:
                times.append(time.perf_counter())
    out[at] = times


def decode_once(args, rng, batch, context):
    prompts = [prompt(rng, context) for _ in range(batch)]
    out = [None] * batch
    threads = [threading.Thread(target=stream_times, args=(args, p, out, i)) for i, p in enumerate(prompts)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if any(t is None or len(t) < DECODE_TOKENS // 2 for t in out):
        sys.exit(f"decode batch {batch}: a stream ended early ({[len(t or []) for t in out]} chunks)")
    # The window where all are decoding: after the last first token, before the first end.
    start = max(t[1] for t in out)
    end = min(t[-1] for t in out)
    gaps = [b - a for t in out for a, b in zip(t, t[1:]) if a >= start and b <= end]
    if len(gaps) < batch * 4:
        return None
    # Tokens generated before the window's middle, on average, for the context then.
    mid = (start + end) / 2
    done = statistics.mean(sum(1 for x in t if x <= mid) for t in out)
    return statistics.mean(gaps), batch * (context + done)


def step_event(ts_us, dur_s, prefill_tokens=0, pairs=0, decode_tokens=0, context=0):
    return {
        "name": "step", "ph": "X", "pid": 1, "tid": 1, "ts": ts_us, "dur": dur_s * 1e6,
        "args": {
            "prefill_tokens": prefill_tokens, "prefill_attention_pairs": pairs,
            "decode_tokens": decode_tokens, "decode_context_tokens": context,
        },
    }


def ints(text):
    return [int(x) for x in text.split(",") if x]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", required=True, help="the engine's base URL")
    p.add_argument("--model", required=True, help="the served model name")
    p.add_argument("--out", required=True, help="the trace to write (Chrome trace JSON)")
    p.add_argument("--prefill-lengths", default="16,64,128,256,384,512,768,1024,1536")
    p.add_argument("--prefill-repeats", type=int, default=4)
    p.add_argument("--decode-batches", default="1,2,4,8,16,32")
    p.add_argument("--decode-contexts", default="128,512")
    p.add_argument("--decode-repeats", type=int, default=2)
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args()
    rng = random.Random(args.seed)

    prefill_once(args, rng, 32)  # warm-up, not recorded
    events, ts = [], 0.0
    lengths = ints(args.prefill_lengths) * args.prefill_repeats
    rng.shuffle(lengths)
    for n in lengths:
        took = prefill_once(args, rng, n)
        events.append(step_event(ts, took, prefill_tokens=n, pairs=n * (n + 1) // 2))
        ts += took * 1e6
        print(f"prefill {n:5d} tokens: {took * 1000:8.1f} ms", flush=True)
    runs = [(b, c) for b in ints(args.decode_batches) for c in ints(args.decode_contexts)]
    runs *= args.decode_repeats
    rng.shuffle(runs)
    for batch, context in runs:
        got = decode_once(args, rng, batch, context)
        if got is None:
            print(f"decode batch {batch:3d} at {context}: too few steps together, skipped", flush=True)
            continue
        step, ctx = got
        events.append(step_event(ts, step, decode_tokens=batch, context=int(ctx)))
        ts += step * 1e6
        print(f"decode batch {batch:3d} at {context:5d}: {step * 1000:8.1f} ms per step", flush=True)
    with open(args.out, "w") as f:
        json.dump({"traceEvents": events}, f)
    print(f"wrote {len(events)} steps to {args.out}")


if __name__ == "__main__":
    main()
