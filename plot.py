"""Plot held-out accuracy against wall time, TBA (one searcher) vs the synchronous baseline.

    python plot.py runs/bench-.../bench.json docs/async_vs_sync.png

Reads the accuracy curves that `bench.py --full` records (time from launch, evaluation time left
out) and draws one line per run. matplotlib is imported here only: `pip install matplotlib`.
"""

import json
import sys


def main(bench_json: str, out: str):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    result = json.load(open(bench_json))
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for run in result["time_to_target"]:
        t, _, accuracy = zip(*run["curve"])
        async_ = run["searchers"] > 0
        ax.plot(t, accuracy, color="tab:blue" if async_ else "tab:orange", marker=".",
                linestyle="-" if run["seed"] == result["seeds"][0] else "--",
                label=f"{'TBA, 1 searcher' if async_ else 'synchronous'} (seed {run['seed']})")
    start = result["time_to_target"][0]["start_accuracy"]
    ax.axhline(start + 0.15, color="gray", linewidth=0.8, linestyle=":", label="target: start + 0.15")
    m = result["machine"]
    ax.set(xlabel="seconds since launch (evaluation time left out)", ylabel="held-out greedy accuracy",
           title=f"toy task (tba.py defaults), {m['cores']} CPU cores")
    ax.legend(fontsize=8, loc="lower right")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(out)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    main(*sys.argv[1:])
