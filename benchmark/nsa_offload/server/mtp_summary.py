"""results/mtp/summary.json from its two halves: the ``mtp`` part of an
exactness run's summary.json (exactness.py ``--servers mtp``: outputs and
accept counts vs the no-offload MTP servers) and the ``summary_mtp_speed.json``
of one or more bench_server.py runs with the MTP pair (ITL ratios).

    python benchmark/nsa_offload/server/mtp_summary.py \\
        --exactness RESULTS/mtp/exactness_tiny/summary.json \\
        --speed RESULTS/mtp/speed_tiny_model/summary_mtp_speed.json \\
        --out RESULTS/mtp/summary.json
"""

import argparse
import json
from typing import List, Optional, Sequence


def merge(exactness: dict, speeds: List[dict]) -> dict:
    """The committed keys; a key one half lacks stays None (not measured)."""
    mtp = exactness.get("mtp")
    if mtp is None:
        raise SystemExit("--exactness: no 'mtp' part (run exactness.py --servers mtp)")
    ratios, steps, commits = {}, set(mtp["num_steps"]), {mtp["code_commit"]}
    for speed in speeds:
        clash = set(ratios) & set(speed["itl_ratio_vs_no_offload_mtp"])
        if clash:
            raise SystemExit(f"--speed: points measured twice: {sorted(clash)}")
        ratios.update(speed["itl_ratio_vs_no_offload_mtp"])
        steps.update(speed["num_steps"])
        c = speed["code_commit"]
        commits.update(c if isinstance(c, list) else [c])
    return {
        "identical": mtp["identical"],
        "total": mtp["total"],
        "accept_length_equal": mtp["accept_length_equal"],
        "itl_ratio_vs_no_offload_mtp": ratios or None,
        "num_steps": sorted(steps),
        "code_commit": commits.pop() if len(commits) == 1 else sorted(commits),
        # Where the figures came from, for a reader of this file alone.
        "negative_control": mtp.get("negative_control"),
        "mean_accept_length": {
            name: a.get("mean_accept_length") for name, a in mtp["accept"].items()
        },
    }


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--exactness", required=True, help="exactness.py's summary.json")
    p.add_argument(
        "--speed",
        nargs="*",
        default=[],
        help="bench_server.py's summary_mtp_speed.json (one per run)",
    )
    p.add_argument("--out", required=True, help="the merged summary.json")
    args = p.parse_args(argv)
    with open(args.exactness) as f:
        exactness = json.load(f)
    speeds = []
    for path in args.speed:
        with open(path) as f:
            speeds.append(json.load(f))
    summary = merge(exactness, speeds)
    with open(args.out, "w") as f:
        json.dump(summary, f, indent=1)
        f.write("\n")
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
