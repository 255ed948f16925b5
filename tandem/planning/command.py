"""`tandem plan`: size a fleet from a workload profile and measured curves or rates; print a table and a patch."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import yaml

from tandem.planning.curves import load_curve
from tandem.planning.profile import WorkloadProfile
from tandem.planning.report import format_plan, plan_patch_yaml, plan_to_dict
from tandem.planning.sizing import make_plan


def run_plan_command(profile: WorkloadProfile, curve_path: str | None = None, patch_style: str = "pools",
                     patch_out: str | None = None, output_format: str = "table") -> int:
    try:
        curve = load_curve(curve_path) if curve_path else None
        plan = make_plan(profile, curve)
    except ValueError as exc:
        print(f"tandem plan: error: {exc}", file=sys.stderr)
        return 2
    try:
        patch = plan_patch_yaml(plan, patch_style) if plan.loads is not None else None
    except ValueError as exc:
        print(f"tandem plan: error: {exc}", file=sys.stderr)
        return 2
    if output_format == "json":
        doc = plan_to_dict(plan)
        doc["patch"] = None if patch is None else yaml.safe_load(patch)
        print(json.dumps(doc, indent=1))
    else:
        print(format_plan(plan))
    if patch is not None:
        if patch_out:
            try:
                Path(patch_out).write_text(patch)
            except OSError as exc:
                print(f"tandem plan: error: cannot write the patch to {patch_out}: {exc.strerror}", file=sys.stderr)
                return 2
            print(f"wrote the LLMDeployment patch to {patch_out}", file=sys.stderr)
        elif output_format == "table":
            print("\n# LLMDeployment patch\n" + patch, end="")
    return 0
