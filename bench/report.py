"""The Markdown report of a bench run, and the README block it is copied into."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from bench.common import REPO
from bench.startup import process_table

START, END = "<!-- bench:start -->", "<!-- bench:end -->"
README_INTRO = """\
## Benchmarks

`make bench` (about 12 minutes here; `make bench BENCH_ARGS=--quick` for a smoke run) measures what
raytrn costs over a bare PyTorch loop and stock Ray Train, and the data, checkpoint, MLflow and
recovery paths, on this machine. Variants are alternated inside one run and compared as ratios, so the
noise of a shared machine mostly cancels; the raw numbers are in `bench/results/<date>-<host>.json`.
The block below is rewritten by each run.

"""


def _num(x: Any, fmt: str = ",.0f", unit: str = "") -> str:
    if x is None:
        return "n/a"
    return f"{format(x, fmt)}{unit}"


def _pct(x: Any, digits: int = 1) -> str:
    return "n/a" if x is None else f"{x * 100:.{digits}f}%"


def _load(avg: list[float]) -> str:
    return f"{avg[0]:.2f}" if avg else "n/a"


def _goal(ok: bool | None, text: str) -> str:
    if ok is None:
        return text
    return f"{text} {'met' if ok else '**not met**'}"


def _status_row(name: str, r: dict[str, Any]) -> str | None:
    if r.get("status") in ("skipped", "failed"):
        return f"| {name} | {r['status']}: {r.get('message', '').splitlines()[0][:200]} | |"
    return None


def render(report: dict[str, Any]) -> str:
    """The whole Markdown block: machine, the results table, GPU and Trainium tables, notes."""
    m, res = report["machine"], report["results"]
    lines = [
        f"Run {report['date']} on `{m['host']}`: {m['logical_cores']} logical cores ({m['cpu']}), "
        f"{m['ram_gib']} GiB RAM, accelerator: {m['accelerator']}; Python {m['python']}, torch {m['torch']}, "
        f"ray {m['ray']}, mlflow {m['mlflow']}. Load average (1 min) {_load(report['load_start'])} at start, "
        f"{_load(report['load_end'])} at the end: the machine was shared with other work, so absolute numbers are "
        f"noisy; the ratios are taken within each round. Mode: {report['mode']}, {report['wall_s'] / 60:.1f} min.",
        "",
    ]
    t = res.get("training", {})
    setup = t.get("setup", {})
    if setup:
        lines += [
            f"Training: `{setup['job']}` (Llama, 2 layers, width 128), micro-batch {setup['micro_batch_size']}, "
            f"seq {setup['seq_len']}, {setup['steps']} steps, steady state after step {setup['warmup_steps']}, "
            f"{setup['threads_per_worker']} torch thread per worker in every variant, {t.get('rounds')} alternated "
            f"round(s); (c) logs every {setup['log_every']} steps and checkpoints every "
            f"{setup['checkpoint_every_n_steps']} (the job's defaults).",
            "",
        ]
    lines += ["| benchmark | result | goal |", "|---|---|---|"]
    row = _status_row("training overhead", t)
    if row:
        lines.append(row)
    elif t:
        c_a, c_b = t.get("c_over_a"), t.get("c_over_b")
        per = ", ".join(f"{x:.3f}" for x in t.get("c_over_a_per_round", []))
        lines += [
            f"| (a) bare PyTorch loop, 1 process | {_num(t.get('bare_tokens_per_s'))} tokens/s | |",
            f"| (a') the same loop with raytrn's allocator settings (`run.tune_malloc`) | "
            f"{_num(t.get('bare_tuned_tokens_per_s'))} tokens/s | |",
            f"| (b) stock Ray Train `TorchTrainer`, 1 worker | {_num(t.get('stock_tokens_per_s'))} tokens/s | |",
            f"| (c) `raytrn train`, 1 worker, tracking + checkpoints on | {_num(t.get('raytrn_tokens_per_s'))} "
            f"tokens/s (the loop's own metric: {_num(t.get('raytrn_tokens_per_s_loop_reported'))}) | |",
            f"| c/a | **{_num(c_a, '.3f')}** (per round: {per}) | {_goal(c_a >= 0.97 if c_a else None, '>= 0.97')} |",
            f"| c/a' (like for like: both with the allocator settings) | **{_num(t.get('c_over_a_tuned'), '.3f')}** "
            f"(per round: {', '.join(f'{x:.3f}' for x in t.get('c_over_a_tuned_per_round', []))}) | |",
            f"| c/b | **{_num(c_b, '.3f')}** (b/a: {_num(t.get('b_over_a'), '.3f')}) | |",
            f"| start to first step, (b) stock | {_num(t.get('stock_first_step_s'), '.1f', ' s')} | |",
        ]
        ttfs, cold = t.get("raytrn_first_step_s"), t.get("cold_over_floor")
        lines += [
            f"| start to first step, (c) `raytrn train` (its `time_to_first_step_s` metric), cold: its own local Ray | "
            f"{_num(ttfs, '.1f', ' s')} | |",
            f"| cold floor: stock Ray Train, empty train function, process start to its start (every round) | "
            f"{_num(t.get('ray_train_floor_s'), '.1f', ' s')} | |",
            f"| cold start: (c) first step done / the cold floor | **{_num(cold, '.2f')}** | "
            f"{_goal(cold <= 0.9 if cold is not None else None, '<= 0.9')} |",
        ]
        if t.get("raytrn_processes"):
            lines.append(
                f"| cold start: processes started before (c)'s first step, CPU-seconds each | "
                f"{process_table(t['raytrn_processes'])} (the floor's: {process_table(t.get('floor_processes', []))}) | |"
            )
        led = t.get("raytrn_ledger") or {}
        if led.get("goodput") is not None:
            lines.append(
                f"| goodput of (c) ({setup.get('steps')} steps, 1 worker) | {_num(led['goodput'], '.2f')} (start-up "
                f"{_num(led.get('badput_startup_s'), '.1f', ' s')}, shutdown {_num(led.get('badput_shutdown_s'), '.1f', ' s')}"
                f" of {_num(led.get('wall_s'), '.1f', ' s')}) | |"
            )
        peak = res.get("peak", {}).get("flops_per_s")
        fpt = t.get("flops_per_token")
        if peak and fpt:
            a_mfu = (t.get("bare_tokens_per_s") or 0) * fpt / peak
            c_mfu = (t.get("raytrn_tokens_per_s") or 0) * fpt / peak
            lines.append(
                f"| model FLOP/s vs one core's fp32 matmul ({peak / 1e9:.1f} GFLOP/s) | (a) {_pct(a_mfu)}, "
                f"(c) {_pct(c_mfu)} | |"
            )
    sc = t.get("scaling") if isinstance(t, dict) else None
    if sc:
        lines.append(
            f"| scaling 1 -> 2 CPU workers (`raytrn train`) | {_num(sc['tokens_per_s_1w'])} -> "
            f"{_num(sc['tokens_per_s_2w'])} tokens/s: {_num(sc['speedup'], '.2f')}x, efficiency "
            f"{_pct(sc['efficiency'], 0)} | 2 cores: see note |"
        )
    elif t and t.get("scaling_message"):
        lines.append(f"| scaling 1 -> 2 CPU workers | {t['scaling_message']} | |")
    lines += _startup_rows(res.get("startup", {}))
    ml = res.get("mlflow", {})
    row = _status_row("MLflow overhead", ml)
    if row:
        lines.append(row)
    for key in sorted(k for k in ml if k.startswith("log_every_")):
        v = ml[key]
        n = key.rsplit("_", 1)[1]
        lines.append(
            f"| MLflow overhead, log every {n} step(s), tracking on vs off | {_pct(v.get('overhead'), 2)} of step time, "
            f"noise ±{_pct(_twice(v.get('noise')), 1)} ({_num(v.get('ms_per_log_call'), '.1f', ' ms')} per logged step; step "
            f"{_num(v.get('step_time_off_s'), '.3f')} s) | {_overhead_goal(v.get('overhead'), v.get('noise'))} |"
        )
        if v.get("in_thread_overhead") is not None:
            inside = v["in_thread_overhead"]
            lines.append(
                f"| MLflow overhead, log every {n} step(s), inside the training thread (rank 0's log calls, timed) | "
                f"{_pct(inside, 3)} of step time ({_num(v.get('in_thread_ms_per_log_call'), '.2f', ' ms')} per "
                f"logged step; median {_num(v.get('in_thread_ms_per_log_call_median'), '.2f', ' ms')}, max "
                f"{_num(v.get('in_thread_ms_per_log_call_max'), '.1f', ' ms')}) | {_goal(inside < 0.01, '< 1%')} |"
            )
    d = res.get("data", {})
    row = _status_row("data pipeline", d)
    if row:
        lines.append(row)
    elif d:
        ratio = d.get("raytrn_over_raw")
        lines.append(
            f"| data: raytrn's read (Ray Data + the loop's iterator) vs raw pyarrow, same shards, same int64 "
            f"micro-batches | {_num(d.get('raytrn_rows_per_s_mean'))} vs {_num(d.get('raw_rows_per_s_mean'))} rows/s "
            f"({_num(ratio, '.3f')}x); {_num(d.get('headroom_vs_training'), ',.0f')}x what (c) "
            f"consumes | {_goal(ratio >= 0.5 if ratio is not None else None, '>= 0.5x')} |"
        )
    wait = t.get("raytrn_data_wait_fraction") if isinstance(t, dict) else None
    if wait is not None:
        lines.append(
            f"| data: the step's wait for its micro-batches (`data_wait_s` / `step_time_s` of (c)) | {_pct(wait, 2)} "
            f"of step time | {_goal(wait < 0.02, '< 2%')} |"
        )
    ck = res.get("checkpoint", {})
    row = _status_row("checkpoint", ck)
    if row:
        lines.append(row)
    for name, v in ck.items():
        if not isinstance(v, dict) or "mb" not in v:
            continue
        save, restore, blocked = v.get("save_over_boto3"), v.get("restore_over_boto3"), v.get("async_blocked_fraction")
        goal = []
        if v["mb"] >= 100 and save is not None:
            goal.append(_goal(save >= 0.9, "save >= 0.9 of raw"))
        if blocked is not None:
            goal.append(_goal(blocked < 0.1, "async blocked < 10%"))
        lines.append(
            f"| checkpoint to S3 (moto), sharded (DCP), {name} model, {v['mb']:.0f} MB | save "
            f"{_num(v.get('raytrn_save_mb_per_s'), ',.0f')} MB/s vs boto3 multipart upload {_num(v.get('boto3_put_mb_per_s'), ',.0f')}"
            f" ({_num(save, '.2f')}x); restore {_num(v.get('raytrn_restore_mb_per_s'), ',.0f')} vs download "
            f"{_num(v.get('boto3_get_mb_per_s'), ',.0f')} ({_num(restore, '.2f')}x); `checkpoint.async` blocks the step "
            f"{_pct(blocked)} of the save{_copied(v)} | {'; '.join(goal)} |"
        )
        if "s3torchconnector_save_over_raytrn" in v:
            lines.append(
                f"| AWS's s3torchconnector DCP writer/reader, same state and endpoint, {name} model | save takes "
                f"{_num(v['s3torchconnector_save_over_raytrn'], '.2f')}x raytrn's time, restore "
                f"{_num(v['s3torchconnector_restore_over_raytrn'], '.2f')}x | informs the choice (performance.md) |"
            )
    ret = ck.get("retention")
    if isinstance(ret, dict) and "round_s" in ret:
        lines.append(
            f"| retention after a commit (`checkpoint.keep_last` 1), S3 (moto), the dropped checkpoint "
            f"{ret['files']} files (a rank's shard each) | the round {_num(ret['round_s'], '.2f', ' s')}, in rank "
            f"0's retention thread beside the next steps; the save returned before it, in "
            f"{_num(ret['save_s'], '.2f', ' s')} (until 2026-12-02 every rank's commit waited for the round) | |"
        )
    lines += _memory_rows(res.get("memory", {}))
    par = res.get("parallel", {})
    row = _status_row("parallel", par)
    if row:
        lines.append(row)
    if "fsdp_over_ddp" in par:
        ratio = par["fsdp_over_ddp"]
        lines.append(
            f"| memory per worker (parameters + gradients + AdamW state), 4 CPU workers, 136 MB state: fsdp vs ddp | "
            f"{_num(par['memory_fsdp_mb'], ',.1f')} vs {_num(par['memory_ddp_mb'], ',.1f')} MB ({ratio:.3f}x) | "
            f"{_goal(ratio <= 0.275, '<= 0.275x')} |"
        )
        lines.append(
            f"| throughput, 2 CPU workers (gloo, no Ray) vs a bare 1-process loop ({_num(par['bare_tokens_per_s'])} "
            f"tokens/s) | ddp {_num(par['ddp_2_tokens_per_s'])} ({par['ddp_over_bare']:.2f}x), fsdp "
            f"{_num(par['fsdp_2_tokens_per_s'])} ({par['fsdp_over_bare']:.2f}x) | 2 cores: ceiling 2x |"
        )
    lines += _layout_rows(res.get("pipeline", {}), res.get("context", {}))
    lo = res.get("lora", {})
    row = _status_row("lora", lo)
    if row:
        lines.append(row)
    elif lo:
        full, ad = lo["full"], lo["lora"]
        lines.append(
            f"| LoRA vs full fine-tuning, one CPU process ({lo['setup']}) | trainable parameters "
            f"{_num(ad['trainable_params'])} vs {_num(full['trainable_params'])} ({_pct(lo['trainable_ratio'], 2)}); "
            f"AdamW state {_num(ad['optimizer_bytes'] / 2**20, ',.1f')} vs {_num(full['optimizer_bytes'] / 2**20, ',.1f')} "
            f"MiB ({_pct(lo['optimizer_ratio'], 2)}); {_num(ad['tokens_per_s'])} vs {_num(full['tokens_per_s'])} "
            f"tokens/s ({_num(lo['speed_ratio'], '.2f')}x) | |"
        )
    mo = res.get("moe", {})
    row = _status_row("moe", mo)
    if row:
        lines.append(row)
    elif mo:
        dense, dropless, fixed = mo["dense"], mo["moe_dropless"], mo["moe_capacity"]
        lines.append(
            f"| Qwen3-MoE step vs a dense Qwen3 of the same active parameters, one CPU process ({mo['setup']}) | "
            f"dropless {_num(dropless['tokens_per_s'])} ({_num(mo['dropless_over_dense'], '.2f')}x), capacity 1.25 "
            f"{_num(fixed['tokens_per_s'])} ({_num(mo['capacity_over_dense'], '.2f')}x, "
            f"{_pct(fixed['dropped_fraction'] or 0.0, 1)} dropped) vs {_num(dense['tokens_per_s'])} tokens/s; "
            f"parameters {_num(dropless['params'])} vs {_num(dense['params'])} | |"
        )
        if "moe_dropless_ep2" in mo:
            ep1, ep2 = mo["moe_dropless_ep1"], mo["moe_dropless_ep2"]
            lines.append(
                f"| Qwen3-MoE at expert parallel 2 vs 1 ({mo['ep_setup']}) | EP 2 {_num(ep2['tokens_per_s'])} vs EP 1 "
                f"{_num(ep1['tokens_per_s'])} tokens/s ({_num(mo['ep2_over_ep1'], '.2f')}x); held a worker (parameters, "
                f"gradients, AdamW) {_num(ep2['held_bytes'] / 2**20, ',.1f')} vs {_num(ep1['held_bytes'] / 2**20, ',.1f')} "
                f"MiB ({_num(mo['ep2_over_ep1_held'], '.2f')}x) | |"
            )
    gu = res.get("guard", {})
    row = _status_row("finiteness check", gu)
    if row:
        lines.append(row)
    elif gu:
        lines.append(
            f"| finiteness check of each step (host read of the grad norm + the guard's count), one CPU process, "
            f"tiny model | {gu['check_s'] * 1e6:.1f} µs per step = {_pct(gu['check_share'], 3)} of the step "
            f"({gu['step_s_checked'] * 1e3:.0f} ms); step time checked / unchecked "
            f"{_num(gu['checked_over_unchecked'], '.3f')} (noise) | {_goal(gu['check_share'] < 0.005, '< 0.5%')} |"
        )
    rec = res.get("recovery", {})
    row = _status_row("recovery", rec)
    if row:
        lines.append(row)
    elif rec:
        stock = (rec.get("stock") or {}).get("kill_to_next_step_s")
        ours = rec.get("kill_to_next_step_s")
        ratio = ours / stock if ours and stock else None
        lines += [
            f"| recovery: SIGKILL of the worker -> first step logged after the restart | "
            f"{_num(ours, '.1f', ' s')} (step {rec.get('killed_at_step')} passed again after "
            f"{_num(rec.get('kill_to_regained_step_s'), '.1f', ' s')}; checkpoint every "
            f"{rec.get('checkpoint_every_n_steps')} steps) | |",
            f"| recovery: stock Ray Train (bench (b)'s loop, a checkpoint every {rec.get('checkpoint_every_n_steps')} "
            f"steps) after the same kill -> its next step | {_num(stock, '.1f', ' s')} | |",
            f"| recovery: raytrn / stock | **{_num(ratio, '.2f')}** | {_goal(ratio <= 0.7 if ratio else None, '<= 0.7')} |",
        ]
    el = res.get("elastic", {})
    row = _status_row("elastic", el)
    if row:
        lines.append(row)
    elif el:
        lost = el.get("node_loss_recovery_s_median")
        lines += [
            f"| elastic, local 3-node Ray (1 worker each, checkpoint every {el['checkpoint_every_n_steps']} steps): node "
            f"lost -> next step logged, median of {len(el['node_loss_recovery_s'])} | **{_num(lost, '.1f', ' s')}** ("
            f"{', '.join(_num(x, '.1f') for x in el['node_loss_recovery_s'])}; restarted at "
            f"{', '.join(str(x) for x in el['node_loss_restarted_dp'])} workers; steps trained again "
            f"{', '.join(str(x) for x in el['node_loss_steps_lost'])}) | {_goal(lost <= 8 if lost else None, '<= 8 s')} |",
            f"| elastic: stock Ray Train V2 (1..3 workers, Ray's defaults) after the same node loss -> its next step | "
            f"{_num((el.get('stock') or {}).get('node_loss_to_next_step_s'), '.1f', ' s')} | |",
            f"| elastic: worker SIGKILLed -> next step logged | {_num(el.get('kill_recovery_s'), '.1f', ' s')} (steps "
            f"trained again {', '.join(str(x) for x in el['kill_steps_lost'])}) | |",
            (
                f"| elastic: spot notice (`ray drain-node`, {el['notice_deadline_s']} s deadline) -> next step logged "
                "(the group restarted once the notice's checkpoint was committed, not at the deadline) | "
                if el.get("notice_measured_from") == "notice"
                else "| elastic: spot notice (`ray drain-node`, 10 s deadline) -> next step logged after the deadline | "
            )
            + f"{_num(el.get('notice_recovery_s'), '.1f', ' s')} (steps lost "
            f"{', '.join(str(x) for x in el['notice_steps_lost'])}) | 0 steps lost |",
            f"| elastic: node back -> 3-worker group running (`resize_interval_s` {el['resize_interval_s']}) | median "
            f"{_num(el.get('scale_up_s_median'), '.1f', ' s')} ({', '.join(_num(x, '.1f') for x in el['scale_up_s'])}) | |",
        ]
        live = el.get("live") or {}
        if live:
            lost_live = live.get("node_loss_to_next_step_s_median")
            lines += [
                f"| elastic, `scaling.recovery: live` (3 hsdp replicas of one worker): node lost -> survivors' next step, "
                f"median of {len(live['node_loss_to_next_step_s'])} | **{_num(lost_live, '.1f', ' s')}** ("
                f"{', '.join(_num(x, '.1f') for x in live['node_loss_to_next_step_s'])}; survivors restarted "
                f"{', '.join(str(x) for x in live['survivors_restarted'])}) | "
                f"{_goal(lost_live <= 5 if lost_live else None, '<= 5 s, 0 restarted')} |",
                _live_back_row(live, el.get("resize_interval_s")),
            ]
        paced = el.get("live_paced") or {}
        if paced:
            lines.append(_live_back_row(paced, el.get("resize_interval_s")))
    for note in _notes(report):
        lines += ["", note]
    lines += ["", *_gpu_block(report)]
    lines += ["", *_trainium_block(res.get("trainium"))]
    return "\n".join(lines).rstrip() + "\n"


def _startup_rows(st: dict[str, Any]) -> list[str]:
    """Start-up on a Ray that is already running (bench/startup.py), and the demo job's goodput."""
    row = _status_row("start-up on a running Ray", st)
    if row or not st:
        return [row] if row else []
    ratio = st.get("ratio")
    rows = [
        f"| on a running Ray: `raytrn train` process start -> first step done / stock `TorchTrainer` process start -> "
        f"empty train function, same cluster, alternated | **{_num(ratio, '.2f')}** ({_num(st.get('raytrn_first_step_s'), '.1f', ' s')} "
        f"vs {_num(st.get('stock_train_fn_s'), '.1f', ' s')}; per round {', '.join(f'{x:.2f}' for x in st.get('ratio_per_round', []))}) | "
        f"{_goal(ratio <= 0.8 if ratio is not None else None, '<= 0.8')} |",
        f"| on a running Ray: processes started before the first step, CPU-seconds each | raytrn: "
        f"{process_table(st.get('raytrn_processes', []))}; stock: {process_table(st.get('stock_processes', []))} | |",
    ]
    demo = st.get("demo") or {}
    if demo.get("goodput") is not None:
        lost = ", ".join(
            f"{k[len('badput_') : -2]} {v:.1f} s" for k, v in demo.items() if k.startswith("badput_") and v >= 0.05
        )
        rows.append(
            f"| goodput of the demo job (`jobs/tiny.yaml`: 2 workers, 100 steps, a cold local Ray) | "
            f"**{demo['goodput']:.2f}** ({_num(demo.get('goodput_s'), '.1f')} of {_num(demo.get('wall_s'), '.1f', ' s')}; "
            f"{lost}) | {_goal(demo['goodput'] >= 0.5, '>= 0.5')} |"
        )
    return rows


def _memory_rows(mem: dict[str, Any]) -> list[str]:
    """The in-memory tier's rows (bench/memory_tier.py): restore from a store's memory vs disk and S3, and the
    step with a snapshot every step."""
    row = _status_row("memory tier", mem)
    if row or not mem:
        return [row] if row else []
    r, st = mem["restore"], mem["step"]
    return [
        f"| restore of a {r['mb']:.0f} MB state (model + AdamW), DCP: from a snapshot store's memory (local Ray) vs "
        f"local disk vs S3 (moto) | {r['memory_restore_s']:.2f} s vs {r['disk_restore_s']:.2f} s vs "
        f"{r['s3_restore_s']:.2f} s: S3 takes {r['s3_over_memory']:.1f}x memory's time, disk "
        f"{r['disk_over_memory']:.1f}x | {_goal(r['s3_over_memory'] >= 5, 'memory >= 5x faster than S3')} |",
        f"| step with an in-memory snapshot every step vs none, bench job, 1 worker (`raytrn train`) | "
        f"{st['step_s_snapshot_every_step'] * 1e3:.0f} ms vs {st['step_s_off'] * 1e3:.0f} ms "
        f"({_pct(st['step_slowdown'])} slower); the step waited for the snapshot {st['blocked_s'] * 1e3:.1f} ms "
        f"({_pct(st['blocked_fraction'])} of a step; the rest is its copies' CPU beside the step on 2 cores) | "
        f"{_goal(st['blocked_fraction'] < 0.05, 'blocked < 5%')}; {_goal(st['step_slowdown'] < 0.05, 'step < 5%')} |",
        *_node_loss_rows(mem.get("node_loss")),
    ]


def _node_loss_rows(nl: dict[str, Any] | None) -> list[str]:
    """Issue 29's scenario with and without the tier (full runs only)."""
    if not nl:
        return []
    m, d = nl["memory"], nl["durable_only"]
    again = m.get("steps_retrained")
    return [
        f"| node lost at step 30 of 60, local 3-node Ray, no durable checkpoint yet: with a snapshot every step vs "
        f"without the tier | next step logged after {m['recovery_s']:.1f} s vs {d['recovery_s']:.1f} s; steps trained "
        f"again {again} vs {d.get('steps_retrained')} (from the old group's last step started: {m['steps_lost']} vs "
        f"{d['steps_lost']}); state from {m['source']} vs {d['source']} | "
        f"{_goal(again <= 1 if again is not None else None, 'at most 1 step trained again')} |"
    ]


def _copied(v: dict[str, Any]) -> str:
    """The async save's blocked share with its copy waited for at the save (before 2026-12-02), same run."""
    copied = v.get("copied_blocked_fraction")
    return "" if copied is None else f" (its copy waited for at the save instead: {_pct(copied)})"


def _twice(noise: float | None) -> float | None:
    """Two standard errors (the README's note: the MLflow rows show ±2 standard errors, the judgement's margin)."""
    return None if noise is None else 2 * noise


def _overhead_goal(overhead: float | None, noise: float | None) -> str:
    """< 1%, judged against the noise (two standard errors): met only when the difference is shown below 1%."""
    if overhead is None:
        return "< 1%"
    if noise is None:
        return _goal(overhead < 0.01, "< 1%")
    if overhead + 2 * noise < 0.01:
        return "< 1% met"
    if overhead - 2 * noise > 0.01:
        return "< 1% **not met**"
    return "< 1%: within the noise, not resolved here"


def _notes(report: dict[str, Any]) -> list[str]:
    notes = [
        "Notes: tokens/s of (c) come from the wall-clock timestamps of its logged steps in MLflow, so logging and "
        "checkpoint time count; the loop's own `tokens_per_s` metric leaves its logging call out. Start to first step of (c) is "
        "its `time_to_first_step_s` metric (process start to the end of step 1: Python imports, a local Ray, the "
        "MLflow run, the worker group, the model and the first batch); the floor row is what stock Ray Train takes "
        "to reach an empty train function on the same machine.",
    ]
    ml = report["results"].get("mlflow", {})
    if any(isinstance(v, dict) and v.get("in_thread_overhead") is not None for v in ml.values()):
        notes.append(
            "MLflow overhead: the on/off rows compare whole segments with tracking on and off, so they carry the "
            "machine's noise (±2 standard errors shown); the in-thread rows time rank 0's log calls where the loop "
            "makes them: all that training pays when the tracking actor runs on another node (the head node of a "
            "cluster). Here the actor's writes also share the 2 cores, which the on/off rows include."
        )
    if report["results"].get("training", {}).get("bare_tuned_tokens_per_s"):
        notes.append(
            "Allocator: Ray Train runs the training function in a thread, and glibc gives that thread an arena whose "
            "heaps are unmapped whenever they fall free, so a CPU step's activations page-fault back in every step "
            "(measured: 90k faults/s, 20% of the training thread in the kernel). raytrn sets glibc settings that stop "
            "this on its CPU workers (`run.tune_malloc`, on by default for cpu; `raytrn/backends/host_malloc.py`). "
            "(a) is the bare loop as a user runs it, with glibc's defaults; (a') the same loop with raytrn's settings, "
            "which also help a main thread (fewer `mmap`/trim faults): c/a' is the like-for-like overhead. (b) runs "
            "with Ray's defaults, as stock Ray Train does."
        )
    if report["results"].get("training", {}).get("stock_tokens_per_s"):
        notes.append(
            "(b) calls `ray.train.report(metrics)` every log interval, as Ray's examples do; in Ray Train V2 that call "
            "is what makes (b) slower than (a) here (a one-off check on this machine without it: 8,600 vs 6,050 "
            "tokens/s, level with (a)). raytrn reports to Ray only with a checkpoint and sends progress to its own "
            "actor, which is why c/b > 1."
        )
    sc = report["results"].get("training", {}).get("scaling")
    if sc:
        notes.append(f"Scaling: {sc['note']}.")
    notes += [f"Run: {note}." for note in report.get("notes", [])]  # (a results file's own, e.g. a second run's)
    return notes


def _gpu_block(report: dict[str, Any]) -> list[str]:
    gpu = report.get("gpu") or {}
    if not gpu.get("table"):
        return ["GPU: no result yet (`bench/gpu.py` on a CUDA machine writes `bench/GPU.md`)."]
    return [f"GPU (from `{gpu['source']}`, measured separately on a GPU machine):", "", *gpu["table"]]


def _trainium_block(rows: list[dict[str, Any]] | dict[str, Any] | None) -> list[str]:
    if not rows or not isinstance(rows, list):  # not run, or a result that says why (skipped, failed)
        return []
    out = [
        "Trainium **targets, not measurements** (no trn node ran these): per trn1.32xlarge, derived from AWS's "
        "published trn1 result and raytrn's FLOPs/token (the `mfu` a real run logs) against "
        f"{rows[0]['node_peak_flops'] / 1e15:.2f} PFLOP/s dense bf16 per node.",
        "",
        "| job | seq | FLOPs/token (train) | target tokens/s per node | implied MFU | basis |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        out.append(
            f"| {r['job']} | {r['seq_len']} | {r['flops_per_token'] / 1e9:.1f} G | "
            f"{_num(r.get('tokens_per_s_per_node'))} | {_pct(r.get('mfu'))} | {r.get('source', '-')} |"
        )
    return out


def gpu_result() -> dict[str, Any] | None:
    """The first Markdown table of bench/GPU.md (written by bench/gpu.py's helper), if there is one."""
    md = REPO / "bench" / "GPU.md"
    if not md.exists():
        return None
    table: list[str] = []
    for line in md.read_text().splitlines():
        if line.startswith("|"):
            table.append(line)
        elif table:
            break
    jsons = sorted((REPO / "bench" / "results").glob("*-gpu-*.json"))
    return {"source": "bench/GPU.md", "table": table, "json": str(jsons[-1].relative_to(REPO)) if jsons else None}


def _live_back_row(live: dict[str, Any], resize_interval_s: float | None) -> str:
    """The live rows' node return (bench.elastic.run_live): from the moment Ray has the new node alive (the
    replacement's own part: its slot, its process and imports, its admission with a live replica's state), judged
    against issue 48's goal (the restart path's resize interval + 5 s), and from the call that adds it (Ray's start
    of the node's processes, on the simulated cluster's shared cores, included); older results have the latter only.
    A paced run (``pace_s``: the survivors' training slowed so that it leaves CPU to the returning node, as on a
    real cluster) says so in its label."""
    back = f"{_num(live.get('back_to_full_size_s_median'), '.1f', ' s')} ({', '.join(_num(x, '.1f') for x in live['back_to_full_size_s'])})"
    if "alive_to_full_size_s" not in live:
        return f"| elastic, live: node back -> 3 replicas training (no storage read) | median {back}{_metrics_note(live)} | |"
    alive = live.get("alive_to_full_size_s_median")
    bound = None if resize_interval_s is None else float(resize_interval_s) + 5
    ok = None if alive is None or bound is None else alive <= bound
    goal = _goal(ok, f"<= {_num(bound, '.0f', ' s')} (resize interval + 5)") if bound is not None else ""
    paced = (
        f", the survivors paced (`RAYTRN_PACE_S` {live['pace_s']:g}: a micro-batch at most every {live['pace_s']:g} s, "
        "CPU left for the returning node's start, as its own node's CPUs would leave it)"
        if live.get("pace_s")
        else ""
    )
    return (
        f"| elastic, live{paced}: node back (alive in Ray) -> 3 replicas training, no storage read, median of "
        f"{len(live['alive_to_full_size_s'])} | **{_num(alive, '.1f', ' s')}** "
        f"({', '.join(_num(x, '.1f') for x in live['alive_to_full_size_s'])}); from adding the node, Ray's start of its "
        f"processes included: median {back}{_metrics_note(live)} | {goal} |"
    )


def _metrics_note(live: dict[str, Any]) -> str:
    """How the live rows' simulated cluster ran Ray's metrics pipeline (bench.elastic.run_live), when recorded."""
    if "ray_metrics" not in live:
        return ""
    if live["ray_metrics"]:
        return "; Ray's metrics on"
    return "; Ray's metrics off in the simulated cluster: docs/elasticity.md"


def update_readme(block: str, readme: Path = REPO / "README.md") -> None:
    """Replace the marked block (or add the Benchmarks section before ``## Layout``, else at the end); nothing else changes."""
    text = readme.read_text()
    body = f"{START}\n{block.rstrip()}\n{END}"
    if START in text and END in text:
        text = re.sub(re.escape(START) + r".*?" + re.escape(END), lambda _: body, text, count=1, flags=re.S)
    else:
        section = README_INTRO + body + "\n\n"
        at = text.find("\n## Layout")
        text = text + "\n" + section if at < 0 else text[: at + 1] + section + text[at + 1 :]
    readme.write_text(text)


def _layout_rows(pp: dict[str, Any], cp: dict[str, Any]) -> list[str]:
    """Pipeline parallelism's bubble and tokens/s, context parallelism's activations (bench/pipeline.py,
    bench/context.py)."""
    rows = [row for row in (_status_row("pipeline", pp), _status_row("context", cp)) if row]
    for m in (4, 8):
        r = pp.get(f"m{m}")
        if r:
            rows.append(
                f"| pipeline 2 (1F1B, {m} micro-batches; {pp['setup']}) vs FSDP 2 and one process | "
                f"{_num(r['pp_tokens_per_s'])} vs {_num(r['fsdp_tokens_per_s'])} vs {_num(r['one_tokens_per_s'])} "
                f"tokens/s ({r['pp_over_fsdp']:.2f}x FSDP); bubble measured {_pct(r['bubble_measured'], 0)} (idle and "
                f"overhead) vs theory {_pct(r['bubble_theory'], 0)} | informs (2 cores: ceiling 2x) |"
            )
    seqs = [k for k in cp if k.startswith("seq")]
    if seqs:
        parts = ", ".join(
            f"{k[3:]} tokens {_num(cp[k]['cp2_saved_mib'], '.1f')} vs {_num(cp[k]['cp1_saved_mib'], '.1f')} MiB "
            f"({cp[k]['cp2_over_cp1']:.2f}x)"
            for k in seqs
        )
        worst = max(cp[k]["cp2_over_cp1"] for k in seqs)
        rows.append(
            f"| activations kept for backward a worker, context parallel 2 vs 1 ({cp['setup']}) | {parts} | "
            f"{_goal(worst <= 0.55, '<= 0.55x (half, and the ring)')} |"
        )
    return rows
