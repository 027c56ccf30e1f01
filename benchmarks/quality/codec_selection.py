"""Does blend's selection spend its rows on compression error? (issue 70)

For each held-out question and codec, blend runs once on float32 entries (the codec-free
reference) and once on the codec's entries, same prompt, same defaults but the first chunk's
exact entry (off in both, so every chunk is approximate in both runs). Per approximate row
(cached, not in an exact segment) it measures the codec's compression error at the first
check layer (squared L2 of decoded − float32 K and V over every KV head, the quantity
kv-deviation adds to the context deviation) and reports:

- ``overlap``: |rows recomputed on both| / |rows recomputed with the codec| (1: compression
  moved no selection);
- ``error_share_selected``: the share of all compression error (layer 1) that sits in the rows
  the codec run recomputes, against ``rows_share_selected``, their share of the rows (equal
  shares: selection ignores compression error; larger: it spends rows on it);
- ``error_rank_selected``: the mean percentile of the recomputed rows' compression error.

    python benchmarks/quality/codec_selection.py --dataset ../shared/data/musique_dev.json \\
        --offset 12 --limit 8 --out benchmarks/results/amd-avx2
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from ragblend.bench import study
from ragblend.store import MemoryStore


def row_errors(reference, coded, layer: int) -> torch.Tensor:
    """Per prompt row: squared error of ``coded``'s layer-``layer`` K and V against
    ``reference``'s, over every head (0 for rows without a cache in either)."""
    rows = []
    for seg_ref, seg_cod in zip(reference, coded, strict=True):
        n = len(seg_ref)
        if seg_ref.kv is None or seg_cod.kv is None or seg_ref.exact:
            rows.append(torch.zeros(n))
            continue
        k0, v0 = seg_ref.kv.layer(layer)
        k1, v1 = seg_cod.kv.layer(layer)
        err = ((k1.float() - k0.float()) ** 2).sum((0, 2)) + ((v1.float() - v0.float()) ** 2).sum(
            (0, 2)
        )
        rows.append(err)
    return torch.cat(rows)


def approximate_rows(segments) -> torch.Tensor:
    """Bool per prompt row: served from a non-exact cache (a row blend may or may not
    recompute)."""
    return torch.cat(
        [
            torch.full((len(s),), s.kv is not None and not s.exact, dtype=torch.bool)
            for s in segments
        ]
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    study.add_case_arguments(ap, offset=12, limit=8, max_new_tokens=None)
    ap.add_argument("--codecs", default="int8,int4,pca4,pca2")
    ap.add_argument("--dtype", default="float32")
    study.add_output_arguments(ap)
    args = ap.parse_args()
    codecs = [c for c in args.codecs.split(",") if c]
    engine = study.engine(
        args,
        "embedded",
        dtype=args.dtype,
        kv_dtype="float32",
        exact_first_chunk=False,  # every chunk approximate in both runs: like with like
        store=MemoryStore(1 << 40),
    )
    check = engine.config.check_layers[0]
    cases = study.cases(args, engine.tokenizer)
    views = {c: engine.with_config(kv_dtype=c) for c in codecs}
    per: dict[str, list[dict]] = {c: [] for c in codecs}
    for i, case in enumerate(cases):
        engine.precompute(case.chunks)
        prompt = engine.tokenize(case.question, case.chunks)
        ref_segments, _ = engine.chunks.lookup(prompt)
        ref = engine.prefill(prompt, mode="blend")
        ref_rows = set(ref.fusion.selected.tolist())
        for codec, view in views.items():
            view.precompute(case.chunks)
            segments, _ = view.chunks.lookup(prompt)
            out = view.prefill(prompt, mode="blend")
            mask = approximate_rows(segments)
            err = row_errors(ref_segments, segments, check)
            selected = torch.zeros_like(mask)
            selected[out.fusion.selected] = True
            picked = selected & mask
            rank = err[mask].argsort().argsort().float() / max(1, int(mask.sum()) - 1)
            ranks = torch.zeros_like(err)
            ranks[mask] = rank
            rows = set(torch.nonzero(picked).flatten().tolist())
            per[codec].append(
                {
                    "overlap": len(rows & ref_rows) / max(1, len(rows)),
                    "error_share_selected": float(err[picked].sum() / err[mask].sum()),
                    "rows_share_selected": float(picked.sum() / mask.sum()),
                    "error_rank_selected": float(ranks[picked].mean()),
                }
            )
        print(f"question {i + 1}/{len(cases)}", flush=True)
    summary = {
        c: {k: statistics.fmean(r[k] for r in rows) for k in rows[0]} for c, rows in per.items()
    }
    result = {
        "settings": {**vars(args), "check_layer": check, "n": len(cases)},
        "codecs": summary,
        "per_question": per,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "codec_selection.json").write_text(json.dumps(result, indent=2))
    for c, s in summary.items():
        print(c, {k: round(v, 3) for k, v in s.items()})


if __name__ == "__main__":
    main()
