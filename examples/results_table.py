"""Render the README's result tables from `pc-rag eval` JSON, so no figure is copied by hand.

    python examples/results_table.py examples/results/levers30.json [more.json ...] [--dataset all] [--columns ...]

Given `pc-rag bench peers --json` files instead, prints TTFT, speedup and decode speed per peer (given
`pc-rag bench encode --json` files, encoding throughput per path and dtype; given `pc-rag bench memory
--json` files, bytes per token per codec and dtype; given `pc-rag bench codec --json` files, CacheGen size
and speed per level; given `pc-rag bench link --json` files, cold TTFT per storage and link speed; given
`examples/codec_allocation.py --json` files, KL against size per step allocation); given
`examples/oracle_sweep.py --json` files, first-token and 8-token KL per selection and recompute budget; given
`examples/adapter_levers.py collect` files, each adapter lever's training and `fast` against full prefill; given
`pc-rag bench serve --json` files, throughput, identity and KV held per run, their median, and the attention step;
given `pc-rag bench scaleout --json` runs, encoding throughput and TTFT from Redis against local per run;
given `examples/load_test.py --json` files, requests, failures and latency per run; given `pc-rag store recode
--json` files, the store's size before and after, bytes per token and encode speed; given `pc-rag bench ttft --json`
files, full-prefill and cached TTFT, the floor and the speedup per context length; given
`examples/decode_kernels_floor.py --json` files, each decode kernel's time, GB/s and gap to its floor).
``--summary`` prints only the first table of a kind that has two (bench serve, bench scaleout).
Otherwise prints a Markdown table with one row per (dataset, mode) of the chosen datasets: F1 and its change
against full prefill with the paired bootstrap interval, answer identity, first-token agreement and KL,
the teacher-forced KL and agreement over 8 tokens, TTFT median and the speedup over full prefill
(``--sizes`` a `pc-rag bench codec --json` file: the ``bytes`` column gives each ``MODE@cachegen:N`` row that
level's bytes per token).
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

Row = dict[str, Any]


def _delta(row: Row, key: str = "f1_delta") -> str:
    if row.get(key) is None:
        return ""
    low, high = row[f"{key}_ci95"]
    return f"{row[key]:+.2f} [{low:+.2f}, {high:+.2f}]"


def _share(key: str) -> Callable[[Row], str]:
    return lambda row: "" if row.get(key) is None else f"{100 * row[key]:.1f}%"


def _number(key: str, digits: int) -> Callable[[Row], str]:
    return lambda row: "" if row.get(key) is None else f"{row[key]:,.{digits}f}"


COLUMNS: dict[str, tuple[str, Callable[[Row], str]]] = {
    "n": ("n", _number("n", 0)),
    "context": ("context", _number("context_tokens_mean", 0)),
    "f1": ("F1", _number("f1", 2)),
    "df1": ("ΔF1 vs full [95% CI]", _delta),
    "identical": ("answer = full", _share("identical")),
    "tok1": ("first token = full", _share("first_token_agreement")),
    "kl": ("KL(full‖mode)", _number("first_token_kl", 3)),
    "tfkl": ("8-token KL", _number("teacher_forced_kl", 3)),
    "tfagr": ("8-token agreement", _share("teacher_forced_agreement")),
    "ttft": ("TTFT p50", lambda r: f"{r['ttft_ms_median']:,.0f} ms"),
    "speedup": ("speedup", lambda r: "" if r.get("speedup") is None else f"{r['speedup']:.1f}x"),
    "recall": ("recall@k", _number("retrieval_recall", 3)),
    "bytes": ("B/token", _number("bytes_per_token", 0)),
    "codec_kl": ("KL(uncompressed‖compressed)", _number("codec_kl", 4)),
    "codec_agr": ("first token = uncompressed", _share("codec_agreement")),
    "codec_df1": (
        "ΔF1 vs uncompressed [95% CI]",
        lambda r: (
            ""
            if r.get("codec_f1_delta") is None
            else f"{r['codec_f1_delta']:+.2f} [{r['codec_f1_delta_ci95'][0]:+.2f}, {r['codec_f1_delta_ci95'][1]:+.2f}]"
        ),
    ),
}
DEFAULT = "n,context,f1,df1,identical,tok1,kl,tfkl,tfagr,ttft,speedup"


def table(rows: list[Row], datasets: list[str] | None, columns: list[str]) -> str:
    """Markdown rows for ``datasets`` (all when None); ``speedup`` is full prefill's TTFT median over the mode's."""
    full = {(r["setting"], r["dataset"]): r["ttft_ms_median"] for r in rows if r["mode"] == "full"}
    chosen = [r for r in rows if datasets is None or r["dataset"] in datasets]
    for r in chosen:  # runs that list no full row (``--modes default``) still hold deltas against it
        base = full.get((r["setting"], r["dataset"]))
        r["speedup"] = base / r["ttft_ms_median"] if base is not None else None
    lead = ["setting"] if len({r["setting"] for r in chosen}) > 1 else []
    head = [*lead, "dataset", "mode", *(COLUMNS[c][0] for c in columns)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in chosen:
        mode = "full prefill" if r["mode"] == "full" else f"`{r['mode']}`"
        cells = [*(r[k] for k in lead), r["dataset"], mode, *(COLUMNS[c][1](r) for c in columns)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def peers_table(rows: list[Row]) -> str:
    """Markdown rows of a `pc-rag bench peers --json` file: TTFT and speedup per length, decode tokens/s, and
    (where recorded) the end-to-end latency of a 32-token answer."""
    lengths = sorted({r["context_tokens"] for r in rows})
    full = {r["context_tokens"]: r["ttft_ms"] for r in rows if r["peer"] == "full prefill (transformers, same runtime)"}
    full = full or {
        r["context_tokens"]: r["ttft_ms"] for r in rows if r["peer"].startswith("full prefill")
    }  # old files
    e2e = all(r.get("end_to_end_ms") is not None for r in rows if r["ttft_ms"] is not None)
    head = ["peer", *(x for t in lengths for x in (f"TTFT @{t}", "speedup")), "decode tok/s"]
    head += ["32-token answer"] if e2e else []
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for peer in dict.fromkeys(r["peer"] for r in rows):
        runs = {r["context_tokens"]: r for r in rows if r["peer"] == peer}
        if any(r["ttft_ms"] is None for r in runs.values()):
            continue  # a peer that could not run (its reason is in the JSON)
        cells = [x for t in lengths for x in (f"{runs[t]['ttft_ms']:,.0f} ms", f"{full[t] / runs[t]['ttft_ms']:.1f}x")]
        decode = " / ".join(f"{runs[t]['decode_tokens_per_s']:.0f}" for t in lengths)
        cells.append(decode)
        if e2e:
            cells.append(" / ".join(f"{runs[t]['end_to_end_ms']:,.0f}" for t in lengths) + " ms")
        lines.append("| " + " | ".join([peer, *cells]) + " |")
    return "\n".join(lines)


def encode_table(rows: list[Row]) -> str:
    """Markdown: one row per encoding path, one column per compute dtype, cells "tokens/s (share of the forward)"."""
    dtypes = list(dict.fromkeys(r["dtype"] for r in rows))
    head = ["path", *dtypes]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for path in dict.fromkeys(r["path"] for r in rows):
        cells = {r["dtype"]: r for r in rows if r["path"] == path}
        values = [
            f"{cells[d]['tokens_per_s']:,.0f} ({cells[d]['vs_forward']:.0%})" if d in cells and cells[d]["tokens_per_s"]
            else "-"
            for d in dtypes
        ]  # fmt: skip
        lines.append("| " + " | ".join([path, *values]) + " |")
    return "\n".join(lines)


def memory_table(rows: list[Row]) -> str:
    """Markdown: one row per storage (codec and dtype), bytes per token in memory and on disk, and the share of
    bfloat16 on disk."""
    bf16 = next((r["disk_bytes_per_token"] for r in rows if r["dtype"] == "bfloat16" and r["codec"] == "raw"), None)
    lines = ["| codec | dtype | memory B/token | disk B/token | vs bfloat16 on disk |", "|---|---|---|---|---|"]
    for r in rows:
        share = f"{r['disk_bytes_per_token'] / bf16:.2f}x" if bf16 else "-"
        cells = [r["codec"], r["dtype"], f"{r['memory_bytes_per_token']:,}", f"{r['disk_bytes_per_token']:,.0f}", share]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def codec_table(rows: list[Row]) -> str:
    """Markdown: one row per CacheGen level, its size (against zstd of the same symbols) and its speed."""
    head = ["codec", "B/token", "rANS B/token", "zstd-19 B/token", "encode tokens/s", "decode tokens/s",
            "decode tokens/s, threads"]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [
            r["codec"], f"{r['bytes_per_token']:,.0f}", f"{r['rans_bytes_per_token']:,.0f}",
            f"{r['zstd_bytes_per_token']:,.0f}", f"{r['encode_tokens_per_s']:,.0f}", f"{r['decode_tokens_per_s']:,.0f}",
            f"{r['decode_tokens_per_s_parallel']:,.0f} ({r['workers']})",
        ]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def link_table(rows: list[Row]) -> str:
    """Markdown: one row per storage, one column per link speed, cells "cold TTFT ms (bfloat16's TTFT / this),
    load ms"; then the warm TTFT and the levels the adaptive loader chose."""
    links = sorted({r["bandwidth_bits_per_s"] for r in rows if r["storage"] != "warm"})
    cell = {(r["storage"], r["bandwidth_bits_per_s"]): r for r in rows}
    head = ["storage", "B/token", *(f"{b / 1e6:,.0f} Mbit/s" for b in links)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for storage in dict.fromkeys(r["storage"] for r in rows if r["storage"] != "warm"):
        values = []
        for b in links:
            r = cell[storage, b]
            ratio = cell["bfloat16", b]["ttft_ms"] / r["ttft_ms"]
            values.append(f"{r['ttft_ms']:,.0f} ({ratio:.2f}x), load {r['load_ms']:,.0f}")
        size = "varies" if storage.endswith("adaptive") else f"{cell[storage, links[0]]['bytes_per_token']:,.0f}"
        lines.append("| " + " | ".join([storage, size, *values]) + " |")
    warm = next((r["ttft_ms"] for r in rows if r["storage"] == "warm"), None)
    chosen = "; ".join(
        f"{b / 1e6:,.0f} Mbit/s: " + ", ".join(f"{k}: {v}" for k, v in sorted(cell[_ADAPTIVE, b]["levels"].items()))
        for b in links
        if (_ADAPTIVE, b) in cell
    )
    return "\n".join([*lines, "", f"Warm (chunks in memory): {warm:,.0f} ms. The adaptive loader's levels: {chosen}."])


_ADAPTIVE = "cachegen:adaptive"


def allocation_table(rows: list[Row]) -> str:
    """Markdown: one row per (allocation, step) of ``examples/codec_allocation.py``: ideal size, first-token KL."""
    labelled = any("tables" in r for r in rows)  # rows of several table files say which they used
    side = any("side_bytes_per_token" in r for r in rows)  # newer rows also count exact tokens and escapes
    lines = ["| " + "tables | " * labelled + "allocation | step | ideal B/token | " + "+ exact, escapes | " * side
             + "KL(uncompressed‖quantized) | max KL | questions |", "|---" * (6 + labelled + side) + "|"]  # fmt: skip
    for r in rows:
        extra = [_number("side_bytes_per_token", 0)(r)] * side
        cells = [f"`{r['allocation']}`", f"{r['step']}", f"{r['ideal_bytes_per_token']:,.0f}", *extra, f"{r['kl']:.4f}",
                 f"{r['kl_max']:.4f}", str(r["questions"])]  # fmt: skip
        lines.append("| " + f"{r.get('tables', '')} | " * labelled + " | ".join(cells) + " |")
    return "\n".join(lines)


SELECTIONS = {
    "query": "the question's attention over the spliced cache, first 2 layers (`query:<share>`, no window)",
    "attention": "oracle: the question's attention in full prefill, all layers",
    "deviation": "oracle: value change from spliced to full prefill, all layers",
    "weighted": "oracle: attention x value change, summed over layers",
}


def oracle_table(rows: list[Row]) -> str:
    """Markdown: one row per (selection, adapter), one column per budget, cells "first-token KL / 8-token KL"."""
    budgets = sorted({r["budget"] for r in rows})
    head = ["chunk tokens recomputed, chosen by", *(f"{b:.0%}" for b in budgets)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for selection, adapter in dict.fromkeys((r["selection"], r["adapter"]) for r in rows):
        cells = {r["budget"]: r for r in rows if (r["selection"], r["adapter"]) == (selection, adapter)}
        name = SELECTIONS.get(selection, selection) + (", with the splice adapter on the question" if adapter else "")
        values = [
            f"{cells[b]['first_token_kl']:.3f} / {cells[b]['teacher_forced_kl']:.3f}" if b in cells else ""
            for b in budgets
        ]
        lines.append("| " + " | ".join([name, *values]) + " |")
    return "\n".join(lines)


def serve_table(runs: list[Row]) -> str:
    """Markdown: one row per `pc-rag bench serve` run and the median of the runs; then the attention step."""
    head = ["run", "together tokens/s", "one at a time tokens/s", "speedup", "identical to alone",
            "shared KV MiB", "duplicated MiB", "KV saved"]  # fmt: skip

    def cells(name: str, r: Row) -> list[str]:
        saved = 1 - r["shared_kv_bytes"] / r["duplicated_kv_bytes"]
        return [name, f"{r['tokens_per_s']:.1f}", f"{r['single_tokens_per_s']:.1f}", f"{r['speedup']:.2f}x",
                str(r["identical"]).lower(), f"{r['shared_kv_bytes'] / 2**20:.1f}",
                f"{r['duplicated_kv_bytes'] / 2**20:.1f}", f"{saved:.0%}"]  # fmt: skip

    rows = [cells(str(i), r) for i, r in enumerate(runs, 1)]
    if len(runs) > 1:
        keys = ["tokens_per_s", "single_tokens_per_s", "speedup", "shared_kv_bytes", "duplicated_kv_bytes"]
        median = {k: statistics.median(r[k] for r in runs) for k in keys}
        median["identical"] = all(r["identical"] for r in runs)
        rows.append(cells("median", median))
    attention_head = ["run", "caches", "case", "queries", "keys", "two-phase us", "baseline", "baseline us", "speedup"]
    attention = [[str(i), a.get("caches", "flushed"), a["case"], str(a["queries"]), f"{a['keys']:,}",
                  f"{a['partition_us']:,.0f}", a["baseline"], f"{a['baseline_us']:,.0f}", f"{a['speedup']:.2f}x"]
                 for i, r in enumerate(runs, 1) for a in r["attention"]]  # fmt: skip
    return markdown(head, rows) + "\n\n" + markdown(attention_head, attention)


def markdown(head: list[str], rows: list[list[str]]) -> str:
    """A Markdown table of ``rows`` (cells already formatted) under ``head``."""
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return "\n".join(lines + ["| " + " | ".join(cells) + " |" for cells in rows])


def load_table(runs: list[Row]) -> str:
    """Markdown: one row per `examples/load_test.py` run against `pc-rag serve`."""
    head = ["requests", "clients", "failed", "identical to serial", "p50 ms", "p99 ms", "tokens/s", "requests/s"]
    return markdown(head, [[str(r["requests"]), str(r["clients"]), str(r["failed"]), str(r["identical"]).lower(),
                            f"{r['p50_ms']:,.0f}", f"{r['p99_ms']:,.0f}", f"{r['tokens_per_s']:.1f}",
                            f"{r['requests_per_s']:.2f}"] for r in runs])  # fmt: skip


def recode_table(runs: list[Row]) -> str:
    """Markdown: one row per `pc-rag store recode --json` run."""
    head = ["codec", "chunks", "tokens", "MiB before", "MiB after", "B/token after", "seconds", "tokens/s"]
    return markdown(head, [[r["codec"], f"{r['chunks']:,}", f"{r['tokens']:,}", f"{r['bytes_before'] / 2**20:,.0f}",
                            f"{r['bytes_after'] / 2**20:,.0f}", f"{r['bytes_per_token']:,.0f}",
                            f"{r['seconds']:,.0f}", f"{r['tokens_per_s']:,.0f}"] for r in runs])  # fmt: skip


def scaleout_table(runs: list[Row]) -> str:
    """Markdown: each `pc-rag bench scaleout` run's encoding paths, then its ratios and TTFTs (and their median)."""
    head = ["run", "encoding path", "chunks", "tokens", "seconds", "tokens/s", "actor start s", "tokens/s less start"]
    encode = [[str(i), r["path"], f"{r['chunks']:,}", f"{r['tokens']:,}", f"{r['seconds']:,.1f}",
               f"{r['tokens_per_s']:,.0f}", "" if r["start_s"] is None else f"{r['start_s']:.1f}",
               "" if r["steady_tokens_per_s"] is None else f"{r['steady_tokens_per_s']:,.0f}"]
              for i, run in enumerate(runs, 1) for r in run["encode"]]  # fmt: skip
    keys = ["two_actors_vs_one", "two_actors_vs_in_process", "redis_vs_local_hot", "redis_vs_local_cold"]

    def cells(name: str, ratios: Row, ttft: dict[tuple[str, str], float]) -> list[str]:
        return [name, *(f"{ratios[k]:.2f}x" for k in keys[:2]), f"{ttft['local', 'hot']:,.0f}",
                f"{ttft['redis', 'hot']:,.0f}", f"{ratios[keys[2]]:.2f}x", f"{ttft['local', 'cold']:,.0f}",
                f"{ttft['redis', 'cold']:,.0f}", f"{ratios[keys[3]]:.2f}x"]  # fmt: skip

    ttfts = [{(t["store"], t["cache"]): t["ttft_ms_median"] for t in run["ttft"]} for run in runs]
    rows = [cells(str(i), run["ratios"], t) for i, (run, t) in enumerate(zip(runs, ttfts, strict=True), 1)]
    if len(runs) > 1:
        ratios = {k: statistics.median(run["ratios"][k] for run in runs) for k in keys}
        rows.append(cells("median", ratios, {c: statistics.median(t[c] for t in ttfts) for c in ttfts[0]}))
    head2 = ["run", "2 actors / 1 actor", "2 actors / in-process", "TTFT local hot ms", "Redis hot ms", "ratio",
             "local cold ms", "Redis cold ms", "ratio"]  # fmt: skip
    return markdown(head, encode) + "\n\n" + markdown(head2, rows)


def conversation_table(run: Row) -> str:
    """Markdown: one row per turn of `pc-rag bench conversation`: prompt tokens, streamed TTFT and cached tokens
    without and with the history cache, and the sources listed."""
    head = ["turn", "prompt tokens", "TTFT no cache (ms)", "TTFT cache (ms)", "cached tokens (no cache / cache)",
            "sources"]  # fmt: skip
    rows = [[str(r["turn"]), str(r["prompt_tokens"]), f"{r['no_cache_ttft_ms']:,.0f}", f"{r['cache_ttft_ms']:,.0f}",
             f"{r['no_cache_cached']} / {r['cache_cached']}", str(r["cache_sources"])]
            for r in run["rows"]]  # fmt: skip
    return markdown(head, rows)


def ttft_table(rows: list[Row]) -> str:
    """Markdown: one row per context length of `pc-rag bench ttft`: full-prefill and cached TTFT, the floor (the
    question's forward alone on a spliced cache), the speedup and cached TTFT over the floor."""
    head = ["context tokens", "full prefill", "cached", "floor", "speedup", "cached / floor"]
    return markdown(head, [[f"{r['context_tokens']:,}", f"{r['full_ttft_ms']:,.0f} ms",
                            f"{r['cached_ttft_ms']:,.1f} ms", f"{r['floor_ms']:,.1f} ms", f"{r['speedup']:.1f}x",
                            f"{r['cached_ttft_ms'] / r['floor_ms']:.2f}x"] for r in rows])  # fmt: skip


def quantized_prefill_table(rows: list[Row]) -> str:
    """Markdown: one row per context length of `examples/quantized_prefill_ab.py`: int4 prefill with bfloat16 GEMMs
    and with float32 GEMMs, the speedup, the float32 model's prefill, and how far the two int4 paths' logits are."""
    head = ["context tokens", "int4, bfloat16 GEMMs", "int4, float32 GEMMs", "speedup", "float32 model",
            "max logit difference", "same next token"]  # fmt: skip
    return markdown(head, [[f"{r['context_tokens']:,}", f"{r['bfloat16_gemm_s']:.2f} s", f"{r['float32_gemm_s']:.2f} s",
                            f"{r['speedup']:.2f}x", f"{r['float32_model_s']:.2f} s",
                            f"{r['max_abs_logit_difference']:.2f}", "yes" if r["same_next_token"] else "no"]
                           for r in rows])  # fmt: skip


def kernels_table(rows: list[Row], layers: int) -> str:
    """Markdown: one row per kernel of `examples/decode_kernels_floor.py`: its call's time, what it reads, the GB/s
    that makes, its gap to the floor, and the milliseconds a step spends in it (one call per layer; the lm_head once).
    """
    head = ["part", "kernel", "shape", "µs a call", "MB read", "GB/s", "gap to floor", "ms a step"]
    return markdown(head, [[r["part"], r["kernel"], r["shape"], f"{r['us']:,.0f}", f"{r['bytes'] / 1e6:.2f}",
                            f"{r['gb_s']:.1f}", f"{r['gap']:.1f}x",
                            f"{r['us'] * (1 if r['kernel'] == 'lm_head' else layers) / 1000:.1f}"]
                           for r in rows])  # fmt: skip


def with_sizes(rows: list[Row], sizes: list[Row]) -> list[Row]:
    """``rows`` of an eval whose ``MODE@CODEC`` rows get ``bytes_per_token`` from a `pc-rag bench codec` file."""
    per_codec = {r["codec"]: r["bytes_per_token"] for r in sizes}
    return [{**r, "bytes_per_token": per_codec.get(r["mode"].partition("@")[2])} for r in rows]


BENCH_TABLES: dict[str, Callable[[list[Row]], str]] = {  # else: bench peers
    "floor_ms": ttft_table,
    "path": encode_table,
    "disk_bytes_per_token": memory_table,
    "rans_bytes_per_token": codec_table,
    "bandwidth_bits_per_s": link_table,
}


def render(loaded: list[Any], args: argparse.Namespace) -> str:
    """The Markdown of ``loaded`` JSON files, by the kind their keys say they are."""
    if all(isinstance(d, list) and d for d in loaded):  # bench rows, told apart by a key only their kind has
        rows = [row for d in loaded for row in d]
        return next((r for key, r in BENCH_TABLES.items() if all(key in d[0] for d in loaded)), peers_table)(rows)
    if all(isinstance(d, dict) and "concurrency" in d for d in loaded):  # bench serve runs
        return serve_table(loaded)
    if all(isinstance(d, dict) and "ratios" in d for d in loaded):  # bench scaleout runs
        return scaleout_table(loaded)
    if all(isinstance(d, dict) and "bytes_before" in d for d in loaded):  # store recode runs
        return recode_table(loaded)
    if all(isinstance(d, dict) and "clients" in d for d in loaded):  # load test runs
        return load_table(loaded)
    if all(isinstance(d, dict) and "chosen" in d for d in loaded):  # default_mode_choice.py
        from default_mode_choice import markdown as mode_choice_table

        return "\n\n".join(mode_choice_table(d) for d in loaded)
    if all(isinstance(d, dict) and "levers" in d for d in loaded):  # adapter_levers.py
        from adapter_levers import markdown as levers_table

        return "\n\n".join(levers_table(d) for d in loaded)
    if all(isinstance(d, dict) and "gates" in d and "machine" in d for d in loaded):  # bench peers --answers
        from pc_rag.bench.answer_time import markdown as answer_table

        return "\n\n".join(answer_table(d) for d in loaded)
    if all(isinstance(d, dict) and "gates" in d for d in loaded):  # pc-rag bench gpu
        from pc_rag.bench.gpu import format_gates

        return "\n\n".join(format_gates(d).split("\n", 2)[2] for d in loaded)  # the table, without its title
    if all(isinstance(d, dict) and "cache_ratio" in d for d in loaded):  # bench conversation
        return "\n\n".join(conversation_table(d) for d in loaded)
    if all(isinstance(d, dict) and d.get("rows") for d in loaded):  # script rows: codec_allocation or oracle sweep
        rows = [row for d in loaded for row in d["rows"]]
        if all("bfloat16_gemm_s" in d["rows"][0] for d in loaded):  # quantized_prefill_ab.py
            return quantized_prefill_table(rows)
        if all("gb_s" in d["rows"][0] for d in loaded):  # decode_kernels_floor.py
            return "\n\n".join(kernels_table(d["rows"], d["layers"]) for d in loaded)
        return allocation_table(rows) if all("allocation" in d["rows"][0] for d in loaded) else oracle_table(rows)
    rows = [row for d in loaded for row in d["results"]]
    if args.sizes is not None:
        rows = with_sizes(rows, json.loads(args.sizes.read_text(encoding="utf-8")))
    return table(rows, args.dataset, [c.strip() for c in args.columns.split(",")])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("json", type=Path, nargs="+", help="`pc-rag eval --json` files (their rows are joined)")
    parser.add_argument("--dataset", action="append", default=None, help="only these datasets (repeatable)")
    parser.add_argument("--columns", default=DEFAULT, help=f"comma-separated, of {', '.join(COLUMNS)}")
    parser.add_argument("--sizes", type=Path, default=None, help="a `pc-rag bench codec --json` file (for `bytes`)")
    parser.add_argument("--summary", action="store_true", help="only the first table of a two-table kind")
    args = parser.parse_args()
    text = render([json.loads(path.read_text(encoding="utf-8")) for path in args.json], args)
    print(text.split("\n\n")[0] if args.summary else text)


if __name__ == "__main__":
    main()
