"""The estimate's answer as JSON (`to_dict`) and as `tokenmill estimate`'s console tables (`render`)."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from tokenmill.estimate.memory import GB, GIB, BudgetSolution, MemoryEstimate, ModelMemory, by_phase


def model_peak(m: ModelMemory) -> int:
    """The model's persistent bytes plus its largest phase (its items of different phases never coexist)."""
    parts = by_phase(m)
    return parts.pop("persistent", 0) + max(parts.values(), default=0)


def to_dict(est: MemoryEstimate, budget: BudgetSolution | None, advice: dict[str, Any]) -> dict[str, Any]:
    """The JSON answer of `estimate_for_config` (bytes as integers; GB = 10^9 bytes in the `*_gb` copies)."""
    plan, dev = est.plan, est.device
    settings = {k: v for k, v in asdict(plan).items() if k not in ("policy", "critic", "reward_models")}
    settings |= {"lora_targets": list(plan.lora_targets), "seq_len": plan.seq_len,
                 "micro_batch_tokens_effective": plan.tokens}
    models = [{"role": m.role, "device": m.device, "trainable": m.trainable, "params": m.params,
               "trainable_params": m.trainable_params, "bytes": m.bytes, "phases": m.phases,
               "peak_bytes": model_peak(m)} for m in est.models]
    device = {"name": dev.name, "count": plan.num_devices, "persistent_bytes": dev.persistent,
              "phase_bytes": dev.phases, "peak_phase": dev.peak_phase, "overhead_bytes": dev.overhead,
              "margin_bytes": dev.margin, "total_bytes": dev.total, "total_gb": round(dev.total / GB, 2),
              "budget_bytes": dev.budget, "fits": dev.fits}
    out: dict[str, Any] = {"mode": plan.mode, "algorithm": plan.algorithm, "model": plan.policy.to_dict(),
                           "settings": settings, "models": models, "devices": [device],
                           "warnings": list(est.warnings), "recommendation": advice, "budget": None}
    if budget is not None:
        out["budget"] = {**{k: v for k, v in asdict(budget).items() if k != "proposals"}, "fits": budget.fits,
                         "suggested_micro_batch_tokens": budget.micro_batch * plan.seq_len,
                         "proposals": [asdict(p) for p in budget.proposals]}
    return out


def _gb(value: int | None) -> str:
    return "" if not value else f"{value / GB:.2f}"


def render(result: dict[str, Any]) -> None:
    """Print `estimate_for_config`'s answer as tables on the console (rich)."""
    from rich.console import Console
    from rich.table import Table

    console, model, st, dev = Console(), result["model"], result["settings"], result["devices"][0]
    console.print(f"[bold]{model['name']}[/]: {model['params']:,} parameters; {result['mode']} ({result['algorithm']}),"
                  f" {st['precision']}, {st['micro_batch_tokens_effective']} tokens per micro-batch, "
                  f"{st['num_devices']} device(s), sharding {st['sharding']}")
    if "vision" in result:  # a vision-language policy
        vision = result["vision"]
        console.print(f"vision tower: {vision['params']:,} parameters; a {vision['image_size'][0]} x "
                      f"{vision['image_size'][1]} picture is {vision['image_tokens']} image tokens, "
                      f"{vision['images_per_prompt']} per prompt (estimate.images_per_prompt)")
    parts = list(dict.fromkeys(k for m in result["models"] for k in m["bytes"]))
    table = Table(title="Memory on each device, GB (10^9 bytes)")
    table.add_column("component")
    table.add_column("phase")
    for m in result["models"]:
        table.add_column(m["role"] + ("" if m["trainable"] else " (frozen)"), justify="right")
    for key in parts:
        phase = next(m["phases"][key] for m in result["models"] if key in m["phases"])
        table.add_row(key, phase, *(_gb(m["bytes"].get(key)) for m in result["models"]))
    table.add_row("trainable params", "", *(f"{m['trainable_params']:,}" for m in result["models"]))
    table.add_row("peak", "", *(_gb(m["peak_bytes"]) for m in result["models"]))
    console.print(table)
    phases = ", ".join(f"{k} {_gb(v) or '0'}" for k, v in dev["phase_bytes"].items())
    budget = "" if dev["budget_bytes"] is None else (
        f" of {dev['budget_bytes'] / GIB:.1f} GiB: " + ("fits" if dev["fits"] else "[red]does not fit[/]"))
    console.print(f"device '{dev['name']}': persistent {_gb(dev['persistent_bytes'])} + peak phase "
                  f"{dev['peak_phase']} (phases: {phases}) + overhead {_gb(dev['overhead_bytes'])} + margin "
                  f"{_gb(dev['margin_bytes'])} = [bold]{dev['total_gb']:.2f} GB[/]{budget}")
    for warning in result["warnings"]:
        console.print(f"[yellow]warning:[/] {warning}")
    rec = result["recommendation"]
    console.print(f"recommendation: {rec['backend']} - {rec['reason']}")
    for line in result.get("placement", {}).get("lines", []):  # cluster.backend ray: where each role runs
        console.print(line, markup=False, highlight=False)
    b = result["budget"]
    if b is not None and b["fits"]:
        console.print(f"budget: up to {b['max_tokens']:,} tokens per micro-batch -> {b['micro_batch']} sequence(s) "
                      f"of {st['seq_len']}, gradient accumulation {b['grad_accum']} "
                      f"(micro_batch_tokens: {b['suggested_micro_batch_tokens']})")
    elif b is not None:
        console.print("budget: one sequence does not fit; in order:")
        for p in b["proposals"]:
            console.print(f"  - {p['action']} ({p['setting']}): saves {_gb(p['saving_bytes']) or '0'} GB"
                          + (" -> fits" if p["fits_after"] else ""))
