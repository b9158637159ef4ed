#!/usr/bin/env python3
"""Where the embedded engine's time goes under a run's load: the scheduler driven in-process (no HTTP)
by a closed loop of C clients, each re-submitting as soon as its request ends (prompts of a shared
prefix plus a unique tail, as GRPO groups send them), for a fixed time; then a cProfile of the
scheduler loop under the same load. Reports generated tokens/s, decode steps/s, the mean decode batch,
prefill forwards/s (stats' prefill_forwards, or model calls minus decode steps for a scheduler without
that counter), prefill tokens, and the top functions by own and cumulative time.

Why: on the H200 (session 7) runs generated 100-185 tokens/s with 64-256 episodes in flight, about
what SmolLM2 does on two CPU cores (61 tokens/s at 32 in bench/results/engine.json).

    python3 bench/gpu/engine_profile.py --model smollm2-135m --device cuda --out "$OUT/engine_profile.json"

Models are random-initialised from the registry's configs (no weights to carry): the timing of a
forward does not depend on the values.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from agentrl.rollout.embedded.scheduler import Scheduler  # noqa: E402 - after the path set-up


def build(name: str, device: str, dtype: str):
    import torch
    from transformers import AutoModelForCausalLM

    if name == "tiny":
        from agentrl.models.tiny import build_tiny_model

        model = build_tiny_model(0)
    else:
        from transformers import LlamaConfig

        from agentrl.models.arch import SMOLLM2_135M as a

        narrow = name == a.name + "-narrow"
        assert name == a.name or narrow, name
        # narrow: SmolLM2's 30 layers and head layout at 1/8 of the width and a 4K vocabulary, so that
        # on a CPU, as on the H200, a step costs its ~400 op launches more than its arithmetic: the
        # scheduler's host costs can be measured and compared there.
        # The registry's shapes; the rest (which the registry does not hold) from SmolLM2-135M-Instruct's
        # config.json, since its real config lives in the GGUF this script avoids carrying.
        model = AutoModelForCausalLM.from_config(LlamaConfig(
            vocab_size=4096 if narrow else a.vocab_size, hidden_size=a.hidden_size // (8 if narrow else 1),
            intermediate_size=a.dense_intermediate_size // (8 if narrow else 1),
            num_hidden_layers=a.num_layers, num_attention_heads=a.num_attention_heads, num_key_value_heads=3,
            max_position_embeddings=8192, rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True))
    return model.to(device=device, dtype=getattr(torch, dtype)).eval()


class ClosedLoop:
    """C clients; each submits a new request when its previous one ends, until stopped. With
    turns > 1 a client holds a conversation, as a multi-turn agent does: the next request is the
    last one's prompt, its output and a new observation of `tail` tokens, for `turns` turns; then a
    new conversation starts from the shared prefix."""

    def __init__(self, sched, clients: int, prefix: int, tail: int, new_tokens: int, vocab: int,
                 turns: int = 1, think_s: float = 0.0, min_new_tokens: int | None = None) -> None:
        import random

        from agentrl.rollout.embedded.sampling import RowParams

        self.sched, self.new_tokens, self.vocab, self.turns = sched, new_tokens, vocab, turns
        # An agent's episodes do not answer at once nor stop together: a client waits an exponential
        # time of mean think_s (the sandbox: create, run the command, score) before each request, and
        # each request stops after a length drawn in [min_new_tokens, new_tokens] (an EOS).
        self.think_s, self.min_new = think_s, new_tokens if min_new_tokens is None else min_new_tokens
        self.rng = random.Random(0)
        self.params = RowParams(temperature=1.0, top_p=1.0, top_k=0)
        self.prefixes = [[(7 * g + 13 * j) % (vocab - 10) + 5 for j in range(prefix)] for g in range(max(clients // 8, 1))]
        self.tail, self.n, self.done_tokens, self.stopped = tail, 0, 0, False
        self.prompt_tokens = 0
        self.lock = threading.Lock()
        for c in range(clients):
            self.later(c, self.prefix_of(c), 1)

    def prefix_of(self, client: int) -> list[int]:
        return self.prefixes[client // 8 % len(self.prefixes)]

    def later(self, client: int, context: list[int], turn: int) -> None:
        """Submit now, or after a think time when think_s is set."""
        if self.think_s <= 0:
            return self.submit(client, context, turn)
        with self.lock:
            delay = self.rng.expovariate(1.0 / self.think_s)
        t = threading.Timer(delay, lambda: None if self.stopped else self.submit(client, context, turn))
        t.daemon = True
        t.start()

    def submit(self, client: int, context: list[int], turn: int) -> None:
        from agentrl.rollout.embedded.request import GenRequest

        with self.lock:
            self.n += 1
            n = self.n
            self.prompt_tokens += len(context) + self.tail
            new = self.rng.randint(self.min_new, self.new_tokens)
        ids = context + [(n * 31 + j) % (self.vocab - 10) + 5 for j in range(self.tail)]
        self.sched.submit(GenRequest(rid=f"r{n}", input_ids=ids, max_new_tokens=new, params=self.params,
                                     on_done=lambda out, c=client, t=turn, p=ids: self.on_done(c, t, p, out),
                                     ignore_eos=True))

    def on_done(self, client: int, turn: int, prompt: list[int], out) -> None:
        with self.lock:
            self.done_tokens += len(out.output_ids)
        if self.stopped:
            return
        if turn < self.turns and not out.error:
            self.later(client, prompt + list(out.output_ids), turn + 1)
        else:
            self.later(client, self.prefix_of(client), 1)


def same_greedy(model, args, static: int) -> dict:
    """Greedy outputs of 24 requests of different lengths through a batch of at most 8 rows (so that
    requests join a running batch and leave it out of order), eager against static decode (CUDA
    graphs on a GPU): whether every token matches, the largest logprob difference, and the static
    decoder's counters (in-place joins and removes, shifts)."""
    from concurrent.futures import Future

    from agentrl.rollout.embedded.graphs import unsupported_reason
    from agentrl.rollout.embedded.request import GenRequest
    from agentrl.rollout.embedded.sampling import RowParams

    why = unsupported_reason(model)
    if why:
        return {"available": False, "why": why}
    vocab = model.get_output_embeddings().weight.shape[0]
    greedy = RowParams(temperature=0.0, top_p=1.0, top_k=0)
    outs = []
    for length in (0, static):
        sched = Scheduler(model, max_batch_size=8, static_decode_len=length)
        sched.start()
        futs = []
        for i in range(min(args.max_batch_size, 24)):
            fut: Future = Future()
            prompt = [(11 * i + 3 * j) % (vocab - 10) + 5 for j in range(16 + 9 * i)]
            sched.submit(GenRequest(rid=f"g{i}", input_ids=prompt, max_new_tokens=8 + 2 * i, params=greedy,
                                    on_done=fut.set_result, ignore_eos=True))
            futs.append(fut)
        outs.append([f.result(timeout=300) for f in futs])
        counters = {k: v for k, v in sched.stats().items() if k in ("adopts", "joins_in_place", "removes_in_place",
                                                                    "left_shifts", "right_shifts", "static_steps")}
        sched.stop()
    tokens = all(a.output_ids == b.output_ids for a, b in zip(*outs))
    diff = max(abs(x - y) for a, b in zip(*outs) for x, y in zip(a.logprobs, b.logprobs))
    return {"available": True, "tokens_equal": tokens, "max_logprob_diff": diff, "static_counters": counters}


def measure(args, name: str) -> dict:
    import torch

    model = build(name, args.device, args.dtype)
    vocab = model.get_output_embeddings().weight.shape[0]
    # Every model call, counted outside the scheduler, so a scheduler without the prefill_forwards
    # counter (an older checkout measured with this script) still reports its prefill forwards.
    calls = [0]
    model.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    out: dict = {"model": name}
    for static in sorted({s for s, _ in args.variant} - {0}):
        out[f"static{static}_matches_eager"] = same_greedy(model, args, static)
        print(name, f"static {static} vs eager:", json.dumps(out[f"static{static}_matches_eager"]), flush=True)
    for (static, wait), clients in [(v, c) for v in args.variant for c in args.clients]:
        key = str(clients) + (f"_static{static}" if static else "") + (f"_wait{wait}" if wait else "")
        sched = Scheduler(model, max_batch_size=args.max_batch_size, static_decode_len=static, admit_wait_steps=wait)
        sched.start()
        load = ClosedLoop(sched, clients, args.prefix_tokens, args.tail_tokens, args.new_tokens, vocab, args.turns,
                          args.think_s, args.min_new_tokens)
        time.sleep(args.warmup_s)
        s0, t0, g0, c0, cpu0 = sched.stats(), time.perf_counter(), load.done_tokens, calls[0], time.process_time()
        n0, p0 = load.n, load.prompt_tokens
        time.sleep(args.seconds)
        s1, dt, c1, cpu = sched.stats(), time.perf_counter() - t0, calls[0], time.process_time() - cpu0
        n1, p1 = load.n, load.prompt_tokens
        load.stopped = True
        sched.stop()
        d = {k: s1[k] - s0[k] for k in s1 if isinstance(s1[k], int | float) and k in s0}
        steps, gen, requests = d["decode_steps"], d["generated_tokens"], d["requests_done"]
        prefills = d.get("prefill_forwards", c1 - c0 - steps)
        out[key] = {"tokens_per_s": gen / dt, "finished_tokens_per_s": (load.done_tokens - g0) / dt,
                             "decode_steps_per_s": steps / dt, "mean_decode_batch": gen / max(steps, 1),
                             "prefill_forwards_per_s": prefills / dt, "model_forwards_per_s": (c1 - c0) / dt,
                             "requests_per_prefill_forward": requests / max(prefills, 1),
                             "prefill_tokens_per_s": d["prefill_tokens"] / dt,
                             "prefill_pad_tokens_per_s": d.get("prefill_pad_tokens", 0) / dt,
                             "requests_per_s": requests / dt,
                             # CPU seconds this process used: on a shared CPU machine tokens per CPU
                             # second moves less with the neighbours' load than tokens per second.
                             "cpu_util": cpu / dt, "tokens_per_cpu_s": gen / max(cpu, 1e-9),
                             "static_steps_per_s": d.get("static_steps", 0) / dt,
                             "graphs_captured": s1.get("graphs_captured", 0),
                             "mean_prompt_tokens": (p1 - p0) / max(n1 - n0, 1),
                             "cached_tokens_per_s": d.get("cached_tokens", 0) / dt}
        print(name, key, json.dumps({k: round(v, 1) for k, v in out[key].items()}), flush=True)
    # The profile: the loop run on this thread (cProfile sees one thread), stopped by a timer; the
    # last variant's settings, at the most clients.
    clients, (static, wait) = max(args.clients), args.variant[-1]
    sched = Scheduler(model, max_batch_size=args.max_batch_size, static_decode_len=static, admit_wait_steps=wait)
    load = ClosedLoop(sched, clients, args.prefix_tokens, args.tail_tokens, args.new_tokens, vocab, args.turns,
                      args.think_s, args.min_new_tokens)
    timer = threading.Timer(args.seconds, lambda: (setattr(load, "stopped", True), sched.stop(0)))
    timer.start()
    prof = cProfile.Profile()
    prof.enable()
    sched._loop()
    prof.disable()
    if args.device == "cuda":
        torch.cuda.synchronize()
    for key in ("tottime", "cumulative"):
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats(key).print_stats(28)
        out[f"profile_{key}"] = buf.getvalue().splitlines()[-34:]
        print("\n".join(out[f"profile_{key}"]), flush=True)
    return out


def variant(text: str) -> tuple[int, int]:
    try:
        static, wait = (int(x) for x in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--variant {text!r}: want STATIC:WAIT, two integers, e.g. 1024:8") from None
    return static, wait


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", action="append", help="repeatable: smollm2-135m, smollm2-135m-narrow (host-bound "
                    "on a CPU), tiny (default: smollm2-135m and tiny)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--clients", type=int, action="append", help="repeatable (default: 8, 32, 64)")
    ap.add_argument("--max-batch-size", type=int, default=64)
    ap.add_argument("--prefix-tokens", type=int, default=400)
    ap.add_argument("--tail-tokens", type=int, default=40)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--turns", type=int, default=1,
                    help="turns per client conversation (each re-sends its context: prefix-cache hits)")
    ap.add_argument("--think-s", type=float, default=0.0,
                    help="mean time (exponential) a client waits before each request, as an episode waits on its "
                         "sandbox; 0: at once (the clients stay in step)")
    ap.add_argument("--min-new-tokens", type=int, default=None,
                    help="each request stops after a length drawn in [this, --new-tokens] (an EOS); default: "
                         "--new-tokens")
    ap.add_argument("--warmup-s", type=float, default=4.0)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--variant", action="append", type=variant, metavar="STATIC:WAIT",
                    help="repeatable: a scheduler setting, rollout.embedded.static_decode_len (KV columns of static "
                         "decode, CUDA graphs on a GPU; 0 = eager) and admit_wait_steps; default 0:0")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    args.model = args.model or ["smollm2-135m", "tiny"]
    args.clients = args.clients or [8, 32, 64]
    args.variant = args.variant or [(0, 0)]
    import platform

    import torch

    report = {"what": "embedded engine scheduler under a closed-loop load, in-process", "settings": vars(args) | {
        "out": str(args.out)}, "machine": {"gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
                                           "platform": platform.platform()},
        "versions": {"torch": torch.__version__, "transformers": __import__("transformers").__version__},
        "models": [measure(args, m) for m in args.model]}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
