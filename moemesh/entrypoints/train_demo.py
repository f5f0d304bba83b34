"""`moemesh train-demo`: train the built-in demo model, a small Mixtral, on the Python standard library.

    moemesh train-demo --out moemesh/demo_model     what ships (about 20 minutes on 2 idle CPU cores)
    moemesh train-demo --out /tmp/demo --steps 20    a smoke run

Deterministic given --seed (same Python, same torch, same thread count: same bytes).

1. Text: the `.py` files of the running Python's standard library, without site-packages, the test
   suites and the generated tables (`stdlib_files`). One file in 40 is held out by a rule on its
   path (`is_held_out`), so the same files are held out on any Python; eval/demo/*.jsonl hold their
   text (`--write-eval-data`) for the accuracy table and the tests.
2. Tokenizer: byte-level BPE (`tokenizers`) of DEMO_SPEC.vocab_size tokens trained on the training
   files, special tokens and chat template as the tiny checkpoints have them. A newline is a token of
   its own (never merged with the next line's indentation), so a prompt that ends a line ends a
   token, as it did in training.
3. Data: every file tokenized and joined with <|endoftext|>; each epoch cuts the stream into windows
   of context + 1 tokens at a seeded offset and visits them in a seeded order.
4. Model: `DemoMixtral`, Mixtral's maths in plain torch under Hugging Face's parameter names (the
   experts stacked; `hf_state_dict` unstacks them into the hub's per-expert tensors).
5. Loop: AdamW, linear warmup then cosine decay, gradient clipping, Switch-style load balancing of
   the router; one `key=value` line every --log-every steps (loss, learning rate, tokens/s).
6. Export: bfloat16 safetensors, config.json (tiny_model.hf_config), generation_config.json and the
   tokenizer files, in the layout of a hub checkpoint; then the held-out loss of what was written.
"""

from __future__ import annotations

import ast
import hashlib
import json
import math
import os
import random
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from torch import nn

from moemesh.errors import CLIError
from moemesh.entrypoints.tiny_model import (BOS_ID, ENDOFTEXT_ID, IM_END_ID, SPECIAL_TOKENS,
                                            TinyModelSpec, _write_json, _write_weights, hf_config, save_tokenizer)

DEMO_SPEC = TinyModelSpec(
    arch="mixtral", num_layers=4, hidden_size=256, intermediate_size=384, num_heads=8, num_kv_heads=2,
    num_experts=8, top_k=2, vocab_size=4096, max_position_embeddings=512, rope_theta=10000.0,
    rms_norm_eps=1e-5, dtype="bfloat16",
)

SKIP_DIRS = frozenset({"site-packages", "test", "tests", "idle_test", "encodings", "pydoc_data", "__pycache__"})
HELD_OUT_ONE_IN = 40


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 800
    batch_size: int = 8  # sequences of spec.max_position_embeddings tokens
    lr: float = 2e-3
    min_lr: float = 2e-4
    warmup: int = 50
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    aux_loss_coef: float = 0.01
    seed: int = 0
    threads: int = 2
    log_every: int = 10


# -- 1. text ----------------------------------------------------------------------------------------

def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(root: Path) -> list[str]:
    """Relative paths of the standard library's own code, sorted: no site-packages, test suites,
    codec tables (encodings/), help text (pydoc_data/) or build configuration."""
    out = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if any(part in SKIP_DIRS for part in rel.parts[:-1]) or rel.parts[0].startswith("config-"):
            continue
        if rel.name.startswith("_sysconfigdata"):
            continue
        out.append(rel.as_posix())
    return sorted(out)


def is_held_out(rel_path: str) -> bool:
    """The fixed held-out rule: 1 in HELD_OUT_ONE_IN files, by the SHA-256 of the relative path."""
    return int(hashlib.sha256(rel_path.encode()).hexdigest(), 16) % HELD_OUT_ONE_IN == 0


def read_sources(root: Path, held_out: bool) -> list[tuple[str, str]]:
    """(relative path, text) of the training files, or of the held-out ones; files that are not UTF-8
    are skipped."""
    out = []
    for rel in stdlib_files(root):
        if is_held_out(rel) != held_out:
            continue
        try:
            out.append((rel, (root / rel).read_text(encoding="utf-8")))
        except UnicodeDecodeError:
            continue
    return out


# -- 2. tokenizer -----------------------------------------------------------------------------------

def train_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split("\n", behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def token_stream(tok: Tokenizer, texts: list[str]) -> torch.Tensor:
    """[N] int64: <|endoftext|> before every document."""
    ids: list[int] = []
    for enc in tok.encode_batch(texts, add_special_tokens=False):
        ids.append(ENDOFTEXT_ID)
        ids.extend(enc.ids)
    return torch.tensor(ids, dtype=torch.int64)


# -- 3. data ----------------------------------------------------------------------------------------

def min_stream_tokens(context: int, batch_size: int) -> int:
    """Tokens `batches` needs: an epoch's offset can be up to context - 1, and every epoch must still
    cut batch_size windows of context + 1 tokens."""
    return (batch_size + 1) * context


def batches(stream: torch.Tensor, context: int, batch_size: int, gen: torch.Generator):
    """Endless [B, context] inputs and targets: per epoch, windows cut at a random offset, shuffled."""
    if len(stream) < min_stream_tokens(context, batch_size):  # (an epoch would cut no batch, for ever)
        raise ValueError(f"{len(stream)} tokens are too few for batches of {batch_size} windows of {context + 1}: "
                         f"at least {min_stream_tokens(context, batch_size)} needed")
    while True:
        offset = int(torch.randint(0, context, (1,), generator=gen))
        n = (len(stream) - offset - 1) // context
        starts = offset + torch.randperm(n, generator=gen) * context
        for i in range(0, n - batch_size + 1, batch_size):
            idx = starts[i:i + batch_size, None] + torch.arange(context + 1)
            window = stream[idx]  # [B, context + 1]
            yield window[:, :-1], window[:, 1:]


# -- 4. model ---------------------------------------------------------------------------------------
# B = batch, S = sequence, H = hidden, D = head dim, E = experts, K = experts per token, I = expert
# intermediate, T = B * S tokens, V = vocabulary.

class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


def rotary(seq_len: int, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [S, D] in Hugging Face's rotate-half layout."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    freqs = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def apply_rotary(x, cos, sin):
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class Attention(nn.Module):
    def __init__(self, spec: TinyModelSpec):
        super().__init__()
        H, D = spec.hidden_size, spec.resolved_head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = spec.num_heads, spec.num_kv_heads, D
        self.q_proj = nn.Linear(H, spec.num_heads * D, bias=False)
        self.k_proj = nn.Linear(H, spec.num_kv_heads * D, bias=False)
        self.v_proj = nn.Linear(H, spec.num_kv_heads * D, bias=False)
        self.o_proj = nn.Linear(spec.num_heads * D, H, bias=False)

    def forward(self, x, cos, sin):  # x [B, S, H]
        B, S, _ = x.shape
        q = self.q_proj(x).view(B, S, self.num_heads, self.head_dim).transpose(1, 2)  # [B, heads, S, D]
        k = self.k_proj(x).view(B, S, self.num_kv_heads, self.head_dim).transpose(1, 2)  # [B, kv heads, S, D]
        v = self.v_proj(x).view(B, S, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)  # [B, heads, S, D]
        return self.o_proj(out.transpose(1, 2).reshape(B, S, -1))


class SparseMoe(nn.Module):
    """Mixtral's block: softmax over E experts, the top K renormalised, SwiGLU experts (w1 gate,
    w3 up, w2 down) stacked as [E, ...] tensors. Returns the output and the load-balancing loss."""

    def __init__(self, spec: TinyModelSpec):
        super().__init__()
        E, H, I = spec.num_experts, spec.hidden_size, spec.intermediate_size
        self.top_k = spec.top_k
        self.gate = nn.Linear(H, E, bias=False)
        self.w1 = nn.Parameter(torch.empty(E, I, H))
        self.w3 = nn.Parameter(torch.empty(E, I, H))
        self.w2 = nn.Parameter(torch.empty(E, H, I))

    def forward(self, x):  # x [T, H]
        E, K = self.w1.shape[0], self.top_k
        probs = F.softmax(self.gate(x), dim=-1)  # [T, E]
        weights, experts = probs.topk(K, dim=-1)  # [T, K]
        weights = weights / weights.sum(-1, keepdim=True)
        flat = experts.flatten()  # [T*K]: token t's k-th choice at t*K + k
        order = flat.argsort(stable=True)  # the T*K slots grouped by expert
        counts = torch.bincount(flat, minlength=E)
        tokens = order // K
        h = x.index_select(0, tokens)  # [T*K, H], expert 0's tokens first
        ys = []
        for e, he in enumerate(h.split(counts.tolist())):  # he [n_e, H]
            ys.append((F.silu(he @ self.w1[e].T) * (he @ self.w3[e].T)) @ self.w2[e].T)
        y = torch.cat(ys) * weights.flatten().index_select(0, order)[:, None]  # [T*K, H]
        out = x.new_zeros(x.shape).index_add(0, tokens, y)
        # Switch Transformer: E * sum_e (share of routed slots) * (mean router probability)
        balance = E * (counts.float() / flat.numel() * probs.mean(0)).sum()
        return out, balance


class DecoderLayer(nn.Module):
    def __init__(self, spec: TinyModelSpec):
        super().__init__()
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.self_attn = Attention(spec)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.block_sparse_moe = SparseMoe(spec)

    def forward(self, x, cos, sin):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        moe, balance = self.block_sparse_moe(self.post_attention_layernorm(x).flatten(0, 1))
        return x + moe.view_as(x), balance


class DemoMixtral(nn.Module):
    def __init__(self, spec: TinyModelSpec):
        super().__init__()
        self.spec = spec
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.model.layers = nn.ModuleList(DecoderLayer(spec) for _ in range(spec.num_layers))
        self.model.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.lm_head = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)
        cos, sin = rotary(spec.max_position_embeddings, spec.resolved_head_dim, spec.rope_theta)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def init_weights(self, gen: torch.Generator) -> None:
        """N(0, 0.02), the residual outputs (o_proj, w2) scaled by 1/sqrt(2 * layers); norms 1."""
        residual_std = 0.02 / math.sqrt(2 * self.spec.num_layers)
        for name, p in self.named_parameters():
            if name.endswith("layernorm.weight") or name == "model.norm.weight":
                nn.init.ones_(p)
            else:
                std = residual_std if name.endswith(("o_proj.weight", ".w2")) else 0.02
                with torch.no_grad():
                    p.copy_(torch.randn(p.shape, generator=gen) * std)

    def forward(self, ids):  # ids [B, S] -> logits [B, S, V], summed load-balancing loss
        S = ids.shape[1]
        cos, sin = self.cos[:S], self.sin[:S]
        x = self.model.embed_tokens(ids)
        balance = x.new_zeros(())
        for layer in self.model.layers:
            x, b = layer(x, cos, sin)
            balance = balance + b
        return self.lm_head(self.model.norm(x)), balance

    def hf_state_dict(self, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """The hub's names and layout: each expert's w1/w2/w3 its own 2-D tensor."""
        out = {}
        for name, t in self.state_dict().items():
            if name.rsplit(".", 1)[-1] in ("w1", "w2", "w3"):
                prefix, w = name.rsplit(".", 1)
                for e in range(t.shape[0]):
                    out[f"{prefix}.experts.{e}.{w}.weight"] = t[e]
            else:
                out[name] = t
        return {k: v.detach().to(dtype).contiguous() for k, v in out.items()}


# -- 5. loop ----------------------------------------------------------------------------------------

def learning_rate(step: int, cfg: TrainConfig) -> float:
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * progress))


def train(model: DemoMixtral, stream: torch.Tensor, cfg: TrainConfig, log=print) -> None:
    """cfg.steps optimizer steps on `stream`; FloatingPointError when the loss or the weights stop
    being finite (a learning rate too high), before any later step builds on them."""
    context = model.spec.max_position_embeddings
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.95))
    # (seeds are 64-bit: the data's is the next one, wrapping at 2**64)
    data = batches(stream, context, cfg.batch_size, torch.Generator().manual_seed((cfg.seed + 1) % 2**64))
    start = window_start = time.perf_counter()
    window_loss, window_steps = 0.0, 0
    for step in range(cfg.steps):
        for group in opt.param_groups:
            group["lr"] = learning_rate(step, cfg)
        x, y = next(data)
        logits, balance = model(x)
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
        value = loss.item()
        if not math.isfinite(value):
            raise FloatingPointError(f"the training loss is {value} at step {step + 1}")
        (loss + cfg.aux_loss_coef * balance / model.spec.num_layers).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        window_loss += value
        window_steps += 1
        if (step + 1) % cfg.log_every == 0 or step + 1 == cfg.steps:
            now = time.perf_counter()
            tokens = window_steps * cfg.batch_size * context
            log(f"step={step + 1}/{cfg.steps} loss={window_loss / window_steps:.4f} "
                f"balance={balance.item() / model.spec.num_layers:.3f} lr={learning_rate(step, cfg):.2e} "
                f"tok_per_s={tokens / (now - window_start):.0f} elapsed_s={now - start:.0f}")
            window_loss, window_steps, window_start = 0.0, 0, now
    if not all(torch.isfinite(p).all() for p in model.parameters()):  # (the last step's update)
        raise FloatingPointError(f"the weights are not finite after step {cfg.steps}")


# -- held-out loss: lm-eval's rolling windows -------------------------------------------------------

def rolling_windows(ids: list[int], prefix: int, max_len: int) -> list[tuple[list[int], int]]:
    """lm-eval's loglikelihood_rolling cut (context_len 1) as (input ids, n): the model reads the
    input (at most max_len ids) and its last n positions score the next n tokens of the document.
    Every token is scored once: the first window reads `prefix` and the first tokens; each later one
    scores the next max_len tokens (fewer at the end) after up to max_len tokens of what precedes them."""
    out, done = [], 0
    while done < len(ids):
        n = min(max_len, len(ids) - done)
        end = done + n
        out.append((([prefix] + ids[:n - 1]) if done == 0 else ids[end - max_len - 1:end - 1], n))
        done = end
    return out


@torch.no_grad()
def heldout_nll(logits_fn, tok: Tokenizer, texts: list[str], max_len: int) -> tuple[float, int, int]:
    """(summed negative log-likelihood in nats, tokens scored, UTF-8 bytes) over `texts`, each document
    scored from <|endoftext|> in lm-eval's windows of max_len tokens; logits_fn(ids) -> logits [len, V]."""
    nll, tokens, nbytes = 0.0, 0, 0
    for text in texts:
        ids = tok.encode(text, add_special_tokens=False).ids
        done = 0
        for window, n in rolling_windows(ids, ENDOFTEXT_ID, max_len):
            logp = torch.log_softmax(logits_fn(window)[-n:].float(), dim=-1)  # [n, V]
            targets = torch.tensor(ids[done:done + n])
            nll -= logp.gather(1, targets[:, None]).sum().item()
            done += n
        tokens += len(ids)
        nbytes += len(text.encode("utf-8"))
    return nll, tokens, nbytes


# -- 6. export --------------------------------------------------------------------------------------

def export(model: DemoMixtral, tok: Tokenizer, spec: TinyModelSpec, out_dir: Path) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    _write_json(out_dir / "config.json", hf_config(spec))
    _write_json(out_dir / "generation_config.json", {
        "bos_token_id": BOS_ID, "eos_token_id": [ENDOFTEXT_ID, IM_END_ID], "pad_token_id": ENDOFTEXT_ID})
    from stage_worker.tensors import torch_dtype

    _write_weights(model.hf_state_dict(torch_dtype(spec.dtype)), out_dir, None)
    save_tokenizer(tok, out_dir, spec.max_position_embeddings)
    return out_dir


# -- eval data: the held-out files and the next-line task (eval/demo) -------------------------------

def next_line_items(sources: list[tuple[str, str]], n: int, seed: int = 0,
                    max_prompt_chars: int = 1000) -> list[dict]:
    """`n` lines drawn (seeded) from the bodies of the functions in `sources` (path, text): not
    blank, not a comment, not the docstring. The prompt is the whole lines before it, at most
    max_prompt_chars, ending in a newline; the target is the line without it. ValueError for a source
    that does not parse, or fewer than `n` such lines."""
    candidates = []
    for rel, text in sources:
        lines = text.split("\n")
        try:
            tree = ast.parse(text)
        except SyntaxError as e:
            raise ValueError(f"held-out file {rel} does not parse ({e.msg}, line {e.lineno}); the next-line "
                             f"task reads its functions") from None
        for node in ast.walk(tree):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            body = node.body
            if ast.get_docstring(node, clean=False) is not None:
                body = body[1:]
            if not body:
                continue
            for ln in range(body[0].lineno, node.end_lineno + 1):  # 1-based
                s = lines[ln - 1].strip()
                if s and not s.startswith("#"):
                    candidates.append((rel, ln))
    candidates = sorted(set(candidates))
    if len(candidates) < n:
        raise ValueError(f"the held-out files' functions have {len(candidates)} lines for the next-line task, "
                         f"fewer than its {n}")
    chosen = sorted(random.Random(seed).sample(candidates, n))
    texts = dict(sources)
    items = []
    for rel, ln in chosen:
        lines = texts[rel].split("\n")
        start = ln - 1
        while start > 0 and sum(len(x) + 1 for x in lines[start - 1:ln - 1]) <= max_prompt_chars:
            start -= 1
        items.append({"path": rel, "line": ln, "prompt": "".join(x + "\n" for x in lines[start:ln - 1]),
                      "target": lines[ln - 1].rstrip()})
    return items


def write_eval_data(root: Path, out_dir: Path, num_lines: int = 250, seed: int = 0) -> None:
    """eval/demo/heldout.jsonl (one held-out file per line) and nextline.jsonl (the next-line task).
    ValueError, with both files left as they were, for sources that cannot make them; each is written
    beside its place and renamed into it at the end."""
    sources = read_sources(root, held_out=True)
    if not sources:
        raise ValueError(f"no held-out files (1 in {HELD_OUT_ONE_IN}, by the SHA-256 of the relative path)")
    records = {"heldout.jsonl": [{"path": rel, "text": text} for rel, text in sources],
               "nextline.jsonl": next_line_items(sources, num_lines, seed)}
    out_dir.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    try:
        for name, items in records.items():
            written.append(out_dir / f".{name}.tmp")
            with open(written[-1], "w") as f:
                f.writelines(json.dumps(item) + "\n" for item in items)
        for tmp in written:
            os.replace(tmp, out_dir / tmp.name[1:-len(".tmp")])
    finally:
        for tmp in written:
            tmp.unlink(missing_ok=True)


def run_train_demo(args) -> int:
    cfg = TrainConfig(**{k: getattr(args, k) for k in TrainConfig.__dataclass_fields__
                         if getattr(args, k, None) is not None})
    spec = DEMO_SPEC
    torch.manual_seed(cfg.seed)
    torch.set_num_threads(cfg.threads)
    root = Path(args.stdlib) if args.stdlib else stdlib_root()
    if args.write_eval_data is None and args.out is None:
        raise CLIError("train-demo needs --out DIR (or --write-eval-data DIR)")
    source = f"{'--stdlib ' if args.stdlib else 'the standard library at '}{root}"
    if not root.is_dir() or next(root.rglob("*.py"), None) is None:
        raise CLIError(f"{source}: no Python sources there")
    for flag, path in (("--out", args.out), ("--write-eval-data", args.write_eval_data)):
        if path is not None:  # (before the training, not after it)
            try:
                Path(path).mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise CLIError(f"{flag} {path}: {e.strerror or e}") from None
    if args.write_eval_data:
        try:
            write_eval_data(root, Path(args.write_eval_data))
        except ValueError as e:
            raise CLIError(f"{source}: {e}; --write-eval-data {args.write_eval_data} is left as it was") from None
        print(f"wrote {args.write_eval_data}/heldout.jsonl and nextline.jsonl")
        return 0
    t0 = time.perf_counter()
    train_sources = read_sources(root, held_out=False)
    heldout = [text for _, text in read_sources(root, held_out=True)]
    if not any(heldout):  # (the held-out loss, the run's result, divides by their tokens)
        raise CLIError(f"{source}: no held-out file with text (1 in {HELD_OUT_ONE_IN} files is held out, by the "
                       f"SHA-256 of its relative path); the held-out loss needs one")
    texts = [text for _, text in train_sources]
    tok = train_tokenizer(texts, spec.vocab_size)
    stream = token_stream(tok, texts)
    context = spec.max_position_embeddings
    if len(stream) < min_stream_tokens(context, cfg.batch_size):
        raise CLIError(f"--batch-size {cfg.batch_size}: {source} has {len(stream)} training tokens; steps of "
                       f"{cfg.batch_size} windows of {context + 1} tokens, cut at an epoch's random offset, need "
                       f"{min_stream_tokens(context, cfg.batch_size)} (give a smaller --batch-size, or a larger "
                       f"--stdlib)")
    print(f"stdlib={root} train_files={len(texts)} heldout_files={len(heldout)} "
          f"train_bytes={sum(len(t.encode()) for t in texts)} train_tokens={len(stream)} "
          f"vocab={tok.get_vocab_size()} prep_s={time.perf_counter() - t0:.0f}", flush=True)

    model = DemoMixtral(spec)
    model.init_weights(torch.Generator().manual_seed(cfg.seed))
    n_params = sum(p.numel() for p in model.parameters())
    print(f"params={n_params} steps={cfg.steps} batch={cfg.batch_size}x{spec.max_position_embeddings} "
          f"threads={cfg.threads} seed={cfg.seed}", flush=True)
    t1 = time.perf_counter()
    try:
        train(model, stream, cfg, log=lambda line: print(line, flush=True))
    except FloatingPointError as e:
        raise CLIError(f"--lr {cfg.lr}: training diverged ({e}); nothing was written to --out {args.out} "
                       f"(try a smaller --lr)") from None
    train_seconds = time.perf_counter() - t1

    out = export(model, tok, spec, Path(args.out))
    # the held-out loss of the weights as written (bfloat16), on the windows lm-eval uses
    model.load_state_dict({k: v.to(torch.bfloat16).float() for k, v in model.state_dict().items()})
    model.eval()
    nll, tokens, nbytes = heldout_nll(lambda ids: model(torch.tensor([ids]))[0][0], tok, heldout,
                                      spec.max_position_embeddings - 2)
    summary = {"python": sys.version.split()[0], "torch": torch.__version__, "params": n_params,
               "train_files": len(texts), "train_tokens": len(stream), "heldout_files": len(heldout),
               "heldout_tokens": tokens, "heldout_loss": round(nll / tokens, 4),
               "heldout_ppl": round(math.exp(nll / tokens), 3), "bits_per_byte": round(nll / nbytes / math.log(2), 4),
               "train_seconds": round(train_seconds), "total_seconds": round(time.perf_counter() - t0),
               **{k: getattr(cfg, k) for k in TrainConfig.__dataclass_fields__}}
    _write_json(out / "training.json", summary)  # provenance, beside the weights
    print(" ".join(f"{k}={summary[k]}" for k in ("heldout_loss", "heldout_ppl", "bits_per_byte", "heldout_tokens",
                                                 "train_seconds", "total_seconds")) + f" out={out}", flush=True)
    return 0
