"""``swiftspec train-draft``: a draft head for a target, trained on the target's own answers.

1. Data (self-distillation): the target answers the training prompts, in batches (greedy by default,
   sampled with ``--temperature``); a hook on its final norm captures the features of every position as
   they are computed. Each batch is a shard in ``OUT/data`` (written atomically; a rerun skips the shards
   already there). A fixed 5 % of the prompts is held out.
2. Sub-vocabulary: the ``--draft-vocab`` tokens the target chose most often in the training answers (plus
   its EOS ids); ``d2t`` in the checkpoint maps them back.
   Before it, the answers are also written as ``OUT/corpus.safetensors``: a corpus for the suffix drafter
   (``--draft suffix --draft-corpus``, engine/spec/corpus.py), all that ``--corpus-only`` makes.
3. Training: the head is unrolled ``--steps`` deep over whole sequences (``unroll``: step s
   predicts as a tree node at depth s - 1 does), with a cross-entropy on the target's greedy token and a
   smooth-L1 regression on the target's feature (weighted 0.1: SmolLM2's features have outlier dimensions
   near 50, whose regression otherwise drowns the token loss), later steps weighted 0.8x less each. The checkpoint in ``OUT`` is
   written after every epoch with the optimiser's state, so a rerun resumes; ``--seed`` makes it
   deterministic on a given machine. Top-1 agreement with the target on the held-out answers is printed
   per epoch and per depth: the chance that a draft token is the one the target would choose.
"""

from __future__ import annotations

import json
import math
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from swiftspec import kernels
from swiftspec.engine.config import Device, Dtype
from swiftspec.engine.host.encode import encode_chat
from swiftspec.engine.model.fp16_linear import fbgemm_available, pack_fp16_linears
from swiftspec.engine.model.loader import load_hf_model, load_model
from swiftspec.engine.model.model_dir import eos_token_ids, load_tokenizer
from swiftspec.engine.spec.corpus import save_corpus
from swiftspec.engine.spec.draft_head import DraftHead, HeadArgs, load_head, save_head

DATA_FORMAT = 1
CORPUS_FILE = "corpus.safetensors"
HELD_OUT = 0.05


@dataclass
class TrainConfig:
    n_prompts: int = 800
    max_new_tokens: int = 256
    temperature: float = 0.0
    batch: int = 32  # prompts answered together
    draft_vocab: int = 8192
    steps: int = 3  # unrolled depth
    epochs: int = 6
    lr: float = 1e-3
    seq_batch: int = 8  # sequences per optimiser step
    seed: int = 0


@dataclass
class Sequence:
    tokens: Tensor  # [n] int64: prompt then answer
    features: Tensor  # [n - 1, dim] fp16: the target's feature at each position but the last
    prompt_len: int


# -------------------------------------------------------------------------------------------- data

def _hf_model(target_dir: Path, device: torch.device):
    """transformers' model of the target: its batched ``generate`` answers many prompts at once. On the CPU
    its linears take fp16 weights (FBGEMM, fp32 math, as ``--dtype float16`` runs the target): a batch of
    answers is faster, and the features move by fp16 rounding only."""
    model = load_hf_model(target_dir, torch.float32).to(device).eval()
    if Device.of(device) is Device.CPU and fbgemm_available():
        pack_fp16_linears(model)
    return model


def _final_norm(model):
    inner = getattr(model, "model", None)
    norm = getattr(inner, "norm", None)
    if norm is None:
        raise ValueError("train-draft needs a Llama-family target (model.norm not found)")
    return norm


@torch.inference_mode()
def answer_batch(model, tokenizer, prompt_ids: list[list[int]], eos: list[int], cfg: TrainConfig,
                 seed: int) -> list[Sequence]:
    """The target answers a batch of prompts; features are captured at its final norm as it generates."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0]
    width = max(map(len, prompt_ids))
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompt_ids])
    attn = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompt_ids])
    captured: list[Tensor] = []
    hook = _final_norm(model).register_forward_hook(lambda _m, _i, out: captured.append(out.detach().half()))
    torch.manual_seed(seed)
    dev = next(model.parameters()).device
    try:
        sample = cfg.temperature > 0
        gen = model.generate(input_ids=ids.to(dev), attention_mask=attn.to(dev), max_new_tokens=cfg.max_new_tokens,
                             do_sample=sample, temperature=cfg.temperature if sample else None, top_p=None,
                             top_k=None, eos_token_id=eos, pad_token_id=pad)
    finally:
        hook.remove()
    feats = torch.cat(captured, dim=1).cpu()  # [B, width + steps, dim]
    out = []
    for b, p in enumerate(prompt_ids):
        answer = gen[b, width:].tolist()
        end = next((i + 1 for i, t in enumerate(answer) if t in eos), len(answer))
        tokens = p + answer[:end]
        f = feats[b, width - len(p):width - len(p) + len(tokens) - 1]
        out.append(Sequence(torch.tensor(tokens), f.clone(), len(p)))
    return out


def _save_shard(path: Path, seqs: list[Sequence]) -> None:
    from safetensors.torch import save_file

    state = {}
    for i, s in enumerate(seqs):
        state[f"{i}.tokens"] = s.tokens
        state[f"{i}.features"] = s.features.contiguous()
        state[f"{i}.prompt_len"] = torch.tensor([s.prompt_len])
    tmp = path.with_suffix(".tmp")
    save_file(state, str(tmp))
    tmp.replace(path)


def _load_shard(path: Path) -> list[Sequence]:
    from safetensors.torch import load_file

    state = load_file(str(path))
    n = len({k.split(".")[0] for k in state})
    return [Sequence(state[f"{i}.tokens"], state[f"{i}.features"], int(state[f"{i}.prompt_len"][0]))
            for i in range(n)]


def make_data(target_dir: Path, tok, eos: list[int], prompts: list[str], out: Path, cfg: TrainConfig,
              device: torch.device, progress) -> list[Sequence]:
    """The self-distillation data, generated once into ``out/data`` (shards; reruns skip existing ones);
    ``tok`` and ``eos``: the target's tokenizer and EOS ids."""
    data = out / "data"
    data.mkdir(parents=True, exist_ok=True)
    meta = {"format": DATA_FORMAT, "prompts": len(prompts), "max_new_tokens": cfg.max_new_tokens,
            "temperature": cfg.temperature, "batch": cfg.batch, "seed": cfg.seed}
    meta_path = data / "meta.json"
    if meta_path.is_file() and json.loads(meta_path.read_text()) != meta:
        raise ValueError(f"{data} holds data made with other settings ({meta_path}); use another --out or "
                         "delete that folder")
    meta_path.write_text(json.dumps(meta) + "\n")
    batches = [prompts[i:i + cfg.batch] for i in range(0, len(prompts), cfg.batch)]
    model = None
    seqs: list[Sequence] = []
    task = progress.add_task("answering prompts", total=len(prompts))
    for i, batch in enumerate(batches):
        shard = data / f"shard-{i:05d}.safetensors"
        if not shard.is_file():
            model = model or _hf_model(target_dir, device)
            ids = [encode_chat(tok, [{"role": "user", "content": p}]) for p in batch]
            _save_shard(shard, answer_batch(model, tok, ids, eos, cfg, cfg.seed * 100_003 + i))
        seqs += _load_shard(shard)
        progress.advance(task, len(batch))
    return seqs


def split(seqs: list[Sequence], seed: int) -> tuple[list[Sequence], list[Sequence]]:
    """A fixed held-out share, chosen by a seeded shuffle of the sequence indices."""
    order = list(range(len(seqs)))
    random.Random(seed).shuffle(order)
    n_held = max(1, round(HELD_OUT * len(seqs)))
    held = set(order[:n_held])
    return [s for i, s in enumerate(seqs) if i not in held], [s for i, s in enumerate(seqs) if i in held]


def choose_vocab(seqs: list[Sequence], labels: list[Tensor], size: int, eos: list[int], vocab: int) -> Tensor:
    """The ``size`` tokens the target chooses most often in the answers, EOS ids included, sorted."""
    counts = torch.zeros(vocab, dtype=torch.long)
    for s, lab in zip(seqs, labels, strict=True):
        counts += torch.bincount(lab[s.prompt_len - 1:], minlength=vocab)
    counts[torch.tensor(eos)] = counts.max() + 1
    return counts.topk(min(size, vocab)).indices.sort().values


@torch.no_grad()
def target_labels(seqs: list[Sequence], lm_head: Tensor) -> list[Tensor]:
    """The target's greedy token after each featured position (argmax of its lm_head)."""
    return [F.linear(s.features.float(), lm_head).argmax(-1) for s in seqs]


# -------------------------------------------------------------------------------------------- training

def _batch(seqs: list[Sequence], labels: list[Tensor], t2d: Tensor, max_len: int):
    """Pads sequences (right) into tensors: tokens, input features (row j: position j - 1's), target
    features and draft-vocab labels (row j: position j's), and the first row of each answer."""
    L = min(max_len, max(len(s.tokens) - 1 for s in seqs))
    dim = seqs[0].features.shape[1]
    B = len(seqs)
    tokens = torch.zeros(B, L, dtype=torch.long)
    f_in = torch.zeros(B, L, dim)
    f_out = torch.zeros(B, L, dim)
    lab = torch.full((B, L), -100, dtype=torch.long)
    valid = torch.zeros(B, L, dtype=torch.bool)
    first = torch.zeros(B, dtype=torch.long)
    for b, s in enumerate(seqs):
        n = min(len(s.tokens) - 1, L)  # rows 0..n-1 have a target feature and label
        tokens[b, :n] = s.tokens[:n]
        f_out[b, :n] = s.features[:n].float()
        f_in[b, 1:n] = s.features[:n - 1].float()
        lab[b, :n] = t2d[labels[b][:n]]
        valid[b, :n] = True
        first[b] = s.prompt_len
    return tokens, f_in, f_out, lab, valid, first


def unroll(head: DraftHead, tokens: Tensor, features: list[Tensor], positions: Tensor) -> list[Tensor]:
    """The head unrolled over whole sequences (B x L) for training, as its tree forward computes it.

    ``features[0]`` [B, L, dim]: row j's input feature (the target's at j - 1). Step s >= 2 feeds
    row j the prediction of row j - 1 at step s - 1: the row of a tree node at depth s - 1 whose
    root sits at j - s + 1. Its keys are then what the draft tree gives it: the step-1 rows at
    positions <= j - s + 1 (the prefix and the root) and the step-t row at j - s + t for t = 2..s (its
    ancestors and itself). Returns the predicted features of each step ([B, L, dim] each).
    """
    a = head.attention
    B, L, _ = features[0].shape
    nh, nkv, hd = a.n_heads, a.n_kv_heads, a.head_dim
    freqs = positions.to(torch.float32)[..., None] * head.inv_freq_for(features[0].device)[None, None]
    emb = torch.cat((freqs, freqs), dim=-1).reshape(B * L, -1)
    cos, sin = emb.cos(), emb.sin()
    idx = torch.arange(L, device=tokens.device)
    keys, values, outs = [], [], []
    feats = features[0]
    steps = len(features)
    for s in range(1, steps + 1):
        x = head.fuse(tokens, feats)
        qk, v = a.wqkv(x).split_with_sizes([(nh + nkv) * hd, nkv * hd], dim=-1)
        qk = kernels.rope_rotate_half(qk.reshape(B * L, nh + nkv, hd), cos, sin).reshape(B, L, nh + nkv, hd)
        q, k = qk.split_with_sizes([nh, nkv], dim=2)
        rep = nh // nkv
        k = k.repeat_interleave(rep, dim=2).transpose(1, 2)  # [B, H, L, hd]
        v = v.reshape(B, L, nkv, hd).repeat_interleave(rep, dim=2).transpose(1, 2)
        q = q.transpose(1, 2)
        keys.append(k)
        values.append(v)
        # step-1 keys at positions <= j - s + 1
        scores = [torch.matmul(q, keys[0].transpose(-1, -2)) * a.scale]
        allowed = idx[None, :] <= (idx[:, None] - s + 1)
        scores[0] = scores[0].masked_fill(~allowed, float("-inf"))
        # the step-t key at j - s + t, t = 2..s: one key per row, shifted by s - t
        for t in range(2, s + 1):
            shift = s - t
            kt = F.pad(keys[t - 1], (0, 0, shift, 0))[:, :, :L]  # row j reads key j - shift
            scores.append((q * kt).sum(-1, keepdim=True) * a.scale)
        probs = torch.cat(scores, dim=-1).float().softmax(-1).to(q.dtype)
        probs = torch.nan_to_num(probs)  # rows j < s - 1 have no root: no key at all
        attn_out = torch.matmul(probs[..., :L], values[0])
        for t in range(2, s + 1):
            shift = s - t
            vt = F.pad(values[t - 1], (0, 0, shift, 0))[:, :, :L]
            attn_out = attn_out + probs[..., L + t - 2:L + t - 1] * vt
        out = head.finish(x + a.wo(attn_out.transpose(1, 2).reshape(B, L, nh * hd)))
        outs.append(out)
        feats = F.pad(out, (0, 0, 1, 0))[:, :L]  # row j's next input: row j - 1's prediction
    return outs


def unrolled_loss(head: DraftHead, batch, steps: int, noise: float, gen: torch.Generator | None
                  ) -> tuple[Tensor, list[tuple[int, int]]]:
    """Loss over the unrolled steps, and per step (correct top-1, rows) on the answers."""
    tokens, f_in, f_out, lab, valid, first = batch
    B, L = tokens.shape
    if noise:
        f_in = f_in + (torch.rand(f_in.shape, generator=gen) * 2 - 1) * noise
    positions = torch.arange(L)[None].expand(B, L)
    outs = unroll(head, tokens, [f_in] * steps, positions)
    idx = torch.arange(L)[None]
    total = torch.zeros(())
    stats = []
    for s, out in enumerate(outs, start=1):
        rows = valid & (idx - s + 1 >= first[:, None])  # the root of row j sits at j - s + 1, in the answer
        if not rows.any():
            stats.append((0, 0))
            continue
        logits = head.logits(out[rows])
        target = lab[rows]
        ce = F.cross_entropy(logits, target, ignore_index=-100) if (target >= 0).any() else logits.sum() * 0
        reg = F.smooth_l1_loss(out[rows], f_out[rows])
        total = total + 0.8 ** (s - 1) * (ce + 0.1 * reg)
        ok = (logits.argmax(-1) == target) & (target >= 0)
        stats.append((int(ok.sum()), int(rows.sum())))
    return total, stats


def init_head(target, d2t: Tensor, seed: int) -> DraftHead:
    """A head shaped like one target layer, starting from the target's last layer (a far better start than
    noise on little data); fc starts as "take the feature", so step 1 begins close to the target's own
    last layer applied once more."""
    torch.manual_seed(seed)
    args = HeadArgs.for_target(target.args)
    head = DraftHead(args, d2t)
    last = target.layers[-1]
    with torch.no_grad():
        head.attention.wqkv.weight.copy_(last.attention.wqkv.weight)  # (a Qwen target's q/k/v bias is dropped)
        head.attention.wo.weight.copy_(last.attention.wo.weight)
        head.ffn_norm.weight.copy_(last.ffn_norm.weight)
        head.feed_forward.w13.weight.copy_(last.feed_forward.w13.weight)
        head.feed_forward.w2.weight.copy_(last.feed_forward.w2.weight)
        head.norm.weight.copy_(target.norm.weight)
        head.fc.weight.zero_()
        head.fc.weight[:, args.dim:] = torch.eye(args.dim)
        head.fc.bias.zero_()
    head.attach_target(target.tok_embeddings.weight, target.output.weight)
    return head


def _optimizer_state(opt: torch.optim.Optimizer, head: DraftHead) -> dict[str, Tensor]:
    names = {id(p): n for n, p in head.named_parameters()}
    out = {}
    for p, st in opt.state.items():
        for k, v in st.items():
            out[f"{names[id(p)]}.{k}"] = v if torch.is_tensor(v) else torch.tensor(v)
    return out


def _load_optimizer_state(opt: torch.optim.Optimizer, head: DraftHead, state: dict[str, Tensor]) -> None:
    for n, p in head.named_parameters():
        st = {k.rsplit(".", 1)[1]: v for k, v in state.items() if k.rsplit(".", 1)[0] == n}
        if st:
            opt.state[p] = st


def agreement(head: DraftHead, seqs: list[Sequence], labels: list[Tensor], t2d: Tensor, steps: int,
              max_len: int) -> list[float]:
    """Held-out top-1 agreement with the target per depth (no noise)."""
    hits = [[0, 0] for _ in range(steps)]
    with torch.no_grad():
        for i in range(0, len(seqs), 8):
            batch = _batch(seqs[i:i + 8], labels[i:i + 8], t2d, max_len)
            _, stats = unrolled_loss(head, batch, steps, 0.0, None)
            for s, (ok, n) in enumerate(stats):
                hits[s][0] += ok
                hits[s][1] += n
    return [ok / n if n else 0.0 for ok, n in hits]


def train(target_dir: Path, out: Path, cfg: TrainConfig, prompts: list[str], device: torch.device,
          console, max_len: int = 512, corpus_only: bool = False) -> list[list[float]]:
    """The whole command: data, the suffix drafter's corpus, vocabulary, epochs (resumable). Returns the
    agreement curve (none with ``corpus_only``: the data and the corpus only)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    torch.manual_seed(cfg.seed)
    tok = load_tokenizer(target_dir)
    eos = eos_token_ids(target_dir)
    cols = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn())
    with Progress(*cols, console=console) as progress:
        seqs = make_data(target_dir, tok, eos, prompts, out, cfg, device, progress)
    n = save_corpus(out / CORPUS_FILE, [(s.tokens.tolist(), s.prompt_len) for s in seqs], tok)
    console.print(f"corpus: {len(seqs)} answers ({n} tokens) in {out / CORPUS_FILE}, for --draft-corpus")
    if corpus_only:
        return []
    target = load_model(target_dir, "cpu", Dtype.FLOAT32, max_slots=1, batch_invariant=False)
    train_set, held = split(seqs, cfg.seed)
    lm_head = target.output.weight.detach()
    train_labels, held_labels = target_labels(train_set, lm_head), target_labels(held, lm_head)
    d2t = choose_vocab(train_set, train_labels, cfg.draft_vocab, eos, target.args.vocab_size)
    t2d = torch.full((target.args.vocab_size,), -100, dtype=torch.long)
    t2d[d2t] = torch.arange(len(d2t))
    answer_tokens = sum(len(s.tokens) - s.prompt_len for s in train_set)
    covered = sum(int((t2d[lab[s.prompt_len - 1:]] >= 0).sum()) for s, lab in zip(train_set, train_labels, strict=True))
    console.print(f"data: {len(train_set)} answers ({answer_tokens} tokens) for training, {len(held)} held out; "
                  f"draft vocabulary {len(d2t)} tokens covers {covered / max(1, answer_tokens):.1%} of the answers")
    head = init_head(target, d2t, cfg.seed).to(device)
    head.embed_weight, head.lm_head_weight = head.embed_weight.to(device), head.lm_head_weight.to(device)
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0)
    state_path, ckpt_state = out / "train_state.json", out / "train_state.safetensors"
    first_epoch, curve = 0, []
    if state_path.is_file():
        from safetensors.torch import load_file

        st = json.loads(state_path.read_text())
        if {**st["config"], "epochs": cfg.epochs} != asdict(cfg):  # more epochs may be asked for
            raise ValueError(f"{out} holds a run with other settings; use another --out or delete it")
        saved = load_head(out, target.args)
        head.load_state_dict(saved.state_dict())
        _load_optimizer_state(opt, head, load_file(str(ckpt_state)))
        first_epoch, curve = st["epoch"], st["agreement"]
        console.print(f"resuming after epoch {first_epoch}")
    noise = 0.1 * float(torch.cat([s.features[:64].float() for s in train_set[:32]]).std())
    steps_per_epoch = math.ceil(len(train_set) / cfg.seq_batch)
    total = steps_per_epoch * cfg.epochs
    warmup = max(1, min(50, total // 10))
    sched = lambda step: min(1.0, (step + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * step / total))
    gen = torch.Generator().manual_seed(cfg.seed)
    for epoch in range(first_epoch, cfg.epochs):
        order = list(range(len(train_set)))
        random.Random(cfg.seed * 1000 + epoch).shuffle(order)
        gen.manual_seed(cfg.seed * 1000 + epoch)
        t0 = time.perf_counter()
        with Progress(*cols, TextColumn("loss {task.fields[loss]:.3f}"), console=console) as progress:
            task = progress.add_task(f"epoch {epoch + 1}/{cfg.epochs}", total=steps_per_epoch, loss=0.0)
            for k in range(steps_per_epoch):
                step = epoch * steps_per_epoch + k
                for g in opt.param_groups:
                    g["lr"] = cfg.lr * sched(step)
                idx = order[k * cfg.seq_batch:(k + 1) * cfg.seq_batch]
                batch = _batch([train_set[i] for i in idx], [train_labels[i] for i in idx], t2d, max_len)
                loss, _ = unrolled_loss(head, batch, cfg.steps, noise, gen)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(params, 0.5)
                opt.step()
                progress.update(task, advance=1, loss=loss.item())
                if not console.is_terminal and (k + 1) % max(1, steps_per_epoch // 10) == 0:
                    console.print(f"epoch {epoch + 1}: step {k + 1}/{steps_per_epoch}, loss {loss.item():.3f}")
        agree = agreement(head, held, held_labels, t2d, cfg.steps, max_len)
        curve.append(agree)
        console.print(f"epoch {epoch + 1}: held-out top-1 agreement by depth "
                      + " ".join(f"{a:.1%}" for a in agree) + f" ({time.perf_counter() - t0:.0f} s)")
        from safetensors.torch import save_file

        save_head(head, out, {"trained_on": {"prompts": len(prompts), "answer_tokens": answer_tokens}})
        save_file(_optimizer_state(opt, head), str(ckpt_state.with_suffix(".tmp")))
        ckpt_state.with_suffix(".tmp").replace(ckpt_state)
        state_path.write_text(json.dumps({"epoch": epoch + 1, "config": asdict(cfg), "agreement": curve}) + "\n")
    return curve
