"""Storage -> tokenize -> pack -> batch -> distribute (the training data flow).

Documents are tokenized once with the `tokenizers` library, joined with the end-of-text token and
stored as a flat token stream (validation_split holds out whole documents by a stable hash, or the
stream's tail when there are too few documents for that) in a cache keyed by the corpus files, the tokenizer and the split
(numpy memmaps: nothing is re-tokenized on resume or by other ranks). Sequence i of the packed data
is stream[i*L : i*L + L + 1] -- input and next-token labels from one window.

Order is a pure function of (seed, step): step s takes positions [(s-1)*G, s*G) of an endless
concatenation of per-epoch permutations, and data-parallel rank r takes its contiguous G/dp slice.
So the ranks read disjoint parts, a resumed run continues exactly where it stopped, and a run on
any number of ranks sees the same global batches as a single process.
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer
from tqdm import tqdm

from pagedllm.training.config import DataConfig
from pagedllm.training.corpus import Document, iter_documents, source_files
from pagedllm.training.tokenizer import special_token_ids, tokenizer_files

CACHE_VERSION = 2
# Documents longer than this many characters are encoded in pieces so tokenization stays parallel.
ENCODE_BATCH = 256
# Off a terminal (a job's train.log, a CI log) the bar is off: a line with the counts this often instead.
PROGRESS_EVERY_S = 10.0


def default_cache_dir() -> Path:
    return Path(os.environ.get("PAGEDLLM_CACHE", Path.home() / ".cache" / "pagedllm")) / "datasets"


def cache_key(data: DataConfig) -> str:
    """Changes whenever the corpus files, the tokenizer or the split change."""
    tokenizer_json, _ = tokenizer_files(data.tokenizer_path)
    h = hashlib.sha256()
    h.update(json.dumps([CACHE_VERSION, data.dataset_path, data.file_glob, data.validation_split]).encode())
    h.update(hashlib.sha256(tokenizer_json.read_bytes()).digest())
    for file in source_files(data.dataset_path, data.file_glob):
        stat = file.stat()
        h.update(f"{file}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    return h.hexdigest()[:24]


def is_validation(doc: Document, fraction: float) -> bool:
    """A stable per-document coin: the same document lands in the same split on every machine."""
    digest = hashlib.sha256(doc.doc_id.encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < fraction


def encode_documents(docs: list[Document], tokenizer: Tokenizer) -> Iterator[tuple[Document, list[int]]]:
    """Each document with its token ids (no special tokens), encoded ENCODE_BATCH at a time."""
    for start in range(0, len(docs), ENCODE_BATCH):
        chunk = docs[start:start + ENCODE_BATCH]
        for doc, encoding in zip(chunk, tokenizer.encode_batch([d.text for d in chunk], add_special_tokens=False)):
            yield doc, encoding.ids


def build_cache(data: DataConfig, cache_dir: Path) -> Path:
    """Tokenize the corpus into cache_dir/<key>/{train,val}.bin; returns that folder (reused if present)."""
    folder = cache_dir / cache_key(data)
    if (folder / "meta.json").is_file():
        return folder
    tokenizer_json, _ = tokenizer_files(data.tokenizer_path)
    tokenizer = Tokenizer.from_file(str(tokenizer_json))
    eos = special_token_ids(data.tokenizer_path)["eos_token"]
    splits: dict[str, list[np.ndarray]] = {"train": [], "val": []}
    docs = list(iter_documents(data.dataset_path, data.file_glob))
    if not docs:
        raise ValueError(f"data_config.dataset_path: no text documents in {data.dataset_path}")
    # Tokenizing a large corpus takes minutes once (issue 44: ~100 s of silence): say so, with a bar on a terminal.
    started = time.perf_counter()
    print(f"tokenizing {len(docs):,} documents ({sum(len(d.text) for d in docs) / 1e6:,.1f} M characters) of "
          f"{data.dataset_path} into {folder} (once: later runs reuse it)", file=sys.stderr, flush=True)
    terminal = sys.stderr.isatty()
    bar = tqdm(total=len(docs), unit="doc", file=sys.stderr, disable=not terminal, mininterval=1)
    reported, tokens = started, 0
    for done, (doc, ids) in enumerate(encode_documents(docs, tokenizer), start=1):
        ids = ids + ([eos] if eos is not None else [])
        splits["val" if is_validation(doc, data.validation_split) else "train"].append(np.asarray(ids))
        tokens += len(ids)
        bar.update()
        now = time.perf_counter()
        if not terminal and done < len(docs) and now - reported >= PROGRESS_EVERY_S:
            print(f"tokenizing: {done:,} of {len(docs):,} documents, {tokens:,} tokens, {now - started:.0f} s",
                  file=sys.stderr, flush=True)
            reported = now
    bar.close()
    dtype = np.uint16 if tokenizer.get_vocab_size() <= 2**16 else np.uint32
    streams = {name: np.concatenate(parts).astype(dtype) if parts else np.zeros(0, dtype) for name, parts in splits.items()}
    if data.validation_split > 0 and not (streams["train"].size and streams["val"].size):
        streams = _tail_split(np.concatenate([streams["train"], streams["val"]]), data.validation_split)
    folder.mkdir(parents=True, exist_ok=True)
    counts = {}
    for name, stream in streams.items():
        tmp = folder / f"{name}.bin.tmp"
        stream.tofile(tmp)
        tmp.replace(folder / f"{name}.bin")
        counts[name] = int(stream.size)
    meta = {"dtype": np.dtype(dtype).name, "tokens": counts, "documents": len(docs),
            "dataset_path": data.dataset_path, "tokenizer": str(tokenizer_json)}
    (folder / "meta.json.tmp").write_text(json.dumps(meta, indent=2))
    (folder / "meta.json.tmp").replace(folder / "meta.json")
    print(f"tokenized: {counts['train']:,} training and {counts['val']:,} validation tokens in "
          f"{time.perf_counter() - started:.1f} s", file=sys.stderr, flush=True)
    return folder


def _tail_split(stream: np.ndarray, fraction: float) -> dict[str, np.ndarray]:
    """Too few documents for a per-document split (a single file, say): hold out the stream's tail."""
    cut = len(stream) - int(len(stream) * fraction)
    return {"train": stream[:cut], "val": stream[cut:]}


class TokenStream:
    """A packed split: `num_sequences` windows of sequence_length + 1 tokens over one memmap."""

    def __init__(self, path: Path, dtype: str, seq_len: int) -> None:
        self.tokens = np.memmap(path, dtype=dtype, mode="r") if path.stat().st_size else np.zeros(0, dtype)
        self.seq_len = seq_len
        self.num_sequences = max(0, (len(self.tokens) - 1) // seq_len)

    def window(self, index: int) -> np.ndarray:
        start = index * self.seq_len
        return np.asarray(self.tokens[start:start + self.seq_len + 1], dtype=np.int64)

    def batch(self, indices: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, labels), each (len(indices), seq_len) int64."""
        windows = torch.from_numpy(np.stack([self.window(int(i)) for i in indices]))
        return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()


@dataclass
class BatchPlan:
    """Which sequences each step and each data-parallel rank reads; pure arithmetic, no state."""

    num_sequences: int
    global_batch: int
    dp_rank: int
    dp_size: int
    seed: int

    def global_indices(self, step: int) -> np.ndarray:
        """Sequence indices of global step `step` (1-based), drawn from per-epoch permutations."""
        positions = np.arange((step - 1) * self.global_batch, step * self.global_batch)
        epochs = positions // self.num_sequences
        out = np.empty_like(positions)
        for epoch in np.unique(epochs):
            perm = np.random.default_rng([self.seed, int(epoch)]).permutation(self.num_sequences)
            mask = epochs == epoch
            out[mask] = perm[positions[mask] % self.num_sequences]
        return out

    def rank_indices(self, step: int) -> np.ndarray:
        per_rank = self.global_batch // self.dp_size
        return self.global_indices(step)[self.dp_rank * per_rank:(self.dp_rank + 1) * per_rank]

    def epoch(self, step: int) -> float:
        return step * self.global_batch / self.num_sequences


class RankSplits:
    """A training and a validation split read by data-parallel ranks: each step's batch and the
    validation windows shared out by rank. Subclasses set train, val (with `batch` and
    `num_sequences`), plan, dp_rank, dp_size and eval_sequences."""

    def step_batch(self, step: int) -> tuple[torch.Tensor, ...]:
        """This rank's (inputs, labels[, segments]) for global step `step`: global_batch / dp sequences."""
        return self.train.batch(self.plan.rank_indices(step))

    def val_indices(self) -> np.ndarray:
        """This rank's share of the first eval_sequences validation windows (fixed, so evals compare)."""
        total = min(self.eval_sequences, self.val.num_sequences)
        total -= total % self.dp_size
        per_rank = total // self.dp_size
        return np.arange(self.dp_rank * per_rank, (self.dp_rank + 1) * per_rank)


class TrainingData(RankSplits):
    """The train and validation streams of one job, and this rank's share of each."""

    def __init__(self, data: DataConfig, folder: Path, dp_rank: int, dp_size: int, seed: int) -> None:
        meta = json.loads((folder / "meta.json").read_text())
        self.train = TokenStream(folder / "train.bin", meta["dtype"], data.sequence_length)
        self.val = TokenStream(folder / "val.bin", meta["dtype"], data.sequence_length)
        if self.train.num_sequences < 1:
            raise ValueError(
                f"data_config.sequence_length: the training split holds {len(self.train.tokens)} tokens, "
                f"fewer than one sequence of {data.sequence_length}"
            )
        self.plan = BatchPlan(self.train.num_sequences, data.global_batch_size, dp_rank, dp_size, seed)
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.eval_sequences = data.eval_sequences

