"""Scaling efficiency of ``demb bench dlrm`` reports: samples/s at world size W against W times
the 1-GPU figure (weak scaling: the batch per rank is fixed).

Usage: ``python dlrm_scaling.py OUT.json REPORT_W1.json [REPORT_W2.json ...]``
"""

from __future__ import annotations

import json
import sys


def main(out: str, paths: list[str]) -> None:
    reports = [json.load(open(p)) for p in paths]  # noqa: SIM115
    base = next(r for r in reports if r["workload"]["world_size"] == 1)["samples_per_s"]
    rows = []
    for r in sorted(reports, key=lambda r: r["workload"]["world_size"]):
        w = r["workload"]["world_size"]
        eff = r["samples_per_s"] / (w * base)
        rows.append(
            {"world_size": w, "step_ms": r["step_ms"], "samples_per_s": r["samples_per_s"],
             "efficiency": eff, "device": r["device"]}
        )  # fmt: skip
        print(
            f"world {w}: {r['step_ms']:.3f} ms/step, {r['samples_per_s']:,.0f} samples/s, "
            f"scaling efficiency {eff:.3f} vs {w} x 1 GPU"
        )
    with open(out, "w") as f:
        json.dump({"scaling": rows, "reports": paths}, f, indent=2)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
