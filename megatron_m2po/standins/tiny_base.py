"""The tiny CPU base model: a byte-level BPE tokenizer and a Qwen2-shaped model, warmed up on
the synthetic arithmetic task so that RL starts with headroom.

``ensure_tiny_base(cache_dir)`` returns a local HF model directory (``config.json``,
``model.safetensors`` in float32, ``tokenizer.json`` + ``tokenizer_config.json``, and
``m2po_tiny.json`` with the prompt format, the task knobs and the measured base accuracy).
The build is deterministic (fixed seeds, deterministic data, one CPU thread) and cached: the
directory name carries a hash of every build parameter, a marker file is written last, and the
build happens in a temporary directory renamed into place, under a file lock so concurrent
ranks build once.

Format (the RL prompts must use the same one; see ``m2po_tiny.json``)::

    prompt   = PROMPT_TEMPLATE.format(problem="12+7")     -> "12+7="
    response = RESPONSE_TEMPLATE.format(answer="19")      -> "\\boxed{19}"  (then </s>)

``data.template=synthetic`` renders exactly this prompt. The warm-up also trains on the ``=``,
so ``data.template=raw`` (prompt ``"12+7"``) works as well: the model first emits ``=``.
``paper`` / ``chat`` prompts encode (any text does: byte-level) but are far from the warm-up.

Task: :class:`megatron_m2po.data.synthetic.SyntheticTask` with ``DataConfig``'s default knobs
(two operands 0..20, ``+-``); the warm-up draws its own stream of problems from it. The task
has only 882 distinct problems, so the RL run's held-out problems were seen in the warm-up;
the base accuracy is therefore "accuracy on the task distribution", not generalisation.

Warm-up: supervised next-token training on the response tokens, with sampled accuracy at
temperature 1 (the RL sampling setting) measured every ``eval_every`` steps; at the first
check at or above ``target_acc`` a second, larger set confirms it (the first crossing is
biased upward by noise) and training stops on the pooled estimate. The final accuracy is
measured on a third, separately seeded set and stored in ``m2po_tiny.json``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import logging
import os
import random
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

from megatron_m2po.data.synthetic import SyntheticTask
from megatron_m2po.rewards.extract import extract_last_boxed
from megatron_m2po.standins.sft import sft_step

if TYPE_CHECKING:  # torch is imported where it is used: `import megatron_m2po.standins.tiny_base` stays light
    import torch

log = logging.getLogger(__name__)

PROMPT_TEMPLATE = "{problem}="
RESPONSE_TEMPLATE = "\\boxed{{{answer}}}"
CHAT_TEMPLATE = ("{% for message in messages %}{{ message['content'] }}{% endfor %}"
                 "{% if add_generation_prompt %}={% endif %}")
MERGED_WORD = "boxed"
# Qwen2's pre-tokenizer split (transformers' Qwen2Tokenizer uses the same pattern).
QWEN2_SPLIT_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                     r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
PAD, BOS, EOS, UNK = "<pad>", "<s>", "</s>", "<unk>"
VOCAB_SIZE = 384  # 4 specials + 256 bytes + 4 merges, reserved tokens fill it; divisible by 128
META_FILE = "m2po_tiny.json"
MARKER_FILE = ".complete"
FORMAT_VERSION = 3  # bump when the build procedure changes in a way the parameters do not show


# The warm-up task is the data module's synthetic task with DataConfig's default knobs.
TinyTask = SyntheticTask


FAMILIES = ("qwen2", "qwen3", "qwen3_moe", "qwen2_tools")
# The qwen3_moe family: the warmed-up qwen3 base upcycled (standins/tiny_moe.py), no further
# training. A little expert noise makes the experts (and so the routing) matter from the start.
MOE_UPCYCLING = {"num_experts": 4, "top_k": 2, "router_std": 0.02, "expert_noise": 0.01, "seed": 0}


@dataclass(frozen=True)
class TinyModelSpec:
    """Shape of the model (untied embeddings: the safest layout for mbridge).

    ``family``: ``"qwen2"`` (Qwen2 / Qwen2.5: q/k/v biases) or ``"qwen3"`` (Qwen3: no q/k/v
    biases, RMSNorm on queries and keys per head, explicit ``head_dim``); the rest of the shape
    is shared, so the two differ exactly where the real families differ. ``"qwen3_moe"``: the
    qwen3 base upcycled into a ``Qwen3MoeForCausalLM`` (``MOE_UPCYCLING``; every MLP becomes
    ``num_experts`` experts of ``intermediate_size``)."""

    family: str = "qwen2"
    hidden_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 256
    max_position_embeddings: int = 1024
    rope_theta: float = 10000.0


@dataclass(frozen=True)
class WarmupSpec:
    """Supervised warm-up and the stopping rule."""

    batch_size: int = 64
    lr: float = 2e-3
    max_steps: int = 3000
    eval_every: int = 25
    eval_problems: int = 256
    confirm_problems: int = 512
    target_acc: float = 0.3
    final_eval_problems: int = 1024
    max_new_tokens: int = 12


@dataclass(frozen=True)
class TinyBaseSpec:
    task: SyntheticTask = field(default_factory=SyntheticTask)
    model: TinyModelSpec = field(default_factory=TinyModelSpec)
    warmup: WarmupSpec = field(default_factory=WarmupSpec)
    seed: int = 0

    def digest(self) -> str:
        fields = dataclasses.asdict(self)
        if fields["model"]["family"] == "qwen2":  # the Qwen2 base keeps the digest it had before families
            del fields["model"]["family"]
        if fields["model"].get("family") == "qwen2_tools":
            from megatron_m2po.standins.tiny_tools import ToolWarmupSpec  # the fine-tune is part of the build
            fields["tool_warmup"] = dataclasses.asdict(ToolWarmupSpec(seed=self.seed))
        blob = json.dumps({"format": FORMAT_VERSION, **fields}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:12]


TEACHER_TARGET_ACC = 0.5


def teacher_spec(spec: TinyBaseSpec) -> TinyBaseSpec:
    """The tiny task's distillation teacher (``model.hf_path`` / ``algo.distill.teacher`` =
    ``tiny-teacher``): ``spec``'s base with its warm-up run on until the held-out sampled accuracy
    reaches :data:`TEACHER_TARGET_ACC` instead of the base's 0.3 (same seed, data order and
    tokenizer, so its first steps are the base's; measured: 700 steps, 0.52 at T=1 against the
    base's 0.35 after 500). Its own cache entry (the warm-up is part of the digest). Dense families
    only: the MoE base is upcycled from the dense one, the tool base fine-tuned from it."""
    if spec.model.family not in ("qwen2", "qwen3"):
        raise ValueError(f"model.tiny_family={spec.model.family}: the tiny teacher is built for the dense families "
                         "(qwen2, qwen3)")
    return dataclasses.replace(spec, warmup=dataclasses.replace(spec.warmup, target_acc=TEACHER_TARGET_ACC))


# --------------------------------------------------------------------------------------------
# Task


def make_problems(n: int, seed: int | str, task: SyntheticTask) -> list[dict[str, str]]:
    """``n`` problems in the DeepScaleR schema ({problem, answer}), deterministic in ``seed``."""
    return [dict(r) for r in task.generate(n, f"tiny-base:{seed}")]


def format_prompt(problem: str) -> str:
    return PROMPT_TEMPLATE.format(problem=problem)


def format_response(answer: str) -> str:
    return RESPONSE_TEMPLATE.format(answer=answer)


# --------------------------------------------------------------------------------------------
# Tokenizer


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2 / Qwen byte-level alphabet: every byte maps to one printable unicode character."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def build_tokenizer():
    """A Qwen2-style byte-level BPE tokenizer of ``VOCAB_SIZE`` ids, tiny vocabulary.

    The pipeline (NFC, Qwen2's split regex, byte-level) is exactly the one transformers'
    ``Qwen2Tokenizer`` rebuilds from ``tokenizer.json`` (transformers 5 forces that class for
    ``model_type=qwen2``), so every loader gives the same ids. ids: 0 <pad>, 1 <s>, 2 </s>,
    3 <unk>, then the 256 bytes, then the merges of "boxed" (so a response is
    "\\", "boxed", "{", digits, "}"), then reserved special tokens up to ``VOCAB_SIZE``.
    Digits are always single tokens (Qwen2's regex splits them). Nothing is added on encode.
    """
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = [PAD, BOS, EOS, UNK]
    vocab = {t: i for i, t in enumerate(specials)}
    for ch in _bytes_to_unicode().values():
        vocab[ch] = len(vocab)
    merges = []
    for i in range(2, len(MERGED_WORD) + 1):
        left, right = MERGED_WORD[:i - 1], MERGED_WORD[i - 1]
        merges.append((left, right))
        vocab[left + right] = len(vocab)
    reserved = [f"<|reserved_{i}|>" for i in range(VOCAB_SIZE - len(vocab))]
    for t in reserved:
        vocab[t] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, dropout=None, unk_token=None,
                               continuing_subword_prefix="", end_of_word_suffix="",
                               fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials + reserved])
    assert tok.get_vocab_size() == VOCAB_SIZE, tok.get_vocab_size()
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS,
                                 pad_token=PAD, unk_token=UNK, model_max_length=1024)
    hf.chat_template = CHAT_TEMPLATE
    return hf


# --------------------------------------------------------------------------------------------
# Model and warm-up


def _build_model(spec: TinyModelSpec, tokenizer):
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    if spec.family not in FAMILIES:
        raise ValueError(f"TinyModelSpec.family={spec.family!r}: use one of {FAMILIES}")
    common = dict(
        vocab_size=VOCAB_SIZE, hidden_size=spec.hidden_size, intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers, num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads, max_position_embeddings=spec.max_position_embeddings,
        rope_theta=spec.rope_theta, rms_norm_eps=1e-6, tie_word_embeddings=False,
        use_sliding_window=False, attention_dropout=0.0,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    if spec.family == "qwen3":
        cfg = Qwen3Config(head_dim=spec.hidden_size // spec.num_heads, attention_bias=False, **common)
        cfg.architectures = ["Qwen3ForCausalLM"]
        return Qwen3ForCausalLM(cfg).to(torch.float32)
    cfg = Qwen2Config(**common)
    cfg.architectures = ["Qwen2ForCausalLM"]
    model = Qwen2ForCausalLM(cfg).to(torch.float32)
    return model


def _encode_examples(rows: list[dict[str, str]], tokenizer) -> tuple["torch.Tensor", ...]:
    """Right-padded [B, T] ids, attention mask, and loss mask (on "=" + response + </s>)."""
    import torch

    seqs, masks = [], []
    for r in rows:
        p = tokenizer.encode(r["problem"], add_special_tokens=False)
        resp = tokenizer.encode("=" + format_response(r["answer"]), add_special_tokens=False)
        seqs.append(p + resp + [tokenizer.eos_token_id])
        masks.append([0] * len(p) + [1] * (len(resp) + 1))
    T = max(map(len, seqs))
    ids = torch.full((len(seqs), T), tokenizer.pad_token_id, dtype=torch.long)
    attn = torch.zeros((len(seqs), T), dtype=torch.long)
    lmask = torch.zeros((len(seqs), T), dtype=torch.float32)
    for i, (s, m) in enumerate(zip(seqs, masks)):
        ids[i, :len(s)] = torch.tensor(s)
        attn[i, :len(s)] = 1
        lmask[i, :len(m)] = torch.tensor(m, dtype=torch.float32)
    return ids, attn, lmask


def sample_responses(model, tokenizer, prompts: list[str], *, max_new_tokens: int,
                     temperature: float = 1.0, seed: int = 0) -> list[str]:
    """Sample continuations at ``temperature`` (full vocabulary, no top-k/p), left-padded batch.

    Recomputes the whole (short) sequence each step: simpler than a KV cache and fast for the
    tiny model. Returns the decoded responses up to (not including) ``</s>``.
    """
    enc = [tokenizer.encode(p, add_special_tokens=False) for p in prompts]
    out = sample_ids(model, tokenizer, enc, max_new_tokens=max_new_tokens, temperature=temperature, seed=seed)
    return [tokenizer.decode([t for t in o if t != tokenizer.eos_token_id], skip_special_tokens=True) for o in out]


def sample_ids(model, tokenizer, enc: list[list[int]], *, max_new_tokens: int, temperature: float = 1.0,
               seed: int = 0) -> list[list[int]]:
    """:func:`sample_responses` on token ids: the sampled ids of each prompt, ``</s>`` included
    when sampled (as an engine's ``output_ids`` hold it)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    B, L = len(enc), max(map(len, enc))
    ids = torch.full((B, L), tokenizer.pad_token_id, dtype=torch.long)
    attn = torch.zeros((B, L), dtype=torch.long)
    for i, e in enumerate(enc):
        ids[i, L - len(e):] = torch.tensor(e)
        attn[i, L - len(e):] = 1
    done = torch.zeros(B, dtype=torch.bool)
    out: list[list[int]] = [[] for _ in range(B)]
    with torch.no_grad():
        for _ in range(max_new_tokens):
            pos = (attn.cumsum(-1) - 1).clamp(min=0)
            logits = model(input_ids=ids, attention_mask=attn, position_ids=pos).logits[:, -1, :]
            probs = torch.softmax(logits.float() / temperature, dim=-1)
            nxt = torch.multinomial(probs, 1, generator=gen).squeeze(-1)
            for i in range(B):
                if not done[i]:
                    out[i].append(int(nxt[i]))
                    done[i] = nxt[i].item() == tokenizer.eos_token_id
            if bool(done.all()):
                break
            ids = torch.cat([ids, nxt[:, None]], dim=1)
            attn = torch.cat([attn, torch.ones((B, 1), dtype=torch.long)], dim=1)
    return out


def sampled_accuracy(model, tokenizer, rows: list[dict[str, str]], *, seed: int,
                     max_new_tokens: int = 12, batch: int = 256) -> float:
    """Fraction of ``rows`` whose sampled (T=1) response boxes the exact answer.

    The answer is read as the reward reads it (``rewards/extract.extract_last_boxed``). Where that
    differs from a plain last ``\\boxed{...}`` regex -- an empty box, ``\\boxed 5`` without
    braces, an unclosed last box, nesting, ``\\fbox`` -- the tiny task's integer answers compare
    the same way on every response a default build samples (its weights and accuracy are unchanged)."""
    correct = 0
    for s in range(0, len(rows), batch):
        chunk = rows[s:s + batch]
        resp = sample_responses(model, tokenizer, [format_prompt(r["problem"]) for r in chunk],
                                max_new_tokens=max_new_tokens, seed=seed + s)
        correct += sum(extract_last_boxed(t) == r["answer"] for t, r in zip(resp, chunk))
    return correct / max(len(rows), 1)


@contextlib.contextmanager
def _single_thread() -> Iterator[None]:
    """One intra-op thread: bitwise-reproducible reductions, and polite on shared machines."""
    import torch

    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(prev)


@contextlib.contextmanager
def _quiet_transformers(quiet: bool) -> Iterator[None]:
    """Hide transformers' own save/load progress bars when our progress is off."""
    from transformers.utils import logging as hf_logging

    was_disabled = not hf_logging.is_progress_bar_enabled()
    if quiet:
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if quiet and not was_disabled:
            hf_logging.enable_progress_bar()


def _warmup(model, tokenizer, spec: TinyBaseSpec, progress: bool) -> dict:
    import torch

    w = spec.warmup
    torch.manual_seed(spec.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=w.lr, betas=(0.9, 0.98), weight_decay=0.0)
    eval_rows = make_problems(w.eval_problems, f"check:{spec.seed}", spec.task)
    confirm_rows = make_problems(w.confirm_problems, f"confirm:{spec.seed}", spec.task)
    train_rng = random.Random(f"tiny-base:train:{spec.seed}")
    history: list[tuple[int, float]] = []
    bar = _progress_bar(w.max_steps, progress)
    step, acc = 0, 0.0
    t0 = time.monotonic()
    try:
        for step in range(1, w.max_steps + 1):
            model.train()
            rows = [spec.task.sample(train_rng) for _ in range(w.batch_size)]
            ids, attn, lmask = _encode_examples(rows, tokenizer)
            loss = sft_step(model, opt, ids, attn, lmask)
            if step % w.eval_every == 0:
                model.eval()
                acc = sampled_accuracy(model, tokenizer, eval_rows, seed=spec.seed + step,
                                       max_new_tokens=w.max_new_tokens)
                if acc >= w.target_acc and w.confirm_problems:
                    # The first crossing is biased upward by noise: confirm on fresh problems
                    # and stop on the pooled estimate.
                    conf = sampled_accuracy(model, tokenizer, confirm_rows, seed=spec.seed - step,
                                            max_new_tokens=w.max_new_tokens)
                    n0, n1 = len(eval_rows), len(confirm_rows)
                    acc = (acc * n0 + conf * n1) / (n0 + n1)
                history.append((step, round(acc, 4)))
                bar.set_postfix(loss=f"{loss.item():.3f}", acc=f"{acc:.2f}")
                if acc >= w.target_acc:
                    bar.update(1)
                    stop_early(bar, "tiny base warm-up", step, w.max_steps,
                               f"held-out sampled accuracy {acc:.3f} reached the target {w.target_acc:.2f}")
                    break
            bar.update(1)
    finally:
        bar.close()
    model.eval()
    final_rows = make_problems(w.final_eval_problems, f"final:{spec.seed}", spec.task)
    final_acc = sampled_accuracy(model, tokenizer, final_rows, seed=spec.seed + 7,
                                 max_new_tokens=w.max_new_tokens)
    return {"steps": step, "check_acc": acc, "base_accuracy_t1": final_acc,
            "warmup_seconds": round(time.monotonic() - t0, 1), "history": history,
            "reached_target": acc >= w.target_acc}


def stop_early(bar, what: str, step: int, max_steps: int, why: str) -> None:
    """End ``bar`` at ``step`` of its ``max_steps``, saying why: a bar left at ``17% 499/3000``
    reads as a crash. The bar is completed at ``step`` and the reason is logged."""
    bar.total = step
    bar.set_description_str(f"{what} (done early)")
    bar.refresh()
    log.info("%s: stopped at step %d of at most %d: %s", what, step, max_steps, why)


def _progress_bar(total: int, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="tiny base warm-up", disable=not enabled, leave=False,
                dynamic_ncols=True)


# --------------------------------------------------------------------------------------------
# Build + cache


def build_tiny_base(out_dir: str | os.PathLike, spec: TinyBaseSpec | None = None, *,
                    progress: bool = True) -> dict:
    """Build the tokenizer and warmed-up model into ``out_dir`` (created); returns the metadata."""
    import torch

    spec = spec or TinyBaseSpec()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with _single_thread(), _quiet_transformers(not progress):
        tokenizer = build_tokenizer()
        torch.manual_seed(spec.seed)
        model = _build_model(spec.model, tokenizer)
        stats = _warmup(model, tokenizer, spec, progress)
        _save_model(model, out)
        tokenizer.save_pretrained(out)
    _portable_tokenizer_config(out)
    n_params = sum(p.numel() for p in model.parameters())
    meta = {
        "format_version": FORMAT_VERSION,
        "digest": spec.digest(),
        "model_sha256": _sha256(out / "model.safetensors"),
        "prompt_template": PROMPT_TEMPLATE,
        "response_template": RESPONSE_TEMPLATE,
        "data_template": "synthetic",
        "example": {"problem": "12+7", "prompt": format_prompt("12+7"),
                    "response": format_response("19")},
        "eos_token": EOS,
        "task": dataclasses.asdict(spec.task),
        "model": dataclasses.asdict(spec.model),
        "warmup": dataclasses.asdict(spec.warmup),
        "seed": spec.seed,
        "num_parameters": n_params,
        "vocab_size": VOCAB_SIZE,
        "base_accuracy_t1": stats["base_accuracy_t1"],
        "base_accuracy_eval_problems": spec.warmup.final_eval_problems,
        **{k: v for k, v in stats.items() if k != "base_accuracy_t1"},
    }
    (out / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")
    if not stats["reached_target"]:
        log.warning("tiny base: held-out accuracy %.3f never reached the target %.2f in %d steps",
                    stats["check_acc"], spec.warmup.target_acc, stats["steps"])
    return meta


def _save_model(model, out: Path) -> None:
    """HF layout (config.json, generation_config.json, model.safetensors) written directly:
    ``save_pretrained`` silently writes nothing on ranks other than 0 once torch.distributed is
    initialised, and any rank may be the one that wins the build lock."""
    from safetensors.torch import save_file

    model.config.save_pretrained(out)
    model.generation_config.save_pretrained(out)
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _portable_tokenizer_config(out: Path) -> None:
    """Declare the class real Qwen2 checkpoints declare (5.x writes its generic backend name)."""
    p = out / "tokenizer_config.json"
    cfg = json.loads(p.read_text())
    cfg["tokenizer_class"] = "Qwen2Tokenizer"
    cfg.setdefault("chat_template", CHAT_TEMPLATE)
    p.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def tiny_base_path(cache_dir: str | os.PathLike, spec: TinyBaseSpec | None = None) -> Path:
    """Where ``ensure_tiny_base`` puts (or finds) the model for ``spec``."""
    spec = spec or TinyBaseSpec()
    return Path(cache_dir).expanduser() / f"{spec.model.family}-tiny-{spec.digest()}"


def is_complete(path: str | os.PathLike) -> bool:
    p = Path(path)
    return (p / MARKER_FILE).is_file() and (p / META_FILE).is_file()


def ensure_tiny_base(cache_dir: str | os.PathLike, *, seed: int = 0, progress: bool = True,
                     spec: TinyBaseSpec | None = None) -> Path:
    """Return the tiny base model directory under ``cache_dir``, building it on first use.

    ``spec`` overrides the defaults (tests use a smaller warm-up); ``seed`` is used when
    ``spec`` is not given. Safe to call from several processes at once: one builds (under a
    lock on ``cache_dir/.lock``), the others wait and reuse.
    """
    spec = spec or TinyBaseSpec(seed=seed)
    final = tiny_base_path(cache_dir, spec)
    if is_complete(final):
        return final
    if spec.model.family == "qwen3_moe":
        return _ensure_upcycled(cache_dir, spec, final, progress)
    if spec.model.family == "qwen2_tools":  # the qwen2 base fine-tuned to call a calculator (standins/tiny_tools.py)
        return _ensure_tool_base(cache_dir, spec, final, progress)
    root = final.parent
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"cannot create the tiny base cache directory {root}: {e}; set "
                         f"model.tiny_cache_dir to a writable path") from e
    with open(root / ".lock", "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("waiting for another process that is building the tiny base model in %s", root)
            fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if is_complete(final):
                return final
            if final.exists():  # a build that died after the rename but before the marker
                shutil.rmtree(final)
            tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=root))
            try:
                log.info("building the tiny base model into %s (one-time, about a minute)", final)
                meta = build_tiny_base(tmp, spec, progress=progress)
                (tmp / MARKER_FILE).write_text(meta["digest"] + "\n")
                tmp.chmod(0o755)  # mkdtemp makes it private; the cache may be shared
                os.replace(tmp, final)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
            log.info("tiny base model ready: %s (%d parameters, base accuracy %.3f at T=1)",
                     final, meta["num_parameters"], meta["base_accuracy_t1"])
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return final


def _ensure_upcycled(cache_dir: str | os.PathLike, spec: TinyBaseSpec, final: Path, progress: bool) -> Path:
    """The qwen3_moe tiny base: the qwen3 one (built first if needed) upcycled into ``final``."""
    from megatron_m2po.standins.tiny_moe import upcycle_to_qwen3_moe

    dense = ensure_tiny_base(cache_dir, spec=dataclasses.replace(
        spec, model=dataclasses.replace(spec.model, family="qwen3")), progress=progress)
    with open(final.parent / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if not is_complete(final):
                # upcycle_to_qwen3_moe writes into a sibling and renames; the marker comes last
                upcycle_to_qwen3_moe(str(dense), str(final), **MOE_UPCYCLING)
                meta = json.loads((final / META_FILE).read_text())  # the dense base's, copied
                meta.update(digest=spec.digest(), model=dataclasses.asdict(spec.model), upcycling=MOE_UPCYCLING,
                            upcycled_from=str(dense), model_sha256=_sha256(final / "model.safetensors"),
                            accuracy_note="base_accuracy_t1 is the dense qwen3 base's")
                (final / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")
                (final / MARKER_FILE).write_text(spec.digest() + "\n")
                log.info("tiny Qwen3-MoE base ready: %s (upcycled from %s)", final, dense)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return final


def _ensure_tool_base(cache_dir: str | os.PathLike, spec: TinyBaseSpec, final: Path, progress: bool) -> Path:
    """The qwen2_tools tiny base: the qwen2 one (built first if needed) fine-tuned into ``final``."""
    base = ensure_tiny_base(cache_dir, spec=dataclasses.replace(
        spec, model=dataclasses.replace(spec.model, family="qwen2")), progress=progress)
    with open(final.parent / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if not is_complete(final):
                if final.exists():
                    shutil.rmtree(final)
                tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
                try:
                    log.info("building the tiny tool-use base model into %s (one-time, cached for later runs; "
                             "about 3 minutes on 2 CPU cores: a fine-tune of the base and its measurement)", final)
                    meta = _build_tool_base(base, tmp, spec, progress)
                    (tmp / MARKER_FILE).write_text(meta["digest"] + "\n")
                    tmp.chmod(0o755)
                    os.replace(tmp, final)
                except BaseException:
                    shutil.rmtree(tmp, ignore_errors=True)
                    raise
                log.info("tiny tool base ready: %s (products right with the tool %.3f, withheld %.3f)", final,
                         meta["eval_with_tool"]["accuracy_hard"], meta["eval_tool_withheld"]["accuracy_hard"])
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return final


def _build_tool_base(base: Path, out: Path, spec: TinyBaseSpec, progress: bool) -> dict:
    """Fine-tune the qwen2 base in ``base`` into ``out`` (standins/tiny_tools.py) and measure it."""
    import torch
    from transformers import AutoModelForCausalLM

    from megatron_m2po.standins import tiny_tools as tt

    ws = tt.ToolWarmupSpec(seed=spec.seed)
    with _single_thread(), _quiet_transformers(not progress):
        tok = build_tokenizer()
        tok.chat_template = tt.TOOL_CHAT_TEMPLATE
        model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
        stats = tt.finetune(model, tok, ws, sample_ids, progress)
        final_rows = [dict(r) for r in ws.task.generate(ws.final_eval_problems, f"tiny-tools:final:{ws.seed}")]
        ev = tt.tool_episode_accuracy(model, tok, final_rows, sample_ids, tools=("working", "withheld"),
                                      seed=ws.seed + 7, max_new_tokens=ws.max_new_tokens, tool_ops=ws.tool_ops)
        evals = {"eval_with_tool": ev["working"], "eval_tool_withheld": ev["withheld"]}
        _save_model(model, out)
        tok.save_pretrained(out)
    cfg = json.loads((out / "tokenizer_config.json").read_text())
    cfg["tokenizer_class"], cfg["chat_template"] = "Qwen2Tokenizer", tt.TOOL_CHAT_TEMPLATE
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    if (out / "chat_template.jinja").is_file():
        (out / "chat_template.jinja").write_text(tt.TOOL_CHAT_TEMPLATE)
    base_meta = load_tiny_meta(base)
    meta = {"format_version": FORMAT_VERSION, "digest": spec.digest(), "derived_from": str(base),
            "base_digest": base_meta["digest"], "model_sha256": _sha256(out / "model.safetensors"),
            **{k: base_meta[k] for k in ("response_template", "eos_token", "model", "vocab_size", "num_parameters")},
            "chat_template": tt.TOOL_CHAT_TEMPLATE, "tools": tt.CALCULATOR_TOOLS, "data_template": "synthetic",
            "data": {"synthetic_ops": ws.task.ops, "synthetic_min_operand": ws.task.min_operand,
                     "synthetic_max_operand": ws.task.max_operand, "synthetic_num_operands": ws.task.num_operands},
            "example": {"call": "calculator;12*7=calculator(12*7)</s>[84]=\\boxed{84}</s>",
                        "direct": "calculator;12+7=\\boxed{19}</s>"},
            "tool_warmup": dataclasses.asdict(ws), "task": dataclasses.asdict(ws.task), "seed": spec.seed,
            "base_accuracy_t1": evals["eval_with_tool"]["accuracy"],
            "base_accuracy_eval_problems": len(final_rows), **evals, **stats}
    (out / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")
    return meta


def load_tiny_meta(path: str | os.PathLike) -> dict:
    """The ``m2po_tiny.json`` of a tiny base directory."""
    p = Path(path) / META_FILE
    if not p.is_file():
        raise ValueError(f"{p.parent} is not a tiny base model directory (no {META_FILE}); "
                         f"build one with `python tools/make_tiny_base.py`")
    return json.loads(p.read_text())
