"""Tokenize + pack time and peak memory of the training data pipeline, and a cache hit's load time (CPU).

The bundled Shakespeare text, one JSONL document per paragraph, repeated to about --tokens tokens, with the demo's
tokenizer (a 2048-token byte-level BPE trained on the text); seq_len 1024. Each mode runs in a fresh process, so
the resident-set peaks do not mix:

    python benchmarks/bench_data.py [--tokens 20000000] [--out DIR]

Prints one JSON line per mode: miss (tokenize, pack, write the cache) and hit (load it), with seconds, windows and
the peak RSS above the process's own start, and a digest of the windows (the two must agree).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SEQ_LEN = 1024


def _corpus(out: Path, tokens: int) -> tuple[Path, Path]:
    """(corpus.jsonl, tokenizer dir), built once under ``out``."""
    from liger_models.train.data import save_tokenizer, train_bpe_tokenizer
    from liger_models.train.init_model import bundled_text

    text = bundled_text()
    tok_dir, corpus = out / "tokenizer", out / "corpus.jsonl"
    if not (tok_dir / "tokenizer.json").is_file():
        save_tokenizer(train_bpe_tokenizer([text]), tok_dir)
    if not corpus.is_file():
        from liger_models.hub import load_tokenizer

        per_copy = len(load_tokenizer(tok_dir).encode(text).ids)
        paragraphs = [p for p in text.split("\n\n") if p.strip()]
        with corpus.open("w", encoding="utf-8") as f:
            for _ in range(-(-tokens // per_copy)):
                f.writelines(json.dumps({"text": p}) + "\n" for p in paragraphs)
    return corpus, tok_dir


def _one_mode(out: Path) -> dict:
    """Build (or load) the dataset once in this process; what the parent prints."""
    from liger_models.hub import load_tokenizer
    from liger_models.train.data import build_dataset, read_special_tokens

    corpus, tok_dir = out / "corpus.jsonl", out / "tokenizer"
    tokenizer = load_tokenizer(tok_dir)
    special = read_special_tokens(tokenizer, tok_dir)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    data = build_dataset([corpus], tokenizer, special, SEQ_LEN, cache_dir=out / "cache")
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    digest = hashlib.sha256()
    for t in (data.input_ids, data.labels, data.position_ids):
        digest.update(t.numpy().tobytes())
    return {"seconds": round(seconds, 2), "windows": len(data), "tokens": data.input_ids.numel(),
            "peak_rss_above_start_mib": (peak - before) // 1024, "digest": digest.hexdigest()[:16]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=20_000_000)
    parser.add_argument("--out", default=None, help="working directory (default: a temporary one)")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(_one_mode(Path(args.child))))
        return
    out = Path(args.out or tempfile.mkdtemp(prefix="bench_data_"))
    out.mkdir(parents=True, exist_ok=True)
    _corpus(out, args.tokens)
    for mode in ("miss", "hit"):
        line = subprocess.run([sys.executable, __file__, "--child", str(out)], check=True, capture_output=True,
                              text=True).stdout.strip().splitlines()[-1]
        print(json.dumps({"mode": mode, **json.loads(line)}), flush=True)


if __name__ == "__main__":
    main()
