"""Human-readable tables of a plan (the `--json` output carries every figure)."""

from __future__ import annotations


def span(values: list[float], digits: int = 1) -> str:
    low, high = values
    return f"{low:.{digits}f}-{high:.{digits}f}"


def shown(value: float | None, template: str, missing: str = "-") -> str:
    """`value` through `template` (a format string of one field), or `missing` for None."""
    return missing if value is None else template.format(value)


def section(title: str, *rows: str) -> list[str]:
    """A table after the first: a blank line, its title, then its rows."""
    return ["", f"== {title} ==", *rows]


def memory_table(memory: dict) -> list[str]:
    lines = [
        "== Memory ==",
        f"parameters            {memory['parameters'] / 1e9:.3f} B "
        f"({memory['parameters_linear'] / 1e9:.3f} B in linear layers)",
        f"weights               {memory['weights_gib']:.2f} GiB as {memory['weight_dtype']}",
        f"KV cache per token    {memory['kv_bytes_per_token'] / 1024:.1f} KiB "
        f"as {memory['kv_cache_dtype']}",
        f"KV per sequence       {memory['kv_gib_per_sequence_at_max_len']:.2f} GiB at max length",
        "",
        f"{'TP':>3} {'weights/GPU':>12} {'overhead':>11} {'KV free':>13} {'KV tokens':>21} "
        f"{'max conc.':>11} {'fits':>5}",
    ]
    for m in memory["per_tp"]:
        tokens = f"{m['kv_capacity_tokens'][0]:,}-{m['kv_capacity_tokens'][1]:,}"
        concurrency = "-".join(str(c) for c in m["max_concurrency_at_max_model_len"])
        fits = "all" if m["fits_max_num_seqs"] else ("one" if m["fits_one_sequence"] else "no")
        lines.append(
            f"{m['tp']:>3} {m['weights_gib']:>8.2f} GiB {span(m['overhead_gib']):>7} GiB "
            f"{span(m['kv_free_gib']):>9} GiB {tokens:>21} {concurrency:>11} {fits:>5}"
        )
    lines.append(
        f"TP needed: {memory['tp_needed_for_one_sequence']} for one sequence at max length, "
        f"{memory['tp_needed_for_max_num_seqs']} for --max-num-seqs of them"
    )
    return lines


def capacity_table(capacity: dict) -> list[str]:
    lines = section(
        "Capacity",
        f"load                  {capacity['requests_per_s']:.2f} req/s: "
        f"{capacity['input_tokens_per_s']:,.0f} input tok/s, "
        f"{capacity['output_tokens_per_s']:,.0f} output tok/s",
        f"per GPU               prefill {capacity['prefill_tokens_per_s_per_gpu']:,.0f} tok/s, "
        f"decode {capacity['decode_tokens_per_s_per_gpu']:,.0f} tok/s "
        f"({capacity['throughput_source']})",
        f"GPUs at full load     prefill {capacity['prefill_gpus_at_full_load']:.2f}, "
        f"decode {capacity['decode_gpus_at_full_load']:.2f}, "
        f"colocated {capacity['colocated_gpus_at_full_load']:.2f} "
        f"(P:D = {capacity['prefill_to_decode_ratio']:.2f}:1)",
        "",
        f"{'target':>7} {'P inst':>7} {'D inst':>7} {'P/D GPUs':>9} {'coloc GPUs':>11} "
        f"{'M/D/1 TTFT':>11}",
    )
    for t in capacity["at_target_utilization"]:
        ttft_text = shown(t["prefill_mean_ttft_ms"], "{:.0f} ms", "unstable")
        lines.append(
            f"{t['target_utilization']:>7.0%} {t['prefill_instances']:>7} "
            f"{t['decode_instances']:>7} {t['disaggregated_gpus']:>9} "
            f"{t['colocated_gpus']:>11} {ttft_text:>11}"
        )
    if capacity["prefill_max_utilization_for_ttft"] is not None:
        lines.append(
            f"prefill pool may run up to {capacity['prefill_max_utilization_for_ttft']:.0%} "
            "busy before mean TTFT (M/D/1) reaches the SLO"
        )
    lines.extend(f"note: {n}" for n in capacity["notes"])
    return lines


def cost_table(rows: list[dict]) -> list[str]:
    lines = section(
        "Cost (per 1M tokens)",
        f"{'target':>7} {'deployment':>14} {'GPUs':>5} {'$/h':>8} {'blended':>9} {'input':>9} "
        f"{'output':>9} {'$/year':>12} {'API break-even':>15}",
    )
    for row in rows:
        for name in ("disaggregated", "colocated"):
            c = row[name]
            api = c["api"] or {}
            breakeven = shown(api.get("break_even_utilization"), "{:.0%} of peak")
            lines.append(
                f"{row['target_utilization']:>7.0%} {name:>14} {c['gpus']:>5} "
                f"{c['cost_per_hour']:>8.2f} {c['price_per_1m_tokens']:>9.4f} "
                f"{c['price_per_1m_input_tokens']:>9.4f} {c['price_per_1m_output_tokens']:>9.4f} "
                f"{c['cost_per_year']:>12,.0f} {breakeven:>15}"
            )
    first = rows[0]["disaggregated"]["by_daily_utilization"]
    by_use = ", ".join(f"{u['utilization']:.0%}: ${u['price_per_1m_tokens']:.4f}" for u in first)
    lines.append(f"blended $/1M by average daily load (first row): {by_use}")
    return lines


def simulation_table(simulation: dict) -> list[str]:
    lines = section(
        "Simulation at peak load",
        f"{'deployment':>24} {'GPUs':>5} {'p50 TTFT':>9} {'p95 TTFT':>9} {'p50 ITL':>8} "
        f"{'p95 ITL':>8} {'goodput':>8}",
    )
    for name in ("disaggregated", "colocated"):
        s = simulation[name]
        goodput = shown(s["request_goodput"], "{:.2f}")
        lines.append(
            f"{s['deployment']:>24} {s['gpus']:>5} {s['median_ttft_ms']:>9.1f} "
            f"{s['p95_ttft_ms']:>9.1f} {s['median_itl_ms']:>8.1f} {s['p95_itl_ms']:>8.1f} "
            f"{goodput:>8}"
        )
    search = simulation.get("placement_search")
    if search:
        lines += ["", "placement search (goodput at 90% SLO attainment, best per GPU first):"]
        for row in search[:8]:
            lines.append(
                f"  {row['deployment']:>22}: {row['goodput_requests_per_s']:.2f} req/s, "
                f"{row['goodput_per_gpu']:.2f} per GPU"
            )
    return lines


def format_plan(plan: dict) -> str:
    lines = memory_table(plan["memory"])
    if plan["capacity"]:
        lines += capacity_table(plan["capacity"])
    else:
        lines += [
            "",
            "(capacity: give --requests-per-minute, --prompt-tokens, --output-tokens "
            "and throughputs, --from-sweep or --calibration)",
        ]
    if plan["cost"]:
        lines += cost_table(plan["cost"])
    if plan["simulation"]:
        lines += simulation_table(plan["simulation"])
    return "\n".join(lines)
