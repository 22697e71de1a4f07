"""One PPO old-log-prob computation in a fresh process: peak RSS and time.

Run by :mod:`benchmarks.scenarios.ppo` once per mode, so that each peak resident set size
(``ru_maxrss``, a process-lifetime high-water mark) belongs to one computation only::

    python -m benchmarks.ppo_memory --mode chunked --batch 1M --out lp.pt

Prints one JSON line: baseline RSS (after the data and the actor exist and a 64-row warm-up ran),
peak RSS after the first full computation, and the median time of ``--repeats`` further calls.
With ``--time-both``, after the memory reading, both computations are also timed with their
calls interleaved (``seconds_both``), so that both see the same machine load.
"""

from __future__ import annotations

import argparse
import json

import torch
from tensordict import TensorDict
from tensordict.nn import NormalParamExtractor, TensorDictModule
from torchrl.modules import MLP, IndependentNormal, ProbabilisticActor

from benchmarks.harness import (
    interleaved_seconds,
    median_seconds,
    non_negative_int,
    peak_rss_bytes,
    positive_int,
    seed_int,
)
from fastreplay import chunked_log_prob


def make_actor(obs_dim: int, act_dim: int, hidden: int) -> ProbabilisticActor:
    """TorchRL's usual continuous PPO actor: MLP (2 x hidden, tanh) -> loc, scale -> Normal."""
    net = torch.nn.Sequential(
        MLP(
            in_features=obs_dim,
            out_features=2 * act_dim,
            num_cells=[hidden, hidden],
            activation_class=torch.nn.Tanh,
        ),
        NormalParamExtractor(),
    )
    return ProbabilisticActor(
        TensorDictModule(net, ["observation"], ["loc", "scale"]),
        in_keys=["loc", "scale"],
        distribution_class=IndependentNormal,
        return_log_prob=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--mode", choices=["one-shot", "chunked"], required=True)
    parser.add_argument("--batch", type=positive_int, default="100k")
    parser.add_argument("--obs-dim", type=positive_int, default=64)
    parser.add_argument("--act-dim", type=positive_int, default=8)
    parser.add_argument("--hidden", type=positive_int, default=256)
    parser.add_argument("--chunk", type=positive_int, default=8192)
    parser.add_argument(
        "--repeats", type=non_negative_int, default=3, help="timed calls (0: memory only)"
    )
    parser.add_argument("--seed", type=seed_int, default=0)
    parser.add_argument(
        "--threads", type=non_negative_int, default=0, help="torch threads (0: torch default)"
    )
    parser.add_argument("--out", help="torch.save the log-probs here (for the answer check)")
    parser.add_argument(
        "--time-both", action="store_true", help="also time both modes, calls interleaved"
    )
    args = parser.parse_args()

    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    actor = make_actor(args.obs_dim, args.act_dim, args.hidden)
    # Written in place by the generator: no temporaries beyond the data itself.
    obs = torch.randn(args.batch, args.obs_dim)
    action = torch.randn(args.batch, args.act_dim)
    data = TensorDict(observation=obs, action=action, batch_size=[args.batch])

    def one_shot() -> torch.Tensor:
        actor.eval()
        with torch.no_grad():
            lp = actor.log_prob(data.select("observation", "action"))
        data.set("action_log_prob", lp)
        return lp

    def chunked() -> torch.Tensor:
        return chunked_log_prob(actor, data, chunk_size=args.chunk)

    compute = one_shot if args.mode == "one-shot" else chunked

    with torch.no_grad():  # load kernels and allocator pools before the baseline
        actor.log_prob(data[:64].select("observation", "action"))
    baseline = peak_rss_bytes()
    lp = compute()
    peak = peak_rss_bytes()
    if args.out:
        torch.save(lp, args.out)
    del lp
    seconds, both = None, None
    if args.time_both:
        both = interleaved_seconds(
            {"one-shot": one_shot, "chunked": chunked}, repeats=args.repeats, warmup=0
        )
        seconds = both[args.mode]
    elif args.repeats:
        seconds = median_seconds(compute, repeats=args.repeats, warmup=0)
    print(
        json.dumps(
            {
                "mode": args.mode,
                "batch": args.batch,
                "baseline_rss": baseline,
                "peak_rss": peak,
                "extra_rss": peak - baseline,
                "output_bytes": args.batch * 4,
                "seconds": seconds,
                "seconds_both": both,
                "threads": torch.get_num_threads(),
            }
        )
    )


if __name__ == "__main__":
    main()
