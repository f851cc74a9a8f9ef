"""results/exactness/summary.json (issue 18's headline) from the runs of
record: one exactness.py summary.json per checkpoint (``tiny``, ``rank``)
and sglang release; the newest release's make the headline, each release's
own is under ``by_sglang_version``. It says, besides the totals, which of
the required cases each model still lacks and whether the negative control
makes the comparison able to fail.

    python benchmark/nsa_offload/server/exactness_headline.py \\
        --run RESULTS/exactness/tiny_run6/summary.json \\
        --run RESULTS/exactness/rank_run4/summary.json \\
        --run RESULTS/exactness/tiny_0517_32751af/summary.json \\
        --out RESULTS/exactness/summary.json
"""

import argparse
import json
import os
from typing import List, Optional, Sequence

from server_utils import recorded_sglang_version, release_key

# Issue 18's cases, each against the no-offload server of its KV dtype: the
# default units, one unit, heavy eviction, bf16 KV (the cross-layer prefetch
# it also named was removed from the offload); one request at a time (seq) and aborted streams. Forced retraction: sglang
# retracts only from batches of two or more, so its case is the bf16 server's
# retracting batches ("retract", exactness.py); the fp8 retract server's
# batch-1 phases retract nothing and are not required. On a checkpoint whose
# own retracting batches (the control) differ from its batch-1 outputs the
# case cannot be strict: there it is "retract_reported", and at least one
# checkpoint must have the strict case.
REQUIRED_SERVERS = (
    "ours_fp8",
    "ours_fp8_1unit",
    "ours_fp8_heavy",
    "ours_bf16",
)
REQUIRED_PHASES = ("seq", "abort")
REQUIRED_RETRACT = "ours_bf16_retract"
# A checkpoint's comparisons count only where one wrong KV row flips this
# share of the control requests.
NC_TARGET = 0.9


def _fraction(comparison: Optional[dict]) -> Optional[str]:
    return f"{comparison['identical']}/{comparison['total']}" if comparison else None


def required_cases(model: str) -> List[str]:
    return [
        f"{model}:{name}:{phase}"
        for name in REQUIRED_SERVERS
        for phase in REQUIRED_PHASES
    ]


def retract_case(run: dict) -> dict:
    """The retraction case's comparison (strict or reported) and its kind."""
    rows = run["comparisons"].get(REQUIRED_RETRACT, {})
    for kind in ("retract", "retract_reported"):
        if kind in rows:
            return {"kind": kind, **rows[kind]}
    return {}


def model_part(run: dict, folder: str) -> dict:
    model = run["model"]
    calls = run.get("merged_from") or []
    nc = run["negative_control"]
    base_nc = next((r for n, r in nc.items() if not n.startswith("dummy")), {})
    stock = run["comparisons"].get("stock_fp8", {})
    return {
        "folder": folder,
        "identical": run["identical"],
        "total": run["total"],
        "negative_control_flip_fraction": run["negative_control_flip_fraction"],
        "negative_control_requests": (base_nc.get("step") or {}).get("requests"),
        "negative_control_flip_fraction_persistent": (
            base_nc.get("persistent") or {}
        ).get("flip_fraction"),
        "negative_control_dummy_weights": {
            mode: r["flip_fraction"] for mode, r in nc.get("dummy_fp8", {}).items()
        }
        or None,
        "stock_defaults": (
            {
                "vs_no_offload_seq": _fraction(stock.get("seq")),
                "self_agreement": _fraction(run["self_agreement"].get("stock_fp8")),
            }
            if stock
            else None
        ),
        "missing_cases": [
            case for case in required_cases(model) if case not in run["cases"]
        ],
        # Requests retracted per phase (older runs: the whole log's count).
        "retracted_reqs": {
            name: run.get("retracted_reqs_by_phase", {}).get(name)
            or {"run": log.get("retracted_reqs")}
            for name, log in run["logs"].items()
            if "retract" in name
        },
        "retract_case": retract_case(run),
        "code_commit": run["code_commit"],
        "calls": calls,
        "checkpoint": run["checkpoint"],
    }


def headline(runs: List[dict], folders: List[str]) -> dict:
    by_model = {}
    for run, folder in zip(runs, folders):
        if run.get("weights") != "checkpoint":
            raise SystemExit(f"--run {folder}: not a generated checkpoint run")
        if run["model"] in by_model:
            raise SystemExit(f"--run: two runs of the {run['model']} checkpoint")
        by_model[run["model"]] = model_part(run, folder)
    why = []
    for model, part in by_model.items():
        flip = part["negative_control_flip_fraction"]
        if flip is None or flip < NC_TARGET:
            why.append(f"{model}: negative control {flip} (need >= {NC_TARGET})")
        if part["identical"] != part["total"]:
            why.append(f"{model}: {part['identical']}/{part['total']} identical")
        if part["missing_cases"]:
            why.append(f"{model}: not run yet: {', '.join(part['missing_cases'])}")
        retract = part["retract_case"]
        if not retract or not retract["control"]:
            why.append(
                f"{model}: not run yet: {REQUIRED_RETRACT} with its control "
                f"(the retraction case)"
            )
        elif not retract["retracted_reqs"] or not retract["control"]["retracted_reqs"]:
            why.append(f"{model}: the retraction case or its control retracted nothing")
    if not any(p["retract_case"].get("kind") == "retract" for p in by_model.values()):
        why.append("no checkpoint has the strict retraction case")
    for model in ("tiny", "rank"):
        if model not in by_model:
            why.append(f"{model}: no run")
    flips = [p["negative_control_flip_fraction"] for p in by_model.values()]
    dummy = next(
        (
            p["negative_control_dummy_weights"]
            for p in by_model.values()
            if p.get("negative_control_dummy_weights")
        ),
        None,
    )
    commits = sorted(
        {c["code_commit"] for p in by_model.values() for c in p["calls"]}
        | {p["code_commit"] for p in by_model.values()}
    )
    return {
        "weights": "checkpoint",
        "negative_control_flip_fraction": (
            None if None in flips or not flips else min(flips)
        ),
        "identical": sum(p["identical"] for p in by_model.values()),
        "total": sum(p["total"] for p in by_model.values()),
        "cases": [c for run in runs for c in run["cases"]],
        "code_commit": runs[-1]["code_commit"],
        "code_commits": commits,
        "sglang_version": sorted({recorded_sglang_version(run) for run in runs}),
        "negative_control_flip_fraction_by_model": {
            m: p["negative_control_flip_fraction"] for m, p in by_model.items()
        },
        "negative_control_flip_fraction_dummy_weights": dummy,
        "negative_control_sweep": "nc_sweep/",
        "met": not why,
        "why_not_met": why or None,
        "by_model": by_model,
    }


def versioned_headline(runs: List[dict], folders: List[str]) -> dict:
    """``headline`` of the newest sglang release's runs (the supported GPU
    base: what ``met`` is about), with ``by_sglang_version``: each release's
    own headline, where the runs span several (one run per checkpoint and
    release)."""
    versions = sorted({str(recorded_sglang_version(r)) for r in runs}, key=release_key)

    def of(version):
        pairs = [
            (r, f) for r, f in zip(runs, folders)
            if str(recorded_sglang_version(r)) == version
        ]  # fmt: skip
        return headline([r for r, _ in pairs], [f for _, f in pairs])

    result = of(versions[-1])
    if len(versions) > 1:
        result["by_sglang_version"] = {v: of(v) for v in versions}
    return result


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--run",
        action="append",
        required=True,
        help="an exactness.py summary.json (one per checkpoint and sglang "
        "release; repeat the flag): the newest release's runs make the headline",
    )
    p.add_argument("--out", required=True, help="the headline summary.json to write")
    args = p.parse_args(argv)
    runs = []
    for path in args.run:
        with open(path) as f:
            runs.append(json.load(f))
    out_dir = os.path.dirname(os.path.abspath(args.out))
    folders = [
        os.path.relpath(os.path.dirname(os.path.abspath(path)), out_dir) + "/"
        for path in args.run
    ]
    result = versioned_headline(runs, folders)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps({k: result[k] for k in ("identical", "total", "met")}))
    for line in result["why_not_met"] or []:
        print("not met:", line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
