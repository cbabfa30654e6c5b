"""Write bench/results/REPORT.md and PNG plots from the benchmarks' JSON results.

Each benchmark saves ``bench/results/<name>.json`` (``{"meta": ..., "rows": [...]}``,
every row with a ``ratio`` against a baseline measured in the same run). This
script turns them into one markdown table and a few plots:

- sync-point cost against pending count, beside PETSc's garbage cleanup;
- loader throughput beside Grain and pickling through multiprocessing.Queue;
- the GC-pause effect in a bulk-synchronous loop;
- sync-point cost per key against pending count at 2-16 ranks, per rank-CPU.

Run: python bench/report.py   (make bench runs it after the benchmarks)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # no display here
import matplotlib.pyplot as plt  # noqa: E402

RESULTS = Path(__file__).parent / "results"


def load() -> dict[str, dict[str, Any]]:
    out = {}
    for path in sorted(RESULTS.glob("*.json")):
        out[path.stem] = json.loads(path.read_text())
    return out


def fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1e4 else f"{value:,.0f}"
    return str(value)


def table(data: dict[str, dict[str, Any]]) -> str:
    lines = ["| benchmark | row | measured | ratio |", "|---|---|---|---|"]
    for name, blob in data.items():
        for row in blob["rows"]:
            label = row.get("bench", name)
            extra = ", ".join(
                f"{k}={fmt(v)}" for k, v in row.items() if k not in ("bench", "ratio", "target")
            )
            ratio = fmt(row["ratio"]) if "ratio" in row else "-"
            if "target" in row:
                ratio += f" (target {row['target']})"
            lines.append(f"| {name} | {label} | {extra} | {ratio} |")
    return "\n".join(lines)


def plot_sync(data: dict[str, dict[str, Any]]) -> str | None:
    core = data.get("core")
    if core is None:
        return None
    rows = [r for r in core["rows"] if r.get("bench") == "sync" and r.get("pending")]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.loglog(
        [r["pending"] for r in rows],
        [r["sync_us"] / 1e3 for r in rows],
        "o-",
        label="collective_gc sync point (no-op destroys)",
    )
    petsc = data.get("petsc")
    if petsc is not None:
        pr = [r for r in petsc["rows"] if "n" in r and "delayed_ms" in r]
        if pr:
            ax.loglog(
                [r["n"] for r in pr],
                [r["delayed_ms"] for r in pr],
                "s--",
                label="PETSc Vecs: delayed destroy + garbage_cleanup",
            )
            ax.loglog(
                [r["n"] for r in pr],
                [r["managed_ms"] for r in pr],
                "^-",
                label="PETSc Vecs: collective_gc sync point",
            )
    ax.set_xlabel("pending destroy requests")
    ax.set_ylabel("sync time (ms, slowest of 4 ranks)")
    ax.set_title("Sync-point cost against pending count")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    out = RESULTS / "sync_cost.png"
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out.name


def plot_scale(data: dict[str, dict[str, Any]]) -> str | None:
    blob = data.get("scale")
    if blob is None:
        return None
    rows = [r for r in blob["rows"] if r.get("pending")]
    fig, ax = plt.subplots(figsize=(6, 4))
    for ranks in sorted({r["ranks"] for r in rows}):
        mine = sorted((r for r in rows if r["ranks"] == ranks), key=lambda r: r["pending"])
        ax.semilogx(
            [r["pending"] for r in mine],
            [r["rank_cpu_us_per_key"] for r in mine],
            "o-",
            label=f"{ranks} ranks",
        )
    ax.set_xlabel("pending destroy requests")
    ax.set_ylabel("us per key per rank-CPU (slowest rank)")
    ax.set_title(f"Sync-point cost per key, {blob['meta'].get('host_cpus', '?')} CPUs")
    ax.set_ylim(bottom=0)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    out = RESULTS / "scale.png"
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out.name


def plot_gcpause(data: dict[str, dict[str, Any]]) -> str | None:
    blob = data.get("gcpause")
    if blob is None:
        return None
    modes = {
        "ratio": "managed",
        "full_exit_ratio": "managed, full exit",
        "hand_ratio": "by hand",
        "floor_ratio": "no collection",
    }
    rows = blob["rows"]
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / len(modes)
    for i, (key, label) in enumerate(modes.items()):
        xs = [j + i * width for j, r in enumerate(rows) if key in r]
        ys = [r[key] for r in rows if key in r]
        bars = ax.bar(xs, ys, width, label=label)
        ax.bar_label(bars, fmt="%.2f", fontsize=7)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(rows))])
    ax.set_xticklabels([r["bench"].removeprefix("gcpause ") for r in rows])
    ax.set_ylabel("time / automatic GC (same run)")
    ax.set_yscale("log")
    ax.set_title(f"Bulk-synchronous loop on {blob['meta'].get('ranks', '?')} ranks")
    ax.legend(fontsize=8)
    out = RESULTS / "gcpause.png"
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out.name


def plot_bars(
    data: dict[str, dict[str, Any]], name: str, keys: dict[str, str], title: str, ylabel: str
) -> str | None:
    blob = data.get(name)
    if blob is None:
        return None
    row = next((r for r in blob["rows"] if all(k in r for k in keys)), None)
    if row is None:
        return None
    fig, ax = plt.subplots(figsize=(6, 4))
    labels = list(keys.values())
    values = [row[k] for k in keys]
    ax.bar(labels, values, color=["tab:blue", "tab:orange", "tab:green", "tab:red"][: len(values)])
    for i, v in enumerate(values):
        ax.text(i, v, fmt(v), ha="center", va="bottom")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    out = RESULTS / f"{name}.png"
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out.name


def main() -> int:
    data = load()
    if not data:
        print("no results in bench/results: run the benchmarks first (make bench)", file=sys.stderr)
        return 1
    plots = [
        plot_sync(data),
        plot_scale(data),
        plot_bars(
            data,
            "loader",
            {
                "ours_per_s": "collective_gc",
                "grain_per_s": "Grain 0.2.18",
                "torch_per_s": "PyTorch 2.13 DataLoader",
                "mpq_per_s": "mp.Queue",
            },
            "Loader throughput, 256 KiB float32, 2 workers",
            "elements / s",
        ),
        plot_gcpause(data),
    ]
    metas = {name: blob.get("meta", {}) for name, blob in data.items()}
    text = [
        "# Benchmark report",
        "",
        "Made by `make bench` (`python bench/report.py` from the JSON in `bench/results/`).",
        "Every ratio is against a baseline measured in the same run (medians; see each",
        "benchmark's docstring for what it compares).",
        "",
        table(data),
        "",
        "Runs: "
        + "; ".join(
            f"{n}: {m.get('date', '?')}, {m.get('ranks', '?')} ranks" for n, m in metas.items()
        ),
        "",
    ]
    text += [f"![{p}]({p})" for p in plots if p]
    (RESULTS / "REPORT.md").write_text("\n".join(text) + "\n")
    print(f"wrote {RESULTS / 'REPORT.md'} and {len([p for p in plots if p])} plots")
    return 0


if __name__ == "__main__":
    sys.exit(main())
