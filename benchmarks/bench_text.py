"""Peak memory and time of tokenizing + packing one large .txt file: in pieces (liger_models/text/pieces.py,
what training does) against the whole text as one string (what it does for tokenizers it cannot cut). CPU.

The bundled Shakespeare text repeated to about --mb MB (copies joined by a blank line), the demo's tokenizer (a
2048-token byte-level BPE trained on the text), seq_len 1024, no data cache. Each mode runs in a fresh process, so
the resident-set peaks do not mix:

    python benchmarks/bench_text.py [--mb 16 100] [--modes pieces whole] [--out DIR]

Prints one JSON line per size and mode: seconds, windows, the peak RSS above the process's RSS before building
(``resource.getrusage``), and a digest of the windows (the modes must agree).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SEQ_LEN = 1024


def _corpus(out: Path, mb: int) -> tuple[Path, Path]:
    """(text file of about ``mb`` MB, tokenizer dir), built once under ``out``."""
    from liger_models.train.data import save_tokenizer, train_bpe_tokenizer
    from liger_models.train.init_model import bundled_text

    text = bundled_text()
    tok_dir, corpus = out / "tokenizer", out / f"shakespeare_{mb}mb.txt"
    if not (tok_dir / "tokenizer.json").is_file():
        save_tokenizer(train_bpe_tokenizer([text]), tok_dir)
    if not corpus.is_file():
        copies = -(-mb * 10**6 // len(text.encode("utf-8")))
        with corpus.open("w", encoding="utf-8") as f:
            for i in range(copies):
                f.write(("\n\n" if i else "") + text.strip())
    return corpus, tok_dir


def _one_mode(corpus: Path, tok_dir: Path, whole: bool) -> dict:
    """Build the dataset once in this process; what the parent prints."""
    from liger_models.hub import load_tokenizer
    from liger_models.text.pieces import TextSplitter
    from liger_models.train import dataset as datasets
    from liger_models.train.data import build_dataset, read_special_tokens

    if whole:  # the text as one string, as for a tokenizer that cannot cut it
        class Whole(TextSplitter):
            def __init__(self, tokenizer):
                super().__init__(tokenizer)
                self.reason = "benchmark: the whole text"

        datasets.TextSplitter = Whole
    tokenizer = load_tokenizer(tok_dir)
    special = read_special_tokens(tokenizer, tok_dir)
    before = _rss_kib()
    start = time.perf_counter()
    dataset = build_dataset([corpus], tokenizer, special, SEQ_LEN)
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    digest = hashlib.sha256()
    for t in (dataset.input_ids, dataset.labels, dataset.position_ids):
        digest.update(t.numpy().tobytes())
    return {"seconds": round(seconds, 1), "windows": len(dataset),
            "peak_rss_above_start_mib": (peak - before) // 1024, "peak_rss_mib": peak // 1024,
            "digest": digest.hexdigest()[:16]}


def _rss_kib() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, nargs="+", default=[16, 100])
    parser.add_argument("--modes", nargs="+", default=["pieces", "whole"], choices=("pieces", "whole"))
    parser.add_argument("--out", default=None, help="working directory (default: a temporary one)")
    parser.add_argument("--child", nargs=3, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        corpus, tok_dir, mode = args.child
        print(json.dumps(_one_mode(Path(corpus), Path(tok_dir), mode == "whole")))
        return
    out = Path(args.out or tempfile.mkdtemp(prefix="bench_text_"))
    out.mkdir(parents=True, exist_ok=True)
    for mb in args.mb:
        corpus, tok_dir = _corpus(out, mb)
        for mode in args.modes:
            run = subprocess.run([sys.executable, __file__, "--child", str(corpus), str(tok_dir), mode],
                                 capture_output=True, text=True)
            if run.returncode != 0:
                print(json.dumps({"mb": mb, "mode": mode, "error": run.stderr.strip().splitlines()[-1:]}), flush=True)
                continue
            line = run.stdout.strip().splitlines()[-1]
            print(json.dumps({"mb": mb, "mode": mode, "bytes": corpus.stat().st_size, **json.loads(line)}),
                  flush=True)


if __name__ == "__main__":
    main()
