"""nanoGPT's own `train.py` beside the harness: its data written here, its command lines, its judge.

nanoGPT's `data/shakespeare_char/prepare.py` downloads Tiny Shakespeare with `requests` when `input.txt` is missing;
a GPU machine without internet (and without `requests`) cannot run it. `prepare_shakespeare_char` writes what it
writes, from the harness's data file: the vocabulary is the sorted set of the text's characters, `train.bin` the ids
of the first 90 % of the characters and `val.bin` the rest, as uint16, and `meta.pkl` a pickle of
{'vocab_size', 'itos', 'stoi'}; nanoGPT's `train.py` reads them with `np.memmap(..., dtype=np.uint16)` and the
vocabulary size from `meta.pkl`. The checkout (`--nanogpt`: karpathy/nanoGPT, carried to the machine, never
committed here) is copied into the check's directory, so nothing is written outside --out.
"""

from __future__ import annotations

import pickle
import re
import shutil
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from gpucheck.judges import Outcome, Verdict, last_line

OUT_DIR = "nanogpt-out"  # nanoGPT's --out_dir, inside the copy of the checkout
FILES = ("train.py", "model.py", "configurator.py", "config/train_shakespeare_char.py")  # what a checkout must have


def prepare_shakespeare_char(text: str, data_dir: Path) -> dict[str, Any]:
    """Write `train.bin`, `val.bin` and `meta.pkl` into `data_dir` exactly as nanoGPT's
    data/shakespeare_char/prepare.py does for `text`; returns the meta dictionary."""
    chars = sorted(set(text))
    if len(chars) > np.iinfo(np.uint16).max + 1:
        raise ValueError(f"{len(chars)} distinct characters do not fit nanoGPT's uint16 ids")
    stoi = {ch: i for i, ch in enumerate(chars)}
    itos = {i: ch for i, ch in enumerate(chars)}
    n = len(text)
    ids = np.array([stoi[c] for c in text], dtype=np.uint16)
    data_dir.mkdir(parents=True, exist_ok=True)
    ids[:int(n * 0.9)].tofile(data_dir / "train.bin")
    ids[int(n * 0.9):].tofile(data_dir / "val.bin")
    meta = {"vocab_size": len(chars), "itos": itos, "stoi": stoi}
    with open(data_dir / "meta.pkl", "wb") as f:
        pickle.dump(meta, f)
    return meta


def missing_files(checkout: Path) -> list[str]:
    """What a nanoGPT checkout lacks for the checks (train.py, model.py, configurator.py, the recipe's config)."""
    return [f for f in FILES if not (checkout / f).is_file()]


def preparer(checkout: Path, data: Path) -> Callable[[Path], None]:
    """The check's preparation: copy what train.py runs (FILES) from the checkout into `<check>/nanoGPT` and write
    its shakespeare_char data from `data` (read as nanoGPT's prepare.py reads input.txt: text, UTF-8)."""
    def prepare(where: Path) -> None:
        work = where / "nanoGPT"
        for name in FILES:
            (work / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(checkout / name, work / name)
        prepare_shakespeare_char(data.read_text(encoding="utf-8"), work / "data" / "shakespeare_char")

    return prepare


def cleanup(where: Path) -> None:
    """nanoGPT saves a checkpoint at every improved evaluation (130 MB at the recipe's size): delete it."""
    (where / "nanoGPT" / OUT_DIR / "ckpt.pt").unlink(missing_ok=True)


def argv(dry: bool, iters: int, compiled: bool) -> list[str]:
    """train.py on its shakespeare-char config: on a GPU its own defaults (bf16 where supported, evaluation every
    250 iterations on 200 batches) for the full 5000 iterations, or 300 iterations timed with one evaluation; a
    dry run's model is tiny, on the CPU in float32."""
    if dry:
        shape = ["--device=cpu", "--dtype=float32", "--batch_size=2", "--block_size=32", "--n_layer=1", "--n_head=2",
                 "--n_embd=32", "--max_iters=3", "--eval_interval=3", "--eval_iters=1", "--log_interval=1"]
    elif iters == 5000:
        shape = []
    else:
        shape = [f"--max_iters={iters}", "--eval_interval=1000", "--eval_iters=20", "--log_interval=10"]
    return [sys.executable, "train.py", "config/train_shakespeare_char.py", f"--compile={compiled}", *shape,
            f"--out_dir={OUT_DIR}"]


def judge(check: Any, o: Outcome) -> Verdict:
    """Exit 0 and nanoGPT's per-iteration times ("iter N: loss L, time T ms"; the median over the iterations after
    the first, which compiles and warms up) and evaluations ("step N: train loss X, val loss Y"; the best)."""
    iters = [(int(m[1]), float(m[2]), float(m[3]))
             for m in re.finditer(r"iter (\d+): loss ([\d.]+), time ([\d.]+)ms", o.stdout)]
    evals = [(int(m[1]), float(m[2]), float(m[3]))
             for m in re.finditer(r"step (\d+): train loss ([\d.]+), val loss ([\d.]+)", o.stdout)]
    times = [t for i, _, t in iters if i > 0] or [t for _, _, t in iters]
    median = statistics.median(times) if times else None
    best = min(evals, key=lambda e: e[2]) if evals else None
    figs = {"ms_per_iter": median, "iterations": len(iters), "last_loss": iters[-1][1] if iters else None,
            "best_val_loss": best[2] if best else None, "best_step": best[0] if best else None}
    if median is None:
        return False, f"no iteration lines of nanoGPT in {o.out / 'stdout.txt'} (exit status {o.rc}): " \
                      f"{last_line(o)}", figs
    text = f"nanoGPT: median {median} ms/iter over {len(times)} iterations"
    if best:
        text += f"; best val {best[2]} at step {best[0]}"
    return o.rc == 0, text if o.rc == 0 else f"exit status {o.rc}: {last_line(o)}", figs
