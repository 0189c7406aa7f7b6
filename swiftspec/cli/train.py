"""``swiftspec train-draft``: a draft head (and a suffix drafter's corpus) from a target's own answers
(swiftspec.train_draft does the training)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer

from swiftspec.cli.options import (
    DeviceOpt,
    MaxNewTokensOpt,
    TargetOpt,
    TemperatureOpt,
    ThreadsOpt,
    app,
    check_model_paths,
    cli_option,
    exit_with,
    sources,
)
from swiftspec.cli.usage import positive_number, whole_number
from swiftspec.engine.config import Device
from swiftspec.train_prompts import training_prompts

TRAIN = "Training"


@app.command("train-draft", epilog=sources())
def train_draft(
    ctx: typer.Context,
    out: Annotated[Path, cli_option("--out", panel=TRAIN, metavar="DIR",
                              help="Where the head goes (config.json + model.safetensors), with its data "
                                   "and training state: rerun the same command to resume.")],
    target: TargetOpt = None,
    prompts: Annotated[Path | None, cli_option(
        "--prompts", panel=TRAIN, metavar="FILE",
        help="Training prompts, JSONL with a 'prompt' field. Default: SwiftSpec's own generated chat "
             "requests (topic x task).")] = None,
    n_prompts: Annotated[int, cli_option("--n-prompts", parser=whole_number(2), panel=TRAIN, metavar="N",
                                   help="Prompts to answer (the first N).")] = 800,
    max_new_tokens: MaxNewTokensOpt = 256,
    temperature: TemperatureOpt = 0.0,
    draft_vocab: Annotated[int, cli_option("--draft-vocab", parser=whole_number(2), panel=TRAIN, metavar="N",
                                     help="Tokens the head can propose: the target's N most frequent in "
                                          "its answers.")] = 8192,
    steps: Annotated[int, cli_option("--steps", parser=whole_number(1, 8), panel=TRAIN, metavar="N",
                               help="Tree depths trained for (unrolled steps).")] = 3,
    epochs: Annotated[int, cli_option("--epochs", parser=whole_number(1), panel=TRAIN, metavar="N",
                                help="Passes over the data.")] = 6,
    lr: Annotated[float, cli_option("--lr", parser=positive_number(), panel=TRAIN, metavar="NUMBER",
                              help="Peak learning rate (AdamW, warm-up then cosine).")] = 1e-3,
    seed: Annotated[int, cli_option("--seed", parser=whole_number(0), panel=TRAIN, metavar="N",
                              help="Seed of everything random: the run is repeatable.")] = 0,
    corpus_only: Annotated[bool, cli_option(
        "--corpus-only", panel=TRAIN,
        help="Stop after the answers: write OUT/corpus.safetensors for --draft-corpus, train no head.")] = False,
    device: DeviceOpt = "auto",
    threads: ThreadsOpt = None,
) -> None:
    """Train an EAGLE-style draft head for a target, on the target's own answers.

    The target answers the prompts (captured: its final hidden states), then a one-layer head learns to predict its next feature and token from them. Use the result with [bold]--draft DIR[/bold]. Prints the held-out agreement with the target per epoch and tree depth. The answers also make a corpus for the suffix drafter, OUT/corpus.safetensors: use it with [bold]--draft suffix --draft-corpus FILE[/bold].

    Example: [bold]swiftspec train-draft --out heads/smollm2 --n-prompts 64 --epochs 1[/bold]
    """
    check_model_paths(ctx, target=target)
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # spinning threads crawl when a core is busy elsewhere
    import torch

    # torch and the training's modules: --help imports none of them
    from swiftspec.bench import parse_jsonl
    from swiftspec.engine.model.model_dir import resolve_model_dir
    from swiftspec.train_draft import TrainConfig, train
    if threads:
        torch.set_num_threads(threads)
    dev = torch.device("cuda" if device == Device.CUDA or (device == Device.AUTO and torch.cuda.is_available()) else "cpu")
    try:
        target_dir = resolve_model_dir(str(target) if target else None)
        if prompts is None:
            texts = training_prompts(n_prompts)
        else:
            texts = [p.text for p in parse_jsonl(prompts.read_text(encoding="utf-8"), prompts.stem)][:n_prompts]
        cfg = TrainConfig(n_prompts=len(texts), max_new_tokens=max_new_tokens, temperature=temperature,
                          draft_vocab=draft_vocab, steps=steps, epochs=epochs, lr=lr, seed=seed)
        from rich.console import Console

        train(target_dir, out, cfg, texts, dev, Console(stderr=True), corpus_only=corpus_only)
    except (ValueError, OSError) as e:
        raise exit_with(str(e), 2) from None
    if not corpus_only:
        typer.echo(f"swiftspec: the head is in {out}; use it with --draft {out}", err=True)
