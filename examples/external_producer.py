#!/usr/bin/env python
"""An external rollout producer: ask the trainer for its weight version, load those weights,
generate with our own harness, score, and push version-tagged groups to the store.

    export M2PO_STORE_TOKEN=...   # the store's producer token (push groups, read the version; it cannot set it)
    python examples/external_producer.py --store-url http://127.0.0.1:8765 \\
        --weights-dir runs/x/weights --base-model tiny --rounds 10

``--base-model``: the trainer's base model, an HF directory, or ``tiny`` for the cached tiny base
of ``examples/tiny_cpu.yaml`` (built on first use, as the trainer builds it; another tiny family:
``--tiny-family``). A trainer with ``rollout.source=external`` logs this command with its own
values at start.

Against a trainer started with ``rollout.source=external`` (or ``m2po store serve``). Each
round: ``GET /v1/version`` -> newest ``<weights-dir>/v<N>`` with ``N <= version`` (the base
model is version 0) -> sample ``--n-samples`` responses for each of ``--prompts-per-round``
synthetic arithmetic prompts -> math reward (last ``\\boxed{}``, docs/design.md §3) -> one group per
prompt, every token tagged with ``N`` and its sampling log-prob -> ``POST /v1/groups``.

Generation: an HF model on this machine (default; reloaded when a newer version appears), or
``--engine-url`` for an SGLang-compatible engine (a CPU worker or SGLang, e.g. engines the
trainer updates): then the engine's reported per-token versions (or its ``weight_version``) tag
the tokens (else the version published at submission, the oldest they can come from). See ``megatron_m2po/ingestion/producer.py`` for the protocol.

Exit status: 0 after ``--rounds`` rounds; 3 when the trainer (or store server) is gone - its
port closed or unreachable after the client's retries, as when a run has finished - with one
line saying so on stderr; 4 when the server refused a request (wrong token, a bad group), with
its answer on one line.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
import time
import uuid

import torch

from megatron_m2po.config import DataConfig, ModelConfig, RewardConfig
from megatron_m2po.data import build_prompt_dataset
from megatron_m2po.rewards import get_reward_fn
from megatron_m2po.ingestion.producer import Completion, ExternalProducer, WeightsRef, make_group
from megatron_m2po.store.client import StoreClientError
from megatron_m2po.utils.hf_dir import resolve_model_path

log = logging.getLogger("external_producer")

EXIT_TRAINER_GONE = 3
EXIT_REFUSED = 4


class HFSampler:
    """Samples with an HF causal LM; log-prob of a sampled token = log_softmax(logits / T) (SGLang's)."""

    def __init__(self, seed: int) -> None:
        self.ref: WeightsRef | None = None
        self.model = None
        self.gen = torch.Generator().manual_seed(seed)

    def load(self, producer: ExternalProducer, version: int) -> None:
        """The newest weights at or below ``version`` (re-resolved if the trainer prunes them meanwhile)."""
        from transformers import AutoModelForCausalLM
        if self.ref is not None and self.ref == producer.weights_for(version):
            return
        self.model, self.ref = producer.load_weights(
            version, lambda path: AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval())
        log.info("loaded weights version %d from %s", self.ref.version, self.ref.path)

    @torch.no_grad()
    def sample(self, prompt_ids: list[int], n: int, *, max_new_tokens: int, temperature: float,
               eos_id: int | None) -> list[tuple[list[int], list[float], str]]:
        ids = torch.tensor([prompt_ids] * n)
        out = self.model(input_ids=ids, use_cache=True)
        past, logits = out.past_key_values, out.logits[:, -1].float()
        toks = [[] for _ in range(n)]
        lps = [[] for _ in range(n)]
        done = [False] * n
        for _ in range(max_new_tokens):
            logp = torch.log_softmax(logits / temperature, -1)
            nxt = torch.multinomial(logp.exp(), 1, generator=self.gen)[:, 0]
            for i in range(n):
                if not done[i]:
                    toks[i].append(int(nxt[i]))
                    lps[i].append(float(logp[i, nxt[i]]))
                    done[i] = eos_id is not None and int(nxt[i]) == eos_id
            if all(done):
                break
            out = self.model(input_ids=nxt[:, None], past_key_values=past, use_cache=True)
            past, logits = out.past_key_values, out.logits[:, -1].float()
        return [(t, lp, "stop" if d else "length") for t, lp, d in zip(toks, lps, done)]


async def _engine_sample(url: str, prompt_ids: list[int], n: int, params: dict, version: int):
    from megatron_m2po.rollout.client import SGLangClient
    async with SGLangClient(url) as c:
        outs = await c.generate_many([prompt_ids] * n, params)
    res = []
    for o in outs:
        if o.token_weight_versions is not None and len(o.token_weight_versions) == len(o.output_ids):
            versions = [int(v) for v in o.token_weight_versions]
        else:
            # The trainer pushes to its engines before it publishes a version, so the version it
            # published at submission is the oldest any token can come from (staleness upper bound).
            versions = version
        res.append((list(o.output_ids), list(o.output_logprobs), o.finish_type if o.finish_type in
                    ("stop", "length", "abort") else "stop", versions))
    return res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--store-url", required=True, help="Ingestion endpoint (m2po store serve or the trainer's).")
    p.add_argument("--token-env", default="M2PO_STORE_TOKEN", help="Env var holding the bearer token.")
    p.add_argument("--weights-dir", default=None, help="The trainer's disk weight-sync dir (<run_dir>/weights).")
    p.add_argument("--base-model", required=True,
                   help="HF dir of the base model (version 0) with its tokenizer, or 'tiny': the cached tiny base "
                        "(model.hf_path=tiny, model.tiny_cache_dir's default).")
    p.add_argument("--tiny-family", default="qwen2", choices=("qwen2", "qwen3", "qwen3_moe", "qwen2_tools"),
                   help="With --base-model tiny: model.tiny_family.")
    p.add_argument("--engine-url", default=None, help="Generate through this SGLang-compatible engine instead.")
    p.add_argument("--rounds", type=int, default=1, help="Rounds (each pushes --prompts-per-round groups).")
    p.add_argument("--prompts-per-round", type=int, default=4)
    p.add_argument("--n-samples", type=int, default=4, help="Samples per prompt (the GRPO group size).")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--template", default="synthetic", help="Prompt template (data.template).")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--group-prefix", default=None, help="Group id prefix (default: ext-<random>).")
    p.add_argument("--interval-s", type=float, default=0.0, help="Pause between rounds.")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:  # the trainer's own resolution: 'tiny' -> the cached tiny base (built on first use), else a directory
        args.base_model = resolve_model_path(ModelConfig(hf_path=args.base_model, tiny_family=args.tiny_family),
                                             progress=True)
    except ValueError as e:
        print(f"external_producer: --base-model: {e}", file=sys.stderr, flush=True)
        return 2

    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(args.base_model)
    data = build_prompt_dataset(DataConfig(train="synthetic", template=args.template, synthetic_eval_size=0,
                                           synthetic_num_problems=max(64, args.rounds * args.prompts_per_round)),
                                tokenizer, args.seed)
    reward = get_reward_fn(RewardConfig(num_workers=1))
    producer = ExternalProducer(args.store_url, os.environ.get(args.token_env) or None,
                                weights_dir=args.weights_dir, base_model_path=args.base_model)
    sampler = HFSampler(args.seed) if args.engine_url is None else None
    prefix = args.group_prefix or f"ext-{uuid.uuid4().hex[:8]}"
    eos = tokenizer.eos_token_id
    try:
        for rnd in range(args.rounds):
            version = producer.current_version()
            prompts = data.next_prompts(args.prompts_per_round)
            if sampler is not None:
                sampler.load(producer, version)
                wv, wdir = sampler.ref.version, sampler.ref.path
                outs = [[(*o, wv) for o in sampler.sample(item.prompt_ids, args.n_samples,
                                                          max_new_tokens=args.max_new_tokens,
                                                          temperature=args.temperature, eos_id=eos)]
                        for item in prompts]
            else:
                wdir = args.engine_url
                params = {"temperature": args.temperature, "max_new_tokens": args.max_new_tokens}
                if eos is not None:
                    params["stop_token_ids"] = [int(eos)]
                outs = [asyncio.run(_engine_sample(args.engine_url, item.prompt_ids, args.n_samples, params, version))
                        for item in prompts]
            texts = [tokenizer.decode(o[0], skip_special_tokens=True) for os_ in outs for o in os_]
            answers = [item.answer for item in prompts for _ in range(args.n_samples)]
            scores = reward.score_batch(texts, answers).scores
            groups, k = [], 0
            for item, os_ in zip(prompts, outs):
                comps = []
                for ids, lps, finish, versions in os_:
                    comps.append(Completion(ids, lps, float(scores[k]), versions, finish_reason=finish))
                    k += 1
                groups.append(make_group(f"{prefix}-r{rnd}-p{item.index}", item.prompt_ids, comps,
                                         metadata={"prompt_index": int(item.index), "answer": item.answer,
                                                   "weights": wdir, "producer": "examples/external_producer.py"}))
            res = producer.push(groups)
            log.info("round %d: trainer version %d, pushed %d groups (stored %d, duplicates %d), mean reward %.3f",
                     rnd, version, len(groups), len(res["stored"]), len(res["duplicates"]),
                     float(sum(scores)) / max(len(scores), 1))
            if args.interval_s and rnd + 1 < args.rounds:
                time.sleep(args.interval_s)
    except StoreClientError as e:
        # No status: no answer at all after the client's retries (the trainer finished and closed
        # its port, or never listened there); a status: the server answered and refused.
        if e.status is None:
            print(f"external_producer: the trainer at {args.store_url} is gone or not answering ({e.message}); stopping",
                  file=sys.stderr, flush=True)
            return EXIT_TRAINER_GONE
        print(f"external_producer: {args.store_url} refused the request: {e}", file=sys.stderr, flush=True)
        return EXIT_REFUSED
    finally:
        reward.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
