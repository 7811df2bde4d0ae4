"""A small byte-level Llama trained here, on the CPU, for the accuracy figures.

No package ships a trained causal LM and nothing is downloaded, so the codecs
suite trains one: a byte-level (vocabulary 256) LlamaForCausalLM on the Python
standard library's own ``.py`` files, for a wall-clock budget of a few
minutes. The weights are saved once under the user's cache directory
(``$MEMKV_CACHE_DIR``, else ``$XDG_CACHE_HOME/memkv``, else ``~/.cache/memkv``)
and reused while their manifest matches. Files are split by path, so the text
perplexity is measured on (:mod:`memkv.bench.accuracy`) was never trained on.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import sys
import sysconfig
import time
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from memkv.bench.report import console
from memkv.errors import InvalidInputError

__all__ = [
    "DEFAULT_TRAIN_MINUTES",
    "LARGE",
    "MANIFEST",
    "MODELS",
    "MODEL_ID",
    "QUICK",
    "SMALL",
    "ByteCorpus",
    "ModelSpec",
    "TrainedModel",
    "default_cache_dir",
    "load_stdlib_corpus",
    "train_byte_llama",
]

#: Fingerprint id of the trained model's caches.
MODEL_ID = "memkv-byte-llama"
VOCAB = 256  # bytes are the tokens: no tokenizer to ship or download

#: 4 layers, hidden 256, 4 heads of 64, 2 KV heads (GQA like the reference
#: model): ~3 M parameters, some hundreds of steps in a few CPU minutes.
FULL_CONFIG: dict[str, Any] = {
    "vocab_size": VOCAB,
    "hidden_size": 256,
    "intermediate_size": 688,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": True,
}
#: The second, larger model: 8 layers, hidden 512, 8 heads of 64, 2 KV heads
#: (22 M parameters). A codec setting is judged on both, so a default is not
#: fitted to one model's statistics.
LARGE_CONFIG: dict[str, Any] = {
    **FULL_CONFIG,
    "hidden_size": 512,
    "intermediate_size": 1376,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
}
#: Tests: the same architecture, tiny, trained for seconds (figures, not quality).
QUICK_CONFIG: dict[str, Any] = {
    **FULL_CONFIG,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}

DEFAULT_TRAIN_MINUTES = 5.0
QUICK_TRAIN_SECONDS = 2.0
QUICK_MAX_STEPS = 20
QUICK_FILES = 40  # the first files in path order: enough text for seconds of training

#: Cached bytes and scored bytes per evaluation window: contexts of 1024, as
#: agents' caches are long and a codec's error compounds over the context.
#: Training windows: longer than prefix + cont + 1 of the evaluation, so every
#: evaluated position was seen in training.
TRAIN_CONTEXT = 1096
#: Windows per step: with 1096-byte windows, about as many bytes a step as 8 x 288.
BATCH = 2
#: A curriculum: the first part of the budget on short windows (more steps per
#: CPU second; the 1096-byte-only recipe reached 2.02 nats/byte held out in 5
#: minutes, this one 1.53), the rest on full-length ones so every evaluated
#: position is trained.
SHORT_CONTEXT = 288
SHORT_BATCH = 8
SHORT_FRACTION = 0.6
QUICK_CONTEXT = 96
PEAK_LR = 2e-3
MIN_LR_FRACTION = 0.1  # cosine decay (over the time budget) ends at 10% of the peak
WARMUP_STEPS = 30
WEIGHT_DECAY = 0.1
BETAS = (0.9, 0.95)
GRAD_CLIP = 1.0
EVAL_BATCHES = 4  # held-out loss recorded in the manifest

#: One file in HOLDOUT_EVERY (by index in path order) is held out for evaluation.
HOLDOUT_EVERY = 20
FILE_SEPARATOR = b"\n\n"
#: Bump when the data selection or training procedure changes: retrains.
RECIPE_VERSION = 2
MANIFEST = "memkv-manifest.json"
_SECONDS_PER_MINUTE = 60.0


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """One byte-level Llama to train: its architecture, budget and windows.

    Attributes:
        name: directory prefix in the cache and the label in tables.
        config: LlamaConfig keyword arguments.
        minutes: wall-clock training budget.
        context: bytes per training window.
        batch: windows per step.
        short_fraction: share of the budget spent first on short windows.
    """

    name: str
    config: Mapping[str, Any]
    minutes: float
    context: int = TRAIN_CONTEXT
    batch: int = BATCH
    short_fraction: float = SHORT_FRACTION


SMALL = ModelSpec("byte-llama", FULL_CONFIG, DEFAULT_TRAIN_MINUTES)
LARGE = ModelSpec("byte-llama-large", LARGE_CONFIG, 10.0)
QUICK = ModelSpec("byte-llama-quick", QUICK_CONFIG, QUICK_TRAIN_SECONDS / _SECONDS_PER_MINUTE,
                  context=QUICK_CONTEXT, batch=8, short_fraction=0.0)
#: What the codecs suite measures on, in its table's order.
MODELS: tuple[ModelSpec, ...] = (SMALL, LARGE)



# --------------------------------------------------------------------------- corpus


@dataclass(frozen=True, slots=True)
class ByteCorpus:
    """The standard library's sources as bytes, split by file.

    Attributes:
        train: concatenated training files (uint8 ids).
        held_out: concatenated held-out files (uint8 ids).
        files: number of files read.
        held_out_files: number of them held out.
        digest: sha256 over the file paths and sizes (what was read).
    """

    train: torch.Tensor
    held_out: torch.Tensor
    files: int
    held_out_files: int
    digest: str


def _stdlib_files(root: Path) -> list[Path]:
    # Installed third-party packages are not the standard library.
    skip = {"site-packages", "dist-packages"}
    return [p for p in sorted(root.rglob("*.py")) if not skip & set(p.relative_to(root).parts)]


def load_stdlib_corpus(*, quick: bool = False, root: Path | None = None) -> ByteCorpus:
    """Read the ``.py`` files of the standard library in path order, split by file.

    Args:
        quick: read only the first :data:`QUICK_FILES` files.
        root: the directory to read (default ``sysconfig.get_paths()["stdlib"]``).

    Returns:
        :class:`ByteCorpus`; every :data:`HOLDOUT_EVERY`-th file is held out.

    Raises:
        InvalidInputError: no ``.py`` files under ``root``.
    """
    base = Path(sysconfig.get_paths()["stdlib"]) if root is None else root
    files = _stdlib_files(base)
    if quick:
        files = files[:QUICK_FILES]
    if not files:
        raise InvalidInputError(f"expected .py files under {base}, found none")
    train: list[bytes] = []
    held: list[bytes] = []
    digest = hashlib.sha256()
    for i, path in enumerate(files):
        data = path.read_bytes()
        digest.update(f"{path.relative_to(base)}:{len(data)}\n".encode())
        (held if i % HOLDOUT_EVERY == 0 else train).append(data)
    return ByteCorpus(
        train=torch.frombuffer(bytearray(FILE_SEPARATOR.join(train)), dtype=torch.uint8),
        held_out=torch.frombuffer(bytearray(FILE_SEPARATOR.join(held)), dtype=torch.uint8),
        files=len(files),
        held_out_files=len(held),
        digest=digest.hexdigest(),
    )


# --------------------------------------------------------------------------- training


@dataclass(frozen=True, slots=True)
class TrainedModel:
    """What :func:`train_byte_llama` hands back besides the model.

    Attributes:
        path: where the weights are saved (None: quick, in memory only).
        cached: loaded from a previous run rather than trained now.
        manifest: config, recipe, steps, losses and timing of the training.
        corpus: the text (its held-out part is what perplexity is measured on).
    """

    path: Path | None
    cached: bool
    manifest: dict[str, Any]
    corpus: ByteCorpus


def default_cache_dir() -> Path:
    """memkv's cache: ``$MEMKV_CACHE_DIR``, ``$XDG_CACHE_HOME/memkv`` or ``~/.cache/memkv``."""
    override = os.environ.get("MEMKV_CACHE_DIR")
    if override:
        return Path(override).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "memkv"


def _recipe(spec: ModelSpec, seed: int, corpus: ByteCorpus) -> dict[str, Any]:
    return {
        "version": RECIPE_VERSION,
        "config": dict(spec.config),
        "minutes": spec.minutes,
        "seed": seed,
        "context": spec.context,
        "batch": spec.batch,
        "curriculum": [SHORT_CONTEXT, SHORT_BATCH, spec.short_fraction],
        "peak_lr": PEAK_LR,
        "corpus": corpus.digest,
        "python": f"{sys.version_info.major}.{sys.version_info.minor}",
    }


def _recipe_hash(recipe: Mapping[str, Any]) -> str:
    return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:16]


def _valid_manifest(path: Path, recipe: Mapping[str, Any]) -> dict[str, Any] | None:
    """The saved manifest when it describes a finished training of ``recipe``, else None."""
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except (OSError, json.JSONDecodeError):
        return None  # absent or half-written: train again
    if not isinstance(manifest, dict) or manifest.get("recipe") != dict(recipe):
        return None
    steps, loss = manifest.get("steps"), manifest.get("train_loss")
    if not isinstance(steps, int) or steps < 1 or not isinstance(loss, float):
        return None
    return manifest if math.isfinite(loss) else None


def _windows(data: torch.Tensor, count: int, length: int, gen: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, len(data) - length + 1, (count,), generator=gen)
    return torch.stack([data[s : s + length] for s in starts.tolist()]).long()


def _lr(step: int, elapsed_fraction: float) -> float:
    warm = min(1.0, (step + 1) / WARMUP_STEPS)
    cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, elapsed_fraction)))
    return PEAK_LR * warm * (MIN_LR_FRACTION + (1 - MIN_LR_FRACTION) * cosine)


def _held_out_loss(model: Any, corpus: ByteCorpus, spec: ModelSpec,
                   gen: torch.Generator) -> float:
    model.eval()
    losses: list[float] = []
    with torch.no_grad():
        for _ in range(EVAL_BATCHES):
            x = _windows(corpus.held_out, spec.batch, min(spec.context, len(corpus.held_out)),
                         gen)
            losses.append(float(model(input_ids=x, labels=x).loss))
    return sum(losses) / len(losses)


def _train(model: Any, corpus: ByteCorpus, spec: ModelSpec, max_steps: int | None,
           seed: int) -> dict[str, Any]:
    """AdamW on random windows of the training text until the time budget is spent."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    if len(corpus.train) < spec.context:
        raise InvalidInputError(
            f"expected at least {spec.context} bytes of training text, got {len(corpus.train)}"
        )
    budget_s = spec.minutes * _SECONDS_PER_MINUTE
    gen = torch.Generator().manual_seed(seed)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]  # norms: no decay
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": WEIGHT_DECAY}, {"params": no_decay, "weight_decay": 0}],
        lr=PEAK_LR, betas=BETAS,
    )
    model.train()
    step, tokens_seen, loss_ema, start = 0, 0, float("nan"), time.perf_counter()
    columns = (TextColumn("[bold]{task.description}"), BarColumn(),
               TextColumn("step {task.fields[step]} loss {task.fields[loss]:.3f}"),
               TimeElapsedColumn())
    with Progress(*columns, console=console, transient=True) as progress:
        task = progress.add_task(f"train {spec.name}", total=budget_s, step=0, loss=float("nan"))
        while True:
            elapsed = time.perf_counter() - start
            if elapsed >= budget_s or (max_steps is not None and step >= max_steps):
                break
            for group in opt.param_groups:
                group["lr"] = _lr(step, elapsed / budget_s)
            short = elapsed < spec.short_fraction * budget_s
            x = (_windows(corpus.train, SHORT_BATCH, SHORT_CONTEXT, gen) if short else
                 _windows(corpus.train, spec.batch, spec.context, gen))
            loss = model(input_ids=x, labels=x, use_cache=False).loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP)
            opt.step()
            step += 1
            tokens_seen += x.numel()
            value = loss.item()
            loss_ema = value if math.isnan(loss_ema) else 0.9 * loss_ema + 0.1 * value
            progress.update(task, completed=min(budget_s, time.perf_counter() - start),
                            step=step, loss=loss_ema)
    train_s = time.perf_counter() - start
    held = _held_out_loss(model, corpus, spec, gen)
    model.eval()
    return {"steps": step, "train_s": round(train_s, 1), "train_loss": float(loss_ema),
            "held_out_loss": held, "tokens_seen": tokens_seen}


def train_byte_llama(
    cache_dir: Path | None = None,
    *,
    spec: ModelSpec = SMALL,
    minutes: float | None = None,
    seed: int = 0,
    quick: bool = False,
) -> tuple[Any, TrainedModel]:
    """A byte-level Llama trained on the standard library: loaded if cached, else trained.

    Args:
        cache_dir: memkv's cache directory; the model lives in
            ``<cache_dir>/models/<spec.name>-<recipe hash>``. None: the user's
            (:func:`default_cache_dir`), or for ``quick`` no saving at all.
        spec: which model (:data:`SMALL`, :data:`LARGE`).
        minutes: training budget (wall clock) instead of the spec's; part of the
            recipe, so another budget is another model.
        seed: weights and window sampling.
        quick: :data:`QUICK`, a tiny config on a few files for about two seconds
            (tests): figures, not a useful model; ``spec`` and ``minutes`` are ignored.

    Returns:
        ``(model, info)``: an fp32 LlamaForCausalLM in eval mode and :class:`TrainedModel`.

    Raises:
        InvalidInputError: ``minutes`` not positive, or too little text to train on.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    if quick:
        spec = QUICK
    elif minutes is not None:
        if not minutes > 0:
            raise InvalidInputError(f"minutes must be > 0, got {minutes!r}")
        spec = replace(spec, minutes=minutes)
    corpus = load_stdlib_corpus(quick=quick)
    recipe = _recipe(spec, seed, corpus)
    root = cache_dir if cache_dir is not None else (None if quick else default_cache_dir())
    path = None if root is None else root / "models" / f"{spec.name}-{_recipe_hash(recipe)}"
    if path is not None:
        manifest = _valid_manifest(path, recipe)
        if manifest is not None:
            model: Any = LlamaForCausalLM.from_pretrained(
                path, dtype=torch.float32, local_files_only=True).eval()
            return model, TrainedModel(path, True, manifest, corpus)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**spec.config))
    stats = _train(model, corpus, spec, QUICK_MAX_STEPS if quick else None, seed)
    manifest = {"recipe": recipe, **stats, "parameters": sum(p.numel() for p in model.parameters()),
                "corpus_files": corpus.files, "held_out_files": corpus.held_out_files,
                "trained_at": time.strftime("%Y-%m-%d %H:%M:%S %z")}
    if path is not None:
        # Save beside, then rename: a run killed mid-save leaves no model that looks finished.
        tmp = path.with_name(path.name + f".tmp{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        model.save_pretrained(tmp)
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        shutil.rmtree(path, ignore_errors=True)
        try:
            tmp.rename(path)
        except OSError:
            # Another run finished the same recipe first: keep its model, drop ours.
            shutil.rmtree(tmp, ignore_errors=True)
            if _valid_manifest(path, recipe) is None:
                raise
    return model, TrainedModel(path, False, manifest, corpus)
