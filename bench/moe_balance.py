"""MoE load balance over training: the standard deviation and coefficient of variation
(std / mean) of the tokens each expert receives, and the rows each expert-parallel rank runs
(max over mean), per step, for four ways of balancing

    none        aux_coef 0, no bias                    (the router is free to collapse)
    aux loss    aux_coef 0.01 (Switch-style load-balancing loss)
    bias        aux_coef 0, bias_update_rate > 0      (aux-loss-free: a per-expert bias on the
                routing scores, nudged by sign(mean load - load) after every step)
    replicas    aux_coef 0, --expert-replicas R        (the router left alone; the busiest experts
                get copies on the least-loaded ranks every --replan-every steps: the experts'
                loads stay those of "none", the ranks' even out)

each a real ``python -m pympar.train`` run of the same MoE model, data and seed with ep = the
world size; the loads are the trainer's metrics (global over the ranks). Also the final training
loss: what the balancing costs (or gains) in model quality over the same steps.

    python bench/moe_balance.py --steps 300      # bench/results/moe_balance.json, docs/img/experts.png
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402


def variants(rate: float, aux: float, replicas: int, replan: int) -> list:
    return [("none", ["--aux-coef", "0"]),
            ("aux loss", ["--aux-coef", str(aux)]),
            ("bias (aux-free)", ["--aux-coef", "0", "--bias-update-rate", str(rate)]),
            (f"replicas ({replicas}/rank)", ["--aux-coef", "0", "--expert-replicas", str(replicas),
                                             "--replan-every", str(replan)])]


def load_stats(record) -> dict:
    """Mean over MoE layers of std and CV of the tokens per expert in one step, and of the max over
    mean of the rows each ep rank ran (what replicas even out; the experts' own loads they leave)."""
    std, cv, rank = [], [], []
    for layer in record["moe"]:
        t = np.asarray(layer["tokens_per_expert"], np.float64)
        std.append(float(t.std()))
        cv.append(float(t.std() / t.mean()) if t.mean() > 0 else 0.0)
        rank.append(layer.get("rank_max_over_mean", 1.0))
    return dict(std=float(np.mean(std)), cv=float(np.mean(cv)), rank=float(np.mean(rank)))


def run(a) -> dict:
    base = ["--preset", a.preset, "--n-expert", str(a.n_expert), "--top-k", "2", "--steps", str(a.steps),
            "--micro-batch-size", str(a.micro_batch_size), "--lr", str(a.lr), "--z-coef", "0", "--ep", str(a.world)]
    out = []
    for name, flags in variants(a.rate, a.aux, a.replicas, a.replan):
        m = common.train(a.world, base + flags, a.timeout)
        per = [load_stats(r) for r in m]
        half = per[len(per) // 2:]
        out.append(dict(variant=name, flags=flags, cv=[p["cv"] for p in per], std=[p["std"] for p in per],
                        rank_max_over_mean=[p["rank"] for p in per],
                        rank_second_half=statistics.mean(p["rank"] for p in half),
                        loss=[r["loss"] for r in m], cv_second_half=statistics.mean(p["cv"] for p in half),
                        std_second_half=statistics.mean(p["std"] for p in half),
                        loss_last10=statistics.mean(r["loss"] for r in m[-10:]),
                        tokens_per_step=int(sum(m[-1]["moe"][0]["tokens_per_expert"]))))
        print(f"  {name:<16} CV (2nd half) {out[-1]['cv_second_half']:.3f}  std {out[-1]['std_second_half']:.1f} tokens  "
              f"rank max/mean {out[-1]['rank_second_half']:.2f}  "
              f"loss (last 10) {out[-1]['loss_last10']:.4f}", file=sys.stderr, flush=True)
    ref = out[0]["cv_second_half"]
    for o in out:
        o["cv_vs_none"] = o["cv_second_half"] / ref if ref else float("nan")
    return dict(kind="moe_balance", machine=common.machine(), preset=a.preset, n_expert=a.n_expert, top_k=2,
                world=a.world, ep=a.world, steps=a.steps, bias_update_rate=a.rate, aux_coef=a.aux,
                replicas=a.replicas, replan_every=a.replan, results=out)


def plot(res: dict, png) -> None:
    plt = common.pyplot()
    fig, (ax, ax3, ax2) = plt.subplots(1, 3, figsize=(13, 3.4))
    k = 5
    for o in res["results"]:
        cv = np.convolve(o["cv"], np.ones(k) / k, mode="valid")
        ax.plot(np.arange(len(cv)) + k - 1, cv, label=f"{o['variant']}: {o['cv_vs_none']:.2f}x none")
        rk = np.convolve(o.get("rank_max_over_mean", [1.0] * len(o["cv"])), np.ones(k) / k, mode="valid")
        ax3.plot(np.arange(len(rk)) + k - 1, rk, label=f"{o['variant']}: {o.get('rank_second_half', 1.0):.2f}")
        loss = np.convolve(o["loss"], np.ones(k) / k, mode="valid")
        ax2.plot(np.arange(len(loss)) + k - 1, loss, label=f"{o['variant']}: last {o['loss_last10']:.3f}")
    ax.set(xlabel="step", ylabel=f"CV of tokens per expert (mean of {k} steps)",
           title="expert load CV (2nd-half ratio to no balancing)")
    ax2.set(xlabel="step", ylabel="training loss", title="loss: what balancing costs")
    ax3.set(xlabel="step", ylabel=f"rows per ep rank, max / mean ({k} steps)",
            title="rank load (2nd-half mean)")
    ax3.legend(fontsize=7)
    ax.legend(fontsize=7)
    ax2.legend(fontsize=7)
    fig.suptitle(f"MoE load balance: {res['preset']}, {res['n_expert']} experts top-2, ep = {res['world']} ranks "
                 f"({common.machine()})", fontsize=8)
    common.save(fig, png)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="moe-tiny")
    ap.add_argument("--n-expert", type=int, default=8)
    ap.add_argument("--world", type=int, default=4, help="ranks (data and expert parallel: ep = world)")
    ap.add_argument("--replicas", type=int, default=1, help="replica slots per rank of the replicas variant")
    ap.add_argument("--replan", type=int, default=10, help="--replan-every of the replicas variant")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--micro-batch-size", type=int, default=8)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--aux", type=float, default=0.01, help="aux_coef of the aux-loss variant")
    ap.add_argument("--rate", type=float, default=0.01, help="bias_update_rate of the aux-free variant")
    ap.add_argument("--timeout", type=float, default=900)
    common.add_output_args(ap, "moe_balance")
    ap.set_defaults(png=str(common.ROOT / "docs" / "img" / "experts.png"))
    a = common.resolve_outputs(ap.parse_args(argv))
    common.write_outputs(a, run(a), plot)


if __name__ == "__main__":
    main()
