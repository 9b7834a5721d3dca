"""BERT data at scale: start-up (block building) and peak memory per rank, and preprocess throughput.

Start-up: a generated corpus of ``--sentences`` sentences (documents of 1-60
sentences of 5-45 tokens) is written straight to ``PREFIX.bin`` / ``PREFIX.idx``
(the index for real, the token file sparse: start-up never reads tokens), so
tokenization is skipped. Each variant then builds the ``BertDataset`` in a fresh
process, as every rank does at start: "vectorized" is hetfair's ``build_blocks``,
"loop" the Python loop it replaced (kept here). Reported: seconds to construct the
dataset, and the process's peak RSS over its RSS after the imports (the memory-mapped
index pages it reads count in RSS; the token file is never touched). Both variants
print a checksum of their blocks: equal checksums, equal blocks.

Preprocess: ``hetfair-preprocess --workers 2`` on a smaller generated text corpus
(``--preprocess-sentences``, random words, WordPiece vocabulary of those words), as
sentences per second of wall time.

    python benchmarks/bench_bert_data.py [--sentences 20000000] [--variants vectorized,loop]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from block_reference import reference_blocks  # the loop before vectorizing; benchmarks/ is on sys.path

SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]



def generate_binary(prefix: str, n_sentences: int, seed: int = 0) -> tuple[int, int]:
    """Write PREFIX.idx (real offsets) and a sparse PREFIX.bin; return (documents, tokens)."""
    from hetfair.data import indexed_dataset as ix

    rng = np.random.default_rng(seed)
    per_document = rng.integers(1, 61, n_sentences // 30 + 10)
    document_index = np.concatenate([[0], np.cumsum(per_document)])
    document_index = document_index[document_index < n_sentences]
    document_index = np.append(document_index, n_sentences).astype("<i8")
    offsets = np.zeros(n_sentences + 1, dtype="<i8")
    np.cumsum(rng.integers(5, 46, n_sentences), out=offsets[1:])
    n_tokens = int(offsets[-1])
    header = np.array([(ix._VERSION, 1, n_sentences, len(document_index) - 1)], dtype=ix._HEADER)  # uint16 tokens
    with open(prefix + ".idx", "wb") as f:
        f.write(ix._MAGIC)
        f.write(header.tobytes())
        f.write(offsets.tobytes())
        f.write(document_index.tobytes())
    with open(prefix + ".bin", "wb") as f:
        f.truncate(n_tokens * 2)
    return len(document_index) - 1, n_tokens


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def child(args: argparse.Namespace) -> None:
    """One rank's start: open the split and build the dataset; print a JSON line."""
    from hetfair.bert import dataset
    from hetfair.data.indexed_dataset import IndexedDataset
    from hetfair.bert.masking import MaskingConfig
    from hetfair.bert.tokenizer import Vocabulary

    if args.child == "loop":
        dataset.build_blocks = reference_blocks
    vocab = Vocabulary.from_tokens(SPECIALS + [f"w{i}" for i in range(1000)], "generated")
    before = rss_mb()
    start = time.perf_counter()
    data = IndexedDataset(args.prefix)
    bert = dataset.BertDataset(data, vocab, args.tokens_per_sample, MaskingConfig(), seed=1, nsp=args.nsp)
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    blocks = bert.blocks
    checksum = int((blocks[:, 0] * 3 + blocks[:, 1]).sum() % (1 << 61)) ^ len(blocks)
    bert[len(bert) // 2]  # a sample reads its tokens through the map
    print(json.dumps({"seconds": seconds, "blocks": len(blocks), "baseline_mb": before,
                      "peak_mb": peak, "checksum": checksum}))


def measure_startup(prefix: str, variant: str, args: argparse.Namespace) -> dict:
    argv = [sys.executable, __file__, "--child", variant, "--prefix", prefix,
            "--tokens-per-sample", str(args.tokens_per_sample), *(["--nsp"] if args.nsp else [])]
    out = subprocess.run(argv, check=True, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return json.loads(out.stdout.strip().splitlines()[-1])


def measure_preprocess(n_sentences: int, workdir: Path) -> float:
    rng = np.random.default_rng(0)
    words = [f"word{i}" for i in range(2000)]
    text = workdir / "corpus.txt"
    with open(text, "w") as f:
        written = 0
        while written < n_sentences:
            for _ in range(int(rng.integers(1, 61))):
                picks = rng.integers(0, len(words), int(rng.integers(4, 30)))
                f.write(" ".join(words[i] for i in picks) + ".\n")
                written += 1
            f.write("\n")
    vocab = workdir / "vocab.txt"
    vocab.write_text("\n".join(SPECIALS + words + ["."]) + "\n")
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "hetfair_cli.preprocess", "--trainpref", str(text), "--dict", str(vocab),
                    "--workers", "2", "--destdir", str(workdir / "bin")], check=True, capture_output=True)
    return written / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sentences", type=int, default=20_000_000, help="sentences of the start-up corpus")
    parser.add_argument("--tokens-per-sample", type=int, default=128)
    parser.add_argument("--nsp", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--variants", default="vectorized,loop", help="comma-separated: vectorized, loop")
    parser.add_argument("--preprocess-sentences", type=int, default=200_000, help="0: skip the preprocess run")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--prefix", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        if args.preprocess_sentences:
            rate = measure_preprocess(args.preprocess_sentences, workdir)
            print(f"hetfair-preprocess --workers 2: {args.preprocess_sentences} sentences, {rate:,.0f} sentences/s",
                  flush=True)
        prefix = str(workdir / "train")
        start = time.perf_counter()
        documents, tokens = generate_binary(prefix, args.sentences)
        print(f"generated {args.sentences:,} sentences, {documents:,} documents, {tokens:,} tokens "
              f"({time.perf_counter() - start:.1f} s); tokens_per_sample {args.tokens_per_sample}, nsp {args.nsp}",
              flush=True)
        print(f"{'variant':<11} {'start-up s':>10} {'blocks':>11} {'peak RSS MB':>12} {'over imports MB':>16}  checksum")
        for variant in args.variants.split(","):
            r = measure_startup(prefix, variant, args)
            print(f"{variant:<11} {r['seconds']:>10.2f} {r['blocks']:>11,} {r['peak_mb']:>12.0f} "
                  f"{r['peak_mb'] - r['baseline_mb']:>16.0f}  {r['checksum']}", flush=True)


if __name__ == "__main__":
    main()
