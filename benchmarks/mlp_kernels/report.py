"""The run's records -> the markdown report, the summary (JSON) and the short table printed last."""

from __future__ import annotations

from benchmarks.mlp_kernels import kernels


def final_records(recs: list[dict]) -> dict[str, dict]:
    return {r["item"]: r for r in recs if r.get("kind") == "item"}


def _f(x, nd=3) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


def _err(r: dict) -> str:
    g = r.get("graph") or r.get("eager") or {}
    return "-" if g.get("rel_l2") is None else f"{g['rel_l2']:.1e}"


def _status(r: dict | None) -> str:
    if r is None:
        return "not run (time budget)"
    if r.get("status") == "ok":
        return "ok"
    why = r.get("why") or r.get("error") or ""
    if r.get("status") == "wrong":
        e, g = r.get("eager", {}), r.get("graph", {})
        why = f"eager rel {e.get('rel_l2')}, nan {e.get('nan')}; graph rel {g.get('rel_l2')}, nan {g.get('nan')}"
    return f"{r.get('status')}: {why}"[:220]


def passed(r: dict | None) -> bool:
    return bool(r and r.get("status") == "ok" and r.get("ms"))


def choices(final: dict) -> dict:
    """What the e2e_q3 section adds from a kernels sweep: the fastest passing attention candidate for Qwen3
    1080p, if it beats fa4."""
    fa4 = final.get("attn/q3_1080p/fa4")
    ranked = sorted(((item.split("/")[-1], r["ms"]) for item, r in final.items()
                     if item.startswith("attn/q3_1080p/") and passed(r)), key=lambda x: x[1])
    top = ranked[0][0] if ranked else None
    return {"attention_72": top if top and top != "fa4" and passed(fa4) else None}


def kernel_tables(final: dict) -> list[str]:
    items = [i for i in kernels.items(sweep=True) if i in final]  # what this run measured
    if not items:
        return ["## Per kernel: none measured in this run", ""]
    lines = ["## Per kernel (CUDA-graph replay, median; numerics against float32, eager and replayed on fresh "
             "inputs with the output poisoned)", "",
             "### Qwen2.5 gate/up GEMM + SwiGLU (x [M, 1280], weight [6912, 1280]; TF/s of the GEMM's FLOPs)", "",
             "| candidate | 1080p (M 10764) ms | TF/s | 8 x 448 (M 8192) ms | TF/s | rel err | status |",
             "|---|---|---|---|---|---|---|"]
    seen = []
    for item in items:
        group, _, cand = item.split("/")
        if group == "mlp" and cand not in seen:
            seen.append(cand)
    for cand in seen:
        a, b = final.get(f"mlp/q25_1080p/{cand}"), final.get(f"mlp/q25_8x448/{cand}")
        cells = []
        for item, r in ((f"mlp/q25_1080p/{cand}", a), (f"mlp/q25_8x448/{cand}", b)):
            ms = r.get("ms") if r else None
            cells += [_f(ms), _f(kernels.flops(item) / ms / 1e9, 0) if ms else "-"]
        lines.append(f"| {cand} | {' | '.join(cells)} | {_err(a or {})} | {_status(a)} |")
    lines += ["", "### fc1 + activation (Qwen3: [8160, 1152] x [4352, 1152], tanh GELU; Qwen2: [10764, 1280] x "
              "[5120, 1280], quick_gelu) and RMSNorm ([10764, 1280])", "",
              "| item | ms | TF/s or GB/s | rel err | status |", "|---|---|---|---|---|"]
    for item in items:
        if item.startswith(("fc1/", "norm/")):
            r = final.get(item)
            ms = r.get("ms") if r else None
            rate = "-"
            if ms:
                rate = (f"{kernels.flops(item) / ms / 1e9:.0f} TF/s" if item.startswith("fc1/")
                        else f"{kernels.moved_bytes(item) / ms / 1e6:.0f} GB/s")
            lines.append(f"| {item} | {_f(ms)} | {rate} | {_err(r or {})} | {_status(r)} |")
    lines += ["", "### Attention (16 heads; v the strided view of a fused qkv)", "",
              "| layout | candidate | ms | TF/s | vs fa4 | rel err | status |", "|---|---|---|---|---|---|---|"]
    for item in items:
        if item.startswith("attn/"):
            _, lay, cand = item.split("/")
            r, ref = final.get(item), final.get(f"attn/{lay}/fa4")
            ms = r.get("ms") if r else None
            ratio = f"{ref['ms'] / ms:.2f}x" if ms and passed(ref) else "-"
            tf = _f(kernels.flops(item) / ms / 1e9, 0) if ms else "-"
            lines.append(f"| {lay} | {cand} | {_f(ms)} | {tf} | {ratio} | {_err(r or {})} | {_status(r)} |")
    return lines


def e2e_rows(final: dict) -> list[dict]:
    rows = []
    for item, r in final.items():
        if item.startswith("e2e/"):
            rows += r.get("cases", []) or [dict(item=item, status=_status(r))]
    return rows


def e2e_table(final: dict) -> list[str]:
    lines = ["## End to end (GraphRunner, bf16, real-size random weights; parity: ours vs transformers fp32 <= 1.1 "
             "x transformers' own bf16)", "",
             "| model | case | variant | graph replay ms (GPU) | encode ms (wall) | ours vs fp32 | transformers bf16 "
             "vs fp32 | parity | kernels | graphs |", "|---|---|---|---|---|---|---|---|---|---|"]
    for c in e2e_rows(final):
        if "case" not in c:
            lines.append(f"| {c['item']} | | | | | | | {c['status']} | | |")
            continue
        p = c.get("mlp_policy") or {}
        forms = sorted({f"{key.split('/')[0]}:{name}" for key, name in p.get("selected", {}).items()})
        sel = (c.get("attention") or {}).get("selected", {})
        ran = "mlp " + (",".join(forms) or "-") + (f" (demoted: {p['demoted']})" if p.get("demoted") else "") \
            + "; attn " + (",".join(sorted(set(sel.values()))) or "-")
        lines.append(f"| {c['model']} | {c['case']} | {c['variant']} | {_f(c.get('replay_ms'), 2)} "
                     f"| {_f(c.get('encode_ms'), 2)} | {c['ours_vs_fp32']:.2e} | {c['transformers_bf16_vs_fp32']:.2e} "
                     f"| {'ok' if c['parity_ok'] else 'FAIL'} | {ran} | {' '.join(c['graphs'])} |")
    return lines


def service_tables(final: dict) -> list[str]:
    lines = ["## Service throughput diagnostics (Qwen3-VL-8B 720p)", ""]
    hc = final.get("service/host_copy")
    if hc and hc.get("status") == "ok":
        lines += ["Completion thread's copy per batch (runtime/transfer.py), ms (page faults):", "",
                  "| batch | MB | start (host; first) | D2H (GPU) | D2H GB/s | clone to fresh memory | GB/s "
                  "| clone, previous freed | free a batch | clone, 1 thread | copy into touched buffers | GB/s "
                  "| pool, fresh mappings | the same, huge pages advised | pool, previous batch freed |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for name in ("qwen3_4x720p", "qwen2_5_3x720p"):
            h = hc[name]
            lines.append(f"| {name} | {h['mb']} | {_f(h['start_ms'], 2)}; {_f(h['start_first_ms'], 1)} "
                         f"| {_f(h['d2h_gpu_ms'], 2)} | {_f(h['d2h_gb_s'], 1)} "
                         f"| {_f(h['clone_ms'], 2)} ({h['clone_faults']:.0f}) | {_f(h['clone_gb_s'], 1)} "
                         f"| {_f(h['clone_steady_ms'], 2)} | {_f(h['free_ms'], 2)} | {_f(h['clone_1thread_ms'], 2)} "
                         f"| {_f(h['copy_reused_ms'], 2)} | {_f(h['copy_reused_gb_s'], 1)} "
                         f"| {_f(h['pool_fresh_ms'], 2)} ({h['pool_fresh_faults']:.0f}) "
                         f"| {_f(h['thp_fresh_ms'], 2)} ({h['thp_fresh_faults']:.0f}) "
                         f"| {_f(h['pool_reused_ms'], 2)} ({h['pool_reused_faults']:.0f}) |")
        lines.append("")
    else:
        lines += [f"host_copy: {_status(hc)}", ""]
    ra = final.get("service/runner_alone")
    if ra and ra.get("status") == "ok":
        runs = [f"{k.removeprefix('batch_')}: {v['images_per_s']:.1f} images/s ({' '.join(v['graphs'])})"
                for k, v in ra.items() if k.startswith("batch_")]
        lines += ["Runner alone (synchronized encode, images per batch: images/s, graphs): " + "; ".join(runs), ""]
    lines += ["Engine, closed loop of 64 callers (no HTTP); variant: preprocessing, CPU threads, where the rows "
              "go (pool: the service now; clone: torch's allocator, before; pinned: no copy, an upper bound), "
              "rows kept (all, or a window: a cache at capacity):", "",
              "| variant | images/s | images per batch | GPU thread host ms / batch | completion wait ms / batch "
              "| page faults / image | pool takes reused / fresh | status |", "|---|---|---|---|---|---|---|---|"]
    for item, r in final.items():
        if item.startswith("service/engine"):
            if r.get("status") == "ok":
                pool = r.get("pool") or {}
                lines.append(f"| {r['variant']} | {r['images_per_s']:.1f} | {r['mean_images_per_batch']:.2f} "
                             f"| {r['gpu_thread_host_ms_per_batch']:.2f} "
                             f"| {r['completion_wait_ms_per_batch']:.2f} | {r['minor_faults_per_image']:.0f} "
                             f"| {pool.get('reused', 0)} / {pool.get('fresh', 0)} | ok |")
            else:
                lines.append(f"| {item} | | | | | | | {_status(r)} |")
    return lines


def readme_tables(final: dict) -> list[str]:
    lines = ["## README rows (benchmarks/bench_vit.py --attention auto,torch; torch's rows without quack)", ""]
    for item, r in final.items():
        if item.startswith("readme/"):
            lines += [f"### {item.removeprefix('readme/')} ({r.get('folder', '')})", "",
                      r.get("markdown") or _status(r), ""]
    return lines


def render(recs: list[dict], wall_s: float) -> tuple[str, dict, str]:
    final = final_records(recs)
    env = next((r for r in recs if r.get("kind") == "env"), {})
    picked = choices(final)
    lines = ["# Issue 23 kernels and service diagnostics (python -m benchmarks.mlp_kernels)", "",
             "env: " + ", ".join(f"{k}={v}" for k, v in env.items() if k != "kind") + f"; wall {wall_s:.0f} s", "",
             f"attention candidate for Qwen3's e2e from a kernels sweep: {picked['attention_72'] or 'none (fa4)'}",
             ""]
    lines += kernel_tables(final) + [""] + e2e_table(final) + [""] + service_tables(final) + [""] \
        + readme_tables(final)
    summary = dict(env=env, picked=picked, records=list(final.values()), wall_s=wall_s)
    return "\n".join(lines) + "\n", summary, short_table(final, picked)


def short_table(final: dict, picked: dict) -> str:
    lines = ["model | case | variant | replay ms | parity"]
    for c in e2e_rows(final):
        if "case" in c:
            lines.append(f"{c['model']} | {c['case']} | {c['variant']} | {_f(c.get('replay_ms'), 2)} "
                         f"| {'ok' if c['parity_ok'] else 'FAIL'}")
    for item, r in final.items():
        if item.split("/")[0] in ("mlp", "fc1", "norm", "attn"):
            lines.append(f"kernel {item}: {_f(r.get('ms'))} ms ({_status(r)[:60]})")
    if picked.get("attention_72"):
        lines.append(f"attention for Qwen3 e2e: {picked['attention_72']}")
    for item, r in final.items():
        if item.startswith("service/engine") and r.get("status") == "ok":
            lines.append(f"engine {r['variant']}: {r['images_per_s']:.1f} images/s")
        elif item.startswith("readme/"):
            lines.append(f"{item}: {_status(r)[:80]}")
    return "\n".join(lines)
