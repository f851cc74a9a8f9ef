"""results/mtp/summary.json from its two halves: the ``mtp`` part of one or
more exactness runs' summary.json (exactness.py ``--servers mtp`` or
``mtp_v2``: outputs and accept counts vs the no-offload MTP servers) and the
``summary_mtp_speed.json`` of one or more bench_server.py runs with the MTP
pair (ITL ratios).

    python benchmark/nsa_offload/server/mtp_summary.py \\
        --exactness RESULTS/mtp/exactness_tiny/summary.json RESULTS/mtp/spec_v2/summary.json \\
        --speed RESULTS/mtp/speed_tiny_model/summary_mtp_speed.json \\
        --out RESULTS/mtp/summary.json
"""

import argparse
import json
from typing import List, Optional, Sequence

from server_utils import one_or_sorted, recorded_sglang_version, release_key


def merge(
    exactness: List[dict], speeds: List[dict], speed_caveat: Optional[str] = None
) -> dict:
    """The committed keys; a key one half lacks stays None (not measured).
    Several exactness runs (with and without the overlap scheduler, say) add up."""
    parts = [run.get("mtp") for run in exactness]
    if not parts or None in parts:
        raise SystemExit("--exactness: no 'mtp' part (run exactness.py --servers mtp)")
    ratios, steps, commits, versions = {}, set(), set(), set()
    for half in parts + speeds:
        v = recorded_sglang_version(half)
        versions.update(v if isinstance(v, list) else [v])
    for mtp in parts:
        steps.update(mtp["num_steps"])
        commits.add(mtp["code_commit"])
    for speed in speeds:
        clash = set(ratios) & set(speed["itl_ratio_vs_no_offload_mtp"])
        if clash:
            raise SystemExit(f"--speed: points measured twice: {sorted(clash)}")
        ratios.update(speed["itl_ratio_vs_no_offload_mtp"])
        steps.update(speed["num_steps"])
        c = speed["code_commit"]
        commits.update(c if isinstance(c, list) else [c])
    accept = {name: a for mtp in parts for name, a in mtp["accept"].items()}
    # Each half's figures by the release they ran on (never read one
    # release's ratio as another's).
    by_version = {}
    for mtp in parts:
        row = by_version.setdefault(str(recorded_sglang_version(mtp)), {})
        row["identical"] = row.get("identical", 0) + mtp["identical"]
        row["total"] = row.get("total", 0) + mtp["total"]
        row["accept_length_equal"] = row.get("accept_length_equal", True) and (
            mtp["accept_length_equal"]
        )
    for speed in speeds:
        row = by_version.setdefault(str(recorded_sglang_version(speed)), {})
        row.setdefault("itl_ratio_vs_no_offload_mtp", {}).update(
            speed["itl_ratio_vs_no_offload_mtp"]
        )
    return {
        "identical": sum(mtp["identical"] for mtp in parts),
        "total": sum(mtp["total"] for mtp in parts),
        "accept_length_equal": all(mtp["accept_length_equal"] for mtp in parts),
        "itl_ratio_vs_no_offload_mtp": ratios or None,
        # What a reader of the ratios alone must know (--speed-caveat).
        "itl_ratio_caveat": speed_caveat,
        "num_steps": sorted(steps),
        "code_commit": one_or_sorted(commits),
        "sglang_version": one_or_sorted(versions),
        # Where the figures came from, for a reader of this file alone.
        "negative_control": {
            k: v
            for mtp in parts
            for k, v in (mtp.get("negative_control") or {}).items()
        }
        or None,
        "mean_accept_length": {
            name: a.get("mean_accept_length") for name, a in accept.items()
        },
        "by_sglang_version": {
            v: by_version[v] for v in sorted(by_version, key=release_key)
        },
    }


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--exactness",
        nargs="+",
        required=True,
        help="exactness.py's summary.json (one per run)",
    )
    p.add_argument(
        "--speed",
        nargs="*",
        default=[],
        help="bench_server.py's summary_mtp_speed.json (one per run)",
    )
    p.add_argument(
        "--speed-caveat",
        help="why the ITL ratios do not mean what they seem (stored with them)",
    )
    p.add_argument("--out", required=True, help="the merged summary.json")
    args = p.parse_args(argv)
    exactness, speeds = [], []
    for paths, runs in ((args.exactness, exactness), (args.speed, speeds)):
        for path in paths:
            with open(path) as f:
                runs.append(json.load(f))
    summary = merge(exactness, speeds, args.speed_caveat)
    with open(args.out, "w") as f:
        json.dump(summary, f, indent=1)
        f.write("\n")
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
