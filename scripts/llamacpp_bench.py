#!/usr/bin/env python3
"""llama.cpp's speed on a GGUF, in the shapes pdserve's `engine_bench` measures.

Four numbers, tokens per second by wall clock, median over --repeat runs:
  prefill         a ~500-token prompt (a repeated paragraph) in one batch
  decode_b1       greedy steps at batch 1 after a 64-token prompt
  decode_b1_long  greedy steps at batch 1 after the long prompt
  decode_bN       N sequences of a 64-token prompt, one token each per step

Needs llama-cpp-python (0.3.x). Build it for the machine it runs on, e.g.
  CMAKE_ARGS="-DGGML_NATIVE=ON" pip install --no-binary llama-cpp-python llama-cpp-python==0.3.36 numpy
Run it alone: llama.cpp and pdserve both spin-wait their threads.
"""
import argparse
import json
import os
import statistics
import time

import llama_cpp as L
import numpy as np

PARAGRAPH = ("The history of the city begins with a small settlement by the river, where "
             "traders met to exchange grain, salt and cloth. Over the centuries it grew into "
             "a market town, then a centre of learning with libraries and workshops. ")


class Engine:
    """One llama.cpp context with room for `seqs` sequences in a unified KV cache."""

    def __init__(self, path, threads, seqs):
        L.llama_backend_init()
        self.model = L.llama_model_load_from_file(path.encode(), L.llama_model_default_params())
        if not self.model:
            raise SystemExit(f"cannot load {path}")
        params = L.llama_context_default_params()
        params.n_ctx, params.n_batch, params.n_ubatch = 4096, 512, 512
        params.n_seq_max = seqs
        params.n_threads = params.n_threads_batch = threads
        if hasattr(params, "kv_unified"):
            params.kv_unified = True  # one KV pool for all sequences, as pdserve's
        self.ctx = L.llama_init_from_model(self.model, params)
        self.vocab = L.llama_model_get_vocab(self.model)
        self.n_vocab = L.llama_vocab_n_tokens(self.vocab)
        self.batch = L.llama_batch_init(512, 0, seqs)

    def tokens(self, n):
        """The first `n` tokens of the paragraph repeated."""
        raw = (PARAGRAPH * (1 + n // 20)).encode()  # the paragraph is ~45 tokens
        buf = (L.llama_token * (len(raw) + 8))()
        got = L.llama_tokenize(self.vocab, raw, len(raw), buf, len(buf), False, False)
        if got < n:
            raise SystemExit(f"tokenizing the prompt gave {got} tokens, want {n}")
        return list(buf[:n])

    def reset(self):
        L.llama_memory_clear(L.llama_get_memory(self.ctx), True)

    def step(self, rows):
        """Runs one batch of (token, position, sequence) rows; returns each row's greedy
        next token."""
        b = self.batch
        b.n_tokens = len(rows)
        for i, (tok, pos, seq) in enumerate(rows):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = tok, pos, 1, True
            b.seq_id[i][0] = seq
        if L.llama_decode(self.ctx, b) != 0:
            raise RuntimeError("llama_decode failed")
        return [self.greedy(i) for i in range(len(rows))]

    def prefill(self, ids, seq=0):
        """The prompt in one batch; returns the next token (only the last row's logits)."""
        b = self.batch
        b.n_tokens = len(ids)
        for p, tok in enumerate(ids):
            b.token[p], b.pos[p], b.n_seq_id[p], b.logits[p] = tok, p, 1, p == len(ids) - 1
            b.seq_id[p][0] = seq
        if L.llama_decode(self.ctx, b) != 0:
            raise RuntimeError("llama_decode failed")
        return self.greedy(len(ids) - 1)

    def greedy(self, row):
        logits = np.ctypeslib.as_array(L.llama_get_logits_ith(self.ctx, row), shape=(self.n_vocab,))
        return int(np.argmax(logits))

    def decode(self, nexts, start, steps):
        """`steps` greedy steps for sequences 0..len(nexts) from position `start`; tok/s."""
        t = time.perf_counter()
        for k in range(steps):
            nexts = self.step([(tok, start + k, s) for s, tok in enumerate(nexts)])
        return len(nexts) * steps / (time.perf_counter() - t)


def main():
    home = os.environ.get("PDSERVE_HOME", os.path.expanduser("~/.cache/pdserve"))
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=os.path.join(home, "models", "SmolLM2-135M-Instruct.Q4_1.gguf"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt-tokens", type=int, default=500)
    ap.add_argument("--decode-steps", type=int, default=32)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()

    e = Engine(a.model, a.threads, max(1, a.batch))
    long_ids = e.tokens(a.prompt_tokens)
    short = long_ids[:64]
    runs = {"prefill": [], "decode_b1": [], "decode_b1_long": [], f"decode_b{a.batch}": []}
    for _ in range(a.repeat):
        e.reset()
        t = time.perf_counter()
        nxt = e.prefill(long_ids)
        runs["prefill"].append(len(long_ids) / (time.perf_counter() - t))
        runs["decode_b1_long"].append(e.decode([nxt], len(long_ids), a.decode_steps))
        e.reset()
        runs["decode_b1"].append(e.decode([e.prefill(short)], len(short), a.decode_steps))
        e.reset()
        nexts = [e.prefill(short, seq=s) for s in range(a.batch)]
        runs[f"decode_b{a.batch}"].append(e.decode(nexts, len(short), a.decode_steps))

    print(f"llama.cpp {L.__version__}, {os.path.basename(a.model)}, {a.threads} threads, "
          f"{len(long_ids)}-token prompt, median of {a.repeat}")
    medians = {k: round(statistics.median(v), 1) for k, v in runs.items()}
    for k, v in runs.items():
        print(f"  {k:<15} {medians[k]:>8.1f} tok/s   (min {min(v):.1f}, max {max(v):.1f})")
    print(json.dumps({"engine": "llama.cpp", "version": L.__version__, **medians}))


if __name__ == "__main__":
    main()
